"""RayWorkerGroup: one `WorkerHost` actor per bundle of a ResourcePool, with the worker's registered
methods bound as methods of the group. Every blocking call has a timeout, and the first rank to fail
ends the call with an error naming the group, the rank and the method.

Since the methods are bound at run time, a `RoleGroup` (controller/groups.py) gives one role's group
a typed surface: each `operation` is derived from the worker method itself, keeps its parameters,
reduces the ranks' results as its `@register` spec says (`workers.base.Reduce`), and is checked at
construction against what the worker registers, so a renamed method fails at start.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from typing import Any, ClassVar, Concatenate, Generic, ParamSpec, TypeVar, overload

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from controller.dispatch import MeshLayout, collect_from_mesh, scatter_all_to_all, split_for_mesh
from controller.resource_pool import ResourcePool, cores_shared
from controller.worker_output import ENV as WORKER_OUTPUT_ENV
from controller.worker_output import redirect_output
from engines.host_memory import keep_freed_memory, malloc_tunables
from engines.threads import openmp_wait_env, set_torch_threads
from workers.base import SPEC_ATTR, Dispatch, MethodSpec, Reduce, registered_methods
from workers.remote import WorkerGroupError as WorkerGroupError  # re-exported: callers catch it here
from workers.remote import wait_all


# libgomp and glibc read these when a rank's process starts: OpenMP threads sleep rather than spin
# when the rank's cores are shared, and malloc uses transparent huge pages.
def _rank_env(share: float) -> dict[str, dict[str, str]]:
    env = openmp_wait_env(cores_shared(share), os.environ)
    env["GLIBC_TUNABLES"] = malloc_tunables(os.environ.get("GLIBC_TUNABLES"))
    return {"env_vars": env}


class WorkerHost:
    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.worker: Any = None

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port, for MASTER_ADDR / MASTER_PORT."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, env: dict[str, str], worker: tuple[type, tuple, dict], bundle_cpus: float = 1.0) -> int:
        os.environ.update(env)
        # Colocated groups ask for a share of the bundle but take turns: each uses the whole bundle.
        set_torch_threads(bundle_cpus, int(env.get("LOCAL_WORLD_SIZE", "1")))
        keep_freed_memory()  # no mmap / munmap of every step's tensors
        if env.get(WORKER_OUTPUT_ENV):  # a service job: output goes to the job's log
            redirect_output(env[WORKER_OUTPUT_ENV])
        cls, args, kwargs = worker
        self.worker = cls(*args, **kwargs)
        return os.getpid()

    def execute(self, method: str, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        return getattr(self.worker, method)(*args, **kwargs)

    def execute_on_batch(self, method: str, batch: Any, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        return getattr(self.worker, method)(batch, *args, **kwargs)

    def pid(self) -> int:
        return os.getpid()


class PendingGroup:
    """A group's actors on one placement, made in two phases so that several groups start at once: the
    constructor asks Ray for the actors, `begin()` sends each its worker, `ready()` waits for them."""

    def __init__(
        self,
        pool: ResourcePool,
        worker_cls: type,
        *args: Any,
        group_name: str = "workers",
        share: float = 1.0,
        call_timeout_s: float = 3600.0,
        start_timeout_s: float = 300.0,
        **kwargs: Any,
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.name, self.pool, self.worker_cls = group_name, pool, worker_cls
        self.worker = (worker_cls, args, kwargs)
        self.start_timeout_s, self.call_timeout_s = start_timeout_s, call_timeout_s
        self.starts: list[ray.ObjectRef] | None = None
        self.hosts: list[str] = []  # "pid 123 on 10.0.0.1" for each rank, once started
        remote_host, env = ray.remote(WorkerHost), _rank_env(share)
        self.actors = [
            remote_host.options(
                num_cpus=pool.cpus_per_bundle * share,
                num_gpus=pool.gpus_per_bundle * share,
                scheduling_strategy=PlacementGroupSchedulingStrategy(
                    placement_group=pool.placement_group, placement_group_bundle_index=bundle
                ),
                name=None,
                runtime_env=env,
            ).remote(rank, pool.num_bundles)
            for rank, bundle in enumerate(pool.bundle_order)
        ]
        # The rendezvous lives on rank 0's node: rank 0's own actor names its node IP and a free port.
        self.address = self.actors[0].node_address.remote()

    def begin(self) -> None:
        if self.starts is not None:
            return
        world, pool = len(self.actors), self.pool
        answers = wait_all(self.name, "node_address", [self.address], self.start_timeout_s)
        master_addr, master_port = answers[0]
        local = pool.local_ranks()
        self.starts = [
            actor.start.remote(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local[rank][0]),
                    "LOCAL_WORLD_SIZE": str(local[rank][1]),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "TANDEM_GROUP": self.name,
                    WORKER_OUTPUT_ENV: os.environ.get(WORKER_OUTPUT_ENV, ""),
                },
                self.worker,
                pool.cpus_per_bundle,
            )
            for rank, actor in enumerate(self.actors)
        ]

    def wait(self) -> PendingGroup:
        self.begin()
        assert self.starts is not None
        pids = wait_all(self.name, "__init__", self.starts, self.start_timeout_s)
        if not self.hosts:
            ips = self.pool.placement()["node_ips"]
            self.hosts = [f"pid {pid} on {ip or 'its node'}" for pid, ip in zip(pids, ips, strict=True)]
        return self

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)

    def ready(self) -> RayWorkerGroup:
        group = RayWorkerGroup.__new__(RayWorkerGroup)
        group._init_view(self.wait())
        return group


def ready_all(pending: dict[str, PendingGroup]) -> dict[str, RayWorkerGroup]:
    """Every launched group, started side by side; the first failure raises (the caller removes the
    pools, and with them the other groups' actors)."""
    for group in pending.values():
        group.begin()
    return {name: group.ready() for name, group in pending.items()}


class RayWorkerGroup:
    def __init__(self, pool: ResourcePool, worker_cls: type, *args: Any, **kwargs: Any) -> None:
        self._init_view(PendingGroup(pool, worker_cls, *args, **kwargs).wait())

    launch = PendingGroup  # a group started without waiting for it (`PendingGroup.ready()` returns it)

    def _init_view(self, hosts: PendingGroup) -> None:
        self._hosts, self.worker_cls, self.name = hosts, hosts.worker_cls, hosts.name
        self.call_timeout_s, self.hosts = hosts.call_timeout_s, hosts.hosts
        worker_cls = hosts.worker_cls
        self._layouts: dict[str, MeshLayout] = {}
        for method, spec in registered_methods(worker_cls).items():
            if hasattr(type(self), method):
                raise ValueError(f"{worker_cls.__name__}.{method} collides with a RayWorkerGroup attribute")
            setattr(self, method, self._bind(method, spec))

    @property
    def world_size(self) -> int:
        return len(self._hosts.actors)

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        return list(self._hosts.actors)

    def mesh_layout(self, mesh: str) -> MeshLayout:
        if mesh not in self._layouts:
            refs = [a.execute.remote("mesh_info", ((mesh,), {})) for a in self._hosts.actors]
            info = wait_all(self.name, "mesh_info", refs, self.call_timeout_s)
            self._layouts[mesh] = MeshLayout.from_info(mesh, info)
        return self._layouts[mesh]

    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Start a registered method without waiting; `result()` collects it as the blocking call would."""
        spec = registered_methods(self.worker_cls).get(method)
        if spec is None:
            raise AttributeError(f"{self.worker_cls.__name__} registers no method '{method}'")
        return self._submit(method, spec, args, kwargs)

    def pids(self, timeout_s: float = 30.0) -> list[int]:
        return wait_all(self.name, "pid", [a.pid.remote() for a in self._hosts.actors], timeout_s)

    def shutdown(self) -> None:
        self._hosts.kill()

    def _bind(self, method: str, spec: MethodSpec) -> Callable[..., Any]:
        def call(*args: Any, **kwargs: Any) -> Any:
            pending = self._submit(method, spec, args, kwargs)
            return pending.result() if spec.blocking else pending

        call.__name__ = method
        call.__doc__ = getattr(self.worker_cls, method).__doc__
        return call

    def _submit(self, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> PendingCall:
        actors = self._hosts.actors
        if spec.mode is Dispatch.ONE_TO_ALL:
            payload = _shared((args, kwargs), len(actors))
            refs = [a.execute.remote(method, payload) for a in actors]
            return PendingCall(self, method, refs, lambda outs: outs)
        if spec.mode is Dispatch.ALL_TO_ALL:
            per_rank = scatter_all_to_all(self.world_size, args, kwargs)
            refs = [a.execute.remote(method, p) for a, p in zip(actors, per_rank, strict=True)]
            return PendingCall(self, method, refs, lambda outs: outs)
        if spec.mode is Dispatch.RANK_ZERO:
            refs = [actors[0].execute.remote(method, (args, kwargs))]
            return PendingCall(self, method, refs, lambda outs: outs[0])
        if spec.mode is Dispatch.MESH:
            return self._submit_mesh(method, spec, args, kwargs)
        raise ValueError(f"unknown dispatch mode {spec.mode}")

    def _submit_mesh(self, method: str, spec: MethodSpec, args: tuple, kwargs: dict) -> PendingCall:
        if not args:
            raise TypeError(f"{self.name}.{method} is a MESH method: pass the Batch as its first argument")
        layout = self.mesh_layout(spec.mesh or "")
        chunks, pad = split_for_mesh(layout, args[0], pad=spec.pad)
        readers = [layout.dp_rank.count(dp) for dp in range(len(chunks))]
        chunk_refs = [_shared(chunk, n) for chunk, n in zip(chunks, readers, strict=True)]  # tp peers
        rest = _shared((args[1:], kwargs), self.world_size)
        refs = [
            actor.execute_on_batch.remote(method, chunk_refs[layout.dp_rank[rank]], rest)
            for rank, actor in enumerate(self._hosts.actors)
        ]
        return PendingCall(self, method, refs, lambda outs: collect_from_mesh(layout, outs, pad))


def _shared(value: Any, readers: int) -> Any:
    """One object-store copy when several ranks read `value`; else inline (a put costs a round trip)."""
    return ray.put(value) if readers > 1 else value


class PendingCall:
    """A submitted group call; `result()` waits (bounded by the group's timeout) and collects."""

    def __init__(
        self,
        group: RayWorkerGroup,
        method: str,
        refs: list[ray.ObjectRef],
        collect: Callable[[list[Any]], Any],
    ) -> None:
        self.group, self.method, self.refs, self._collect = group, method, refs, collect

    def result(self, timeout_s: float | None = None) -> Any:
        timeout_s = timeout_s or self.group.call_timeout_s
        outputs = wait_all(self.group.name, self.method, self.refs, timeout_s, self.group.hosts)
        return self._collect(outputs)


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
