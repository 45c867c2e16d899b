"""Engines ahead of their checkpoints under Ray, the daemon's side and the agent's, with Ray's
calls answered by stand-ins (the two-node test, test_ray_nodes.py, runs the real cluster): what
a review found. A refused or slow request for an engine costs that engine, never its node's
agent and the jobs running there, and never blocks the loop; the nodes' idle engines are asked
again after a job ends while they answered; a node keeps the files of the requests its worker
may use and no others."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from ckpt_watcher.executors.node_agent import EARLY_META_DIR, NodeAgent
from ckpt_watcher.executors.ray import SHIP_MAX_BYTES, RayExecutor, _Agent
from ckpt_watcher.jobfolder import PREPARE_DIR, EvalRequest, JobFolder, JobSpec, warm_home


class TaskError(Exception):
    """Ray's RayTaskError: the agent's method raised."""


class FakeRay:
    """`get` runs what a call returned (a function: the agent's answer, or what it raises)."""

    class exceptions:
        RayTaskError = TaskError

    def __init__(self) -> None:
        self.killed: list[str] = []

    def get(self, ref: Any, timeout: float | None = None) -> Any:
        return ref(timeout)

    def kill(self, handle: Any) -> None:
        self.killed.append(handle.name)


class Handle:
    """An agent's actor handle: `handle.<method>.remote(...)` calls `answers[method]`."""

    def __init__(self, name: str, **answers: Any) -> None:
        self.name, self.answers, self.calls = name, answers, []

    def __getattr__(self, method: str) -> Any:
        handle = self

        class Method:
            def remote(self, *args: Any) -> Any:
                handle.calls.append((method, args))
                answer = handle.answers[method]
                return lambda timeout: answer(*args, timeout=timeout)

        return Method()


def _request(checkpoint: str, run: str = "r", device: str = "node-b/cuda:0") -> JobSpec:
    req = EvalRequest(checkpoint, "vllm", {}, [], 0, {}, None, None, None, None, "/r", "cuda")
    return JobSpec(run, device, req)


def _executor(state: Path, handle: Handle) -> tuple[RayExecutor, _Agent]:
    ex = RayExecutor.__new__(RayExecutor)  # no cluster: what __init__ sets, with stand-ins
    ex._ray, ex._lock, ex._next_refresh = FakeRay(), threading.Lock(), float("inf")
    ex._fetched, ex._idle, ex._idle_until = state / "early-meta", {}, 0.0
    ex._changes, ex._idle_changes, ex._preparing = 0, -1, {}
    agent = _Agent("id-b", "node-b", handle, None)
    ex._agents, ex._jobs, ex._folders = {"id-b": agent}, {"job-1": agent}, {}
    return ex, agent


def _wait_for(what: Any, seconds: float = 5.0) -> Any:
    deadline = time.monotonic() + seconds
    while not (got := what()) and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def test_a_refused_or_slow_engine_request_costs_that_engine_not_the_node(tmp_path: Path) -> None:
    def refuses(*args: Any, timeout: float | None) -> Any:
        time.sleep(0.3)
        raise TaskError("OSError: [Errno 28] No space left on device")

    def slow(*args: Any, timeout: float | None) -> Any:
        time.sleep(0.5)
        return True

    for answer in (refuses, slow):
        ex, agent = _executor(
            tmp_path, Handle("agent-b", prepare=answer, idle_engines=lambda **_: {})
        )
        folder = JobFolder(tmp_path / answer.__name__ / PREPARE_DIR)
        folder.write_spec(_request("/efs/ckpts/r_step100"))
        began = time.monotonic()
        assert ex.prepare("node-b/cuda:0", folder, {})
        assert time.monotonic() - began < 0.2  # the loop does not wait for the node
        assert ex.idle_engines() == {"node-b/cuda:0": "r"}  # taken for the run meanwhile
        assert not ex.prepare("node-b/cuda:0", folder, {})  # one request at a time
        _wait_for(lambda ex=ex: not ex._preparing)
        assert ex.idle_engines() == {}
        # the node's agent and the job running there are untouched
        assert ex._ray.killed == [] and ex._agents == {"id-b": agent} and "job-1" in ex._jobs


def test_an_s3_steps_files_go_with_the_request_up_to_a_size(tmp_path: Path) -> None:
    sent: list[dict[str, bytes] | None] = []

    def prepare(spec: str, env: Any, files: Any, timeout: float | None) -> bool:
        sent.append(files)
        return True

    ex, _ = _executor(tmp_path, Handle("agent-b", prepare=prepare))
    meta = tmp_path / "early-meta" / "0123"
    meta.mkdir(parents=True)
    (meta / "adapter_config.json").write_text("{}")
    folder = JobFolder(tmp_path / PREPARE_DIR)
    folder.write_spec(_request(str(meta)))
    assert ex.prepare("node-b/cuda:0", folder, {})
    _wait_for(lambda: sent)
    assert sent == [{"adapter_config.json": b"{}"}]
    with (meta / "adapter_model.safetensors").open("wb") as f:
        f.truncate(SHIP_MAX_BYTES)  # sparse: past the size with the config beside it
    _wait_for(lambda: not ex._preparing)
    assert ex.prepare("node-b/cuda:0", folder, {})
    _wait_for(lambda: not ex._preparing)
    assert len(sent) == 1  # not sent: its step loads when complete


def test_a_job_that_ends_while_the_nodes_answer_is_seen_at_the_next_look(tmp_path: Path) -> None:
    """The nodes' answer of their idle engines is kept a second, unless something changed
    while they answered: then the next look asks again."""
    engine: dict[str, str] = {}  # the node's idle engines now

    def idle_engines(timeout: float | None) -> dict[str, str]:
        answer = dict(engine)
        engine["node-b/cuda:0"] = "X"  # meanwhile its job ends, leaving X's engine idle
        ex._stale()  # as the job's waiter does, before the loop is woken
        return answer

    ex, _ = _executor(tmp_path, Handle("agent-b", idle_engines=idle_engines))
    assert ex.idle_engines() == {}
    assert ex.idle_engines() == {"node-b/cuda:0": "X"}  # asked again, not a second later


def test_a_node_keeps_the_files_its_worker_may_use_and_no_others(tmp_path: Path) -> None:
    class Warm:  # WarmExecutor's decisions
        def __init__(self) -> None:
            self.busy: set[str] = set()
            self.workers: set[str] = set()

        def prepare(self, label: str, folder: JobFolder, env: Any) -> bool:
            if label in self.busy:
                return False
            self.workers.add(label)
            return True

        def idle_engines(self) -> dict[str, None]:
            return {w: None for w in self.workers - self.busy}

        def release(self, label: str) -> None:
            if label not in self.busy:
                self.workers.discard(label)

    agent = NodeAgent.__new__(NodeAgent)
    agent.home, agent.node = tmp_path, "node-b"
    agent._launcher, agent.executor = ThreadPoolExecutor(1), Warm()
    label = "node-b/cuda:0"
    meta = warm_home(tmp_path, label) / EARLY_META_DIR

    def ask(run: str, **files: bytes) -> bool:
        return agent.prepare(_request("/daemon/state/early-meta/x", run).to_json(), {}, files)

    def kept() -> list[bytes]:
        return sorted(f.read_bytes() for p in meta.iterdir() for f in p.iterdir())

    assert ask("X", adapter_config_json=b"X")
    agent.executor.busy.add(label)  # X's engine runs X's job, its adapter from X's folder
    assert not ask("Y", adapter_config_json=b"Y")
    assert kept() == [b"X"]  # X's kept, Y's refused and gone
    agent.release(label)  # busy: not released, X's files stay
    assert kept() == [b"X"]
    agent.executor.busy.clear()
    assert ask("Z", adapter_config_json=b"Z")
    assert kept() == [b"Z"]  # Z's only: X's engine was replaced
    agent.release(label)
    assert not meta.exists()
