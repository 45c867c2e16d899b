"""lm-eval's code tasks judged in the watcher's sandbox (worker only).

lm-eval's `humaneval` and `mbpp` utils, and any task YAML like them, score model-written code
with Hugging Face's `code_eval` metric, `evaluate.load("code_eval")`: fetched from the Hub,
refused unless `HF_ALLOW_CODE_EVAL=1`, and run in a forked child of the worker with the worker's
files, network and credentials in reach, 3 s of wall-clock time each. In a worker that metric
is `CodeEval` instead (lm_eval_internals.serve_code_eval): the same interface and the same
answers (`compute(references, predictions, k)` -> pass@k by k, and each program's result by
problem), each program run in the sandbox (sandbox/), judged by CPU time, nothing fetched.

It runs programs only while an entry with `allow_code_execution: true` is evaluated (`allowed`,
set by the worker around that entry alone); otherwise it refuses, as `code_eval` does without its
variable. Each program's verdict is kept (by the test and the program) so that the entry's
per-document records carry them (`attach`): `watcher samples` shows why a response failed.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from typing import Any

from ckpt_watcher.errors import EvalError
from ckpt_watcher.sandbox import Program, Sandbox, Verdict

REFUSED = (
    "this task runs model-written code (unsafe code): set allow_code_execution: true on its "
    "entry to run it in the watcher's sandbox"
)


class CodeEval:
    """What `evaluate.load("code_eval")` returns in a worker."""

    def __init__(self) -> None:
        self.sandbox: Sandbox | None = None
        self.allowed = False
        # (test, candidate) -> verdict; for the shipped tasks' programs, (problem, source)
        self.verdicts: dict[tuple[str, str], Verdict] = {}
        self.settings: Any = None  # the sandbox's (config.SandboxConfig)

    def compute(
        self,
        predictions: Sequence[Sequence[str]],
        references: Sequence[str],
        k: Sequence[int] | int = (1, 10, 100),
        num_workers: int = 4,  # code_eval's; the sandbox's own parallelism is used
        timeout: float = 3.0,  # code_eval's wall-clock limit; the sandbox's CPU limit is used
    ) -> tuple[dict[str, Any], dict[int, list[tuple[int, dict[str, Any]]]]]:
        """code_eval's answer: pass@k for each k every problem has samples for, and per
        problem each candidate's (completion_id, {task_id, passed, result, completion_id})."""
        import numpy as np

        if not self.allowed or self.sandbox is None:
            raise ValueError(REFUSED)
        jobs = [
            (task_id, completion_id, candidate, test)
            for task_id, (candidates, test) in enumerate(zip(predictions, references, strict=True))
            for completion_id, candidate in enumerate(candidates)
        ]
        verdicts = self.sandbox.run_many([Program(c + "\n" + t) for _, _, c, t in jobs])
        results: dict[int, list[tuple[int, dict[str, Any]]]] = defaultdict(list)
        for (task_id, completion_id, candidate, test), verdict in zip(jobs, verdicts, strict=True):
            self.verdicts[(test, candidate)] = verdict
            results[task_id].append(
                (
                    completion_id,
                    {
                        "task_id": task_id,
                        "passed": verdict.passed,
                        "result": code_eval_result(verdict),
                        "completion_id": completion_id,
                    },
                )
            )
        total = np.array([len(r) for r in results.values()])
        correct = np.array([sum(x[1]["passed"] for x in r) for r in results.values()])
        ks = [k] if isinstance(k, int) else list(k)
        pass_at_k = {
            f"pass@{n}": estimate_pass_at_k(total, correct, n).mean()
            for n in ks
            if (total >= n).all()
        }
        return pass_at_k, results

    def judge_programs(self, items: Sequence[tuple[str, Program]]) -> list[Verdict]:
        """Each program's verdict, kept by (`key`, its source): a task's own programs (the
        shipped code tasks' filters), `key` naming its problem as the task's target does. A
        program judged before under its key is not run again; the others run at once."""
        if not self.allowed or self.sandbox is None:
            raise ValueError(REFUSED)
        todo: dict[tuple[str, str], Program] = {}
        for key, program in items:
            if (key, program.source) not in self.verdicts:
                todo.setdefault((key, program.source), program)
        for known, verdict in zip(todo, self.sandbox.run_many(list(todo.values())), strict=True):
            self.verdicts[known] = verdict
        return [self.verdicts[(key, program.source)] for key, program in items]

    def remember(self, key: str, source: str, verdict: Verdict) -> None:
        """A verdict reached without running (a response with no program in it)."""
        self.verdicts[(key, source)] = verdict

    def attach(self, records: list[dict[str, Any]]) -> int:
        """Each record's verdicts, per filter, for the candidates its filter made (a code
        task's filter builds the programs: prompt and response); how many were found."""
        found = 0
        for rec in records:
            test = rec.get("target")
            if not isinstance(test, str):
                continue
            responses = rec.get("responses") or []
            for filt, extracted in (rec.get("extracted") or {}).items():
                if len(extracted) == len(responses):  # one answer per response
                    candidates = [_one(answer) for answer in extracted]
                else:  # one document's answers, its repeats' programs in one list
                    candidates = extracted[0] if len(extracted) == 1 else extracted
                    if not isinstance(candidates, list | tuple):
                        candidates = [candidates]
                said = [
                    self.verdicts.get((test, str(c))) if c is not None else None for c in candidates
                ]
                if any(v is not None for v in said):
                    rec.setdefault("verdicts", {})[filt] = [
                        {"status": v.status, "error": v.error} if v else None for v in said
                    ]
                    found += sum(v is not None for v in said)
        return found

    def forget(self) -> None:
        self.verdicts.clear()


def _one(answer: Any) -> Any:
    """A response's program, whether a filter left it alone or in a list of one (None where
    it left none, or several)."""
    if isinstance(answer, list | tuple):
        return answer[0] if len(answer) == 1 else None
    return answer


def code_eval_result(verdict: Verdict) -> str:
    """The result string code_eval gives: `passed`, `timed out`, or `failed: <error>`."""
    if verdict.passed:
        return "passed"
    if verdict.status == "timeout":
        return "timed out"
    last = verdict.error.strip().splitlines()[-1] if verdict.error.strip() else verdict.status
    return f"failed: {last}"


def estimate_pass_at_k(num_samples: Any, num_correct: Any, k: int) -> Any:
    """code_eval's own estimator (its float arithmetic, for the same figures): per problem,
    1 - prod(1 - k / i) over i in n - c + 1 .. n, or 1 where n - c < k."""
    import numpy as np

    def estimator(n: int, c: int, k: int) -> float:
        if n - c < k:
            return 1.0
        return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))

    samples = (
        list(itertools.repeat(num_samples, len(num_correct)))
        if isinstance(num_samples, int)
        else list(num_samples)
    )
    pairs = zip(samples, num_correct, strict=True)
    return np.array([estimator(int(n), int(c), k) for n, c in pairs])


JUDGE = CodeEval()  # one per worker process (lm-eval's task utils keep the object they load)


def judge_for(settings: dict[str, Any] | None) -> CodeEval:
    """The worker's judge, with the sandbox `settings` (an entry's `sandbox`) describe, opened
    and proven once per process and settings."""
    from ckpt_watcher.config import SandboxConfig
    from ckpt_watcher.sandbox import SandboxUnavailable, open_sandbox

    wanted = SandboxConfig(**(settings or {}))
    if JUDGE.sandbox is None or JUDGE.settings != wanted:
        if JUDGE.sandbox is not None:
            JUDGE.sandbox.close()  # its servers, with the settings before
            JUDGE.sandbox = None
        try:
            JUDGE.sandbox = open_sandbox(wanted)
        except SandboxUnavailable as e:
            raise EvalError(f"the code sandbox cannot run here: {e}") from None
        JUDGE.settings = wanted
    return JUDGE
