"""The ledger mirror (SageMaker's local disk vanishes with the job): after every append, each
run's whole ledger file is uploaded to `<ledger_mirror>/<run_path>/ledger.jsonl` as one PUT, so the
mirror always holds a complete object, never a partial one; its HTML report (`report.html`, when
written) goes beside it.

Uploads run on the mirror's own lane, never on the daemon's loop: an S3 endpoint that hangs
delays only the mirror. Appends made while an upload is in flight are coalesced into the next
upload of that run. A failed upload is logged and tried again (`retry_due`), so the mirror
catches up once S3 answers again; it never stops the daemon. The daemon re-sends every run at
start, so a crash between an append and its upload leaves the mirror behind only until then.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.errors import WatcherError
from ckpt_watcher.lane import Coalescing
from ckpt_watcher.ledger import REPORT_NAME, ledger_path, line_run_path
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
        self.uploads = Coalescing("ledger-mirror", self.upload, wake)
        self._last_retry = 0.0

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client()
        return self._client

    def request(self, run: str) -> None:
        """Upload `run`'s ledger soon, on the mirror's lane (returns at once); thread-safe."""
        self.uploads.request(run)

    def ledger_line(self, line: dict[str, Any]) -> None:
        """A ledger listener: the line's run is uploaded again."""
        self.request(line_run_path(line))

    def retry_due(self, now: float, force: bool = False) -> None:
        """Re-send runs whose upload failed, at most every RETRY_FAILED_SECONDS (or now)."""
        if not self.uploads.has_failed() or (
            not force and now - self._last_retry < RETRY_FAILED_SECONDS
        ):
            return
        self._last_retry = now
        self.uploads.retry_failed()

    def pending(self) -> set[str]:
        """Runs whose latest ledger is not in the mirror yet."""
        return self.uploads.pending()

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
        return self.uploads.flush(timeout)

    def close(self) -> None:
        self.uploads.close()
