"""The model server of a served harness: vLLM's OpenAI server for the job's checkpoint, on the
job's device, loopback only, TP=1, seeded, with the eval's model args; in a warm worker, kept
across jobs.

`Servers.start()` answers the server an entry needs. Within a job, entries that ask for the same
server (the same chat template) share it. In a warm worker (`Servers(keeper)`) the server
outlives the job: when the next job's checkpoint has the same *signature* as the one it serves
(`signature.model_signature`: the config apart from graph-neutral fields, the tokenizer and
generation files, the server's arguments), its weights are swapped into the running server
through vLLM's development endpoint `/collective_rpc` (`SwapExtension.ckpt_watcher_swap`, the
reload the in-process warm engine uses) instead of a restart. Swaps are checked as the keeper
checks engines (evaluators/keeper.py): the quick check on a server just started for a signature
never swapped here, through the same route (`ckpt_watcher_swap_permuted`, `_scramble`,
`_digest`); where it does not apply or fails, the first swap against a freshly started server,
which then serves the job; and every `verify_every`-th swap so. A mismatch sends the signature
cold for good; any error in a swap restarts the server: the job loses nothing.

The server listens on a Unix socket in a folder of its own that only the worker's user can
enter (`--uds`), never on a TCP port: vLLM binds it before its engine starts, so the readiness
wait asks exactly our process (no other listener can take the path), and its development
routes (`/collective_rpc`, which swaps weights) are out of reach of other local users. The
harness never sees it either: it talks to the entry's proxy (`endpoint.py`), which forwards only
the routes a harness needs.
"""

from __future__ import annotations

import http.client
import itertools
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from contextlib import suppress
from pathlib import Path
from typing import TYPE_CHECKING, Any

import structlog

from ckpt_watcher import scratch
from ckpt_watcher.errors import AdapterNotServed, EvalError, SwapError
from ckpt_watcher.evaluators import compile_cache
from ckpt_watcher.evaluators.harness import VLLM_ONLY_ARGS, lora_rank
from ckpt_watcher.harnesses.reaper import reaped
from ckpt_watcher.jobfolder import EvalRequest

if TYPE_CHECKING:
    from ckpt_watcher.evaluators.keeper import EngineKeeper, Probe, Reach

log = structlog.get_logger("ckpt_watcher.harnesses.server")

MODEL_NAME = "checkpoint"
READY_TIMEOUT_SECONDS = 900.0
STOP_GRACE_SECONDS = 30.0
SWAP_TIMEOUT_SECONDS = 900.0
# the signature's backend: a server's weights never swap into an in-process engine's
BACKEND = "vllm-server"
# engine arguments (eval.model_args) the server takes as flags: the vLLM-only ones, and these
_SERVER_ARGS = tuple(
    sorted(
        VLLM_ONLY_ARGS | {"dtype", "max_model_len", "trust_remote_code", "revision", "tokenizer"}
    )
)
_CHECKPOINT = "<checkpoint>"
_SOCKET = "<socket>"
SOCKET_NAME = "vllm.sock"
_adapter_ids = itertools.count(1)  # an adapter's name is never reused in a worker (see Servers)


class UnixHTTPConnection(http.client.HTTPConnection):
    """HTTP to a server listening on a Unix socket (the model server's `--uds`)."""

    def __init__(self, path: str, timeout: float | None = None) -> None:
        super().__init__("localhost", timeout=timeout)
        self.socket_path = path

    def connect(self) -> None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(self.timeout)
        try:
            sock.connect(self.socket_path)
        except OSError:
            sock.close()
            raise
        self.sock = sock


def socket_folder() -> Path:
    """A new folder only this user can enter (mkdtemp: 0700) for a server's socket: in the
    worker's own temporary folder (scratch.py), else in /tmp where that path is too long."""
    for where in (None, "/tmp"):
        folder = Path(tempfile.mkdtemp(prefix="srv-", dir=where))
        if len(os.fsencode(folder / SOCKET_NAME)) <= scratch.MAX_SOCKET_PATH:
            return folder
        folder.rmdir()
    raise EvalError("no folder short enough for the model server's Unix socket")


def server_argv(
    req: EvalRequest, spec: dict[str, Any], sock: str = _SOCKET, swappable: bool = False
) -> list[str]:
    """vLLM's OpenAI server for the checkpoint: on the Unix socket `sock`, TP=1, seeded, the
    eval's model args (a `false` one as vLLM's `--no-` flag, which overrides its default);
    `swappable`: with the worker extension that swaps weights in."""
    argv = [
        sys.executable,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        req.checkpoint,
        "--served-model-name",
        MODEL_NAME,
        "--uds",
        sock,
        "--tensor-parallel-size",
        "1",
        "--seed",
        str(req.seed),
        "--disable-uvicorn-access-log",
    ]
    for key in _SERVER_ARGS:
        value = req.model_args.get(key)
        if value is None:
            continue
        flag = key.replace("_", "-")
        if isinstance(value, bool):
            argv.append(f"--{flag}" if value else f"--no-{flag}")
        else:
            argv += [f"--{flag}", str(value)]
    if spec.get("chat_template"):
        argv += ["--chat-template", str(spec["chat_template"])]
    engine = {k: req.model_args[k] for k in _SERVER_ARGS if k in req.model_args}
    compiled = compile_cache.with_cache(engine, req.compile_cache, req.checkpoint)
    if "compilation_config" in compiled:  # one compile per model shape, as lm-eval's engines
        argv += ["--compilation-config", json.dumps(compiled["compilation_config"])]
    if swappable:
        from ckpt_watcher.evaluators.vllm_internals import SWAP_EXTENSION

        argv += ["--worker-extension-cls", SWAP_EXTENSION]
    if req.lora is not None:  # the base, ready to serve adapters of this rank or less
        argv += ["--enable-lora", "--max-loras", "1", "--max-lora-rank", str(lora_rank(req.lora))]
    return argv


def _server_env(req: EvalRequest, swappable: bool) -> dict[str, str]:
    env = dict(os.environ)
    if req.device == "cpu":
        env.setdefault("VLLM_TARGET_DEVICE", "cpu")
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # the model runs in the engine core's process: on CPU vLLM's default adds a third
        # process (its "mp" executor's worker) that imports torch and vLLM again, ~9 s of
        # every start here (the API server's engine core stays a process of its own)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        if env.get("CUDA_VISIBLE_DEVICES") == "":
            env["CUDA_VISIBLE_DEVICES"] = "-1"
    if swappable:  # /collective_rpc and /reset_prefix_cache, on its private socket only
        env["VLLM_SERVER_DEV_MODE"] = "1"
    if req.lora is not None:  # /v1/load_lora_adapter and /v1/unload_lora_adapter
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    return env


class ServerExited(EvalError):
    """The model server ended before it answered (a bad argument, a model it cannot load)."""


def _wait_ready(proc: subprocess.Popen[bytes], sock: str, logfile: Path, timeout: float) -> None:
    """Until our server answers /health on its own socket; fails at once if it exits."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            tail = "\n".join(logfile.read_text(errors="replace").splitlines()[-15:])
            raise ServerExited(f"the model server exited with status {proc.returncode}:\n{tail}")
        with suppress(OSError, http.client.HTTPException):
            conn = UnixHTTPConnection(sock, timeout=2)
            try:
                conn.request("GET", "/health")
                if conn.getresponse().status == 200:
                    return
            finally:
                conn.close()
        time.sleep(0.5)
    raise EvalError(f"the model server did not answer within {timeout:g}s (see {logfile})")


def _stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.terminate()  # the reaper stops the server, then ends what it left
        try:
            proc.wait(timeout=STOP_GRACE_SECONDS)
        except subprocess.TimeoutExpired:
            pass
    _kill(proc)


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """The server and all it started, at once: its reaper's process group, which outlives the
    reaper itself (a hung server may never act on SIGTERM; a reaper killed -9 ends nothing)."""
    with suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with suppress(ProcessLookupError):
        proc.kill()
    proc.wait()


def request(
    sock: str,
    method: str,
    path: str,
    body: bytes | None,
    headers: dict[str, str],
    timeout: float | None,
) -> tuple[int, str, bytes]:
    """One HTTP request to the server on `sock`: its status, content type and body."""
    conn = UnixHTTPConnection(sock, timeout=timeout)
    try:
        conn.request(method, path, body=body, headers=headers)
        r = conn.getresponse()
        return r.status, r.getheader("Content-Type") or "application/json", r.read()
    except http.client.HTTPException as e:  # cut off mid-answer: as a lost connection
        raise ConnectionError(f"{type(e).__name__}: {e}") from e
    finally:
        conn.close()


def _call(sock: str, path: str, body: dict[str, Any], timeout: float) -> bytes:
    """POST `body` to the server; its answer's bytes (SwapError unless it is a 200)."""
    status, _, raw = request(
        sock,
        "POST",
        path,
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
        timeout,
    )
    if status != 200:
        raise SwapError(f"POST {path}: HTTP {status}: {raw[:300].decode(errors='replace')}")
    return raw


def _post(sock: str, path: str, body: dict[str, Any], timeout: float) -> Any:
    """POST `body` to the server; its JSON answer (None for an empty one)."""
    raw = _call(sock, path, body, timeout)
    return json.loads(raw) if raw.strip() else None


def swap(sock: str, checkpoint: str) -> None:
    """`checkpoint`'s weights into the running server, then its prefix cache dropped (the old
    weights' KV blocks)."""
    rpc = {"method": "ckpt_watcher_swap", "args": [checkpoint]}
    _post(sock, "/collective_rpc", rpc, SWAP_TIMEOUT_SECONDS)
    _post(sock, "/reset_prefix_cache", {}, 60)


def _eager_ranks(sock: str, on: bool) -> None:
    """The sampled tokens' ranks uncompiled while probing, as in process
    (`vllm_internals.probe`); a server without the extension (not swappable) compiles them."""
    rpc = {"method": "ckpt_watcher_eager_ranks", "args": ["1" if on else ""]}
    with suppress(SwapError):
        _post(sock, "/collective_rpc", rpc, 60)


def probe(sock: str) -> Probe:
    """Greedy tokens and their logprobs for each probe text, from the server (as
    `keeper.probe` asks an in-process engine)."""
    from ckpt_watcher.evaluators.keeper import PROBE_TEXTS, PROBE_TOKENS

    prompts = []
    for text in PROBE_TEXTS:
        tok = _post(
            sock,
            "/tokenize",
            {"model": MODEL_NAME, "prompt": text, "add_special_tokens": False},
            60,
        )
        room = max(1, int(tok.get("max_model_len") or 1 << 30) - PROBE_TOKENS)
        if tok["tokens"]:
            prompts.append(tok["tokens"][:room])
    _eager_ranks(sock, True)
    try:
        out = _post(
            sock,
            "/v1/completions",
            {
                "model": MODEL_NAME,
                "prompt": prompts,
                "max_tokens": PROBE_TOKENS,
                "temperature": 0.0,
                "logprobs": 1,
                "seed": 0,
                "return_tokens_as_token_ids": True,
            },
            SWAP_TIMEOUT_SECONDS,
        )
    finally:
        _eager_ranks(sock, False)
    result = []
    for choice in sorted(out["choices"], key=lambda c: c["index"]):
        lp = choice["logprobs"]
        tokens = [int(str(t).rsplit(":", 1)[1]) for t in lp["tokens"]]
        result.append((tokens, [float(x) for x in lp["token_logprobs"]]))
    return result


class Servers:
    """The model server of a worker's served entries: started for the first, shared by the
    job's entries that ask for the same server; with `keeper` (a warm worker) kept across jobs,
    each next checkpoint's weights swapped in where its signature allows. `keeper` keeps the
    swap counts, the signatures gone cold for good and the events (`engine.json`).

    A LoRA adapter saved alone (`req.lora`, on its base `req.checkpoint`) is served, not
    merged: the base started once with LoRA enabled at the adapter's rank, each step's adapter
    loaded through `/v1/load_lora_adapter` under a name never used before in this worker (vLLM's
    prefix cache keys hold the name: a reused one would answer from the last adapter's KV
    blocks) and the last one unloaded. The entry's proxy asks for it by that name
    (`adapter`). An adapter or base the server refuses raises AdapterNotServed: merged instead.
    """

    def __init__(
        self,
        keeper: EngineKeeper | None = None,
        argv_of: Callable[[EvalRequest, dict[str, Any], str, bool], list[str]] | None = None,
    ) -> None:
        """`argv_of(req, spec, socket, swappable)`: the server's command line (default
        `server_argv`; tests start a stand-in)."""
        self.keeper = keeper
        self.argv_of = argv_of or server_argv
        self.req: EvalRequest | None = None
        self.socket = ""  # the running server's Unix socket
        self._folder: Path | None = None  # the socket's own folder
        self._proc: subprocess.Popen[bytes] | None = None
        self._shape: list[str] = []  # its argv, the checkpoint's path left out
        self._signature: str | None = None
        self._this_job = False  # it serves this job's checkpoint (started or swapped for it)
        self._checkpoint = ""  # the weights it serves (started on or swapped in)
        self.adapter: str | None = None  # the name of the adapter it serves this job's on

    def job(self, req: EvalRequest) -> Servers:
        """The next job's request: its entries get its checkpoint, swapped in or started."""
        self.req = req
        self._this_job = False
        return self

    def alive(self) -> bool:
        return self._proc is not None and self._proc.poll() is None

    def died(self) -> str | None:
        """What happened to a server that was started and has ended without being stopped
        (killed, out of memory, crashed); None while it runs or after `stop`."""
        if self._proc is None or self._proc.poll() is None:
            return None
        rc = self._proc.returncode
        signum = -rc if rc < 0 else rc - 128 if rc > 128 else 0  # the reaper passes it on
        how = f"was killed by signal {signum}" if signum else f"exited with status {rc}"
        return f"the model server (pid {self._proc.pid}, under its reaper) {how}"

    def kill(self) -> None:
        """End a server that stopped answering, at once, with all it started."""
        if self._proc is not None:
            _kill(self._proc)
        self.stop()

    def start(self, spec: dict[str, Any], out: Path) -> tuple[str, str, float]:
        """The server this entry needs: its socket, how it came to serve this checkpoint
        ("cold": started, "warm": swapped in or already serving it) and the seconds that took
        (0 when the job's server was up already)."""
        req = self.req
        assert req is not None, "Servers.job(req) first"
        swappable = self.keeper is not None
        shape = [
            _CHECKPOINT if a == req.checkpoint else a
            for a in self.argv_of(req, spec, _SOCKET, swappable)
        ]
        same = self.alive() and shape == self._shape
        if same and self._this_job:
            return self.socket, "warm", 0.0
        began = time.monotonic()
        if req.lora is not None:
            return self._serve_adapter(req, out, shape, same, began)
        signature = self._signature_of(req, shape)
        if same and self._swappable(signature):
            kind = self._swap(req, signature, out, began)
            if kind is not None:
                return self.socket, kind, time.monotonic() - began
        self.stop()
        self._cold(req, out, shape, signature)
        self._quick_check(req, out, shape, signature)
        return self.socket, "cold", time.monotonic() - began

    def _serve_adapter(
        self, req: EvalRequest, out: Path, shape: list[str], same: bool, began: float
    ) -> tuple[str, str, float]:
        """`start` for an adapter: its base kept where the server has it already ("warm"),
        else started with LoRA enabled ("cold"; a base the server will not start on so is
        refused for good in this worker); then the adapter loaded in place of the last."""
        assert req.lora is not None
        kind = "warm"
        if not (same and req.checkpoint == self._checkpoint):
            kind = "cold"
            self.stop()
            try:
                self._cold(req, out, shape, None)
            except ServerExited as e:  # (one that does not answer in time fails the entry)
                raise AdapterNotServed(
                    f"vLLM's server would not start on {req.checkpoint} with LoRA enabled: {e}",
                    base_refused=True,
                ) from e
        self._this_job = True
        self._use_adapter(req.lora)
        return self.socket, kind, time.monotonic() - began

    def _use_adapter(self, path: str) -> None:
        """The adapter in `path` loaded under a new name, the last one unloaded."""
        if self.adapter is not None:
            try:
                _call(self.socket, "/v1/unload_lora_adapter", {"lora_name": self.adapter}, 60)
            except (SwapError, OSError) as e:  # a new name never reaches its KV blocks
                log.info("server.adapter_not_unloaded", name=self.adapter, error=str(e))
            self.adapter = None
        name = f"{Path(path).name}-{next(_adapter_ids)}"
        began = time.monotonic()
        try:
            _call(
                self.socket,
                "/v1/load_lora_adapter",
                {"lora_name": name, "lora_path": path},
                SWAP_TIMEOUT_SECONDS,
            )
        except (SwapError, OSError) as e:
            raise AdapterNotServed(f"vLLM's server cannot serve the adapter {path}: {e}") from e
        self.adapter = name
        log.info(
            "server.adapter_served",
            adapter=path,
            name=name,
            seconds=round(time.monotonic() - began, 3),
        )

    def _quick_check(
        self, req: EvalRequest, out: Path, shape: list[str], signature: str | None
    ) -> None:
        """The keeper's quick check of swaps into the server just started, where it is due
        (failed, the first swap is checked against a fresh server); a server it left other
        than started is started again."""
        keeper = self.keeper
        if keeper is None or signature is None:
            return
        hidden = keeper.quick_check_due(signature, Path(req.checkpoint))
        if hidden is None:
            return
        if not keeper.quick_verdict("server", req, signature, self._reach(req.checkpoint, hidden)):
            self.stop()
            self._cold(req, out, shape, signature)

    def _reach(self, checkpoint: str, hidden: int) -> Reach:
        from ckpt_watcher.evaluators.keeper import Reach

        sock = self.socket

        def rpc(method: str, *args: str) -> Any:
            answer = _post(sock, "/collective_rpc", {"method": method, "args": list(args)}, 600)
            return answer["results"][0] if answer else None

        def swap_permuted() -> None:
            rpc("ckpt_watcher_swap_permuted", checkpoint, str(hidden))
            _post(sock, "/reset_prefix_cache", {}, 60)

        return Reach(
            probe=lambda: probe(sock),
            digest=lambda: rpc("ckpt_watcher_digest"),
            scramble=lambda: rpc("ckpt_watcher_scramble"),
            swap=lambda: swap(sock, checkpoint),
            swap_permuted=swap_permuted,
        )

    def _signature_of(self, req: EvalRequest, shape: list[str]) -> str | None:
        if self.keeper is None:
            return None
        from ckpt_watcher.evaluators.signature import model_signature

        try:
            return model_signature(Path(req.checkpoint), BACKEND, {"argv": shape})
        except SwapError:
            return None  # an unreadable config: the cold start says why

    def _swappable(self, signature: str | None) -> bool:
        """The kept server's signature is this checkpoint's, and not one gone cold for good
        (None, as without a keeper: never)."""
        return (
            self.keeper is not None
            and signature is not None
            and signature == self._signature
            and signature not in self.keeper.cold_for_good
        )

    def _swap(self, req: EvalRequest, signature: str | None, out: Path, began: float) -> str | None:
        """Swap `req`'s checkpoint in: "warm", or "cold" where the swap was checked against a
        fresh server (which then serves); None when the swap failed (the caller starts cold)."""
        keeper = self.keeper
        assert keeper is not None and signature is not None  # _swappable said so
        n = keeper.swaps.get(signature, 0)
        try:
            swap(self.socket, req.checkpoint)
            keeper.swaps[signature] = n + 1
            self._this_job, self._checkpoint = True, req.checkpoint
            warm = probe(self.socket) if keeper.fresh_check_due(signature, n) else None
        except Exception as e:  # any error in a swap: a fresh server, nothing lost
            keeper.event("server.swap_failed", error=f"{type(e).__name__}: {e}")
            return None
        if warm is None:
            log.info("server.swapped", checkpoint=req.checkpoint, swaps=n + 1)
            return "warm"
        # the check: the same checkpoint in a fresh server, which then serves the job
        swapped = time.monotonic()
        shape = self._shape
        self.stop()
        self._cold(req, out, shape, signature)
        loaded = time.monotonic()
        seconds = {"swap_s": round(swapped - began, 3), "load_s": round(loaded - swapped, 3)}
        keeper.judge("server", req, signature, warm, probe(self.socket), seconds)
        return "cold"

    def _cold(
        self,
        req: EvalRequest,
        out: Path,
        shape: list[str],
        signature: str | None,
    ) -> None:
        """Start a server for `req`'s checkpoint with the arguments `shape` names."""
        swappable = self.keeper is not None
        self._folder = socket_folder()
        self.socket = str(self._folder / SOCKET_NAME)
        fill = {_CHECKPOINT: req.checkpoint, _SOCKET: self.socket}
        argv = [fill.get(a, a) for a in shape]
        logfile = out / "server.log"
        with open(logfile, "ab") as sink:
            self._proc = subprocess.Popen(
                reaped(argv),  # its engine ends with the worker, however the worker ends
                env=_server_env(req, swappable),
                stdin=subprocess.DEVNULL,
                stdout=sink,
                stderr=subprocess.STDOUT,
            )
        try:
            _wait_ready(self._proc, self.socket, logfile, READY_TIMEOUT_SECONDS)
        except BaseException:
            self.stop()
            raise
        self._shape, self._signature, self._this_job = shape, signature, True
        self._checkpoint = req.checkpoint

    def stop(self) -> None:
        if self._proc is not None:
            _stop(self._proc)
            self._proc = None
        if self._folder is not None:
            shutil.rmtree(self._folder, ignore_errors=True)
            self._folder = None
        self.socket = ""
        self._signature, self._shape, self._this_job = None, [], False
        self._checkpoint, self.adapter = "", None
