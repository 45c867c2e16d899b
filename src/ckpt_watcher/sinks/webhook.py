"""A webhook sink: Slack-compatible JSON (`{"text": ...}`) POSTed from a thread of its own.

`send` only queues: the daemon's loop never waits on the network. Each message gets three
attempts of `timeout_seconds` each (1 s, then 2 s apart); then it is dropped and logged. The
queue is bounded: when the endpoint hangs and messages pile up, the oldest are dropped (and
logged), never the loop blocked. On stop, messages still queued get `close`'s time budget.
"""

from __future__ import annotations

import json
import queue
import threading
import time
import urllib.error
import urllib.request

import structlog

from ckpt_watcher import redact

log = structlog.get_logger("ckpt_watcher.sinks.webhook")

ATTEMPTS = 3
BACKOFF_SECONDS = (1.0, 2.0)
MAX_QUEUED = 100


class Webhook:
    def __init__(self, url: str, timeout_seconds: float = 5.0) -> None:
        self.url = url
        self.timeout = timeout_seconds
        self._queue: queue.Queue[str | None] = queue.Queue(maxsize=MAX_QUEUED)
        self._stopping = threading.Event()
        self._thread = threading.Thread(target=self._run, name="webhook", daemon=True)
        self._thread.start()
        self.sent = 0
        self.dropped = 0

    def send(self, text: str) -> None:
        """Queue one message (never blocks)."""
        while True:
            try:
                self._queue.put_nowait(text)
                return
            except queue.Full:
                try:
                    old = self._queue.get_nowait()
                except queue.Empty:
                    continue
                self.dropped += 1
                log.error(
                    "webhook.dropped", url=redact.url(self.url), reason="queue full", text=old
                )

    def close(self, budget_seconds: float = 10.0) -> None:
        """Send what is queued within `budget_seconds`, then stop (the thread is a daemon)."""
        self._stopping.set()
        try:
            self._queue.put_nowait(None)
        except queue.Full:
            pass
        self._thread.join(timeout=budget_seconds)

    def _run(self) -> None:
        while True:
            text = self._queue.get()
            if text is None:
                return
            self._post(text)

    def _post(self, text: str) -> None:
        body = json.dumps({"text": text}).encode()
        error = ""
        for attempt in range(ATTEMPTS):
            request = urllib.request.Request(
                self.url, data=body, headers={"Content-Type": "application/json"}, method="POST"
            )
            try:
                with urllib.request.urlopen(request, timeout=self.timeout) as r:
                    r.read()
                self.sent += 1
                return
            except (urllib.error.URLError, OSError, ValueError) as e:
                error = str(getattr(e, "reason", None) or e)
            if attempt < ATTEMPTS - 1 and not self._stopping.is_set():
                time.sleep(BACKOFF_SECONDS[attempt])
        self.dropped += 1
        # the URL is a credential (Slack's): neither it nor an error quoting it is logged
        error = error.replace(self.url, redact.url(self.url))
        log.error(
            "webhook.failed", url=redact.url(self.url), attempts=ATTEMPTS, error=error, text=text
        )
