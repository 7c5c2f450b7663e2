"""The hybrid actor-rollout-ref worker on a real local Ray: generation, log-probs, update, weight sync.

The central check: after update_actor and sync_weights, the rollout engine holds exactly the
trainer's weights (bitwise) and its sampling log-probs equal the trainer's recomputed log-probs.
Before the sync they differ, so it is the sync that makes them equal.
"""

from __future__ import annotations

import pytest
import torch

from controller.resource_pool import ResourcePool
from controller.worker_group import RayWorkerGroup, ready_all
from schema.workers import RolloutConfig
from workers.actor_role import ActorRolloutRefWorker
from workers.base import Dispatch, register
from workers.batch import Batch
from workers.critic import CriticWorker
from workers.rollout_role import rollout_mesh_coords

PROMPTS = [[5, 6, 7], [8, 9], [10, 11, 12, 13], [14], [15, 16], [17, 18, 19]]
SAMPLING = {"max_new_tokens": 6, "temperature": 1.0, "seed": 3}


def worker_config(model_dir, **rollout) -> dict:
    return {
        "actor": {"model_path": str(model_dir), "optim": {"lr": 5e-2}},
        "ref": {"model_path": str(model_dir)},
        "rollout": {"bucket_mb": 0.01, **rollout},  # ~10 KB buckets: many buckets for an 87k model
    }


def prompt_batch(prompts=PROMPTS) -> Batch:
    return Batch.from_dict(
        non_tensors={"prompt_ids": prompts, "row": list(range(len(prompts)))},
        meta={"sampling": SAMPLING, "max_prompt_length": 4},
    )


def with_advantages(batch: Batch) -> Batch:
    tensors = batch.tensors.clone(recurse=False)
    g = torch.Generator().manual_seed(0)
    tensors["advantages"] = (
        torch.randn(tensors["response_mask"].shape, generator=g) * tensors["response_mask"]
    )
    return Batch(tensors, batch.non_tensors, batch.meta)


def max_log_prob_gap(batch: Batch) -> float:
    mask = batch.tensors["response_mask"].bool()
    return float((batch.tensors["rollout_log_probs"] - batch.tensors["old_log_probs"])[mask].abs().max())


@pytest.fixture(scope="module")
def group(ray_cluster, tiny_model_dir):
    pool = ResourcePool(1, cpus_per_bundle=1, name="hybrid-ws1")
    wg = RayWorkerGroup(pool, ActorRolloutRefWorker, worker_config(tiny_model_dir), group_name="hybrid")
    yield wg
    wg.shutdown()
    pool.remove()


def test_sync_makes_rollout_and_trainer_agree(group):
    out = group.compute_log_prob(group.generate_sequences(prompt_batch()))
    assert max_log_prob_gap(out) <= 1e-4  # same initial weights on both sides
    assert out.tensors["weight_version"].tolist() == [0] * len(PROMPTS)
    # Rows come back in input order, prompts left-padded to max_prompt_length.
    assert list(out.non_tensors["row"]) == list(range(len(PROMPTS)))
    for row, prompt in enumerate(PROMPTS):
        assert out.tensors["input_ids"][row, 4 - len(prompt) : 4].tolist() == prompt

    metrics = group.update_actor(with_advantages(out), {"policy_loss": "ppo"}, {"epochs": 2})[0]
    assert metrics["actor/optimizer_steps"] == 2 and metrics["actor/grad_norm"] > 0
    actor = group.actor_state_dict()[0]
    rollout = group.rollout_state_dict()[0]
    assert any(not torch.equal(actor[k], rollout[k]) for k in actor)  # not yet synced
    stale = group.compute_log_prob(group.generate_sequences(prompt_batch()))
    assert max_log_prob_gap(stale) > 1e-3

    sync = group.sync_weights()[0]
    assert sync["weight_sync/buckets"] > 1 and sync["weight_sync/version"] == 1
    assert sync["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in actor.values())
    rollout = group.rollout_state_dict()[0]
    assert all(torch.equal(actor[k], rollout[k]) for k in actor)
    fresh = group.compute_log_prob(group.generate_sequences(prompt_batch()))
    assert max_log_prob_gap(fresh) <= 1e-4
    assert fresh.tensors["weight_version"].tolist() == [1] * len(PROMPTS)


def test_reference_log_probs_stay_at_the_initial_policy(group):
    batch = group.compute_log_prob(group.generate_sequences(prompt_batch()))
    before = group.compute_ref_log_prob(batch).tensors["ref_log_probs"]
    group.update_actor(with_advantages(batch), {"policy_loss": "ppo"}, {"epochs": 1})  # alone or not
    ref = group.compute_ref_log_prob(batch).tensors["ref_log_probs"]
    now = group.compute_log_prob(batch).tensors["old_log_probs"]
    mask = batch.tensors["response_mask"].bool()
    assert torch.equal(ref, before)  # the actor's update leaves the reference where it was
    assert float((ref - now)[mask].abs().max()) > 1e-3  # while the actor moved


def test_rollout_mesh_coordinates():
    assert [rollout_mesh_coords(r, 2) for r in range(4)] == [(0, True), (0, False), (1, True), (1, False)]
    with pytest.raises(ValueError, match="tensor_parallel_size must be 1"):
        RolloutConfig(backend="hf", tensor_parallel_size=2)


def test_two_ranks_share_identical_weights_and_collect_in_order(ray_cluster, tiny_model_dir):
    pool = ResourcePool(2, cpus_per_bundle=1, name="hybrid-ws2")
    wg = RayWorkerGroup(pool, ActorRolloutRefWorker, worker_config(tiny_model_dir), group_name="hybrid2")
    try:
        assert wg.mesh_layout("rollout").dp_size == 2
        out = wg.compute_log_prob(wg.generate_sequences(prompt_batch()))
        assert list(out.non_tensors["row"]) == list(range(len(PROMPTS)))
        wg.update_actor(with_advantages(out), {"policy_loss": "ppo"}, {"mini_batch_size": 6})
        wg.sync_weights()
        replicas = wg.rollout_state_dict()
        actor = wg.actor_state_dict()
        assert all(torch.equal(replicas[0][k], replicas[1][k]) for k in replicas[0])
        assert all(torch.equal(actor[0][k], replicas[0][k]) for k in actor[0])
        fresh = wg.compute_log_prob(wg.generate_sequences(prompt_batch()))
        assert max_log_prob_gap(fresh) <= 1e-4
    finally:
        wg.shutdown()
        pool.remove()


def trainer_devices(worker: ActorRolloutRefWorker) -> dict[str, set[str]]:
    """The device types of the actor's parameters and optimizer state and of the reference's parameters."""
    state = worker.actor.optimizer.state.values()
    return {
        "actor": {p.device.type for p in worker.actor.model.parameters()},
        "optimizer": {v.device.type for s in state for v in s.values() if torch.is_tensor(v)},
        "ref": {p.device.type for p in worker.ref.model.parameters()},
    }


class OffloadProbeWorker(ActorRolloutRefWorker):
    """The hybrid worker, noting where the training role's tensors are while its rollout engine generates."""

    def _before_rollout(self) -> None:
        super()._before_rollout()
        self.during_rollout = trainer_devices(self)

    @register(Dispatch.ONE_TO_ALL)
    def trainer_devices(self) -> dict[str, dict[str, set[str]]]:
        return {"during_rollout": self.during_rollout, "now": trainer_devices(self)}


def train_twice(wg: RayWorkerGroup) -> tuple[list[Batch], list[dict], dict[str, torch.Tensor]]:
    """Two generate / log-prob / update / sync rounds: the rollouts, the update metrics, the weights."""
    rollouts, metrics = [], []
    for _ in range(2):
        batch = wg.compute_ref_log_prob(wg.compute_log_prob(wg.generate_sequences(prompt_batch())))
        rollouts.append(batch)
        metrics.append(
            wg.update_actor(
                with_advantages(batch), {"policy_loss": "ppo", "use_kl_loss": True, "kl_loss_coef": 0.1}, {}
            )[0]
        )
        wg.sync_weights()
    return rollouts, metrics, wg.actor_state_dict()[0]


def test_offloading_the_trainer_during_rollout_changes_no_number(ray_cluster, tiny_model_dir):
    """rollout.offload_trainer_during_rollout: while the rollout engine generates, the actor's parameters
    and optimizer state and the reference's parameters are in host memory (on a CPU they always are),
    back on the training device after it; the rollouts, losses and weights are those of a run without it."""
    runs = {}
    for offload, worker_cls in ((False, ActorRolloutRefWorker), (True, OffloadProbeWorker)):
        pool = ResourcePool(1, cpus_per_bundle=1, name=f"offload-{offload}")
        config = worker_config(tiny_model_dir, offload_trainer_during_rollout=offload)
        wg = RayWorkerGroup(pool, worker_cls, config, group_name=f"offload-{offload}")
        try:
            runs[offload] = train_twice(wg)
            if offload:
                devices = wg.trainer_devices()[0]
        finally:
            wg.shutdown()
            pool.remove()
    assert devices["during_rollout"] == {"actor": {"cpu"}, "optimizer": {"cpu"}, "ref": {"cpu"}}
    device = "cuda" if torch.cuda.is_available() else "cpu"
    assert devices["now"] == {"actor": {device}, "optimizer": {device}, "ref": {device}}
    (rollouts_off, metrics_off, weights_off), (rollouts_on, metrics_on, weights_on) = runs[False], runs[True]
    tolerance = 1e-6  # the same computation on the same device: only a move's rounding could differ (none)
    for off, on in zip(rollouts_off, rollouts_on, strict=True):
        assert torch.equal(off.tensors["responses"], on.tensors["responses"])
        for key in ("rollout_log_probs", "old_log_probs", "ref_log_probs"):
            torch.testing.assert_close(on.tensors[key], off.tensors[key], atol=tolerance, rtol=0)
    for off, on in zip(metrics_off, metrics_on, strict=True):
        assert off.keys() == on.keys() and off["actor/optimizer_steps"] == 1
        assert all(abs(off[k] - on[k]) <= tolerance * max(1.0, abs(off[k])) for k in off), (off, on)
    assert weights_off.keys() == weights_on.keys()
    for name, tensor in weights_off.items():
        torch.testing.assert_close(weights_on[name], tensor, atol=tolerance, rtol=0)


def test_colocated_critic_learns_returns(ray_cluster, tiny_model_dir):
    """The critic on the same bundle as the hybrid worker, each with half of the bundle's CPU."""
    pool = ResourcePool(1, cpus_per_bundle=1, name="colocated")
    # lr 1e-2 overshot (losses 0.25, 0.76, 0.03, 0.22 on one sampled batch); at 3e-3 the fourth loss
    # was 0.03-0.05x the first on the batches of sampling seeds 3, 4 and 5
    critic_cfg = {"model_path": str(tiny_model_dir), "optim": {"lr": 3e-3}}
    started = ready_all(
        {
            "hybrid": RayWorkerGroup.launch(
                pool, ActorRolloutRefWorker, worker_config(tiny_model_dir), group_name="hybrid-co", share=0.5
            ),
            "critic": RayWorkerGroup.launch(pool, CriticWorker, critic_cfg, group_name="critic", share=0.5),
        }
    )
    hybrid, critic = started["hybrid"], started["critic"]
    try:
        batch = hybrid.generate_sequences(prompt_batch())
        tensors = batch.tensors.clone(recurse=False)
        tensors["returns"] = torch.full(tensors["response_mask"].shape, 0.7) * tensors["response_mask"]
        batch = Batch(tensors, batch.non_tensors, batch.meta)
        losses = []
        for _ in range(4):
            valued = critic.compute_values(batch)
            losses.append(critic.update_critic(valued, None, "token-mean", {})[0]["critic/vf_loss"])
        assert valued.tensors["values"].shape == tensors["returns"].shape
        assert losses[-1] < losses[0] * 0.7, losses
    finally:
        critic.shutdown()
        hybrid.shutdown()
        pool.remove()
