"""A program's verdict on its tests, reached outside the sandbox: the runner (runner.py) gets
each test's input and reports what the program gave, in the form LiveCodeBench compares; the
expected outputs stay here, so a program can neither read them nor change the comparison. The
first test that did not give its expected output decides (`failed`), unless the run ended on
an error or a limit before it."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from typing import Any

from ckpt_watcher.sandbox.program import Verdict
from ckpt_watcher.sandbox.runner import LONGEST_INT, SHOWN, canonical_output, digest, shortened

ENDINGS = ("timeout", "memory", "runtime_error", "syntax_error")  # a run's, before its tests


def inputs_only(tests: Sequence[dict[str, str]]) -> list[dict[str, str]]:
    return [{"input": str(t["input"])} for t in tests]


def verdict(
    tests: Sequence[dict[str, str]],
    call: str | None,
    report: dict[str, Any],
    stdout: str,
    cpu: float,
    wall: float,
) -> Verdict:
    """The verdict of a tests-mode run whose runner reported `report`."""
    # LiveCodeBench's tests hold integers past Python's 4300 digits; what a program's report
    # can make this process parse is capped (runner.INLINE_JSON)
    if 0 < sys.get_int_max_str_digits() < LONGEST_INT:
        sys.set_int_max_str_digits(LONGEST_INT)
    outputs = report.get("outputs") or []
    if not isinstance(outputs, list):
        outputs = []
    n = len(tests)
    for i, (test, got) in enumerate(zip(tests, outputs, strict=False)):
        wrong = _wrong(test, call, got if isinstance(got, dict) else {})
        if wrong:
            return Verdict("failed", f"test {i + 1} of {n}: {wrong}", stdout, cpu, wall,
                           {"tests_passed": i})  # fmt: skip
    status = str(report.get("status"))
    if status == "ran" and len(outputs) == n:
        return Verdict("passed", "", stdout, cpu, wall, {"tests_passed": n})
    if status in ENDINGS:
        error = str(report.get("error") or "")
    else:  # never `passed` on the report's word: a program can write one
        status = "runtime_error"
        error = f"the run accounted for {len(outputs)} of {n} tests"
    return Verdict(status, error, stdout, cpu, wall, {"tests_passed": len(outputs)})


def _wrong(test: dict[str, str], call: str | None, got: dict[str, Any]) -> str:
    """What was wrong with one test's output ("" if nothing)."""
    expected = str(test["output"])
    shown = str(got.get("shown", got.get("json", "")))[:SHOWN]
    if call is None:
        want = digest(canonical_output(expected))
        return (
            ""
            if got.get("digest") == want
            else f"printed {shown!r}, expected {shortened(expected)!r}"
        )
    if "unequal" in got:
        return f"returned {got['unequal']} ({shown}), expected {shortened(expected)}"
    value = json.loads(expected)
    if "json" in got:
        try:
            same = json.loads(str(got["json"])) == value
        except (ValueError, RecursionError):
            same = False
    else:
        same = got.get("digest") == digest(json.dumps(value, sort_keys=True))
    return "" if same else f"returned {shown}, expected {shortened(expected)}"
