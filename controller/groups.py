"""Typed surfaces of the job's worker groups: what the trainer may call on each role, and what it gets.

A `RayWorkerGroup` binds a worker's registered methods at run time, so type checkers cannot see
them. Each class here names the operations its role offers, each one line derived from the worker
method itself: `update_actor = operation(ActorRefWorker.update_actor)` takes that method's
parameters and returns what its annotation says, reduced over ranks as its `@register` spec
declares (`workers.base.Reduce`):
- MESH calls that return a Batch come back gathered by dp rank (controller/dispatch.py);
- `Reduce.GLOBAL`: results the engine already reduced over ranks (update metrics, the grad norm),
  identical on every rank, so rank 0's;
- `Reduce.RANK_ZERO`: a per-rank measurement (a weight sync's timing) or acknowledgement: rank 0's.
A group checks at construction that its worker registers every operation it offers with the same spec, so a renamed
or re-declared worker method fails when the group starts, not in the middle of a job.

The actor's group holds its rollout group: the same workers for the hybrid worker, or a rollout
group of its own (placement 'split'), to which the training rank 0 sends the weights.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar, overload

from controller.worker_group import RayWorkerGroup
from workers.actor_role import ActorRefWorker
from workers.base import SPEC_ATTR, Dispatch, MethodSpec, Reduce, registered_methods
from workers.batch import Batch
from workers.critic import CriticWorker
from workers.operations import TrainingOperations
from workers.reward_model import RewardModelWorker
from workers.rollout_role import RolloutWorker

P = ParamSpec("P")
R = TypeVar("R")


def reduce_results(spec: MethodSpec, results: Any) -> Any:
    """One result from the ranks' results, as the method's spec declares (module docstring)."""
    if spec.reduce is Reduce.ALL:
        return results
    if spec.mode is Dispatch.RANK_ZERO:
        return results  # already rank 0's alone
    return results[0]


class operation(Generic[P, R]):  # noqa: N801 -- used like a decorator, named like one
    """A group method derived from a registered worker method: the same parameters (less `self`)
    and the same result, reduced over ranks as the method's spec says."""

    def __init__(self, method: Callable[Concatenate[Any, P], R]) -> None:
        spec = getattr(method, SPEC_ATTR, None)
        if not isinstance(spec, MethodSpec):
            raise TypeError(
                f"{method.__qualname__} is not a registered worker method (workers.base.register)"
            )
        if not spec.blocking:
            raise TypeError(f"{method.__qualname__} is non-blocking; start it with RoleGroup.start")
        self.name, self.spec, self.__doc__ = method.__name__, spec, method.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        if name != self.name:
            raise TypeError(f"{owner.__name__}.{name} must carry the worker method's name, {self.name!r}")

    @overload
    def __get__(self, group: None, owner: type) -> operation[P, R]: ...
    @overload
    def __get__(self, group: RoleGroup, owner: type) -> Callable[P, R]: ...
    def __get__(self, group: RoleGroup | None, owner: type) -> operation[P, R] | Callable[P, R]:
        if group is None:
            return self

        def call(*args: P.args, **kwargs: P.kwargs) -> R:
            return reduce_results(self.spec, getattr(group.group, self.name)(*args, **kwargs))

        call.__name__, call.__doc__ = self.name, self.__doc__
        return call


class RoleGroup:
    """A typed view of one role's RayWorkerGroup; subclasses declare their `operation`s."""

    # Derived from the class's operations (__init_subclass__), never written by hand.
    operations: ClassVar[dict[str, operation]] = {}

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        ops = {n: v for k in reversed(cls.__mro__) for n, v in vars(k).items() if isinstance(v, operation)}
        cls.operations = ops

    def __init__(self, group: RayWorkerGroup) -> None:
        registered = registered_methods(group.worker_cls)
        missing = sorted(name for name, op in self.operations.items() if registered.get(name) != op.spec)
        if missing:
            raise TypeError(
                f"{group.worker_cls.__name__} does not register {missing} as {type(self).__name__} expects"
            )
        self.group = group

    def start(self, op: operation[P, R], *args: P.args, **kwargs: P.kwargs) -> Callable[[], R]:
        """`op` started without waiting; call the result to wait for it (same timeout, same reduction)."""
        pending = self.group.submit(op.name, *args, **kwargs)
        return lambda: reduce_results(op.spec, pending.result())

    def shutdown(self) -> None:
        self.group.shutdown()


class CheckpointedGroup(RoleGroup):
    """A training role (workers/operations.py): the job's checkpoints and live edits, and the
    fine-grained operations a low-level client drives one by one."""

    save_checkpoint = operation(TrainingOperations.save_checkpoint)
    load_checkpoint = operation(TrainingOperations.load_checkpoint)
    set_hyperparameters = operation(TrainingOperations.set_hyperparameters)
    forward_backward = operation(TrainingOperations.forward_backward)
    optim_step = operation(TrainingOperations.optim_step)
    lr_scheduler_step = operation(TrainingOperations.lr_scheduler_step)
    forward = operation(TrainingOperations.forward)
    save_state = operation(TrainingOperations.save_state)
    load_state = operation(TrainingOperations.load_state)

    def set_learning_rate(self, lr: float) -> None:
        self.set_hyperparameters(lr=lr)


class RolloutGroup(RoleGroup):
    """The rollout role: in the hybrid worker (workers/hybrid.py) or on its own workers
    (workers/rollout_role.py, placement 'split')."""

    generate_sequences = operation(RolloutWorker.generate_sequences)
    generate = operation(RolloutWorker.generate)


class ActorGroup(CheckpointedGroup):
    """The actor and its rollout: the hybrid worker (workers/hybrid.py), or the training role
    (workers/actor_role.py) beside a rollout group of its own (`rollout`, placement 'split'), to
    which its rank 0 sends the weights."""

    compute_log_prob = operation(ActorRefWorker.compute_log_prob)
    compute_ref_log_prob = operation(ActorRefWorker.compute_ref_log_prob)
    update_actor = operation(ActorRefWorker.update_actor)
    update_sft = operation(ActorRefWorker.update_sft)
    sync_weights = operation(ActorRefWorker.sync_weights)
    export_hf = operation(ActorRefWorker.export_hf)

    def __init__(self, group: RayWorkerGroup, rollout: RayWorkerGroup | None = None) -> None:
        super().__init__(group)
        self.rollout = RolloutGroup(rollout or group)
        self._own_rollout = rollout is not None

    def generate_sequences(self, prompts: Batch) -> Batch:
        """One response per row, sampled with the batch's SamplingParams (rollout mesh)."""
        return self.rollout.generate_sequences(prompts)

    def set_rollout(self, rollout: RayWorkerGroup) -> None:
        """A replacement rollout group of its own (placement 'split'; controller/roles.py)."""
        self.rollout, self._own_rollout = RolloutGroup(rollout), True

    @property
    def own_rollout(self) -> RayWorkerGroup | None:
        """The rollout group placed apart (placement 'split'), or None when the workers are hybrid."""
        return self.rollout.group if self._own_rollout else None

    def start_sync_weights(self) -> Callable[[], dict[str, float]]:
        """`sync_weights` started without waiting; call the result to wait for its measurements."""
        return self.start(ActorGroup.sync_weights)

    def shutdown(self) -> None:
        if self._own_rollout:
            self.rollout.shutdown()
        super().shutdown()


class CriticGroup(CheckpointedGroup):
    """The value model (workers/critic.py)."""

    compute_values = operation(CriticWorker.compute_values)
    update_critic = operation(CriticWorker.update_critic)


class RewardGroup(RoleGroup):
    """The reward model (workers/reward_model.py)."""

    compute_rm_score = operation(RewardModelWorker.compute_rm_score)
