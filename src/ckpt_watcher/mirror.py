"""The ledger mirror (SageMaker's local disk vanishes with the job): after every append, each
run's whole ledger file is uploaded to `<ledger_mirror>/<run_path>/ledger.jsonl` as one PUT, so the
mirror always holds a complete object, never a partial one.

Uploads run on the mirror's own lane, never on the daemon's loop: an S3 endpoint that hangs
delays only the mirror. Appends made while an upload is in flight are coalesced into the next
upload of that run. A failed upload is logged and tried again (`retry_due`), so the mirror
catches up once S3 answers again; it never stops the daemon. The daemon re-sends every run at
start, so a crash between an append and its upload leaves the mirror behind only until then.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.errors import WatcherError
from ckpt_watcher.lane import Lane
from ckpt_watcher.ledger import REPORT_NAME, ledger_path
from ckpt_watcher.s3client import Retry, make_client, split_uri

log = structlog.get_logger("ckpt_watcher.mirror")

RETRY_FAILED_SECONDS = 30.0


class LedgerMirror:
    def __init__(
        self,
        uri: str,
        ledger_dir: Path,
        client: Any = None,
        retry: Retry | None = None,
        wake: Callable[[], None] | None = None,
    ) -> None:
        self.bucket, self.prefix = split_uri(uri)
        self.ledger_dir = ledger_dir
        self._client = client
        self.retry = retry or Retry(max_seconds=120)
        self.lane = Lane("ledger-mirror", wake)
        self._lock = threading.Lock()
        self._dirty: set[str] = set()
        self._failed: set[str] = set()
        self._draining = False
        self._last_retry = 0.0

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client()
        return self._client

    def request(self, run: str) -> None:
        """Upload `run`'s ledger soon, on the mirror's lane (returns at once)."""
        with self._lock:
            self._dirty.add(run)
            if self._draining:
                return  # the upload in flight picks it up
            self._draining = True
        self.lane.submit(self._drain)

    def retry_due(self, now: float, force: bool = False) -> None:
        """Re-send runs whose upload failed, at most every RETRY_FAILED_SECONDS (or now)."""
        with self._lock:
            if not self._failed or (not force and now - self._last_retry < RETRY_FAILED_SECONDS):
                return
            self._last_retry = now
            runs, self._failed = self._failed, set()
        for run in runs:
            self.request(run)

    def pending(self) -> set[str]:
        """Runs whose latest ledger is not in the mirror yet."""
        with self._lock:
            return self._dirty | self._failed

    def _drain(self) -> None:
        while True:
            with self._lock:
                if not self._dirty:
                    self._draining = False
                    return
                run = self._dirty.pop()
            if not self.upload(run):
                with self._lock:
                    self._failed.add(run)

    def upload(self, run: str) -> bool:
        """Put the run's whole ledger now (blocking); False (logged) if S3 refused or stayed
        unreachable."""
        body = ledger_path(self.ledger_dir, run).read_bytes()
        key = f"{self.prefix}{run}/ledger.jsonl"
        try:
            self._put(key, body, "application/x-ndjson")
            page = self.ledger_dir / run / REPORT_NAME
            if page.exists():  # the run's HTML report, beside its ledger
                self._put(f"{self.prefix}{run}/{REPORT_NAME}", page.read_bytes(), "text/html")
        except (OSError, WatcherError) as e:
            log.error(
                "ledger.mirror_failed", run=run, uri=f"s3://{self.bucket}/{key}", error=str(e)
            )
            return False
        log.info("ledger.mirrored", run=run, uri=f"s3://{self.bucket}/{key}", bytes=len(body))
        return True

    def _put(self, key: str, body: bytes, content_type: str) -> None:
        put = partial(
            self.client.put_object,
            Bucket=self.bucket,
            Key=key,
            Body=body,
            ContentType=content_type,
        )
        self.retry(put, f"s3://{self.bucket}/{key}")

    def flush(self, timeout: float) -> bool:
        """At shutdown: wait up to `timeout` seconds for uploads in flight or due; True if the
        mirror holds every run's latest ledger."""
        self.retry_due(0.0, force=True)  # failed runs get one more try now
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._draining:
                    return not (self._dirty or self._failed)
            time.sleep(0.05)
        return False

    def close(self) -> None:
        self.lane.close()
