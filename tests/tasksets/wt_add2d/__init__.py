"""A verifiers taskset for the tests: the demo model's 2-digit sums, scored exactly (the first
three characters of the reply are the sum with 3 digits), data built in code."""

import random

import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip()[:3] == self.data.answer else 0.0

    @vf.reward(weight=0.0)  # reported on its own, not in the reward (which stays 0/1)
    async def three_digits(self, trace: vf.Trace) -> float:
        return 1.0 if trace.last_reply.strip()[:3].isdigit() else 0.0


class SumConfig(vf.TasksetConfig):
    num_tasks: int = 16
    seed: int = 1234


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self) -> list[SumTask]:
        rng = random.Random(self.config.seed)
        pairs = [(rng.randint(10, 99), rng.randint(10, 99)) for _ in range(self.config.num_tasks)]
        return [
            SumTask(
                SumData(id=f"{a}+{b}", prompt=f"{a}+{b}=", answer=f"{a + b:03d}"), self.config.task
            )
            for a, b in pairs
        ]


__all__ = ["SumTaskset"]
