"""The one S3 layer: a client with bounded timeouts, retries with back-off, listings by level, and
a checkpoint prefix viewed as files. The S3 source, the worker's staging and the ledger mirror all
use it (and nothing here imports them).

Every request is bounded: connect and read timeouts on the client, a number of attempts and a
total time in `Retry`. A hanging endpoint therefore costs its caller a bounded time; callers
that must not wait at all (the daemon's loop) run these calls on a thread of their own.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from functools import cached_property, partial
from typing import Any, TypeVar

import structlog
import tenacity

from ckpt_watcher.checkpoints.files import MARK_VERSION
from ckpt_watcher.checkpoints.layouts import listing
from ckpt_watcher.errors import S3Error

log = structlog.get_logger("ckpt_watcher.s3")
T = TypeVar("T")

DEFAULT_REQUEST_TIMEOUT = 30.0

_RETRY_CODES = frozenset(
    {
        "SlowDown",
        "Throttling",
        "ThrottlingException",
        "RequestLimitExceeded",
        "RequestTimeout",
        "RequestTimeTooSkewed",
        "InternalError",
        "ServiceUnavailable",
        "500",
        "502",
        "503",
        "504",
    }
)
_FATAL_HINTS = {
    "NoSuchBucket": "the bucket does not exist: check the source's uri",
    "AccessDenied": "access denied: the credentials lack s3:ListBucket / s3:GetObject on this prefix",
    "InvalidAccessKeyId": "the access key is not valid: check AWS_ACCESS_KEY_ID or the profile",
    "SignatureDoesNotMatch": "the secret key does not match: check AWS_SECRET_ACCESS_KEY",
    "ExpiredToken": "the session token has expired: refresh the credentials",
}


def split_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix/") (prefix "" for the whole bucket)."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def make_client(
    endpoint_url: str | None = None, request_timeout: float = DEFAULT_REQUEST_TIMEOUT
) -> Any:
    """A boto3 S3 client whose every request gives up after `request_timeout` seconds without an
    answer; botocore's own retries are off (ours, with jitter, wrap each call)."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(
            retries={"total_max_attempts": 1, "mode": "standard"},
            connect_timeout=min(10.0, request_timeout),
            read_timeout=request_timeout,
        ),
    )


def is_retryable(exc: BaseException) -> bool:
    from botocore.exceptions import (
        ClientError,
        ConnectionClosedError,
        ConnectTimeoutError,
        EndpointConnectionError,
        ReadTimeoutError,
    )
    from urllib3.exceptions import HTTPError

    if isinstance(exc, ClientError):
        err = exc.response.get("Error", {})
        status = str(exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", ""))
        return err.get("Code") in _RETRY_CODES or status.startswith("5")
    return isinstance(
        exc,
        EndpointConnectionError
        | ConnectionClosedError
        | ReadTimeoutError
        | ConnectTimeoutError
        | HTTPError,
    ) or type(exc).__name__ in ("IncompleteReadError", "ResponseStreamingError", "ProtocolError")


def explain(exc: BaseException, where: str) -> S3Error:
    """The one-line, actionable error for a failure that will not go away by retrying."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return S3Error(
            f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or an instance role)"
        )
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        hint = _FATAL_HINTS.get(
            code, exc.response.get("Error", {}).get("Message", "") or "request refused"
        )
        return S3Error(f"{where}: {code}: {hint}")
    return S3Error(f"{where}: {type(exc).__name__}: {exc}")


class Retry:
    """Retry S3 calls on throttling, 5xx and connection errors; exponential back-off with jitter.

    Gives up after `attempts` tries or once `max_seconds` have passed since the first, whichever
    comes first. What still fails is an `OSError` (transient: try again later), a
    `FileNotFoundError` (no such key) or an `S3Error` (retrying cannot fix it).
    """

    def __init__(
        self,
        attempts: int = 6,
        initial: float = 0.2,
        maximum: float = 10.0,
        max_seconds: float | None = None,
    ) -> None:
        self.attempts = attempts
        self.initial = initial
        self.maximum = maximum
        self.max_seconds = max_seconds

    def __call__(self, fn: Callable[[], T], where: str) -> T:
        stop: tenacity.stop.stop_base = tenacity.stop_after_attempt(self.attempts)
        if self.max_seconds is not None:
            stop = stop | tenacity.stop_after_delay(self.max_seconds)
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_retryable),
            wait=tenacity.wait_exponential_jitter(
                multiplier=self.initial, max=self.maximum, jitter=self.initial
            ),
            stop=stop,
            reraise=True,
            before_sleep=lambda rs: log.info(
                "s3.retry",
                where=where,
                attempt=rs.attempt_number,
                error=str(rs.outcome.exception()) if rs.outcome else "",
            ),
        )
        started = time.monotonic()
        try:
            return retrying(fn)
        except Exception as e:
            if is_retryable(e):
                tries = f"{time.monotonic() - started:.0f}s of tries"
                raise OSError(f"{where}: still failing after {tries}: {e}") from e
            from botocore.exceptions import BotoCoreError, ClientError

            if isinstance(e, ClientError | BotoCoreError):
                if isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in (
                    "NoSuchKey",
                    "404",
                ):
                    raise FileNotFoundError(where) from e
                raise explain(e, where) from e
            raise


def list_level(
    client: Any, retry: Retry, bucket: str, prefix: str, deep: bool = False
) -> Iterator[tuple[list[str], list[dict[str, Any]]]]:
    """Pages of (sub-prefixes, objects) directly under `prefix` (delimiter "/"); with `deep`,
    every object under it (no sub-prefixes)."""
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix}
        if not deep:
            kwargs["Delimiter"] = "/"
        if token:
            kwargs["ContinuationToken"] = token
        page = retry(partial(client.list_objects_v2, **kwargs), f"s3://{bucket}/{prefix}")
        yield [p["Prefix"] for p in page.get("CommonPrefixes", [])], page.get("Contents", [])
        if not page.get("IsTruncated"):
            return
        token = page.get("NextContinuationToken")


def get_bytes(
    client: Any, retry: Retry, bucket: str, key: str, byte_range: str | None = None
) -> bytes:
    """One object's bytes (or a `bytes=a-b` range of them); FileNotFoundError if absent."""
    kwargs: dict[str, Any] = {"Bucket": bucket, "Key": key}
    if byte_range:
        kwargs["Range"] = byte_range
    return bytes(retry(lambda: client.get_object(**kwargs)["Body"].read(), f"s3://{bucket}/{key}"))


class S3Files:
    """One checkpoint prefix, read through listings and ranged GETs (a `CheckpointFiles`)."""

    def __init__(self, client: Any, retry: Retry, bucket: str, prefix: str) -> None:
        self.client, self.retry, self.bucket, self.prefix = client, retry, bucket, prefix
        self._etags: dict[str, str] = {}
        self._modified: dict[str, float] = {}

    @cached_property
    def files(self) -> dict[str, int]:
        return listing(self._level)  # and a native format's folders (checkpoints/layouts.py)

    def _level(self, sub: str) -> dict[str, int]:
        prefix = self.prefix + sub
        out: dict[str, int] = {}
        for _, objects in list_level(self.client, self.retry, self.bucket, prefix):
            for obj in objects:
                name = obj["Key"][len(self.prefix) :]
                if name and "/" not in obj["Key"][len(prefix) :]:
                    out[name] = int(obj["Size"])
                    self._etags[name] = obj.get("ETag", "")
                    if "LastModified" in obj:
                        self._modified[name] = obj["LastModified"].timestamp()
        return out

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if name not in self.files:
            raise FileNotFoundError(name)
        if length == 0 or start >= self.files[name]:
            return b""
        byte_range = None
        if start or length is not None:
            end = "" if length is None else str(min(start + length, self.files[name]) - 1)
            byte_range = f"bytes={start}-{end}"
        return get_bytes(self.client, self.retry, self.bucket, self.prefix + name, byte_range)

    def etag(self, name: str) -> str:
        """The object's ETag as listed ("" if the listing gave none)."""
        self.files  # noqa: B018 (lists the prefix once)
        return self._etags.get(name, "")

    def last_write(self) -> float | None:
        self.files  # noqa: B018 (lists the prefix once)
        return max(self._modified.values(), default=None)

    def write_mark(self, names: list[str] | None = None) -> str:
        sizes = self.files
        chosen = sorted(sizes) if names is None else [n for n in names if n in sizes]
        parts = [f"{n}:{sizes[n]}:{self._etags.get(n, '')}" for n in chosen]
        return "\n".join([MARK_VERSION, *parts])
