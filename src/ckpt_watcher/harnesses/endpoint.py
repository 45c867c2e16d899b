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
  those of an uninterrupted run.
"""

from __future__ import annotations

import hashlib
import http.client
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

from ckpt_watcher.harnesses.server import HOST, MODEL_NAME, Servers
from ckpt_watcher.journal import JournalRef

log = structlog.get_logger("ckpt_watcher.harnesses.endpoint")

JOURNAL_PREFIX = "endpoint-"
FSYNC_EVERY_SECONDS = 1.0
COMPLETIONS = ("/v1/chat/completions", "/v1/completions")


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
    """A served checkpoint behind the journaling, clamping proxy."""

    def __init__(
        self, upstream_port: int, journal: EndpointJournal, seed: int, max_len: int | None
    ):
        self.upstream_port = upstream_port
        self.journal = journal
        self.seed = seed
        self.max_len = max_len
        self.model = MODEL_NAME
        self.engine = "cold"  # how the server came to serve the checkpoint (Servers.start)
        self.ready_seconds = 0.0
        self.resumed = 0
        self.computed = 0
        self.clamped = 0
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
        conn = http.client.HTTPConnection(HOST, self.upstream_port, timeout=None)
        try:
            conn.request(method, path, body=body, headers=headers)
            r = conn.getresponse()
            return r.status, r.getheader("Content-Type") or "application/json", r.read()
        finally:
            conn.close()

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
        if method != "POST" or path.split("?")[0] not in COMPLETIONS:
            return self.upstream(method, path, raw or None, headers)
        try:
            body = json.loads(raw or b"{}")
        except ValueError:
            return self.upstream(method, path, raw, headers)
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
            error = {"error": {"message": problem, "type": "BadRequestError", "code": 400}}
            return 400, "application/json", json.dumps(error).encode()
        status, ctype, out = self.upstream(
            method, path, json.dumps(body).encode(), {"Content-Type": "application/json"}
        )
        if status == 200:
            self.journal.put(key, occurrence, ctype, out)
            with self._lock:
                self.computed += 1
        return status, ctype, out

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
                    status, ctype = 502, "application/json"
                    out = json.dumps({"error": {"message": f"model server: {e}"}}).encode()
                self.send_response(status)
                self.send_header("Content-Type", ctype)
                self.send_header("Content-Length", str(len(out)))
                self.end_headers()
                self.wfile.write(out)

            do_GET = do_POST = do_DELETE = _serve

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


@contextmanager
def serve(
    servers: Servers, spec: dict[str, Any], out: Path, ref: JournalRef | None
) -> Iterator[Endpoint]:
    """The checkpoint served on the job's device (`servers`) behind a proxy of this entry's
    own (its journal, its counts), until the block ends."""
    port, kind, seconds = servers.start(spec, out)
    req = servers.req
    assert req is not None
    journal = EndpointJournal(ref)
    max_len = req.model_args.get("max_model_len")
    endpoint = Endpoint(port, journal, req.seed, max_len if isinstance(max_len, int) else None)
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
