"""Typed surfaces of the job's worker groups: what the trainer may call on each role, and what it gets.

A `RayWorkerGroup` binds methods at run time, so each class here declares its role's operations, each
derived from the worker method itself (`update_actor = operation(ActorRefWorker.update_actor)`), with
its parameters, its result reduced over ranks as its `@register` spec says (`workers.base.Reduce`),
and a check at construction that the worker registers it so: a renamed method fails at start.
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
    """All ranks' results (Reduce.ALL), or rank 0's (RANK_ZERO dispatch: already rank 0's alone)."""
    if spec.reduce is Reduce.ALL or spec.mode is Dispatch.RANK_ZERO:
        return results
    return results[0]


class operation(Generic[P, R]):  # noqa: N801 -- used like a decorator, named like one
    """A group method with a registered worker method's parameters and result, reduced over ranks."""

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
        """`op` started without waiting; call the result to wait for it."""
        pending = self.group.submit(op.name, *args, **kwargs)
        return lambda: reduce_results(op.spec, pending.result())

    def shutdown(self) -> None:
        self.group.shutdown()


class CheckpointedGroup(RoleGroup):
    """A training role (workers/operations.py): checkpoints, live edits and fine-grained operations."""

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
    """The rollout role: in the hybrid worker, or on its own workers (placement 'split')."""

    generate_sequences = operation(RolloutWorker.generate_sequences)
    generate = operation(RolloutWorker.generate)


class ActorGroup(CheckpointedGroup):
    """The actor and its rollout: the hybrid worker, or the training role beside a rollout group of its
    own (placement 'split'), to which its rank 0 sends the weights."""

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
        return self.rollout.generate_sequences(prompts)

    def set_rollout(self, rollout: RayWorkerGroup) -> None:
        """A replacement rollout group of its own (placement 'split')."""
        self.rollout, self._own_rollout = RolloutGroup(rollout), True

    @property
    def own_rollout(self) -> RayWorkerGroup | None:
        """The rollout group placed apart, or None when the workers are hybrid."""
        return self.rollout.group if self._own_rollout else None

    def start_sync_weights(self) -> Callable[[], dict[str, float]]:
        return self.start(ActorGroup.sync_weights)

    def shutdown(self) -> None:
        if self._own_rollout:
            self.rollout.shutdown()
        super().shutdown()


class CriticGroup(CheckpointedGroup):
    compute_values = operation(CriticWorker.compute_values)
    update_critic = operation(CriticWorker.update_critic)


class RewardGroup(RoleGroup):
    compute_rm_score = operation(RewardModelWorker.compute_rm_score)
