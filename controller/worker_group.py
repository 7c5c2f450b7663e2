"""RayWorkerGroup: one Ray actor per bundle of a ResourcePool, with the workers' registered methods
bound as methods of the group.

Every actor is a `WorkerHost` that holds one or more worker roles (plain `workers.base.Worker`
subclasses). A group made with `RayWorkerGroup(pool, cls, ...)` hosts one role; `fused_groups(...)`
hosts several roles in the same processes and returns one group view per role over the same actors,
each role keeping its own mesh registry. Every blocking call has a timeout, and the first rank to
fail ends the call with an error naming the group, the rank and the method.
"""

from __future__ import annotations

import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from controller.dispatch import MeshLayout, collect_from_mesh, scatter_all_to_all, split_for_mesh
from controller.resource_pool import ResourcePool, cores_shared
from controller.worker_output import ENV as WORKER_OUTPUT_ENV
from controller.worker_output import redirect_output
from engines.host_memory import keep_freed_memory, malloc_tunables
from engines.threads import openmp_wait_env, set_torch_threads
from workers.base import Dispatch, MethodSpec, registered_methods
from workers.remote import WorkerGroupError as WorkerGroupError  # re-exported: callers catch it here
from workers.remote import wait_all

DEFAULT_ROLE = "main"


# Settings that libgomp and glibc read when a rank's process starts, so they go in the actor's
# environment (Ray merges them into the job's env_vars): OpenMP threads spin between ops unless
# the rank's cores are shared, where they sleep (engines/threads.openmp_wait_env), and malloc on
# transparent huge pages (engines/host_memory.py).
def _rank_env(share: float) -> dict[str, dict[str, str]]:
    env = openmp_wait_env(cores_shared(share), os.environ)
    env["GLIBC_TUNABLES"] = malloc_tunables(os.environ.get("GLIBC_TUNABLES"))
    return {"env_vars": env}


@dataclass
class RoleSpec:
    """How to build one worker role inside a host actor."""

    cls: type
    args: tuple = ()
    kwargs: dict[str, Any] = field(default_factory=dict)


class WorkerHost:
    """The Ray actor body: sets the distributed env, then builds and serves its worker roles."""

    def __init__(self, rank: int, world_size: int) -> None:
        self.rank, self.world_size = rank, world_size
        self.roles: dict[str, Any] = {}

    def node_address(self) -> tuple[str, int]:
        """This node's IP and a free TCP port, for MASTER_ADDR / MASTER_PORT."""
        with socket.socket() as sock:
            sock.bind(("", 0))
            port = sock.getsockname()[1]
        return ray.util.get_node_ip_address(), port

    def start(self, env: dict[str, str], roles: dict[str, RoleSpec], bundle_cpus: float = 1.0) -> None:
        os.environ.update(env)
        # Ray leaves an actor one OpenMP thread per CPU it asked for, and colocated groups ask for a
        # share of the bundle; they take turns, so each uses the whole bundle (up to the cores).
        set_torch_threads(bundle_cpus, int(env.get("LOCAL_WORLD_SIZE", "1")))
        keep_freed_memory()  # no mmap / munmap of every step's tensors (engines/host_memory.py)
        if env.get(WORKER_OUTPUT_ENV):  # a service job: output goes to the job's log
            redirect_output(env[WORKER_OUTPUT_ENV])
        for name, spec in roles.items():
            self.roles[name] = spec.cls(*spec.args, **spec.kwargs)

    def execute(self, role: str, method: str, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        return getattr(self.roles[role], method)(*args, **kwargs)

    def execute_on_batch(self, role: str, method: str, batch: Any, payload: tuple[tuple, dict]) -> Any:
        args, kwargs = payload
        return getattr(self.roles[role], method)(batch, *args, **kwargs)

    def pid(self) -> int:
        return os.getpid()


class _Hosts:
    """The actors of one placement, shared by every role view over them."""

    def __init__(
        self, pool: ResourcePool, roles: dict[str, RoleSpec], name: str, share: float, start_timeout_s: float
    ) -> None:
        if not 0 < share <= 1:
            raise ValueError(f"share must be in (0, 1], got {share}")
        self.name, self.pool = name, pool
        world = pool.num_bundles
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
            ).remote(rank, world)
            for rank, bundle in enumerate(pool.bundle_order)
        ]
        # The rendezvous lives on rank 0's node: ask rank 0's own actor for its node IP and a free port.
        master_addr, master_port = ray.get(self.actors[0].node_address.remote(), timeout=start_timeout_s)
        local = pool.local_ranks()
        starts = [
            actor.start.remote(
                {
                    "RANK": str(rank),
                    "WORLD_SIZE": str(world),
                    "LOCAL_RANK": str(local[rank][0]),
                    "LOCAL_WORLD_SIZE": str(local[rank][1]),
                    "MASTER_ADDR": master_addr,
                    "MASTER_PORT": str(master_port),
                    "TANDEM_GROUP": name,
                    WORKER_OUTPUT_ENV: os.environ.get(WORKER_OUTPUT_ENV, ""),
                },
                roles,
                pool.cpus_per_bundle,
            )
            for rank, actor in enumerate(self.actors)
        ]
        wait_all(name, "__init__", starts, start_timeout_s)

    def kill(self) -> None:
        for actor in self.actors:
            ray.kill(actor, no_restart=True)


class RayWorkerGroup:
    """One role's view over a set of worker actors, with its registered methods bound."""

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
        hosts = _Hosts(
            pool, {DEFAULT_ROLE: RoleSpec(worker_cls, args, kwargs)}, group_name, share, start_timeout_s
        )
        self._init_view(hosts, DEFAULT_ROLE, worker_cls, call_timeout_s)

    @classmethod
    def _view(cls, hosts: _Hosts, role: str, worker_cls: type, call_timeout_s: float) -> RayWorkerGroup:
        group = cls.__new__(cls)
        group._init_view(hosts, role, worker_cls, call_timeout_s)
        return group

    def _init_view(self, hosts: _Hosts, role: str, worker_cls: type, call_timeout_s: float) -> None:
        self._hosts, self.role, self.worker_cls = hosts, role, worker_cls
        self.call_timeout_s = call_timeout_s
        self.name = hosts.name if role == DEFAULT_ROLE else f"{hosts.name}/{role}"
        self._layouts: dict[str, MeshLayout] = {}
        for method, spec in registered_methods(worker_cls).items():
            if hasattr(type(self), method):
                raise ValueError(f"{worker_cls.__name__}.{method} collides with a RayWorkerGroup attribute")
            setattr(self, method, self._bind(method, spec))

    # ---- public ------------------------------------------------------------------------------

    @property
    def world_size(self) -> int:
        return len(self._hosts.actors)

    @property
    def actors(self) -> list[ray.actor.ActorHandle]:
        return list(self._hosts.actors)

    def mesh_layout(self, mesh: str) -> MeshLayout:
        """The mesh's layout, queried from all ranks on first use and cached for this role."""
        if mesh not in self._layouts:
            info = self._run_all("mesh_info", [((mesh,), {})] * self.world_size)
            self._layouts[mesh] = MeshLayout.from_info(mesh, info)
        return self._layouts[mesh]

    def submit(self, method: str, *args: Any, **kwargs: Any) -> PendingCall:
        """Start a registered method without waiting; `result()` collects it as the blocking call
        would (the same dispatch, collection and timeout), so the controller can work meanwhile."""
        spec = registered_methods(self.worker_cls).get(method)
        if spec is None:
            raise AttributeError(f"{self.worker_cls.__name__} registers no method '{method}'")
        return self._submit(method, spec, args, kwargs)

    def shutdown(self) -> None:
        """Kill the actors (every role view over them goes with them)."""
        self._hosts.kill()

    # ---- binding and execution ---------------------------------------------------------------

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
            refs = [a.execute.remote(self.role, method, payload) for a in actors]
            return PendingCall(self, method, refs, lambda outs: outs)
        if spec.mode is Dispatch.ALL_TO_ALL:
            per_rank = scatter_all_to_all(self.world_size, args, kwargs)
            refs = [a.execute.remote(self.role, method, p) for a, p in zip(actors, per_rank, strict=True)]
            return PendingCall(self, method, refs, lambda outs: outs)
        if spec.mode is Dispatch.RANK_ZERO:
            refs = [actors[0].execute.remote(self.role, method, (args, kwargs))]
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
            actor.execute_on_batch.remote(self.role, method, chunk_refs[layout.dp_rank[rank]], rest)
            for rank, actor in enumerate(self._hosts.actors)
        ]
        return PendingCall(self, method, refs, lambda outs: collect_from_mesh(layout, outs, pad))

    def _run_all(self, method: str, per_rank: list[tuple[tuple, dict]]) -> list[Any]:
        refs = [
            a.execute.remote(self.role, method, p) for a, p in zip(self._hosts.actors, per_rank, strict=True)
        ]
        return wait_all(self.name, method, refs, self.call_timeout_s)


def _shared(value: Any, readers: int) -> Any:
    """`value` as one object-store copy when several ranks read it, else as itself: Ray then sends
    a small argument inside the call (a `ray.put` costs ~0.5 ms at quiet, and the rank a fetch) and
    stores a large one once anyway."""
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
        outputs = wait_all(self.group.name, self.method, self.refs, timeout_s or self.group.call_timeout_s)
        return self._collect(outputs)


def fused_groups(
    pool: ResourcePool,
    roles: dict[str, RoleSpec],
    group_name: str = "workers",
    share: float = 1.0,
    call_timeout_s: float = 3600.0,
    start_timeout_s: float = 300.0,
) -> dict[str, RayWorkerGroup]:
    """Host several roles in the same actors; one group view per role, each with its own meshes."""
    hosts = _Hosts(pool, roles, group_name, share, start_timeout_s)
    return {role: RayWorkerGroup._view(hosts, role, spec.cls, call_timeout_s) for role, spec in roles.items()}
