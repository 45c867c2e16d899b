"""An S3 prefix as a checkpoint source (SageMaker writes checkpoints straight to S3).

A poll costs listing pages, not a request per checkpoint: prefixes are walked with a delimiter
(`ListObjectsV2`, paginated) and a known checkpoint is just a name in a page. Completeness uses
the same rules as local folders, through `S3Files`: the object listing gives sizes, and ranged
GETs read only the 8-byte length and the header of each safetensors file. Throttling, 5xx and
dropped connections are retried with exponential back-off and jitter; missing credentials or
buckets fail at once with a message saying what to fix.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from functools import cached_property, partial
from pathlib import Path, PurePosixPath
from typing import Any, TypeVar

import structlog
import tenacity

from ckpt_watcher.checkpoints.naming import looks_like_checkpoint_name, parse_name
from ckpt_watcher.errors import WatcherError
from ckpt_watcher.sources.base import Found
from ckpt_watcher.sources.local import UNRECOGNISED

log = structlog.get_logger("ckpt_watcher.sources.s3")
T = TypeVar("T")

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


class S3SourceError(WatcherError):
    """S3 refused for a reason retrying cannot fix (credentials, bucket, permissions)."""


def split_uri(uri: str) -> tuple[str, str]:
    """s3://bucket/some/prefix -> ("bucket", "some/prefix/") (prefix "" for the whole bucket)."""
    rest = uri.removeprefix("s3://")
    bucket, _, prefix = rest.partition("/")
    if prefix and not prefix.endswith("/"):
        prefix += "/"
    return bucket, prefix


def make_client(endpoint_url: str | None = None) -> Any:
    """A boto3 S3 client with botocore's own retries off (ours, with jitter, wrap each call)."""
    import boto3
    from botocore.config import Config

    endpoint = endpoint_url or os.environ.get("AWS_ENDPOINT_URL") or None
    return boto3.client(
        "s3",
        endpoint_url=endpoint,
        config=Config(
            retries={"max_attempts": 1, "mode": "standard"}, connect_timeout=10, read_timeout=60
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


def explain(exc: BaseException, where: str) -> WatcherError:
    """The one-line, actionable error for a failure that will not go away by retrying."""
    from botocore.exceptions import ClientError, NoCredentialsError

    if isinstance(exc, NoCredentialsError):
        return S3SourceError(
            f"{where}: no AWS credentials found (set AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, a profile or an instance role)"
        )
    if isinstance(exc, ClientError):
        code = exc.response.get("Error", {}).get("Code", "")
        hint = _FATAL_HINTS.get(
            code, exc.response.get("Error", {}).get("Message", "") or "request refused"
        )
        return S3SourceError(f"{where}: {code}: {hint}")
    return S3SourceError(f"{where}: {type(exc).__name__}: {exc}")


class Retry:
    """Retry S3 calls on throttling, 5xx and connection errors; exponential back-off with jitter."""

    def __init__(self, attempts: int = 6, initial: float = 0.2, maximum: float = 10.0) -> None:
        self.attempts = attempts
        self.initial = initial
        self.maximum = maximum

    def __call__(self, fn: Callable[[], T], where: str) -> T:
        retrying = tenacity.Retrying(
            retry=tenacity.retry_if_exception(is_retryable),
            wait=tenacity.wait_exponential_jitter(
                multiplier=self.initial, max=self.maximum, jitter=self.initial
            ),
            stop=tenacity.stop_after_attempt(self.attempts),
            reraise=True,
            before_sleep=lambda rs: log.info(
                "s3.retry",
                where=where,
                attempt=rs.attempt_number,
                error=str(rs.outcome.exception()) if rs.outcome else "",
            ),
        )
        try:
            return retrying(fn)
        except Exception as e:
            if is_retryable(e):
                raise OSError(f"{where}: still failing after {self.attempts} tries: {e}") from e
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
    client: Any, retry: Retry, bucket: str, prefix: str
) -> Iterator[tuple[list[str], list[dict[str, Any]]]]:
    """Pages of (sub-prefixes, objects) directly under `prefix` (delimiter "/")."""
    token: str | None = None
    while True:
        kwargs: dict[str, Any] = {"Bucket": bucket, "Prefix": prefix, "Delimiter": "/"}
        if token:
            kwargs["ContinuationToken"] = token
        page = retry(partial(client.list_objects_v2, **kwargs), f"s3://{bucket}/{prefix}")
        yield [p["Prefix"] for p in page.get("CommonPrefixes", [])], page.get("Contents", [])
        if not page.get("IsTruncated"):
            return
        token = page.get("NextContinuationToken")


class S3Files:
    """One checkpoint prefix, read through listings and ranged GETs."""

    def __init__(self, client: Any, retry: Retry, bucket: str, prefix: str) -> None:
        self.client, self.retry, self.bucket, self.prefix = client, retry, bucket, prefix
        self._etags: dict[str, str] = {}

    @cached_property
    def files(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for _, objects in list_level(self.client, self.retry, self.bucket, self.prefix):
            for obj in objects:
                name = obj["Key"][len(self.prefix) :]
                if name and "/" not in name:
                    out[name] = int(obj["Size"])
                    self._etags[name] = obj.get("ETag", "")
        return out

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        if name not in self.files:
            raise FileNotFoundError(name)
        if length == 0 or start >= self.files[name]:
            return b""
        kwargs: dict[str, Any] = {"Bucket": self.bucket, "Key": self.prefix + name}
        if start or length is not None:
            end = "" if length is None else str(min(start + length, self.files[name]) - 1)
            kwargs["Range"] = f"bytes={start}-{end}"
        where = f"s3://{self.bucket}/{self.prefix}{name}"
        return bytes(self.retry(lambda: self.client.get_object(**kwargs)["Body"].read(), where))

    def fingerprint(self) -> str:
        sizes = self.files
        return "\n".join(f"{n}:{sizes[n]}:{self._etags.get(n, '')}" for n in sorted(sizes))


class S3Source:
    """Scan `uri` (to `max_depth` prefix levels) for checkpoint prefixes."""

    def __init__(
        self,
        uri: str,
        poll_seconds: float = 60.0,
        endpoint_url: str | None = None,
        max_depth: int = 4,
        client: Any = None,
        retry: Retry | None = None,
        cache_dir: Path = Path("/tmp/watcher-cache"),
        keep_staged: bool = False,
        cache_max_gb: float = 200.0,
    ) -> None:
        self.cache_dir = cache_dir
        self.cache_max_gb = cache_max_gb
        self.keep_staged = keep_staged
        self.uri = uri
        self.name = uri
        self.poll_seconds = poll_seconds
        self.endpoint_url = endpoint_url
        self.max_depth = max_depth
        self.bucket, self.prefix = split_uri(uri)
        self._client = client
        self.retry = retry or Retry()

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client(self.endpoint_url)
        return self._client

    def _key(self, location: str) -> str:
        bucket, key = split_uri(location)
        if bucket != self.bucket:
            raise ValueError(f"{location} is not in bucket {self.bucket}")
        return key

    def scan(self) -> list[Found]:
        found: list[Found] = []
        stack: list[tuple[str, int]] = [(self.prefix, 0)]
        while stack:
            prefix, depth = stack.pop()
            subs: list[str] = []
            keys: set[str] = set()
            for page_subs, objects in list_level(self.client, self.retry, self.bucket, prefix):
                subs += page_subs
                keys.update(o["Key"] for o in objects)
            if depth > 0 and prefix + "config.json" in keys:
                found.append(Found(f"s3://{self.bucket}/{prefix}", None, None, UNRECOGNISED))
                continue  # model files under an unknown name: reported, not walked into
            for sub in subs:
                path = PurePosixPath(sub.rstrip("/"))
                parts = sub[len(self.prefix) :].rstrip("/").split("/")
                if any(p in ("", ".", "..") for p in parts):
                    found.append(
                        Found(
                            f"s3://{self.bucket}/{sub}",
                            None,
                            None,
                            "key has empty, '.' or '..' components: never staged",
                        )
                    )
                    continue
                if looks_like_checkpoint_name(path.name):
                    ident = parse_name(
                        path.name,
                        path.parent.name,
                        partial(self._get_or_none, sub + "trainer_state.json"),
                    )
                    note = "" if ident else "its run (parent prefix) name has unsafe characters"
                    found.append(Found(f"s3://{self.bucket}/{sub}", None, ident, note))
                elif depth + 1 < self.max_depth:
                    stack.append((sub, depth + 1))
        return found

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return bytes(
                self.retry(
                    lambda: self.client.get_object(Bucket=self.bucket, Key=key)["Body"].read(), key
                )
            )
        except FileNotFoundError:
            return None

    def view(self, location: str) -> S3Files:
        return S3Files(self.client, self.retry, self.bucket, self._key(location))

    def exists(self, location: str) -> bool:
        key = self._key(location)
        page = self.retry(
            lambda: self.client.list_objects_v2(Bucket=self.bucket, Prefix=key, MaxKeys=1), location
        )
        return bool(page.get("KeyCount", 0))

    def prepare(self, location: str) -> list[str]:
        return []  # the naming fix happens in the staged copy, never in the bucket

    def stage_spec(self, location: str) -> dict[str, Any]:
        return {
            "location": location,
            "cache_dir": str(self.cache_dir),
            "endpoint_url": self.endpoint_url,
        }

    def release(self, location: str) -> None:
        if not self.keep_staged:
            from ckpt_watcher.sources.staging import remove_staged

            remove_staged(self.cache_dir, location)

    def make_room(self, needed: list[str]) -> None:
        """Evict least recently used staged copies beyond cache_max_gb, except `needed` ones."""
        from ckpt_watcher.sources.staging import evict, staged_path

        keep = {staged_path(self.cache_dir, loc) for loc in needed}
        if self.cache_dir.is_dir():
            evict(self.cache_dir, int(self.cache_max_gb * 2**30), keep)

    def watch(self, wake: Callable[[], None]) -> bool:
        return False  # S3 has no change notifications here: polling only

    def close(self) -> None:
        pass
