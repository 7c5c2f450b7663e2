"""External trajectories: every call of an agent recorded token-exact, until a step trains on it.

A segment is one trainer row, a multi-turn `Trajectory`: the first prompt's tokens as templated, then
per call the delta its prompt adds (mask 0) and the sampled tokens with their log-probs (mask 1). A call
that extends the previous call's messages adds to the segment; one that rewrites history or changes the
tools starts a new one (`reason` says why). States: open -> rewarded -> consumed, or open -> dropped (no
reward within reward_timeout_s). In an async job the store holds the job's `RolloutBuffer`
(B = trajectories_per_step, one sample per trajectory): a new trajectory is an admission (refused: a
429), a reward that completes a group puts it (its version: the group's oldest call's), a step takes
groups through the buffer's staleness filter, and a restart drops what the lost attempt sampled.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass, field
from typing import Any

from controller.rollout_buffer import BufferedRollout, BufferTimeout, RolloutBuffer
from schema.external import ExternalSpec
from workers import multiturn
from workers.chat_serving import content_text, parsed_arguments, tool_call_text


class TrajectoryError(Exception):
    """A request the store refuses: HTTP status, message, the field at fault, a code."""

    def __init__(
        self, status: int, message: str, param: str | None, code: str, retry_after: float = 0
    ) -> None:
        super().__init__(message)
        self.status, self.param, self.code, self.retry_after = status, param, code, retry_after

    def as_dict(self) -> dict[str, Any]:
        return {"status": self.status, "message": str(self), "param": self.param, "code": self.code,
                "retry_after": self.retry_after}  # fmt: skip


@dataclass
class Segment(multiturn.Trajectory):
    """Its multi-turn fields are the trainer's row; the rest is what later calls are matched against."""

    env: Any = None
    kind: str = "chat"  # chat | completion
    reason: str = "first call"  # why it started: first call | the history was rewritten | ...
    finish_reason: str | None = "done"  # done | budget (its last call ran out of new tokens)
    weight_versions: list[int] = field(default_factory=list)  # one per call
    history: list[Any] = field(default_factory=list)  # canonical messages so far (chat)
    tools_key: str = ""
    text: str = ""  # completion: the prompt text and the returned text so far
    # the constrained calls: their index, the constraint's kind and grammar hash
    constraints: list[dict[str, Any]] = field(default_factory=list)
    trajectory_id: str = ""  # these three: set when a step takes it
    task_id: str = ""
    policy_version: int = 0  # async: its trajectory's oldest call's version

    @property
    def sequence(self) -> list[int]:
        return self.prompt_ids + self.tokens

    def add_call(self, delta: list[int], sampled: list[int], log_probs: list[float], version: int) -> None:
        self.append(delta, sampled=False)
        self.append(sampled, sampled=True, log_probs=list(log_probs))
        self.weight_versions.append(version)
        self.turns, self.weight_version = len(self.weight_versions), min(self.weight_versions)

    def copy(self) -> Segment:
        return Segment(**{k: (list(v) if isinstance(v, list) else v) for k, v in vars(self).items()})


@dataclass
class Trajectory:
    id: str
    last_call: float
    segments: list[Segment] = field(default_factory=list)
    state: str = "open"  # open | rewarded | consumed | dropped
    task_id: str = ""
    reward: float = 0.0
    turn_rewards: list[float] | None = None
    metadata: dict[str, Any] = field(default_factory=dict)
    calls: int = 0
    rewarded_at: float = 0.0

    def versions(self) -> list[int]:
        return [v for s in self.segments for v in s.weight_versions]


def canonical_message(m: dict[str, Any]) -> tuple:
    """What must be equal for a later call's message to be the same as an earlier one."""
    calls = []
    for c in m.get("tool_calls") or []:
        f = c.get("function", {})
        args = f.get("arguments", "")
        parsed = parsed_arguments(args)  # arguments that are not JSON: compared as they are
        calls.append((f.get("name"), args if parsed is args else json.dumps(parsed, sort_keys=True)))
    return (m.get("role"), content_text(m.get("content")).strip() if calls else content_text(m.get("content")),
            tuple(calls))  # fmt: skip


def tools_key(tools: list[dict] | None) -> str:
    return json.dumps(tools or [], sort_keys=True)


class TrajectoryStore:
    """The job's external trajectories. Not thread-safe: one event loop."""

    def __init__(self, config: ExternalSpec) -> None:
        self.config = config
        self.trajectories: dict[str, Trajectory] = {}  # every id this job has seen (lookups, 404 vs 409)
        self.live: dict[str, Trajectory] = {}  # the open and rewarded ones: what sweep and take visit
        self._swept = 0.0
        self.dropped = self.consumed = self.new_segments = self._groups_put = 0
        self.buffer: RolloutBuffer | None = None  # trainer.mode async: admission of new trajectories

    def use_buffer(self, max_staleness: int, capacity: int, version: int) -> None:
        """trainer.mode async: admit and buffer trajectories (the buffer outlives a restart)."""
        if self.buffer is None:
            self.buffer = RolloutBuffer(self.config.trajectories_per_step, max_staleness, capacity, version)

    def open(self, tid: str) -> Trajectory:
        """The trajectory a call names, created on its first call (429 past rollout.external.max_pending)."""
        self.sweep()
        traj = self.trajectories.get(tid)
        if traj is not None:
            if traj.state != "open":
                raise TrajectoryError(409, f"trajectory '{tid}' is {traj.state}: it takes no more calls",
                                      "trajectory_id", f"trajectory_{traj.state}")  # fmt: skip
            return traj
        if len(self.live) >= self.config.pending_limit:
            raise TrajectoryError(
                429, f"the job holds {len(self.live)} trajectories that no step has taken yet "
                f"(rollout.external.max_pending = {self.config.pending_limit}); retry later",
                "trajectory_id", "buffer_full", retry_after=1.0,
            )  # fmt: skip
        wait = None if self.buffer is None else self.buffer.try_admit(1)
        if wait is not None:
            raise TrajectoryError(
                429, f"the job's rollout buffer admits no new trajectory now (trainer.max_staleness = "
                f"{self.buffer.max_staleness}, trainer.buffer_size = {self.buffer.capacity}); retry later",
                "trajectory_id", "staleness_bound", retry_after=wait,
            )  # fmt: skip
        traj = self.trajectories[tid] = self.live[tid] = Trajectory(tid, time.time())
        return traj

    def get(self, tid: str) -> Trajectory:
        if tid not in self.trajectories:
            raise TrajectoryError(404, f"no trajectory '{tid}' in this job (trajectories still open when the job "
                                  "was paused or restarted are not kept: start a new one)", "trajectory_id",
                                  "not_found")  # fmt: skip
        return self.trajectories[tid]

    def forget(self, tid: str) -> None:
        """A trajectory whose first call failed: as if never opened."""
        self.trajectories.pop(tid, None)
        if self.live.pop(tid, None) is not None and self.buffer is not None:
            self.buffer.cancel(1)

    def fork(self, tid: str, before: list[Segment]) -> Trajectory:
        """Choice k > 0 of a call with n > 1: a trajectory with the parent's segments so far."""
        traj = self.open(tid)
        traj.segments = [s.copy() for s in before]
        return traj

    def reward(self, tid: str, reward: float, task_id: str | None, turn_rewards: list[float] | None,
               metadata: dict[str, Any]) -> Trajectory:  # fmt: skip
        self.sweep()
        traj = self.get(tid)
        if traj.state != "open":
            raise TrajectoryError(409, f"trajectory '{tid}' is already {traj.state}", "trajectory_id",
                                  f"trajectory_{traj.state}")  # fmt: skip
        traj.state, traj.reward, traj.rewarded_at = "rewarded", float(reward), time.time()
        traj.task_id = task_id if task_id is not None else tid
        traj.turn_rewards, traj.metadata = turn_rewards, metadata
        self.put_groups()
        return traj

    def sweep(self, now: float | None = None) -> int:
        """Drop open trajectories whose reward did not come within reward_timeout_s; returns how many."""
        now = time.time() if now is None else now
        if now - self._swept < 0.5:  # at most twice a second: a sweep visits every pending trajectory
            return 0
        self._swept = now
        timeout = self.config.reward_timeout_s
        return self._drop(
            [t for t in self.live.values() if t.state == "open" and now - t.last_call > timeout]
        )

    def _drop(self, gone: list[Trajectory]) -> int:
        for t in gone:
            t.state, t.segments = "dropped", []  # its tokens are not needed any more
            del self.live[t.id]
        self.dropped += len(gone)
        if self.buffer is not None:  # admitted samples that will not come: their room goes back
            self.buffer.cancel(len(gone))
        return len(gone)

    def _groups(self) -> list[list[Trajectory]]:
        """Whole groups of one task id, oldest reward first."""
        self.sweep()
        size = self.config.group_size
        by_task: dict[str, list[Trajectory]] = {}
        rewarded = [t for t in self.live.values() if t.state == "rewarded"]
        for t in sorted(rewarded, key=lambda t: t.rewarded_at):
            by_task.setdefault(t.task_id, []).append(t)
        return [ts[:size] for ts in by_task.values() if len(ts) >= size]

    def _rows(self, t: Trajectory, policy_version: int = 0) -> list[Segment]:
        """The trainer's rows of a trajectory a step takes, one per segment; it keeps only its id (a late
        reward: 409)."""
        t.state = "consumed"
        del self.live[t.id]
        self.consumed += 1
        rows, t.segments = t.segments, []
        for s in rows:
            s.trajectory_id, s.task_id, s.reward, s.policy_version = t.id, t.task_id, t.reward, policy_version
            s.history, s.text = [], ""  # what later calls were matched against: not the trainer's
        return rows

    def take(self) -> list[Segment] | None:
        """Sync: a step's rows, of trajectories_per_step trajectories in whole groups, or None while
        fewer are ready."""
        want, groups = self.config.trajectories_per_step // self.config.group_size, self._groups()
        if len(groups) < want:
            return None
        return [row for g in groups[:want] for t in g for row in self._rows(t)]

    def put_groups(self) -> None:
        """Async: every complete group into the buffer, each row at its trajectory's oldest call's version."""
        for group in self._groups() if self.buffer is not None else []:
            newest = max(v for t in group for v in t.versions())
            rows = [row for t in group for row in self._rows(t, min(t.versions()))]
            version = min(row.policy_version for row in rows)
            self.buffer.put(
                BufferedRollout(self._groups_put, len(group), version, rows, extra={"newest": newest})
            )
            self._groups_put += 1

    def rewind(self, version: int) -> int:
        """The workers restarted from the checkpoint of `version`: what newer weights sampled is dropped
        (a later call or reward of it: 409), admission restarts from `version`; returns how many."""
        dropped = self.buffer.drop_where(lambda g: g.extra.get("newest", g.version) > version)
        gone = self._drop([t for t in self.live.values() if any(v > version for v in t.versions())])
        self.buffer.set_version(version)
        return dropped + gone

    def take_step(self, version: int, who: str) -> dict[str, Any] | None:
        try:
            groups, _ = self.buffer.take(version, self.buffer.batch_size, 0.0, who)
        except BufferTimeout:
            return None
        return {
            "rows": [row for g in groups for row in g.payload],
            "dropped_total": self.buffer.dropped,
            "fill": self.buffer.buffered_samples() / self.buffer.capacity,
        }

    def stats(self) -> dict[str, float]:
        waiting = sum(t.state == "rewarded" for t in self.live.values())
        return {
            "external/open": float(len(self.live) - waiting),
            "external/rewarded_waiting": float(waiting),
            "external/dropped_total": float(self.dropped),
            "external/consumed_total": float(self.consumed),
            "external/new_segments_total": float(self.new_segments),
        }


def readable_message(m: dict[str, Any]) -> dict[str, str]:
    text = content_text(m.get("content"))
    text += "".join(tool_call_text(c) for c in m.get("tool_calls") or [])
    return {"role": str(m.get("role")), "content": text}


VIEW_KEYS = "reason kind prompt_ids tokens loss_mask log_probs messages weight_versions constraints".split()


def trajectory_view(t: Trajectory, tokens: bool = False) -> dict[str, Any]:
    out = {"id": t.id, "object": "trajectory", "state": t.state, "task_id": t.task_id, "reward": t.reward,
           "turn_rewards": t.turn_rewards, "metadata": t.metadata, "calls": t.calls,
           "segments": len(t.segments)}  # fmt: skip
    if tokens:
        out["segment_list"] = [{k: getattr(s, k) for k in VIEW_KEYS} for s in t.segments]
    return out
