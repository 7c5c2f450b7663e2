"""The reward model: padding-invariant last-token scores, micro-batching, the worker on a real Ray."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from engines.models.tiny_models import build_tiny_model
from workers.base import Dispatch, Worker, register
from workers.batch import Batch
from workers.reward_model import RewardModel, RewardModelError, RewardModelWorker, scores_on_last_token

TOL = 1e-5


@pytest.fixture(scope="module")
def rm_dir(tmp_path_factory) -> Path:
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return build_tiny_model(tmp_path_factory.mktemp("models") / "tiny-rm", reward=True)


@pytest.fixture(scope="module")
def reward_model(rm_dir) -> RewardModel:
    return RewardModel(rm_dir, device="cpu", dtype="float32", micro_batch_size=4)


def random_sequences(lengths: list[int], seed: int = 0) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return [torch.randint(4, 100, (n,), generator=gen) for n in lengths]


def score_alone(model: RewardModel, seq: torch.Tensor) -> float:
    return float(model.score(seq[None], torch.ones(1, len(seq), dtype=torch.long))[0])


def rollout_layout(
    prompts: list[torch.Tensor], responses: list[torch.Tensor], width: int, new_tokens: int, pad: int = 0
) -> dict[str, torch.Tensor]:
    """The hybrid worker's layout: prompt left-padded to `width`, response right-padded to `new_tokens`."""
    rows = len(prompts)
    input_ids = torch.full((rows, width + new_tokens), pad, dtype=torch.long)
    mask = torch.zeros_like(input_ids)
    for i, (prompt, response) in enumerate(zip(prompts, responses, strict=True)):
        input_ids[i, width - len(prompt) : width] = prompt
        mask[i, width - len(prompt) : width] = 1
        input_ids[i, width : width + len(response)] = response
        mask[i, width : width + len(response)] = 1
    return {
        "input_ids": input_ids,
        "attention_mask": mask,
        "responses": input_ids[:, width:].clone(),
        "response_mask": mask[:, width:].clone(),
    }


def rollout_batch(rows: int, seed: int = 0) -> Batch:
    gen = torch.Generator().manual_seed(seed)
    prompt_lens = torch.randint(1, 7, (rows,), generator=gen).tolist()
    response_lens = torch.randint(0, 6, (rows,), generator=gen).tolist()
    response_lens[0] = 5  # at least one full-width response
    prompts = random_sequences(prompt_lens, seed + 1)
    responses = random_sequences(response_lens, seed + 2)
    return Batch.from_dict(
        tensors=rollout_layout(prompts, responses, width=6, new_tokens=5),
        non_tensors={"uid": [f"row-{i}" for i in range(rows)]},
    )


# ---- the engine, no Ray ------------------------------------------------------------------------


def test_scores_do_not_depend_on_padding(reward_model):
    prompts = random_sequences([3, 6, 1, 4, 2])
    responses = random_sequences([5, 0, 4, 1, 3], seed=1)
    seqs = [torch.cat([p, r]) for p, r in zip(prompts, responses, strict=True)]
    alone = torch.tensor([score_alone(reward_model, seq) for seq in seqs])
    assert alone.abs().max() > 0.01 and alone.std() > 0.01  # the test would be vacuous otherwise

    layout = rollout_layout(prompts, responses, width=8, new_tokens=7)  # left and right padding
    batched = reward_model.score(layout["input_ids"], layout["attention_mask"])
    assert batched.shape == (5,) and batched.dtype == torch.float32
    assert (batched - alone).abs().max() <= TOL

    # Pure left padding, pure right padding, and a pad id that is also a real token of the rows.
    for side in ("left", "right"):
        ids = torch.full((5, 12), int(seqs[0][-1]), dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, seq in enumerate(seqs):
            cols = slice(12 - len(seq), 12) if side == "left" else slice(0, len(seq))
            ids[i, cols], mask[i, cols] = seq, 1
        assert (reward_model.score(ids, mask) - alone).abs().max() <= TOL, side


def test_agrees_with_transformers_pooling_when_the_pad_id_is_unambiguous(reward_model):
    """Our pooling reads the mask; transformers' reads pad ids. With a pad id no row uses, they agree."""
    layout = rollout_layout(random_sequences([2, 5, 3]), random_sequences([4, 1, 3], seed=3), 5, 4)
    ids, mask = layout["input_ids"], layout["attention_mask"]
    with torch.no_grad():
        theirs = reward_model.model(
            input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)
        ).logits[:, 0]
    assert (reward_model.score(ids, mask) - theirs).abs().max() <= TOL


def test_micro_batch_of_one_equals_whole_batch(rm_dir):
    layout = rollout_batch(7).tensors
    one = RewardModel(rm_dir, device="cpu", micro_batch_size=1)
    whole = RewardModel(rm_dir, device="cpu", micro_batch_size=64)
    a = one.score(layout["input_ids"], layout["attention_mask"])
    b = whole.score(layout["input_ids"], layout["attention_mask"])
    assert (a - b).abs().max() <= TOL


def test_row_without_tokens_is_refused(reward_model):
    ids = torch.zeros(2, 4, dtype=torch.long)
    mask = torch.tensor([[0, 1, 1, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match=r"rows \[1\] have no real token"):
        reward_model.score(ids, mask)


def test_missing_folder_error_names_the_folder(tmp_path):
    missing = tmp_path / "no-such-rm"
    with pytest.raises(RewardModelError, match="no-such-rm") as err:
        RewardModel(missing, device="cpu")
    assert str(missing) in str(err.value)


def test_causal_lm_folder_is_refused(tiny_model_dir):
    with pytest.raises(RewardModelError, match="ForSequenceClassification") as err:
        RewardModel(tiny_model_dir, device="cpu")
    assert str(tiny_model_dir) in str(err.value)


def test_score_lands_on_the_last_response_token():
    mask = torch.tensor([[1, 1, 0], [0, 0, 0], [1, 1, 1]])
    out = scores_on_last_token(torch.tensor([0.5, 2.0, -1.0]), mask)
    assert torch.equal(out, torch.tensor([[0.0, 0.5, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, -1.0]]))


# ---- the worker on a real local Ray ------------------------------------------------------------


class Neighbour(Worker):
    """Another role that shares the reward model's bundle."""

    @register(Dispatch.ONE_TO_ALL)
    def where(self) -> tuple[int, str]:
        import ray

        return os.getpid(), ray.get_runtime_context().get_node_id()


def check_scored(batch: Batch, scored: Batch, local: RewardModel) -> None:
    assert list(scored.non_tensors["uid"]) == list(batch.non_tensors["uid"])  # input order
    assert torch.equal(scored.tensors["input_ids"], batch.tensors["input_ids"])
    expected = local.score(batch.tensors["input_ids"], batch.tensors["attention_mask"])
    assert (scored.tensors["rm_scores"] - expected).abs().max() <= TOL
    token_scores = scored.tensors["rm_token_scores"]
    assert token_scores.shape == batch.tensors["response_mask"].shape
    has_response = batch.tensors["response_mask"].any(dim=-1)
    assert torch.allclose(token_scores.sum(-1), torch.where(has_response, expected, 0.0), atol=TOL)


def test_two_ranks_score_a_batch_in_order(ray_cluster, rm_dir, reward_model):
    from controller.resource_pool import ResourcePool
    from controller.worker_group import RayWorkerGroup

    pool = ResourcePool(2, cpus_per_bundle=1, name="rm-ws2")
    cfg = {"model_path": str(rm_dir), "device": "cpu", "micro_batch_size": 2}
    group = RayWorkerGroup(pool, RewardModelWorker, cfg, group_name="rm")
    try:
        batch = rollout_batch(7, seed=4)  # odd: the controller pads to the dp size and unpads
        check_scored(batch, group.compute_rm_score(batch), reward_model)
        assert group.mesh_layout("actor").dp_size == 2
    finally:
        group.shutdown()
        pool.remove()


def test_colocated_with_another_group_on_one_bundle(ray_cluster, rm_dir, reward_model):
    from controller.resource_pool import ResourcePool
    from controller.worker_group import RayWorkerGroup

    pool = ResourcePool(1, cpus_per_bundle=1, name="rm-colocated")
    neighbour = RayWorkerGroup(pool, Neighbour, group_name="neighbour", share=0.5)
    cfg = {"model_path": str(rm_dir), "device": "cpu"}
    group = RayWorkerGroup(pool, RewardModelWorker, cfg, group_name="rm-co", share=0.5)
    try:
        batch = rollout_batch(3, seed=5)
        check_scored(batch, group.compute_rm_score(batch), reward_model)
        ((pid, node),) = neighbour.where()
        assert node == pool.node_of_rank()[0]
        assert pid not in ray_cluster.get(
            [a.pid.remote() for a in group.actors], timeout=60
        )  # separate actors
    finally:
        group.shutdown()
        neighbour.shutdown()
        pool.remove()
