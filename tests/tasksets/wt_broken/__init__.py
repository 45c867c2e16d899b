"""A verifiers taskset whose every rollout fails (its reward function raises)."""

import verifiers.v1 as vf


class BrokenData(vf.TaskData):
    answer: str = ""


class BrokenTask(vf.Task[BrokenData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        raise RuntimeError("the grader is broken")


class BrokenTaskset(vf.Taskset[BrokenTask, vf.TasksetConfig]):
    def load(self) -> list[BrokenTask]:
        return [
            BrokenTask(BrokenData(prompt=f"{i}{i}+11=", answer=""), self.config.task)
            for i in range(1, 4)
        ]


__all__ = ["BrokenTaskset"]
