"""verifiers environments the tests name (rollout.external.agent 'tests.verifiers_envs:NAME'): one whose
rubric raises on its first task and never returns on its second, one whose tasks need a container."""

from __future__ import annotations

import asyncio

import verifiers.v1 as vf


class BrokenTask(vf.Task[vf.TaskData]):
    @vf.reward
    async def broken(self, trace: vf.Trace) -> float:
        if self.data.name == "raises":
            raise ValueError("rubric broke on purpose")
        await asyncio.sleep(3600)  # "hangs": never returns
        return 0.0


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self):
        yield BrokenTask(vf.TaskData(prompt="1+1=", name="raises"))
        yield BrokenTask(vf.TaskData(prompt="2+2=", name="hangs"))


class BoxedTask(vf.Task[vf.TaskData]):
    NEEDS_CONTAINER = True


class ContainerTaskset(vf.Taskset[BoxedTask, vf.TasksetConfig]):
    def load(self):
        yield BoxedTask(vf.TaskData(prompt="ls"))
