"""The ledger mirror (SageMaker's local disk vanishes with the job): after every append, each
run's whole ledger file is uploaded to `<ledger_mirror>/<run>/ledger.jsonl` as one PUT, so the
mirror always holds a complete object, never a partial one. Failures are logged, retried on the
next append, and never stop the daemon."""

from __future__ import annotations

from functools import partial
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher.errors import WatcherError
from ckpt_watcher.ledger import ledger_path
from ckpt_watcher.sources.s3 import Retry, make_client, split_uri

log = structlog.get_logger("ckpt_watcher.mirror")


class LedgerMirror:
    def __init__(
        self, uri: str, ledger_dir: Path, client: Any = None, retry: Retry | None = None
    ) -> None:
        self.bucket, self.prefix = split_uri(uri)
        self.ledger_dir = ledger_dir
        self._client = client
        self.retry = retry or Retry()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client()
        return self._client

    def upload(self, run: str) -> bool:
        """Put the run's whole ledger; False (logged) if S3 refused or stayed unreachable."""
        body = ledger_path(self.ledger_dir, run).read_bytes()
        key = f"{self.prefix}{run}/ledger.jsonl"
        put = partial(
            self.client.put_object,
            Bucket=self.bucket,
            Key=key,
            Body=body,
            ContentType="application/x-ndjson",
        )
        try:
            self.retry(put, f"s3://{self.bucket}/{key}")
        except (OSError, WatcherError) as e:
            log.error(
                "ledger.mirror_failed", run=run, uri=f"s3://{self.bucket}/{key}", error=str(e)
            )
            return False
        log.info("ledger.mirrored", run=run, uri=f"s3://{self.bucket}/{key}", bytes=len(body))
        return True
