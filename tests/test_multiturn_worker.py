"""Multi-turn generation in the hybrid worker on a real local Ray: trainer/rollout log-prob agreement.

Two ranks, each running its rows' trajectories turn by turn; the trainer recomputes log-probs on
the whole token sequences (observations included in the context), and on the sampled tokens they
agree with the rollout engine's within the single-turn tolerance, before and after an update.
"""

from __future__ import annotations

import pytest
import torch

from controller.resource_pool import ResourcePool
from controller.worker_group import RayWorkerGroup
from engines.models.tiny_models import build_builtin_model
from tests.test_hybrid_worker import max_log_prob_gap, worker_config
from workers.actor_role import ActorRolloutRefWorker
from workers.batch import Batch

ROWS = 4
ENVIRONMENT = {"ref": "tests.multiturn_envs:ScriptedEnv", "max_turns": 6, "max_response_tokens": 160}


def trajectory_batch() -> Batch:
    return Batch.from_dict(
        non_tensors={
            "prompt": [f"p{i}" for i in range(ROWS)],
            "prompt_ids": [[0]] * ROWS,  # unused: the environment's reset gives the first prompt
            "ground_truth": [None] * ROWS,
            "extra": [{"turns": 4}] * ROWS,
            "row": list(range(ROWS)),
        },
        meta={
            "sampling": {"max_new_tokens": 8, "temperature": 1.0, "seed": 5},
            "max_prompt_length": 48,
            "environment": ENVIRONMENT,
        },
    )


@pytest.fixture(scope="module")
def group(ray_cluster, tmp_path_factory):
    model = build_builtin_model("tiny-qwen2-chat", tmp_path_factory.mktemp("chat-ray"))
    pool = ResourcePool(2, cpus_per_bundle=1, name="multiturn-ws2")
    wg = RayWorkerGroup(pool, ActorRolloutRefWorker, worker_config(model), group_name="multiturn")
    yield wg
    wg.shutdown()
    pool.remove()


def test_log_probs_agree_on_sampled_tokens_over_four_turns(group):
    out = group.compute_log_prob(group.generate_sequences(trajectory_batch()))
    t = out.tensors
    assert list(out.non_tensors["row"]) == list(range(ROWS))
    assert t["num_turns"].tolist() == [4] * ROWS and t["env_rewards"].tolist() == [1.0] * ROWS
    assert list(out.non_tensors["finish_reason"]) == ["done"] * ROWS
    assert all(len(m) == 2 + 4 + 3 for m in out.non_tensors["messages"])  # system, user, 4 turns, 3 obs
    sampled = t["response_mask"].bool()
    in_sequence = t["attention_mask"][:, 48:].bool()
    assert bool((in_sequence & ~sampled).any())  # observation tokens sit between the sampled turns
    assert max_log_prob_gap(out) <= 1e-4
    assert float(t["old_log_probs"][~sampled].abs().max()) == 0.0  # masked outside sampled tokens

    tensors = t.clone(recurse=False)
    tensors["advantages"] = torch.where(sampled, 1.0, 0.0)
    metrics = group.update_actor(Batch(tensors, out.non_tensors, out.meta), {"policy_loss": "ppo"}, {})[0]
    assert metrics["actor/grad_norm"] > 0
    group.sync_weights()
    fresh = group.compute_log_prob(group.generate_sequences(trajectory_batch()))
    assert max_log_prob_gap(fresh) <= 1e-4
    assert fresh.tensors["weight_version"].tolist() == [1] * ROWS
