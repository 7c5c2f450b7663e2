"""1 rank vs 2 FSDP ranks (two gloo processes): the same global batch gives the same gradients and
metrics, for the aggregation modes, for the rollout-corrected actor loss, when one rank's rows
all run forward only (engines.training.base.NEEDS_BACKWARD) while the other's back-propagate, and when the
shards keep each layer gathered across the call's micro-batches (ZeRO-2); and the same gradients
when each rank takes its rows in two calls that accumulate."""

from __future__ import annotations

import socket

import pytest
import torch
import torch.multiprocessing as mp

from tests.engine_util import ZERO2, checkpoint_rank_main, max_rel_diff, rank_main


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


CASES = [
    ("token-mean", {"micro_batch_size": 1}),
    ("seq-mean-token-sum", {"micro_batch_size": 2}),
    ("seq-mean-token-mean", {}),
    ("seq-mean-token-sum-norm", {"max_tokens_per_micro_batch": 24}),
    ("rollout-corrected", {"micro_batch_size": 2}),
    ("forward-only-rows", {"max_tokens_per_micro_batch": 24}),
    ("token-mean" + ZERO2, {"micro_batch_size": 1}),
]


def _run(world: int, model_dir, out) -> dict:
    """Every case in one spawn of `world` processes (one engine per case): the processes' start-up,
    not the cases, is what costs."""
    mp.spawn(rank_main, args=(world, _free_port(), str(model_dir), CASES, str(out)), nprocs=world, join=True)
    return torch.load(out, weights_only=False)


@pytest.fixture(scope="module")
def runs(tiny_model_dir, tmp_path_factory) -> tuple[dict, dict]:
    tmp = tmp_path_factory.mktemp("dist")
    return _run(1, tiny_model_dir, tmp / "world1.pt"), _run(2, tiny_model_dir, tmp / "world2.pt")


@pytest.mark.parametrize("mode", [mode for mode, _ in CASES])
def test_two_ranks_match_one_rank(runs, mode):
    one, two = runs[0][mode], runs[1][mode]
    assert max_rel_diff(two["grads"], one["grads"]) <= 1e-5
    # Every metric, sums and maxima alike (the mismatch report's rollout/log_prob_diff_max).
    assert two["metrics"] == pytest.approx(one["metrics"], rel=1e-5, abs=1e-7)
    assert two["norm"] == pytest.approx(one["norm"], rel=1e-5)
    # After one Adam step (lr 1e-2) both runs hold the same weights within 1% of a step: Adam's first
    # update is ~lr * sign(g), so gradients near zero amplify their 1e-5 relative differences.
    assert max(float((two["params"][k] - one["params"][k]).abs().max()) for k in one["params"]) <= 1e-4


def test_zero2_shards_stay_gathered_across_micro_batches_and_are_freed_after_the_call(runs):
    """fsdp.reshard_after_forward False: each layer is gathered once for the call's micro-batches
    (one row each here) and freed at its end; the gradients match one rank's (the test above)."""
    zero2, plain = runs[1]["token-mean" + ZERO2], runs[1]["token-mean"]
    assert (zero2["kept_gathered"], plain["kept_gathered"]) == (True, False)
    assert zero2["all_resharded"] and plain["all_resharded"]  # every parameter a DTensor shard again
    assert not runs[0]["token-mean" + ZERO2]["kept_gathered"]  # one fp32 rank: nothing is sharded
    assert max_rel_diff(zero2["grads"], plain["grads"]) <= 1e-5


@pytest.mark.parametrize("mode", [mode for mode, _ in CASES])
def test_two_ranks_accumulating_over_calls_match_one_call_on_one_rank(runs, mode):
    """Each rank's rows in two calls, told the global batch's counts (engines/training/base.py): the gradient of
    one call with the whole batch on one rank, in every aggregation mode (tests/test_accumulation.py
    checks one rank)."""
    assert max_rel_diff(runs[1][mode]["accumulated"], runs[0][mode]["grads"]) <= 1e-5
    assert max_rel_diff(runs[0][mode]["accumulated"], runs[0][mode]["grads"]) <= 1e-5


@pytest.mark.parametrize("save_world, load_world", [(1, 2), pytest.param(2, 1, marks=pytest.mark.slow)])
def test_a_checkpoint_loads_across_world_sizes(tiny_model_dir, tmp_path, save_world, load_world):
    """One fp32 rank trains an unwrapped model, two train FSDP2 shards (engines/training/fsdp/engine.py): a
    checkpoint of either loads into the other with the same weights and Adam state."""
    folder = str(tmp_path / "ckpt")
    for world, mode in ((save_world, "save"), (load_world, "load")):
        args = (world, _free_port(), str(tiny_model_dir), folder, mode)
        mp.spawn(checkpoint_rank_main, args=args, nprocs=world, join=True)
    saved = torch.load(f"{folder}.save.pt", weights_only=False)
    loaded = torch.load(f"{folder}.load.pt", weights_only=False)
    assert saved["sharded"] == (save_world == 2) and loaded["sharded"] == (load_world == 2)
    assert saved["params"].keys() == loaded["params"].keys()
    for name, tensor in saved["params"].items():
        assert torch.equal(loaded["params"][name], tensor), name
    # The Adam moments came along: one more step on the same rows moves both alike, within 1% of
    # an lr-1e-2 step (as above, Adam's near-sign update amplifies 1e-6 gradient differences).
    after, reference = loaded["after"], saved["after"]
    assert max(float((after[k] - reference[k]).abs().max()) for k in reference) <= 1e-4
    moved = max(float((reference[k] - saved["params"][k]).abs().max()) for k in reference)
    assert moved > 5e-3  # the step did move the weights
