"""`watcher demo`, as a new user runs it: the tiny model must learn, on any machine, and the
demo must leave a config that the commands it suggests, and those the docs mark as runnable,
accept."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_watcher.demo.runner import watcher_command

from .conftest import WATCHER, read_ledger
from .helpers import addition_accuracy
from .test_docs import runnable_blocks

pytestmark = pytest.mark.e2e


def test_watcher_demo_learns_prints_its_table_and_leaves_a_usable_config(tmp_path: Path) -> None:
    workdir = tmp_path / "watcher-demo"  # the folder the docs' runnable commands name
    r = subprocess.run(
        [*WATCHER, "demo", "--workdir", str(workdir)],
        capture_output=True,
        text=True,
        timeout=600,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = read_ledger(workdir / "ledgers", "demo")
    scores = {ln["step"]: ln["metrics"]["exact_match,none"] for ln in lines if ln["status"] == "ok"}
    assert len(scores) == len(lines) == 4, lines
    first, last = scores[min(scores)], scores[max(scores)]
    assert last >= 0.6 and last > first, scores
    # the seeds test below scores without lm-eval; here both ways agree on the same checkpoint
    assert addition_accuracy(workdir / "checkpoints" / f"demo_step{max(scores)}") == last
    for step, score in scores.items():  # the table the user reads is the ledger's
        assert any(ln.split()[:2] == [str(step), f"{score:.4f}"] for ln in r.stdout.splitlines()), (
            r.stdout
        )
    config = workdir / "watcher.yaml"
    assert config.is_file()
    # the suggested commands run as printed: this install's `watcher` by its full path, since
    # the tests' PATH does not hold it (`watcher` alone where it does: test_cli)
    w = shlex.split(watcher_command())
    suggested = [shlex.split(ln.split("#")[0]) for ln in r.stdout.splitlines() if " -c " in ln]
    suggested = [argv[len(w) - 1 :] for argv in suggested if argv[: len(w)] == w]
    assert {c[1] for c in suggested} >= {"status", "results", "plot", "report"}, r.stdout
    assert any(c[1] == "run" for c in suggested)  # not run here: it watches until stopped
    for argv in (c for c in suggested if c[1] != "run"):
        command = " ".join(argv)
        assert str(config) in argv, command
        out = subprocess.run(
            [*w, *argv[1:]], capture_output=True, text=True, timeout=120, cwd=workdir
        )
        # status exits 3: the demo's daemon has stopped, as it says
        assert out.returncode in ((0, 3) if argv[1] == "status" else (0,)), command + out.stderr
        if argv[1] == "results":
            assert f"{last:.4f}" in out.stdout
        if argv[1] == "report":  # the page's chart has a point per checkpoint
            page = Path(argv[argv.index("-o") + 1]).read_text()
            assert 'data-points="4"' in page and f'data-value="{last}"' in page
        if argv[1] == "samples":  # the problems that flipped between the first and last step
            assert argv[argv.index("--step") + 1] == str(max(scores))
            assert argv[argv.index("--vs") + 1] == str(min(scores))
            flips = subprocess.run(
                [*WATCHER, *argv[1:], "--max", "0", "--json"],
                capture_output=True,
                text=True,
                timeout=120,
                cwd=workdir,
            )
            flipped = [json.loads(x) for x in flips.stdout.splitlines()]
            pairs = [(f["before"], f["after"]) for f in flipped]
            assert {(a["step"], b["step"]) for a, b in pairs} == {(min(scores), max(scores))}
            learned = sum(1 for a, b in pairs if b["scores"]["exact_match,none"] == [1.0])
            forgot = len(pairs) - learned
            # every flip is a real one, and they account for the score's change exactly
            assert all(a["scores"] != b["scores"] for a, b in pairs)
            assert learned - forgot == round((last - first) * 100), (learned, forgot, scores)
            assert learned > 0 and f"step {min(scores)}: 0/1 right -> step" in out.stdout
    # the commands the docs mark as runnable, as printed, beside this demo's folder: each exits
    # 0, and where the page shows output, the first line printed has its shape (as many fields,
    # the same first one; paths differ between machines)
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    for page, command, shown in runnable_blocks():
        out = subprocess.run(
            ["bash", "-c", command], cwd=tmp_path, env=env, capture_output=True, text=True,
            timeout=120,
        )  # fmt: skip
        assert out.returncode == 0, (page, command, out.stdout[-1000:], out.stderr[-2000:])
        if shown:
            first = out.stdout.splitlines()[0].split() if out.stdout.strip() else []
            want = shown[0].split()
            assert len(first) == len(want) and first[:1] == want[:1], (page, command, out.stdout)


# The demo's recipe (600 steps, its learning-rate schedule included) stopped at its middle,
# step 300, where a run that stalls shows it (the demo's CLI has no way to stop part way).
TRAIN_TO_MIDDLE = """
import sys
from pathlib import Path
from ckpt_watcher.demo.train import train
out, seed, threads = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
train(out, run="demo", seed=seed, threads=threads, stop_after=300)
"""


def test_the_demo_recipe_learns_with_any_seed_and_thread_count(tmp_path: Path) -> None:
    """The demo's point is a rising curve: float kernels and seeds differ between machines, so
    the recipe must get there from another seed and with 2 threads, not only on the demo's own
    seed 0 on 1 thread (which the demo test above trains to the end). Seed 3 on 2 threads, to
    the middle of the recipe, step 300, where the demo reads 0.90-0.95 (a recipe that stalled
    stayed below 0.15 there: see docs/getting-started.md). Seeds 0-6, on 1 and 2 threads, all learned when the
    recipe was chosen; a recipe that learns only on seed 0, or only on 1 thread, fails here."""
    threads, seed = 2, 3
    folder = tmp_path / f"t{threads}-seed{seed}"
    trainer = subprocess.run(
        [sys.executable, "-c", TRAIN_TO_MIDDLE, str(folder), str(seed), str(threads)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        timeout=1200,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
    )
    assert trainer.returncode == 0, trainer.stdout[-3000:]
    first, last = (addition_accuracy(folder / f"demo_step{step}") for step in (150, 300))
    # here seeds 1-4 read 0.74-0.91 at step 300 from 0.06-0.16 at step 150; a stalled recipe
    # stayed below 0.15
    assert last >= 0.5 and last > first, f"seed {seed} on {threads} threads: {first} -> {last}"
