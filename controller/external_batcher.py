"""The endpoint's calls, batched onto the job's rollout replicas: calls that arrive while a replica is
busy, or within batch_window_ms, go to a free replica as one `generate` per sampling setting. Every
completion carries the trainer's version of the weights that sampled it.
"""

from __future__ import annotations

import asyncio
import itertools
from typing import Any

from controller.external_store import TrajectoryError
from engines.rollout.constrained import ConstraintError

GENERATE_TIMEOUT_S = 900.0  # a call waits for a training step's update on a colocated worker
ATTACH_TIMEOUT_S = 60.0
STARTING_WAIT_S = 120.0  # a call that arrives before the rollout workers are attached waits this long


class ReplicaBatcher:
    """One per endpoint, attached again to each attempt's replicas."""

    def __init__(self, window_ms: float) -> None:
        self.window_ms = window_ms
        self.queue: asyncio.Queue | None = None
        self.free: asyncio.Queue | None = None
        self.hosts: list[Any] = []
        self.task: asyncio.Task | None = None
        self.held: list[tuple] = []  # calls the loop took off the queue, not yet on a replica (see attach)
        self.running: set[asyncio.Task] = set()  # the loop keeps no other reference to a batch's task
        self.offset = 0  # trainer version - engine version of the attached workers (see attach)
        self.engine_calls = 0
        self.attached = asyncio.Event()

    async def attach(self, hosts: list[Any], version: int) -> None:
        """Serve from `hosts`, which hold trainer version `version`. An engine counts its syncs from 0
        in every new process, so calls record engine version + the offset measured here."""
        engine = hosts[0].execute.remote("weight_version", ((), {}))
        self.offset = version - int(await asyncio.wait_for(engine, ATTACH_TIMEOUT_S))
        self.hosts = list(hosts)
        free: asyncio.Queue = asyncio.Queue()
        for host in hosts:
            free.put_nowait(host)
        self.free = free
        if self.queue is None:
            self.queue = asyncio.Queue()
        if self.task is not None:  # the calls it held (every replica was busy) go to the new replicas
            self.task.cancel()
        self.task = asyncio.get_running_loop().create_task(self._batch_loop(free, self.offset))
        self.attached.set()

    async def generate(self, prompt: list[int], params: Any) -> list[Any]:
        if self.queue is None:  # a new job's first calls wait for its workers (see attach)
            try:
                await asyncio.wait_for(self.attached.wait(), STARTING_WAIT_S)
            except asyncio.TimeoutError:
                raise TrajectoryError(503, f"the job's rollout workers did not come up within {STARTING_WAIT_S:.0f} s; "
                                      "retry", None, "starting", 2.0) from None  # fmt: skip
        future = asyncio.get_running_loop().create_future()
        await self.queue.put((prompt, params, future))
        return await future

    async def _batch_loop(self, free: asyncio.Queue, offset: int) -> None:
        """From the first call, gather until as many arrived as the last batch held (agents answered
        together call again together) or batch_window_ms passed; then a free replica takes them all.
        The calls taken wait in `held`, where a re-attach's new loop finds them."""
        queue, loop, held = self.queue, asyncio.get_running_loop(), self.held
        expected = 1
        while self.free is free:  # wait_for may swallow attach's cancel: a loop ends with its replicas
            if not held:
                held.append(await queue.get())
            deadline = loop.time() + self.window_ms / 1000
            while len(held) < expected and (left := deadline - loop.time()) > 0:
                try:
                    held.append(await asyncio.wait_for(queue.get(), left))
                except asyncio.TimeoutError:
                    break
            host = await free.get()
            if self.free is not free:
                return
            while not queue.empty():
                held.append(queue.get_nowait())
            items, expected = list(held), len(held)
            held.clear()
            task = loop.create_task(self._run(host, items, free, offset))
            self.running.add(task)
            task.add_done_callback(self.running.discard)

    async def _run(self, host: Any, items: list[tuple], free: asyncio.Queue, offset: int) -> None:
        """`items` on `host`; every caller hears an answer or an error, whatever fails; the host goes back
        to the replicas it came from (an earlier attempt's, after a re-attach, serve no more)."""
        why = "its batch was cancelled"
        try:
            key = lambda item: item[1].model_dump_json()  # noqa: E731
            for _, group in itertools.groupby(sorted(items, key=key), key=key):
                if self.free is not free:  # re-attached: this attempt's replicas serve no more
                    why = "the job's rollout workers were started again"
                    break
                await self._run_group(host, list(group), offset)
        except Exception as err:  # its callers hear it below, as a cancellation's do
            why = f"{type(err).__name__}: {err}"
        finally:
            free.put_nowait(host)
            unanswered = [future for _, _, future in items if not future.done()]
            error = TrajectoryError(503, f"the rollout worker {_named(host)} gave no answer to this call: "
                                    f"{why}"[:2000], None, "rollout_failed", 5.0)  # fmt: skip
            for future in unanswered:
                future.set_exception(error)

    async def _run_group(self, host: Any, group: list[tuple], offset: int) -> None:
        params = group[0][1]
        prompts = [g[0] for g in group]
        try:
            ref = host.execute.remote("generate", ((prompts, params.model_dump()), {}))
            self.engine_calls += 1
            completions = await asyncio.wait_for(ref, GENERATE_TIMEOUT_S)
            if len(completions) != len(group) * params.n:  # a caller would get another's, or none
                raise ValueError(f"{len(completions)} completions for {len(group)} prompts x n = {params.n}")
        except Exception as err:  # every caller of the batch hears it
            refused = err if isinstance(err, ConstraintError) else getattr(err, "cause", None)
            failure = TrajectoryError(503, f"the rollout worker {_named(host)} failed: {type(err).__name__}: "
                                      f"{err}"[:2000], None, "rollout_failed", 5.0)  # fmt: skip
            if isinstance(refused, ConstraintError):  # the engine cannot enforce the call's constraint
                param = "tool_choice" if params.constraint.kind == "tool_call" else "response_format"
                failure = TrajectoryError(
                    422, str(refused).replace(refused.param, param, 1), param, "unsupported_value"
                )
            for _, _, future in group:
                if not future.done():
                    future.set_exception(failure)
            return
        for comp in completions:  # the trainer's version of the weights that sampled it
            comp.weight_version += offset
        for i, (_, _, future) in enumerate(group):
            if not future.done():
                future.set_result(completions[i * params.n : (i + 1) * params.n])


def _named(host: Any) -> str:
    """A replica as its error names it: its Ray actor id."""
    actor_id = getattr(host, "_actor_id", None)
    return actor_id.hex()[:16] if actor_id is not None else repr(host)
