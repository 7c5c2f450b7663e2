"""verifiers environments the tests' jobs name (rollout.external.agent 'tests.verifiers_envs:NAME'):
one whose rubric raises, one whose rubric never returns, one that needs a container."""

from __future__ import annotations

import asyncio

import verifiers.v1 as vf


class EchoTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        raise ValueError("rubric broke on purpose")


class RaisingTaskset(vf.Taskset[EchoTask, vf.TasksetConfig]):
    def load(self):
        yield EchoTask(vf.TaskData(prompt="1+1="))


class SlowTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def forever(self, trace: vf.Trace) -> float:
        await asyncio.sleep(3600)
        return 0.0


class HangingTaskset(vf.Taskset[SlowTask, vf.TasksetConfig]):
    def load(self):
        yield SlowTask(vf.TaskData(prompt="1+1="))


class BoxedTask(vf.Task[vf.TaskData]):
    NEEDS_CONTAINER = True


class ContainerTaskset(vf.Taskset[BoxedTask, vf.TasksetConfig]):
    def load(self):
        yield BoxedTask(vf.TaskData(prompt="ls"))
