"""Weight transfer across processes (engines/transfer/, workers/transfer_choice.py) on a real Ray:
a training rank sends to a rollout worker in another process, over a torch.distributed group made
for it (gloo) or Ray's object store. The rollout worker ends bitwise equal to the trainer, for the
whole model and for a named subset (the other tensors keep their old values, and generation uses
the new ones: the fused decode buffers saw the update). A rollout worker that stops answering (SIGSTOP)
fails either strategy's sync within its limit with a `TransferTimeout` naming the worker (group, rank,
pid) and its call, which recovery retries as that worker's loss; a receiver that raises (a bad tensor)
stays the job's own error. A rollout worker dying mid-transfer is tests/test_placement.py's (in a job,
with its checkpoint)."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import time

import pytest
import torch

from controller.recovery import worker_lost
from controller.resource_pool import ResourcePool
from controller.worker_group import RayWorkerGroup, WorkerGroupError, ready_all
from engines.transfer.base import TransferError, TransferTimeout
from engines.transfer.collective import pack, peer_failure, unpack
from tests.test_hybrid_worker import prompt_batch, with_advantages
from workers.actor_role import ActorRefWorker
from workers.remote import _collective_timed_out
from workers.rollout_role import RolloutWorker
from workers.transfer_choice import ObjectStoreTransfer, RolloutLink, RolloutPeers

GREEDY = {"max_new_tokens": 5, "temperature": 0.0}
SUBSET = ("model.layers.0.self_attn.q_proj.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight")


def test_pack_round_trips_every_dtype_bitwise():
    bucket = [
        ("a", torch.randn(3, 4)),
        ("b", torch.randn(5).to(torch.bfloat16)),
        ("c", torch.tensor(7, dtype=torch.int64)),
        ("d", torch.randn(2, 2, 2).transpose(0, 2)),  # not contiguous
    ]
    header, flat = pack(bucket)
    assert flat.dtype == torch.uint8 and flat.numel() >= sum(t.numel() * t.element_size() for _, t in bucket)
    assert all(offset % 64 == 0 for *_, offset in header)
    for (name, sent), (got_name, got) in zip(bucket, unpack(header, flat.clone()), strict=True):
        assert name == got_name and got.dtype == sent.dtype and torch.equal(got, sent)
    with pytest.raises(ValueError, match="does not match its header"):
        unpack(header, flat[:-1])


@pytest.fixture(scope="module")
def groups(ray_cluster, tiny_model_dir):
    """One training rank and one rollout worker in another process."""
    pools = [ResourcePool(1, cpus_per_bundle=1, name=f"xfer-{r}") for r in ("train", "rollout")]
    rollout_cfg = {"bucket_mb": 0.01}  # ~10 KB buckets: many buckets for an 87k model
    started = ready_all(
        {
            "trainer": RayWorkerGroup.launch(
                pools[0],
                ActorRefWorker,
                {"actor": {"model_path": str(tiny_model_dir), "optim": {"lr": 5e-2}}, "rollout": rollout_cfg},
                group_name="xfer-train",
            ),
            "rollout": RayWorkerGroup.launch(
                pools[1],
                RolloutWorker,
                {"model_path": str(tiny_model_dir), "rollout": rollout_cfg},
                group_name="xfer-rollout",
            ),
        }
    )
    trainer, rollout = started["trainer"], started["rollout"]
    yield trainer, rollout
    for group in (trainer, rollout):
        group.shutdown()
    for pool in pools:
        pool.remove()


@pytest.fixture(params=["collective", "object_store"])
def pair(request, groups):
    """The two linked by the strategy, for each test (connecting again replaces the previous link)."""
    trainer, rollout = groups
    link = RolloutLink(rollout.actors, rollout.name, request.param, timeout_s=60)
    trainer.connect_rollout(link)
    return request.param, trainer, rollout


def train_once(trainer: RayWorkerGroup, rollout: RayWorkerGroup) -> None:
    batch = trainer.compute_log_prob(rollout.generate_sequences(prompt_batch()))
    trainer.update_actor(with_advantages(batch), {"policy_loss": "ppo"}, {"epochs": 2})


def test_a_transfer_makes_the_rollout_worker_bitwise_equal_to_the_trainer(pair):
    _, trainer, rollout = pair
    train_once(trainer, rollout)
    actor = trainer.actor_state_dict()[0]
    assert any(not torch.equal(actor[k], v) for k, v in rollout.rollout_state_dict()[0].items() if k in actor)
    before = rollout.weight_version()[0]
    metrics = trainer.sync_weights()[0]
    assert metrics["weight_sync/buckets"] > 1 and metrics["weight_sync/version"] == before + 1
    assert metrics["weight_sync/bytes"] == sum(t.numel() * t.element_size() for t in actor.values())
    assert metrics["weight_sync/gbps"] > 0
    got = rollout.rollout_state_dict()[0]
    assert all(torch.equal(actor[k], got[k]) for k in actor)
    assert rollout.weight_version()[0] == before + 1
    # The rollout samples with the trainer's weights: its log-probs are the trainer's.
    fresh = trainer.compute_log_prob(rollout.generate_sequences(prompt_batch()))
    mask = fresh.tensors["response_mask"].bool()
    gap = (fresh.tensors["rollout_log_probs"] - fresh.tensors["old_log_probs"])[mask].abs().max()
    assert float(gap) <= 1e-4


def test_a_named_subset_lands_alone_and_generation_uses_it(pair, tiny_model_dir):
    from engines.rollout.hf import HFRolloutEngine

    _, trainer, rollout = pair
    trainer.sync_weights()
    old = rollout.rollout_state_dict()[0]
    train_once(trainer, rollout)
    actor = trainer.actor_state_dict()[0]
    metrics = trainer.sync_weights(list(SUBSET))[0]
    assert metrics["weight_sync/bytes"] == sum(actor[k].numel() * 4 for k in SUBSET)
    got = rollout.rollout_state_dict()[0]
    for name in actor:
        expected = actor[name] if name in SUBSET else old[name]
        assert torch.equal(got[name], expected), name
    assert any(not torch.equal(actor[k], old[k]) for k in SUBSET)  # the subset really changed
    # Reference: an engine in this process loaded with the same mixed weights (all of them).
    reference = HFRolloutEngine(str(tiny_model_dir), device="cpu", dtype="float32")
    reference.update_weights(list(got.items()))
    prompts = [[5, 6, 7], [8, 9]]
    want = reference.generate(prompts, reference_params())
    completions = rollout.generate(prompts, GREEDY)
    for a, b in zip(completions, want, strict=True):
        assert a.token_ids == b.token_ids
        assert max(abs(x - y) for x, y in zip(a.log_probs, b.log_probs, strict=True)) <= 1e-5


def reference_params():
    from engines.rollout import SamplingParams

    return SamplingParams(**GREEDY)


LIMIT_S = 2.0  # a stopped receiver's transfer limit: small, so that it is named quickly


def test_a_receiver_that_raises_is_the_jobs_own_error(groups):
    """A bad tensor (a shape the rollout model does not have): the receiver raises at once, named; the
    error is no timeout, and not retried."""
    _, rollout = groups
    peers = RolloutPeers(rollout.actors, rollout.name, LIMIT_S, rollout.hosts)
    with pytest.raises(TransferError) as failed:
        ObjectStoreTransfer(peers).transfer([("model.norm.weight", torch.zeros(7))])
    assert not isinstance(failed.value, TransferTimeout)
    assert "rank 0, method 'receive_bucket': raised ValueError: weight 'model.norm.weight'" in str(
        failed.value
    )
    assert worker_lost(failed.value, None) is None


@pytest.fixture
def stopped_rollout(ray_cluster, tiny_model_dir):
    """A rollout worker of its own (it is SIGSTOPped), killed at the end."""
    pool = ResourcePool(1, cpus_per_bundle=1, name="xfer-stopped")
    rollout = RayWorkerGroup(
        pool, RolloutWorker, {"model_path": str(tiny_model_dir)}, group_name="xfer-stopped"
    )
    (pid,) = rollout.pids()
    yield rollout, pid
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)  # a stopped process never ends by itself
    rollout.shutdown()
    pool.remove()


def test_a_receiver_stopped_in_a_sync_is_named_and_retried_as_a_lost_worker(groups, stopped_rollout):
    """The rollout worker is SIGSTOPped: each strategy's sync fails within its limit (and the collective's
    short grace), naming the worker, its pid and the call it did not answer; recovery reads the training
    rank's error as that worker's loss (retried), not the job's own."""
    trainer, _ = groups
    rollout, pid = stopped_rollout
    calls = {"collective": "receive_weights", "object_store": "receive_bucket"}
    trainer.connect_rollout(RolloutLink(rollout.actors, rollout.name, "collective", LIMIT_S, rollout.hosts))
    os.kill(pid, signal.SIGSTOP)
    for strategy, call in calls.items():
        if strategy != "collective":  # closes the collective group without waiting on the stopped worker
            trainer.connect_rollout(
                RolloutLink(rollout.actors, rollout.name, strategy, LIMIT_S, rollout.hosts)
            )
        start = time.monotonic()
        with pytest.raises(WorkerGroupError) as failed:
            trainer.sync_weights()
        assert time.monotonic() - start < 2 * LIMIT_S + 20, strategy  # not the 300 s of a default link
        assert failed.value.group == "xfer-train" and failed.value.kind == "raised"
        named = rf"'xfer-stopped', rank 0, method '{call}': did not answer within [\d.]+s \(pid {pid} on "
        assert re.search(named, str(failed.value)), str(failed.value)
        lost = worker_lost(failed.value, None)
        assert lost is not None, str(failed.value)
        assert (lost.group, lost.rank) == ("xfer-stopped", 0)
        assert lost.summary == "worker rank 0 stopped answering in a weight transfer"
        assert f"pid {pid} on " in lost.error and "method 'sync_weights'" in lost.error


def test_a_senders_own_failure_is_not_laid_on_its_receivers():
    """A broadcast the sender could not make (out of memory, a bad dtype) leaves healthy receivers
    waiting for the next bucket: asking them would name one as silent and replace it for nothing."""
    gloo = RuntimeError("[../gloo/transport/tcp/pair.cc:598] Timed out waiting 2000ms for send operation")
    assert peer_failure(gloo) and peer_failure(RuntimeError("Connection closed by peer [10.0.0.2]:4242"))
    assert not peer_failure(torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert not peer_failure(TypeError("cannot cast a float8 bucket"))
    # A transfer's own timeout names its receiver: the training group's other ranks are not hung for it.
    named = TransferTimeout(f"weight transfer to 'r' timed out: {gloo}", "r", 0, "receive_weights")
    assert _collective_timed_out(gloo) and not _collective_timed_out(named)
