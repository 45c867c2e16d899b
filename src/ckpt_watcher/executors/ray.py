"""Run jobs on every node of a Ray cluster, through one agent per node (executors/node_agent.py).

The daemon stays the only scheduler and the only ledger writer. It places a `NodeAgent` actor on
each alive node (a node that joins gets one at the next look, `REFRESH_SECONDS`); the agents'
devices (`node-a/cuda:6`) are the daemon's inventory, and the processes not ours on them decide
which are free, which are given back to training and which are reported as zombies, as NVML
does on one host. A job is handed to the agent of its device's node, which runs its worker
(warm or one-shot) and returns the worker's outcome files and log; the daemon writes them into
the job's folder and settles the job as for a local worker.

With `executor.shared_dir`, devices left idle on any node join a running job's task (helpers,
jobs/helpers.py): the task's journal and its chunk claims are on storage every node sees.

With warm engines, a node's idle devices also start engines ahead of a run's first checkpoint
(jobs/early.py): the daemon asks the node's agent (`prepare`, from a thread: an agent that
refuses or is slow costs that engine only, never its node), sending along the config and
tokenizer it fetched for an S3 step (a local step's folder is on storage the node sees). The
engines waiting for a job on every node (`idle_engines`) are asked of the agents at most once
every `IDLE_SECONDS`, and again after a job starts or ends and after an engine is asked for or
released.

A node that dies, or an agent killed, fails its jobs' attempts (their workers die with the
agent); the jobs are retried on the devices left and resume from the journals in
`executor.shared_dir`. The node's devices are gone until an agent answers there again.
Checkpoint and ledger folders must be on storage every node sees (EFS/NFS), or S3 sources used.
The agents hold no Ray resources: NVML on each node says which GPUs are free, whoever holds them.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.devices import Device, GpuProcess
from ckpt_watcher.errors import BackendUnavailable
from ckpt_watcher.executors.base import Executor, ExitCallback, WorkerHandle
from ckpt_watcher.executors.node_agent import NodeAgent, node_of
from ckpt_watcher.jobfolder import EARLY_META_DIR, Crash, JobFolder, Progress

log = structlog.get_logger("ckpt_watcher.executors.ray")

REFRESH_SECONDS = 2.0  # how often the cluster's nodes are looked at (joined, died)
CALL_SECONDS = 10.0  # an agent that does not answer a question about its devices this fast is lost
START_SECONDS = 60.0  # at the daemon's start, for the agents to answer
AGENT_CONCURRENCY = 64  # an agent's calls at once (each running job waits in one)
IDLE_SECONDS = 1.0  # how long the agents' answer of their idle engines is taken as current
PREPARE_SECONDS = 300.0  # for a node's agent to take an engine's request (start its worker)
SHIP_MAX_BYTES = 256 << 20  # of an S3 step's fetched files sent along with such a request


class _Agent:
    """The daemon's side of one node's agent."""

    def __init__(self, node_id: str, name: str, handle: Any, ready: Any) -> None:
        self.node_id = node_id
        self.name = name
        self.handle = handle
        self.ready = ready  # its `describe` call, until answered
        self.devices: list[Device] = []


def node_names(nodes: list[dict[str, Any]], known: dict[str, str]) -> dict[str, str]:
    """A name for each node (node id -> name): its host name, with the start of its node id
    where hosts share a name (containers, a test's raylets on one machine); a name once given
    is kept."""
    hosts = [n.get("NodeManagerHostname") or n["NodeManagerAddress"] for n in nodes]
    out = dict(known)
    for node, host in zip(nodes, hosts, strict=True):
        if node["NodeID"] not in out:
            unique = hosts.count(host) == 1 and host not in known.values()
            out[node["NodeID"]] = host if unique else f"{host}-{node['NodeID'][:6]}"
    return out


class RayExecutor(Executor):
    def __init__(self, on_exit: ExitCallback, cfg: WatcherConfig) -> None:
        try:
            import ray
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy
        except ImportError as e:
            raise BackendUnavailable(
                "executor.kind is ray but Ray is not installed: pip install 'ckpt-watcher[ray]'"
            ) from e
        self._ray: Any = ray
        self._affinity = NodeAffinitySchedulingStrategy
        if not ray.is_initialized():
            ray.init(
                address=cfg.executor.address,
                include_dashboard=False,
                log_to_driver=False,
                logging_level=logging.WARNING,
            )
        self._actor = self._ray.remote(
            num_cpus=0, max_restarts=0, max_concurrency=AGENT_CONCURRENCY
        )(NodeAgent)
        self.settings = {
            "devices": cfg.devices.model_dump(mode="json"),
            "warm": cfg.eval.warm,
            "warm_idle_seconds": cfg.eval.warm_idle_seconds,
            "warm_verify_every": cfg.eval.warm_verify_every,
            "preload": cfg.forks_workers,
            # each node keeps what its workers stage within the source's budget
            "caches": {
                str(src.cache_dir): int(src.cache_max_gb * 2**30)
                for src in cfg.sources
                if src.kind == "s3"
            },
        }
        # helpers on other nodes join a task through its journal, on storage every node sees
        self.shares_journals = cfg.executor.shared_dir is not None
        self.starts_engines_ahead = cfg.eval.warm
        # what jobs/early.py fetches for an S3 step: no node sees it, it is sent along
        self._fetched = cfg.state_dir / EARLY_META_DIR
        self._idle: dict[str, str | None] = {}  # the nodes' last answer, kept IDLE_SECONDS
        self._idle_until = 0.0
        self._changes = 0  # jobs started or ended, engines asked for or released
        self._idle_changes = -1  # how many there had been when `_idle` was asked for
        self._preparing: dict[str, str] = {}  # device -> the run an engine is asked for
        self.on_exit = on_exit
        self._agents: dict[str, _Agent] = {}  # node id -> its agent
        self._names: dict[str, str] = {}
        self._jobs: dict[str, _Agent] = {}  # running job -> the agent running it
        self._folders: dict[str, JobFolder] = {}  # running job -> its folder here
        self._lock = threading.Lock()
        self._next_refresh = 0.0
        self._first_look()

    def _first_look(self) -> None:
        """Place an agent on every node and wait for them to answer (their devices are the
        daemon's at its start), at most START_SECONDS."""
        self._refresh()
        with self._lock:
            pending = [a.ready for a in self._agents.values() if a.ready is not None]
        if pending:
            self._ray.wait(pending, num_returns=len(pending), timeout=START_SECONDS)
        self._refresh()
        self._next_refresh = time.monotonic() + REFRESH_SECONDS

    # --- the nodes and their agents -----------------------------------------------------------
    def agents(self) -> list[_Agent]:
        """The agents that have answered, the cluster looked at again if it is time."""
        now = time.monotonic()
        if now >= self._next_refresh:
            self._next_refresh = now + REFRESH_SECONDS
            self._refresh()
        with self._lock:
            return [a for a in self._agents.values() if a.ready is None]

    def _refresh(self) -> None:
        nodes = self._ray.nodes()
        self._names = node_names(nodes, self._names)
        alive = {n["NodeID"]: n for n in nodes if n.get("Alive")}
        with self._lock:
            for node_id in set(self._agents) - set(alive):
                self._lost(self._agents[node_id], "its node left the cluster")
            for node_id, node in alive.items():
                if node_id not in self._agents:
                    self._place(node_id, node)
            pending = [a for a in self._agents.values() if a.ready is not None]
        for agent in pending:
            done, _ = self._ray.wait([agent.ready], timeout=0)
            if not done:
                continue
            try:
                info = self._ray.get(agent.ready)
            except Exception as e:  # it died starting (its node going away)
                with self._lock:
                    self._lost(agent, f"{type(e).__name__}: {e}")
                continue
            agent.devices = [Device(**d) for d in info["devices"]]
            agent.ready = None
            log.info(
                "ray.node_joined",
                node=agent.name,
                devices=[d.label for d in agent.devices],
                agent_pid=info["pid"],
            )
            for w in info["warnings"]:
                log.warning("devices.warning", node=agent.name, message=w)

    def _place(self, node_id: str, node: dict[str, Any]) -> None:
        name = self._names[node_id]
        settings = self.settings | {"ray_gpus": int(node.get("Resources", {}).get("GPU", 0))}
        handle = self._actor.options(
            scheduling_strategy=self._affinity(node_id, soft=False),
            name=None,
        ).remote(name, settings)
        self._agents[node_id] = _Agent(node_id, name, handle, handle.describe.remote())

    def _lost(self, agent: _Agent, why: str) -> None:
        """Forget an agent (under the lock): its devices go; a new one is placed on its node at
        the next look if the node is still there."""
        if self._agents.get(agent.node_id) is agent:
            del self._agents[agent.node_id]
            log.warning("ray.node_lost", node=agent.name, why=why)
            try:
                self._ray.kill(agent.handle)
            except Exception:  # already gone
                pass

    def agent_of(self, device_name: str) -> _Agent | None:
        node = node_of(device_name)
        with self._lock:
            return next(
                (a for a in self._agents.values() if a.name == node and a.ready is None), None
            )

    # --- jobs -------------------------------------------------------------------------------
    def start(self, job_id: str, folder: JobFolder, env: dict[str, str]) -> WorkerHandle:
        device = folder.read_spec().device_label
        agent = self.agent_of(device)
        if agent is None:
            raise OSError(f"the node of {device} has left the cluster")
        with self._lock:
            self._jobs[job_id] = agent
            self._folders[job_id] = folder
        where = f"{folder.path.parent.name}/{folder.path.name}"  # <job>/attempt-N[-help-...]
        started = agent.handle.start.remote(job_id, folder.spec_text(), env, where)
        self._stale()  # its device's engine, if idle, is not any more
        threading.Thread(
            target=self._wait, args=(job_id, agent, started, folder), daemon=True
        ).start()
        return WorkerHandle(job_id, 0, "ray")

    def _wait(self, job_id: str, agent: _Agent, started: Any, folder: JobFolder) -> None:
        rc = -9
        try:
            pid = self._ray.get(started)
            result = self._ray.get(agent.handle.wait.remote(job_id))
        except self._ray.exceptions.RayTaskError as e:  # the agent could not start it
            rc = 1
            _note(folder, f"[node {agent.name}] could not start the worker: {e}\n")
        except Exception as e:  # the node died, the agent was killed, Ray lost it
            with self._lock:
                self._lost(agent, f"a job's call failed: {type(e).__name__}")
            _note(folder, f"[node {agent.name}] lost: {type(e).__name__}: {e}\n")
            # the reason the attempt is retried with (its worker died with its node; no signal
            # of its own, no OOM killer to suspect)
            lost = f"node {agent.name} was lost while the job ran there ({type(e).__name__})"
            try:
                folder.write_crash(Crash(lost, heals=True))
            except OSError as err:
                log.warning("ray.crash_unwritten", job_id=job_id, error=str(err))
        else:
            rc = int(result["rc"])
            try:
                folder.put_results(result["files"])
            except OSError as err:  # its outcomes are lost: the attempt is retried
                log.warning("ray.results_unwritten", job_id=job_id, error=str(err))
                rc = -9
            _note(folder, f"[ran on node {agent.name}, pid {pid}]\n" + result["log"])
        finally:
            with self._lock:
                self._jobs.pop(job_id, None)
                self._folders.pop(job_id, None)
            self._stale()
            self.on_exit(job_id, rc)  # whatever happened above: the job is never left running

    def kill(self, job_id: str) -> None:
        with self._lock:
            agent = self._jobs.get(job_id)
        if agent is not None:
            agent.handle.kill.remote(job_id)

    def where(self, job_id: str) -> str | None:
        """The node running a job."""
        with self._lock:
            agent = self._jobs.get(job_id)
        return agent.name if agent is not None else None

    def running(self) -> set[str]:
        with self._lock:
            return set(self._jobs)

    # --- engines ahead of their checkpoints (jobs/early.py) -------------------------------------
    def prepare(self, device_label: str, folder: JobFolder, env: dict[str, str]) -> bool:
        """The device's node starts an engine for the request in `folder` on that device's
        warm worker (NodeAgent.prepare); an S3 step's fetched files go with the request, up to
        SHIP_MAX_BYTES (an adapter's weights past that: no engine ahead, the step loads when
        complete). Asked from a thread of its own, never on the loop: the device counts as
        holding the run meanwhile (`idle_engines`), and an agent that refuses or is slow loses
        nothing but this engine (never counted as a lost node: its jobs go on)."""
        agent = self.agent_of(device_label)
        if agent is None:
            return False
        spec = folder.read_spec()
        with self._lock:
            if device_label in self._preparing:
                return False
            self._preparing[device_label] = spec.job_id
        self._stale()
        args = (agent, device_label, folder.spec_text(), env, Path(spec.request.checkpoint))
        threading.Thread(target=self._prepare, args=args, daemon=True).start()
        return True

    def _prepare(
        self, agent: _Agent, device_label: str, spec: str, env: dict[str, str], meta: Path
    ) -> None:
        try:
            files = None
            if meta.is_relative_to(self._fetched):
                paths = [p for p in sorted(meta.iterdir()) if p.is_file()]
                size = sum(p.stat().st_size for p in paths)
                if size > SHIP_MAX_BYTES:
                    log.info("ray.engine_not_ahead", node=agent.name, device=device_label,
                             why=f"{size} bytes of meta files to send")  # fmt: skip
                    return
                files = {p.name: p.read_bytes() for p in paths}
            sent = self._ray.get(
                agent.handle.prepare.remote(spec, env, files), timeout=PREPARE_SECONDS
            )
            log.info("ray.engine_prepare", node=agent.name, device=device_label, sent=bool(sent))
        except Exception as e:  # refused (a full disk there), slow, or its node gone: the
            # step loads when complete, as without; whether the node is lost is the looks' call
            log.warning("ray.engine_prepare_failed", node=agent.name, device=device_label,
                        error=f"{type(e).__name__}: {e}")  # fmt: skip
        finally:
            with self._lock:
                self._preparing.pop(device_label, None)
            self._stale()

    def idle_engines(self) -> dict[str, str | None]:
        """Every node's warm workers waiting for a job, and those being asked for an engine;
        the nodes' answer kept IDLE_SECONDS, unless a job started or ended, or an engine was
        asked for or released, since it was asked for (then it is asked again)."""
        with self._lock:
            asked = self._changes
            fresh = asked == self._idle_changes and time.monotonic() < self._idle_until
            idle = dict(self._idle)
        if not fresh:
            idle = {}
            for answer in self.ask_all("idle_engines"):
                idle |= answer
            with self._lock:
                if self._changes == asked:  # nothing changed while the nodes answered
                    self._idle, self._idle_changes = dict(idle), asked
                    self._idle_until = time.monotonic() + IDLE_SECONDS
        with self._lock:
            return idle | self._preparing

    def release(self, device_label: str) -> None:
        """Stop the device's idle warm worker on its node (from a thread: nothing waits for
        it on the loop; the next give-back pass sees any engine still there)."""
        agent = self.agent_of(device_label)
        if agent is not None:
            ref = agent.handle.release.remote(device_label)
            threading.Thread(target=self._released, args=(agent, device_label, ref),
                             daemon=True).start()  # fmt: skip
        self._stale()

    def _released(self, agent: _Agent, device_label: str, ref: Any) -> None:
        try:
            self._ray.get(ref, timeout=CALL_SECONDS)
        except Exception as e:
            log.warning("ray.release_failed", node=agent.name, device=device_label,
                        error=f"{type(e).__name__}: {e}")  # fmt: skip
        self._stale()

    def _stale(self) -> None:
        """The nodes' idle engines are asked again at the next look."""
        with self._lock:
            self._changes += 1

    def look_elsewhere(self) -> list[dict[str, object]]:
        reports = self.ask_all("report")
        with self._lock:
            folders = dict(self._folders)
        for report in reports:  # the daemon's job folders: `watcher status` reads them
            for job_id, progress in report["progress"].items():
                if job_id in folders:
                    folders[job_id].write_progress(Progress(**progress))
        return [e for report in reports for e in report["engines"]]

    def ask_all(self, call: str) -> list[Any]:
        """Every answering agent's answer to `call`, asked of all at once (the loop waits for
        the slowest, at most CALL_SECONDS, not for their sum); an agent that gives none is
        forgotten, as by `ask`."""
        asked = [(a, getattr(a.handle, call).remote()) for a in self.agents()]
        deadline = time.monotonic() + CALL_SECONDS
        answers = []
        for agent, ref in asked:
            try:
                answers.append(self._ray.get(ref, timeout=max(0.0, deadline - time.monotonic())))
            except Exception as e:
                with self._lock:
                    self._lost(agent, f"{call}: {type(e).__name__}")
        return answers

    def ask(self, agent: _Agent, call: str, *args: Any, lost: Any = None) -> Any:
        """One agent's answer, or `lost` where it does not give one within CALL_SECONDS (it is
        then forgotten, and its node gets a new agent at the next look)."""
        try:
            return self._ray.get(getattr(agent.handle, call).remote(*args), timeout=CALL_SECONDS)
        except Exception as e:
            with self._lock:
                self._lost(agent, f"{call}: {type(e).__name__}")
            return lost

    def close(self) -> None:
        """Release every node's warm engines, then the agents."""
        with self._lock:
            agents = list(self._agents.values())
        for agent in agents:
            if agent.ready is None:
                self.ask(agent, "close")
            try:
                self._ray.kill(agent.handle)
            except Exception:
                pass


def _note(folder: JobFolder, text: str) -> None:
    try:
        folder.log.write_text(text)
    except OSError as e:  # the job's folder gone: its exit is still reported
        log.warning("ray.log_unwritten", folder=str(folder.path), error=str(e))


class RayInventory:
    """Every node's devices, as its agent reads them (NVML there)."""

    def __init__(self, executor: RayExecutor) -> None:
        self.executor = executor

    def devices(self) -> list[Device]:
        return [d for agent in self.executor.agents() for d in agent.devices]

    def gpu_processes(self) -> list[GpuProcess]:
        """The processes not ours on every node's GPUs (each agent leaves its workers out)."""
        return [
            GpuProcess(**p) for answer in self.executor.ask_all("foreign_processes") for p in answer
        ]

    def reap(self, device_id: str, pid: int) -> None:
        agent = self.executor.agent_of(device_id)
        gone = "its node's agent did not answer"
        why = (
            self.executor.ask(agent, "reap", device_id, pid, lost=gone)
            if agent is not None
            else gone
        )
        if why:
            raise ProcessLookupError(why)
