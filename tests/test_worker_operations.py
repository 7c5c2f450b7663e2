"""The fine-grained training operations through a real Ray worker group and its typed surface
(controller/groups.py): forward_backward twice with the whole batch's counts, then optim_step with
its own AdamW settings, moves the weights exactly as update_sft does with the whole batch in one
mini-batch; save_state / load_state bring a worker back; forward gives compute_log_prob's log-probs."""

from __future__ import annotations

import pytest
import torch

from controller.dispatch import MeshLayout, split_for_mesh
from controller.groups import ActorGroup, CheckpointedGroup, CriticGroup
from controller.resource_pool import ResourcePool
from controller.worker_group import RayWorkerGroup, operation
from engines.training.base import GlobalCounts
from schema.engine import OptimizerConfig
from schema.losses import SFTLossConfig
from tests.engine_util import make_batch
from workers.actor_role import ActorRolloutRefWorker
from workers.base import Dispatch, Reduce, Worker, register, registered_methods
from workers.batch import Batch

LR = 5e-2


@pytest.fixture(scope="module")
def actor(ray_cluster, tiny_model_dir):
    pool = ResourcePool(1, cpus_per_bundle=1, name="ops-ws1")
    config = {"actor": {"model_path": str(tiny_model_dir), "optim": {"lr": LR}}}
    group = ActorGroup(RayWorkerGroup(pool, ActorRolloutRefWorker, config, group_name="ops"))
    yield group
    group.shutdown()
    pool.remove()


def test_accumulated_operations_equal_one_update(actor, tmp_path):
    batch = Batch(make_batch())
    actor.save_state(str(tmp_path / "start"), 0)
    # A low-level client's step: two forward_backward calls, then one optim_step.
    counts = GlobalCounts.of([batch.tensors])
    first = actor.forward_backward(batch[:2], SFTLossConfig(), counts)
    second = actor.forward_backward(batch[2:], SFTLossConfig(), counts)
    norm = actor.optim_step(OptimizerConfig(lr=LR))
    by_operations = actor.group.actor_state_dict()[0]

    assert actor.load_state(str(tmp_path / "start")) == 0
    restored = actor.group.actor_state_dict()[0]
    assert any(not torch.equal(restored[k], by_operations[k]) for k in restored)  # the step moved them
    metrics = actor.update_sft(batch, "token-mean", {"shuffle": False})
    by_update = actor.group.actor_state_dict()[0]

    assert first["loss"] > 0 and second["loss"] > 0
    assert norm == pytest.approx(metrics["sft/grad_norm"], rel=1e-5)
    # Within 1% of a step (as tests/test_train_engine_dist.py): Adam's first update is ~lr * sign(g),
    # so gradient entries near its eps turn float-summation-order differences into weight differences.
    assert max(float((by_update[k] - by_operations[k]).abs().max()) for k in by_update) <= 1e-2 * LR
    assert actor.lr_scheduler_step() == pytest.approx(LR)  # constant schedule


def test_forward_gives_the_log_probs_of_compute_log_prob(actor):
    batch = Batch(make_batch())
    forward = actor.forward(batch).tensors["log_probs"]
    assert torch.allclose(forward, actor.compute_log_prob(batch).tensors["old_log_probs"], atol=1e-6)


def test_surfaces_are_derived_from_the_registered_methods():
    assert set(CheckpointedGroup.operations) <= set(ActorGroup.operations) & set(CriticGroup.operations)
    assert ActorGroup.update_actor.spec.reduce is Reduce.GLOBAL
    assert ActorGroup.sync_weights.spec.reduce is Reduce.RANK_ZERO

    class Probe(Worker):
        @register(Dispatch.ONE_TO_ALL)
        def ping(self) -> int:
            return 1

        def helper(self) -> int:
            return 2

    with pytest.raises(TypeError, match="not a registered worker method"):
        operation(Probe.helper)
    with pytest.raises(TypeError, match="must carry the worker method's name"):
        operation(Probe.ping).__set_name__(CheckpointedGroup, "pong")


def test_a_gradient_call_refuses_a_batch_that_padding_would_count_twice():
    layout = MeshLayout.from_info("actor", [(0, True), (1, True)])
    batch = Batch(make_batch(batch_size=5))
    assert registered_methods(ActorRolloutRefWorker)["forward_backward"].pad is False
    with pytest.raises(ValueError, match="5 rows does not split evenly over the 2 data-parallel"):
        split_for_mesh(layout, batch, pad=False)
    chunks, pad = split_for_mesh(layout, batch)  # other MESH methods pad, and drop the pad's outputs
    assert pad == 1 and [len(chunk) for chunk in chunks] == [3, 3]
