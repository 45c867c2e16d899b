"""The checkpoint served on loopback for a harness that talks to an OpenAI-compatible server.

`serve()` gets the job's model server (`server.py`: vLLM's OpenAI server on the job's device,
started or, in a warm worker, the checkpoint swapped into the kept one) and puts a proxy in
front of it; the harness is given the proxy's URL. For each completion request the proxy

- clamps what it asks to the context: `max_tokens` above what the model's context leaves after
  the prompt (counted by the server's own tokenizer) is lowered to fit and counted (the
  `max_gen_toks` lesson: one long request must not fail the run);
- seeds it, where the request names no seed, from `eval.seed`, the request and its occurrence,
  so K identical rollout requests are K different samples, the same K on every run;
- journals the answer, keyed by the checkpoint's fingerprint and settings (the task's journal
  folder), the request body and its occurrence index; after a kill or a yield the harness's
  rerun is answered from the journal up to where it stopped (`resumed`), so its metrics are
  those of an uninterrupted run;
- forwards only what a harness needs (`ROUTES`: completions, chat completions, the model list,
  tokenize, health): never the server's development routes, which swap weights;
- on a step that is a LoRA adapter served on its base (`Servers.adapter`), asks for the adapter
  under its name of the moment wherever the harness names the checkpoint (`model`), and answers
  with the checkpoint's name: the harness, and the journal, see one model whatever the name.

While the harness runs, `check()` watches the server: one that died, or that made no progress
(no answer, no token counted in its /metrics) for `stall_seconds` while requests wait, is
killed and the entry fails with `ServerLost`, which heals: the next attempt starts a new
server and resumes from the journal, as a dead engine under lm-eval does. A harness that saw
the server fail (the proxy answered it 502) never files its result either.
"""

from __future__ import annotations

import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.errors import ServerLost
from ckpt_watcher.harnesses.server import MODEL_NAME, Servers, request
from ckpt_watcher.journal import JournalRef

log = structlog.get_logger("ckpt_watcher.harnesses.endpoint")

HOST = "127.0.0.1"
JOURNAL_PREFIX = "endpoint-"
FSYNC_EVERY_SECONDS = 1.0
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")
# what the proxy forwards: a harness's routes, never the server's others (/collective_rpc)
ROUTES = frozenset(
    {("POST", p) for p in (*COMPLETIONS, "/tokenize")} | {("GET", "/v1/models"), ("GET", "/health")}
)
STALL_SECONDS = 600.0  # a served entry's default `stall_seconds`
METRICS_TIMEOUT_SECONDS = 5.0
# vLLM's counters of tokens it has computed: any change is progress
TOKEN_COUNTERS = ("vllm:prompt_tokens_total", "vllm:generation_tokens_total")


class EndpointJournal:
    """Finished completions of one task on one checkpoint: `endpoint-<writer>.jsonl` files in
    the task's journal folder, one JSON line per answer (key, occurrence, status, body)."""

    def __init__(self, ref: JournalRef | None) -> None:
        self.folder = Path(ref.folder) if ref is not None else None
        self.identity = json.dumps(ref.identity if ref else {}, sort_keys=True)
        self.saved: dict[tuple[str, int], dict[str, Any]] = {}
        self._file = None
        self._synced = 0.0
        self._lock = threading.Lock()
        if self.folder is None:
            return
        self.folder.mkdir(parents=True, exist_ok=True)
        for path in sorted(self.folder.glob(JOURNAL_PREFIX + "*.jsonl")):
            for line in path.read_bytes().splitlines():
                try:
                    row = json.loads(line)
                    self.saved[(row["key"], int(row["occurrence"]))] = row
                except (ValueError, KeyError):
                    continue  # the torn last line of a killed writer
        name = f"{JOURNAL_PREFIX}{socket.gethostname()}-{os.getpid()}-{time.time_ns()}.jsonl"
        self._file = open(self.folder / name, "ab")  # noqa: SIM115 - closed in close()

    def key(self, path: str, body: dict[str, Any]) -> str:
        blob = json.dumps([self.identity, path, body], sort_keys=True, ensure_ascii=False)
        return hashlib.sha256(blob.encode()).hexdigest()

    def get(self, key: str, occurrence: int) -> dict[str, Any] | None:
        return self.saved.get((key, occurrence))

    def put(self, key: str, occurrence: int, content_type: str, body: bytes) -> None:
        if self._file is None:
            return
        row = {
            "key": key,
            "occurrence": occurrence,
            "content_type": content_type,
            "body": body.decode("utf-8", errors="replace"),
        }
        data = json.dumps(row, ensure_ascii=False).encode() + b"\n"
        with self._lock:
            self._file.write(data)
            self._file.flush()  # a killed worker's answers are in the page cache
            if time.monotonic() - self._synced >= FSYNC_EVERY_SECONDS:
                os.fsync(self._file.fileno())
                self._synced = time.monotonic()

    def close(self) -> None:
        if self._file is not None:
            with suppress(OSError):
                os.fsync(self._file.fileno())
            self._file.close()
            self._file = None


class Endpoint:
    """A served checkpoint behind the journaling, clamping proxy, watched while it serves."""

    def __init__(
        self,
        servers: Servers,
        journal: EndpointJournal,
        seed: int,
        max_len: int | None,
        stall_seconds: float = STALL_SECONDS,
        upstream_timeout: float | None = None,
    ):
        self.servers = servers
        self.socket = servers.socket
        self.journal = journal
        self.seed = seed
        self.max_len = max_len
        self.stall_seconds = stall_seconds
        # a backstop only: a request may rightly take long; a stalled server is found by check()
        self.upstream_timeout = upstream_timeout
        self.model = MODEL_NAME
        self.engine = "cold"  # how the server came to serve the checkpoint (Servers.start)
        self.ready_seconds = 0.0
        self.resumed = 0
        self.computed = 0
        self.clamped = 0
        self.upstream_errors: list[str] = []  # requests the server could not be reached for
        self._in_flight = 0
        self._progress_at = time.monotonic()
        self._tokens: float | None = None
        self._seen: dict[str, int] = {}
        self._lock = threading.Lock()
        self.url = ""
        self._server: ThreadingHTTPServer | None = None

    def answered(self) -> int:
        return self.resumed + self.computed

    def occurrence(self, key: str) -> int:
        with self._lock:
            n = self._seen.get(key, 0)
            self._seen[key] = n + 1
            return n

    def upstream(
        self, method: str, path: str, body: bytes | None, headers: dict[str, str]
    ) -> tuple[int, str, bytes]:
        with self._lock:
            self._in_flight += 1
        try:
            answer = request(self.socket, method, path, body, headers, self.upstream_timeout)
        except OSError as e:
            with self._lock:
                self.upstream_errors.append(f"{method} {path}: {e}")
            raise
        finally:
            with self._lock:
                self._in_flight -= 1
                self._progress_at = time.monotonic()
        return answer

    # --- the server's health, while the harness runs -------------------------------------------
    def check(self) -> None:
        """Raise ServerLost when the server died, or made no progress for `stall_seconds`
        while requests waited (then it is killed first). Called about once a second."""
        died = self.servers.died()
        if died is not None:
            raise ServerLost(
                f"{died} while serving {self.answered()} answers in; the attempt is retried on "
                "a new server, resuming from the journal"
            )
        now = time.monotonic()
        with self._lock:
            waiting, since = self._in_flight, self._progress_at
        if not waiting:
            return
        tokens = self._token_count() if now - since >= min(10.0, self.stall_seconds / 3) else None
        if tokens is not None and tokens != self._tokens:
            self._tokens = tokens
            with self._lock:
                self._progress_at = now
            return
        if now - since >= self.stall_seconds:
            self.servers.kill()
            raise ServerLost(
                f"the model server made no progress for {now - since:.0f} s with {waiting} "
                f"request(s) waiting (stall_seconds {self.stall_seconds:g}): killed; the attempt "
                "is retried on a new server, resuming from the journal"
            )

    def _token_count(self) -> float | None:
        """The server's prompt and generated tokens so far (its /metrics); None when it does
        not answer in time."""
        try:
            status, _, raw = request(
                self.socket, "GET", "/metrics", None, {}, METRICS_TIMEOUT_SECONDS
            )
        except OSError:
            return None
        if status != 200:
            return None
        total = 0.0
        for line in raw.decode(errors="replace").splitlines():
            if line.startswith(TOKEN_COUNTERS):
                with suppress(ValueError, IndexError):
                    total += float(line.rsplit(None, 1)[1])
        return total

    def ended(self) -> None:
        """After the harness's end: raise ServerLost where it saw the server fail (its answers
        then hold errors of ours, not the model's)."""
        self.check()
        if self.upstream_errors:
            raise ServerLost(
                f"the model server could not be reached for {len(self.upstream_errors)} "
                f"request(s) (the first: {self.upstream_errors[0]}); the attempt is retried, "
                "resuming from the journal"
            )

    # --- requests ------------------------------------------------------------------------------
    def clamp(self, path: str, body: dict[str, Any]) -> str | None:
        """Lower the request's max_tokens to what the context leaves after its prompt; an
        error message where the prompt alone fills the context."""
        if self.max_len is None:
            return None
        field = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        asked = body.get(field)
        if not isinstance(asked, int):
            return None
        probe = {"model": body.get("model", self.model)}
        if path.endswith("/chat/completions"):
            probe["messages"] = body.get("messages", [])
        else:
            probe["prompt"] = body.get("prompt", "")
        status, _, raw = self.upstream(
            "POST", "/tokenize", json.dumps(probe).encode(), {"Content-Type": "application/json"}
        )
        if status != 200:
            return None  # the server says what is wrong with the request itself
        count = int(json.loads(raw).get("count", 0))
        room = self.max_len - count
        if room < 1:
            return f"the prompt ({count} tokens) fills the model's context ({self.max_len})"
        if asked > room:
            body[field] = room
            with self._lock:
                self.clamped += 1
        return None

    def seeded(self, key: str, occurrence: int, body: dict[str, Any]) -> None:
        if "seed" not in body:
            digest = hashlib.sha256(f"{self.seed}:{key}:{occurrence}".encode()).digest()
            body["seed"] = int.from_bytes(digest[:4], "big") & 0x7FFFFFFF

    def handle(
        self, method: str, path: str, raw: bytes, headers: dict[str, str]
    ) -> tuple[int, str, bytes]:
        route = path.split("?")[0]
        if (method, route) not in ROUTES:
            return _error(
                404,
                f"{method} {route} is not served here; the watcher's endpoint serves "
                + ", ".join(f"{m} {p}" for m, p in sorted(ROUTES)),
            )
        if method != "POST":
            answer = self.upstream(method, path, raw or None, headers)
            adapter = self.servers.adapter
            return answer if adapter is None else _renamed(answer, adapter, self.model)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self.upstream(method, path, raw, headers)
        if not isinstance(body, dict):  # the server says what is wrong with it
            return self.upstream(method, path, raw, headers)
        if route not in COMPLETIONS:  # /tokenize
            return self.ask(method, path, body)
        key = self.journal.key(path, body)
        occurrence = self.occurrence(key)
        saved = self.journal.get(key, occurrence)
        if saved is not None:
            with self._lock:
                self.resumed += 1
            return 200, saved["content_type"], saved["body"].encode()
        self.seeded(key, occurrence, body)
        problem = self.clamp(path, body)
        if problem is not None:
            return _error(400, problem)
        status, ctype, out = self.ask(method, path, body)
        if status == 200:
            self.journal.put(key, occurrence, ctype, out)
            with self._lock:
                self.computed += 1
        return status, ctype, out

    def ask(self, method: str, path: str, body: Any) -> tuple[int, str, bytes]:
        """The server's answer to `body`: the adapter served asked for by its name of the moment
        where the harness names the checkpoint, the answer naming the checkpoint again."""
        adapter = self.servers.adapter
        # no model, or an empty one, is the base to vLLM: the harness means the checkpoint
        named = isinstance(body, dict) and body.get("model") in (None, "", self.model)
        if adapter is not None and named:
            body = body | {"model": adapter}
        answer = self.upstream(
            method, path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        if adapter is None or not named:
            return answer
        return _renamed(answer, adapter, self.model)

    def start_proxy(self) -> None:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def _serve(self) -> None:
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                headers = {"Content-Type": self.headers.get("Content-Type", "application/json")}
                try:
                    status, ctype, out = endpoint.handle(self.command, self.path, raw, headers)
                except OSError as e:  # the server died or refused: the harness sees a 502
                    status, ctype, out = _error(502, f"model server: {e}")
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_PUT = do_DELETE = _serve

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer((HOST, 0), Handler)
        self._server.daemon_threads = True
        self.url = f"http://{HOST}:{self._server.server_address[1]}/v1"
        threading.Thread(target=self._server.serve_forever, daemon=True).start()

    def stop_proxy(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()


ERROR_TYPES = {400: "BadRequestError", 404: "NotFoundError", 502: "BadGatewayError"}


def _renamed(answer: tuple[int, str, bytes], name: str, to: str) -> tuple[int, str, bytes]:
    """The server's answer with the adapter `name` said as `to`: its `model` field (in a JSON
    answer, or in each event of a streamed one), and left out of the model list."""
    status, ctype, out = answer
    if ctype.startswith("text/event-stream"):
        lines = out.split(b"\n")
        for i, line in enumerate(lines):
            if line.startswith(b"data: ") and line != b"data: [DONE]":
                lines[i] = b"data: " + _renamed_json(line[6:], name, to)
        return status, ctype, b"\n".join(lines)
    return status, ctype, _renamed_json(out, name, to)


def _renamed_json(raw: bytes, name: str, to: str) -> bytes:
    try:
        data = json.loads(raw)
    except ValueError:  # not JSON: as it came
        return raw
    if not isinstance(data, dict):
        return raw
    if data.get("object") == "list" and isinstance(data.get("data"), list):  # /v1/models
        data["data"] = [
            m for m in data["data"] if not (isinstance(m, dict) and m.get("id") == name)
        ]
    elif data.get("model") == name:
        data["model"] = to
    else:
        return raw
    return json.dumps(data).encode()


def _error(status: int, message: str) -> tuple[int, str, bytes]:
    """An answer of the proxy's own, in the OpenAI server's error format."""
    error = {"error": {"message": message, "type": ERROR_TYPES[status], "code": status}}
    return status, "application/json", json.dumps(error).encode()


@contextmanager
def serve(
    servers: Servers,
    spec: dict[str, Any],
    out: Path,
    ref: JournalRef | None,
    upstream_timeout: float | None = None,
) -> Iterator[Endpoint]:
    """The checkpoint served on the job's device (`servers`) behind a proxy of this entry's
    own (its journal, its counts), until the block ends."""
    _, kind, seconds = servers.start(spec, out)
    req = servers.req
    assert req is not None
    journal = EndpointJournal(ref)
    max_len = req.model_args.get("max_model_len")
    endpoint = Endpoint(
        servers,
        journal,
        req.seed,
        max_len if isinstance(max_len, int) else None,
        float(spec.get("stall_seconds") or STALL_SECONDS),
        upstream_timeout,
    )
    endpoint.engine, endpoint.ready_seconds = kind, seconds
    try:
        endpoint.start_proxy()
        log.info(
            "endpoint.ready",
            url=endpoint.url,
            engine=kind,
            seconds=round(seconds, 1),
            journaled=len(journal.saved),
        )
        yield endpoint
    finally:
        endpoint.stop_proxy()
        journal.close()
