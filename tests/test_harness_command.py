"""`harness: command`: any other harness, per checkpoint, in an interpreter of its own.

The harness here is a real program in a real virtualenv of its own (made without pip: it needs
only the standard library): it reads each checkpoint's weights and writes a results file and a
per-sample file, so each ledger line's number says which checkpoint it was computed from.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import venv
from pathlib import Path

import pytest

from ckpt_watcher.config import parse_config
from ckpt_watcher.harnesses.command import dotted

from .conftest import WATCHER, read_ledger, write_config, write_fake_checkpoint

HARNESS = r"""
import json, os, sys
ckpt, out, device = sys.argv[1], sys.argv[2], sys.argv[3]
size = sum(open(os.path.join(ckpt, "config.json"), "rb").read()) % 997
os.makedirs(out, exist_ok=True)
json.dump({"argv": sys.argv[1:], "python": sys.executable, "path0": os.environ["PATH"].split(os.pathsep)[0],
           "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"), "flag": os.environ.get("MY_FLAG")},
          open(os.path.join(out, "seen.json"), "w"))
json.dump({"scores": {"size": size, "f1": 0.5}, "results": [{"acc": len(ckpt)}]},
          open(os.path.join(out, "results.json"), "w"))
with open(os.path.join(out, "samples.jsonl"), "w") as f:
    for i in range(3):
        f.write(json.dumps({"doc_id": i, "prompt": f"q{i}", "responses": [f"a{i}"], "scores": {"acc,none": [i % 2]}}) + "\n")
"""


@pytest.fixture(scope="module")
def harness_venv(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A virtualenv of the harness's own, not the watcher's (standard library only)."""
    root = tmp_path_factory.mktemp("harness-venv")
    venv.create(root / "venv", with_pip=False, symlinks=True)
    (root / "my_eval.py").write_text(HARNESS)
    return root


SECRET = "sk-proj-0123456789abcdefABCDEF"


def config(tmp: Path, watch: Path, harness_root: Path, **entry_over: object) -> dict:
    entry = {
        "harness": "command",
        "name": "my_eval",
        "venv": str(harness_root / "venv"),
        "argv": [
            "python",
            str(harness_root / "my_eval.py"),
            "{checkpoint}",
            "{output_dir}/o",
            "{device}",
        ],
        "results": {
            "file": "{output_dir}/o/results.json",
            "metrics": {"size": "scores.size", "f1": "scores.f1", "acc": "results.0.acc"},
        },
        "samples": "{output_dir}/o/samples.jsonl",
        "env": {"MY_FLAG": "on"},
        "version": "1.2",
    } | entry_over
    return {
        "state_dir": str(tmp / "state"),
        "ledger_dir": str(tmp / "ledgers"),
        "settle_seconds": 0,
        "sources": [{"kind": "local", "path": str(watch), "poll_seconds": 1}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": {"tasks": [entry], "retry_backoff_seconds": 0.2},
    }


def test_dotted_paths_read_keys_and_list_indexes() -> None:
    data = {"a": {"b": [{"c": 1}, {"c": 2}]}, "x.y": 3}
    assert dotted(data, "a.b.1.c") == 2
    with pytest.raises(KeyError):
        dotted(data, "a.b.5.c")
    with pytest.raises(KeyError):
        dotted(data, "a.nope")


def test_a_placeholder_outside_the_list_is_refused_naming_those_it_has(tmp_path: Path) -> None:
    raw = config(tmp_path, tmp_path, tmp_path, argv=["x", "{ckpt}"])
    with pytest.raises(Exception, match=r"unknown placeholder \{ckpt\}.*\{checkpoint\}"):
        parse_config(raw)
    raw = config(tmp_path, tmp_path, tmp_path, argv=["x", "{url}"])
    with pytest.raises(Exception, match=r"needs `serve: true`"):
        parse_config(raw)


def test_eval_limit_reaches_a_command_through_its_placeholder_or_is_refused(
    tmp_path: Path,
) -> None:
    """eval.limit is part of every result's identity: a command must be given it."""
    from ckpt_watcher.harnesses.base import Context
    from ckpt_watcher.harnesses.command import fill

    raw = config(tmp_path, tmp_path, tmp_path)
    raw["eval"]["limit"] = 20
    with pytest.raises(Exception, match=r"eval.limit is set, but command entry 'my_eval' is never"):
        parse_config(raw)
    raw["eval"]["tasks"][0]["argv"] += ["--limit", "{limit}"]
    parse_config(raw)
    del raw["eval"]["limit"]
    with pytest.raises(Exception, match=r"uses \{limit\}, but eval.limit is not set"):
        parse_config(raw)
    for limit, text in ((20.0, "20"), (0.25, "0.25")):
        ctx = Context({}, "ckpt", tmp_path, "cpu-0", "cpu", 1, limit)
        assert fill("--limit={limit}", ctx) == f"--limit={text}"


@pytest.mark.e2e
def test_each_checkpoint_is_evaluated_by_the_command_in_its_own_venv(
    tmp_path: Path, harness_venv: Path
) -> None:
    # a folder name a shell would run: one harmless argument without a shell
    watch = tmp_path / "ckpts; touch PWNED"
    a = write_fake_checkpoint(watch / "run1" / "step_100")
    b = write_fake_checkpoint(watch / "run1" / "step_200")
    cfg = write_config(tmp_path / "w.yaml", config(tmp_path, watch, harness_venv))
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 0, r.stderr[-3000:]
    lines = {ln["checkpoint"]: ln for ln in read_ledger(tmp_path / "ledgers", "run1")}
    assert set(lines) == {str(a), str(b)}
    for ckpt, ln in lines.items():
        size = sum(Path(ckpt, "config.json").read_bytes()) % 997
        assert ln["status"] == "ok", ln
        assert ln["task"] == "my_eval"
        assert ln["metrics"]["size"] == size  # of its own checkpoint's files
        assert ln["metrics"]["f1"] == 0.5
        assert ln["harness"] == "command" and ln["harness_version"] == "1.2"
        assert ln["n_samples"] == 3
        run_dir = tmp_path / "ledgers" / "run1"
        seen = json.loads(
            next((run_dir / Path(ln["results_file"]).parent).glob("seen.json")).read_text()
        )
        given = seen["argv"][0]  # the checkpoint, or its pin beside it: one argument
        assert "; touch PWNED" in given and ln["metrics"]["acc"] == len(given)
        assert seen["python"].startswith(str(harness_venv / "venv"))
        assert seen["path0"] == str(harness_venv / "venv" / "bin")
        assert seen["flag"] == "on"
    assert not list(tmp_path.rglob("PWNED"))
    assert lines[str(a)]["metrics"]["size"] != lines[str(b)]["metrics"]["size"]
    # no lm-eval entry: no worker starter importing torch and lm-eval for workers that run a
    # command (each worker was a fresh process)
    assert not list(tmp_path.rglob("worker-starter.log"))
    # the per-sample file is what `watcher samples` shows
    s = subprocess.run(
        [*WATCHER, "samples", "run1", "-c", str(cfg), "--task", "my_eval", "--step", "100"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert s.returncode == 0, s.stderr
    assert "q1" in s.stdout
    # like any other result: the table by step
    table = subprocess.run(
        [*WATCHER, "results", "run1", "-c", str(cfg)], capture_output=True, text=True, timeout=120
    )
    assert table.returncode == 0, table.stderr
    assert "my_eval" in table.stdout
    # a second pass finds everything done: nothing runs again
    again = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert again.returncode == 0
    assert len(read_ledger(tmp_path / "ledgers", "run1")) == 2


@pytest.mark.e2e
def test_a_result_is_only_what_the_command_wrote_in_this_run(
    tmp_path: Path, harness_venv: Path
) -> None:
    """A relative results file is read where the command ran (its output folder), never from
    the daemon's working folder; a results file older than the command's start is not its
    result; a metric the file lacks fails the entry, saying which."""
    watch = tmp_path / "ckpts"
    ckpt = write_fake_checkpoint(watch / "run1" / "step_100")
    base = config(tmp_path, watch, harness_venv)
    entry = base["eval"]["tasks"][0]
    stale = {"scores": {"size": -1, "f1": -1.0}, "results": [{"acc": -1}]}
    # where the daemon runs: an old results file at the relative path the entry names
    cwd = tmp_path / "daemon-cwd"
    (cwd / "o").mkdir(parents=True)
    (cwd / "o" / "results.json").write_text(json.dumps(stale))
    (cwd / "o" / "samples.jsonl").write_text(json.dumps({"prompt": "old"}) + "\n")
    # an absolute results file left from an earlier run, which this run's command never writes
    old = tmp_path / "old-results.json"
    old.write_text(json.dumps(stale))
    os.utime(old, (time.time() - 3600, time.time() - 3600))
    relative = entry | {
        "name": "rel",
        "results": entry["results"] | {"file": "o/results.json"},
        "samples": "o/samples.jsonl",
    }
    lingering = entry | {"name": "lingering", "results": entry["results"] | {"file": str(old)}}
    gone = entry | {"name": "gone", "results": entry["results"] | {"metrics": {"x": "scores.nope"}}}
    # a harness that prints its API key and fails: its log's tail is in the error
    leaky = entry | {
        "name": "leaky",
        "argv": ["python", "-c", "import os; print('key', os.environ['OPENAI_API_KEY']); exit(1)"],
        "env": {"OPENAI_API_KEY": SECRET, "MY_FLAG": "on"},
    }
    base["eval"]["tasks"] = [relative, lingering, gone, leaky]
    base["eval"]["max_attempts"] = 1
    cfg = write_config(tmp_path / "w.yaml", base)
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=300, cwd=cwd
    )
    assert r.returncode == 1, r.stderr[-2000:]
    lines = {ln["task"]: ln for ln in read_ledger(tmp_path / "ledgers", "run1")}
    assert lines["rel"]["status"] == "ok", lines["rel"]
    assert lines["rel"]["metrics"]["size"] == sum(Path(ckpt, "config.json").read_bytes()) % 997
    assert lines["rel"]["n_samples"] == 3
    assert lines["lingering"]["status"] == "failed"
    assert "was last written before the command started" in lines["lingering"]["error"]
    assert lines["gone"]["status"] == "failed"
    assert "has no x (scores.nope)" in lines["gone"]["error"]
    # the key reached the harness, and nothing the watcher wrote or prints holds it
    assert "key <redacted>" in lines["leaky"]["error"], lines["leaky"]["error"]
    ledgers = tmp_path / "ledgers"
    resolved = (ledgers / "watcher-config.resolved.yaml").read_text()
    assert "OPENAI_API_KEY: <redacted>" in resolved and "MY_FLAG: <redacted>" in resolved
    written = [p.read_bytes() for p in ledgers.rglob("*") if p.is_file()]  # its log too
    assert not [b for b in written if SECRET.encode() in b]
    for command in ("status", "doctor"):
        said = subprocess.run(
            [*WATCHER, command, "-c", str(cfg)], capture_output=True, text=True, timeout=120
        )
        assert SECRET not in said.stdout + said.stderr, command


@pytest.mark.e2e
def test_a_harness_interpreter_that_does_not_exist_stops_the_start_with_exit_2(
    tmp_path: Path,
) -> None:
    watch = tmp_path / "ckpts"
    write_fake_checkpoint(watch / "run1" / "step_100")
    cfg = write_config(tmp_path / "w.yaml", config(tmp_path, watch, tmp_path / "nowhere"))
    r = subprocess.run(
        [*WATCHER, "once", "-c", str(cfg)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2, r.stderr
    assert "entry 'my_eval' (command): venv" in r.stderr
    assert "does not exist" in r.stderr
    assert not (tmp_path / "state" / "jobs").exists()


def test_a_worker_killed_9_takes_its_harness_and_all_it_started_along(tmp_path: Path) -> None:
    """The reaper: a harness's own children (an engine core, rollouts) end with the worker."""
    import os
    import signal
    import sys
    import time

    from ckpt_watcher.harnesses.reaper import reaped

    harness = "import subprocess, time; p = subprocess.Popen(['sleep', '300']); print(p.pid, flush=True); time.sleep(300)"
    worker = (
        "import subprocess, sys, time; "
        f"p = subprocess.Popen({reaped([sys.executable, '-c', harness])!r}, stdout=subprocess.PIPE, text=True); "
        "print(p.stdout.readline().strip(), flush=True); time.sleep(300)"
    )
    proc = subprocess.Popen([sys.executable, "-c", worker], stdout=subprocess.PIPE, text=True)
    grandchild = int(proc.stdout.readline())  # type: ignore[union-attr]
    os.kill(grandchild, 0)  # running
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        try:
            os.kill(grandchild, 0)
        except ProcessLookupError:
            break
        with open(f"/proc/{grandchild}/stat") as f:
            if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                break  # ended, not yet reaped by init
        time.sleep(0.1)
    else:
        raise AssertionError("the harness's child outlived the worker")


# Binds a Unix socket in its TMPDIR, as vLLM's engine does (ZMQ `ipc://`), then waits to be
# killed; run again (its first run's record exists), it finishes.
LINGERER = r"""
import json, os, socket, sys, time
out, probe = sys.argv[1], os.environ["PROBE_DIR"]
tmp = os.environ["TMPDIR"]
first = not os.path.exists(os.path.join(probe, "first.json"))
if first:
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(os.path.join(tmp, "engine.sock"))
record = {"tmp": tmp, "pid": os.getpid()}
json.dump(record, open(os.path.join(probe, "first.json" if first else "second.json"), "w"))
if first:
    time.sleep(300)
os.makedirs(out, exist_ok=True)
json.dump({"scores": {"size": 1}}, open(os.path.join(out, "results.json"), "w"))
"""


@pytest.mark.e2e
def test_what_a_killed_worker_left_in_its_temporary_folder_goes_with_it(
    tmp_path: Path, harness_venv: Path
) -> None:
    """vLLM leaves its engine's sockets in the temporary folder when it is killed: each worker
    has a folder of its own there, gone when its process group is (scratch.py)."""
    import os
    import signal
    import sys

    from ckpt_watcher import scratch

    from .helpers import alive, running_job, wait_for, watcher_run

    watch, probe = tmp_path / "ckpts", tmp_path / "probe"
    probe.mkdir()
    write_fake_checkpoint(watch / "run1" / "step_100")
    (harness_venv / "lingerer.py").write_text(LINGERER)
    raw = config(
        tmp_path,
        watch,
        harness_venv,
        argv=["python", str(harness_venv / "lingerer.py"), "{output_dir}/o"],
        results={"file": "{output_dir}/o/results.json", "metrics": {"size": "scores.size"}},
        samples=None,
        env={"PROBE_DIR": str(probe)},
    )
    cfg = write_config(tmp_path / "w.yaml", raw)
    # a worker that ended while no daemon watched it left its folder; a live one keeps its own
    ended = subprocess.Popen([sys.executable, "-c", "pass"])
    ended.wait()
    left = scratch.folder(ended.pid)
    left.mkdir()
    (left / "stale.sock").write_text("")
    mine = scratch.folder(os.getpid())
    mine.mkdir(exist_ok=True)
    log = tmp_path / "daemon.log"
    try:
        with watcher_run(cfg, log) as daemon:
            wait_for(lambda: not left.exists(), 60, "the ended worker's folder swept", daemon, log)
            assert mine.is_dir()
            first = wait_for(lambda: _json(probe / "first.json"), 120, "the harness", daemon, log)
            assert first is not None
            job = running_job(tmp_path / "state")
            assert job is not None and job.pid
            assert first["tmp"] == str(scratch.folder(job.pid))  # the worker's, inherited
            assert (scratch.folder(job.pid) / "engine.sock").exists()
            os.kill(job.pid, signal.SIGKILL)  # the worker; its harness is left to the daemon
            wait_for(lambda: not scratch.folder(job.pid).exists(), 30, "reaped", daemon, log)
            (line,) = wait_for(
                lambda: read_ledger(tmp_path / "ledgers", "run1"), 120, "the retry", daemon, log
            )
            assert line["status"] == "ok" and line["attempt"] == 2, line
            second = _json(probe / "second.json")
            assert second is not None and second["tmp"] != first["tmp"]
        # a warm worker holds its folder until it exits; the daemon killed, it exits cleanly
        wait_for(lambda: not Path(second["tmp"]).exists(), 60, "a clean exit's", None, log)
        assert not alive(first["pid"])  # the harness that bound the socket went with its worker
    finally:
        mine.rmdir()


def _json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def test_a_temporary_folder_too_deep_for_sockets_is_kept_as_inherited() -> None:
    """A cluster's TMPDIR can be long: a worker's folder in it must leave room for vLLM's socket
    names (107 bytes in all), or the worker keeps the TMPDIR it was given."""
    import os
    import shutil
    import sys
    import tempfile

    show = (
        "import os; from ckpt_watcher import scratch; print(scratch.enter(), os.environ['TMPDIR'])"
    )
    short = Path(tempfile.mkdtemp(prefix="t", dir="/tmp"))  # /tmp/tXXXXXXXX
    deep = short.joinpath(*["d" * 9] * 6)  # 60 characters more: no room for the socket names
    deep.mkdir(parents=True)
    try:
        for base, fits in ((short, True), (deep, False)):
            out = subprocess.run(
                [sys.executable, "-c", show],
                env=dict(os.environ, TMPDIR=str(base)),
                capture_output=True,
                text=True,
                check=True,
            ).stdout.split()
            if fits:
                assert Path(out[0]).parent == base and out[1] == out[0], out
                assert len(out[0]) + 37 <= 107
            else:
                assert out == ["None", str(base)], out
    finally:
        shutil.rmtree(short)
