"""An S3 prefix as a checkpoint source (SageMaker writes checkpoints straight to S3).

A poll costs listing pages, not a request per checkpoint: prefixes are walked with a delimiter
(`ListObjectsV2`, paginated) and a known checkpoint is just a name in a page (verl's
`global_step_{N}` and DeepSpeed's `global_step{N}` prefixes are listed once more, to find the
model folder inside, if any). Completeness uses the same rules as local folders, through
`S3Files`: the object listing gives sizes, and ranged GETs read only the 8-byte length and the
header of each safetensors file. Every request is bounded in time (see `s3client`); the daemon
calls a source only from that source's own thread.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial
from pathlib import Path, PurePosixPath
from typing import Any

from ckpt_watcher.checkpoints.fingerprint import Mode
from ckpt_watcher.checkpoints.naming import (
    VERL_ROLES,
    being_written,
    contents_decide,
    has_hf_copy,
    looks_like_checkpoint_name,
    model_folder,
    parse_name,
)
from ckpt_watcher.jobfolder import Stage
from ckpt_watcher.s3client import (
    DEFAULT_REQUEST_TIMEOUT,
    Retry,
    S3Files,
    get_bytes,
    list_level,
    make_client,
    split_uri,
)
from ckpt_watcher.sources.base import UNRECOGNISED, Found
from ckpt_watcher.sources.staging import evict, is_staged, remove_staged, stage, staged_path

# Evaluated checkpoints whose listing a scan re-reads to notice a rewrite: a poll then costs at
# most this many extra LIST requests, and each checkpoint is looked at every n/16 polls.
RECHECK_PER_SCAN = 16


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
        request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
        fingerprint: Mode = "sampled",
        adapter_base: Path | None = None,
        convert: list[str] | None = None,
    ) -> None:
        self.uri = uri
        self.fingerprint_mode: Mode = fingerprint
        self.adapter_base = adapter_base
        self.convert = convert
        # a listing per evaluated checkpoint: this many per scan, in turn (see Discovery)
        self.recheck_per_scan: int | None = RECHECK_PER_SCAN
        self.name = uri
        self.poll_seconds = poll_seconds
        self.endpoint_url = endpoint_url
        self.max_depth = max_depth
        self.cache_dir = cache_dir
        self.cache_max_gb = cache_max_gb
        self.keep_staged = keep_staged
        self.request_timeout = request_timeout
        self.bucket, self.prefix = split_uri(uri)
        self._models: dict[str, str] = {}  # step prefix -> its model folder, once found
        self._client = client
        # a call gives up after ~4 unanswered requests: a dead endpoint shows within minutes
        self.retry = retry or Retry(max_seconds=4 * request_timeout)

    @property
    def client(self) -> Any:
        if self._client is None:
            self._client = make_client(self.endpoint_url, self.request_timeout)
        return self._client

    def owns(self, location: str) -> bool:
        """True for locations under this source's prefix (and only those)."""
        return location.startswith(f"s3://{self.bucket}/{self.prefix}")

    def _key(self, location: str) -> str:
        if not self.owns(location):
            raise ValueError(f"{location} is not under {self.uri}")
        return split_uri(location)[1]

    def scan(self) -> list[Found]:
        found: list[Found] = []
        stack: list[tuple[str, int]] = [(self.prefix, 0)]
        listed: dict[str, list[str]] = {}  # prefix -> its sub-prefixes, as this scan saw them
        while stack:
            prefix, depth = stack.pop()
            subs: list[str] = []
            keys: set[str] = set()
            for page_subs, objects in list_level(self.client, self.retry, self.bucket, prefix):
                subs += page_subs
                keys.update(o["Key"] for o in objects)
            listed[prefix] = subs
            if depth > 0 and keys & {prefix + "config.json", prefix + "adapter_config.json"}:
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
                above = listed.get(f"{path.parent.parent}/", [])
                beside = {a.rstrip("/").rsplit("/", 1)[-1] for a in above}
                if being_written(path.name) or has_hf_copy(
                    path.name, path.parent.name, beside.__contains__
                ):
                    continue  # OpenRLHF's DeepSpeed states beside its Hugging Face copy
                if looks_like_checkpoint_name(path.name):
                    ident = parse_name(
                        path.name,
                        path.parent.name,
                        partial(self._get_or_none, sub + "trainer_state.json"),
                        parts[:-1],
                        path.parent.parent.name,
                    )
                    note = "" if ident else "its run (parent prefix) name has unsafe characters"
                    model = self._model_folder(sub, path.name)
                    if model is not None:  # None: a step folder with no model in it
                        found.append(Found(f"s3://{self.bucket}/{sub}{model}", None, ident, note))
                elif depth + 1 < self.max_depth:
                    stack.append((sub, depth + 1))
        return found

    def _model_folder(self, prefix: str, name: str) -> str | None:
        """Where under a checkpoint prefix its model is (`naming.model_folder`): a LIST of the
        prefix for `global_step` names only (`""` at once for any other name), until found; then
        one LIST of a key a scan, to see it is still there."""
        if not contents_decide(name):
            return ""
        kept = self._models.get(prefix)
        if kept is not None:  # a model folder found stays where it is, while it is there
            if not kept or self.exists(f"s3://{self.bucket}/{prefix}{kept}"):
                return kept
            del self._models[prefix]  # deleted (verl's keep-last-k takes `actor/`): look again
        held: set[str] = set()
        for subs, objects in list_level(self.client, self.retry, self.bucket, prefix):
            held.update(s[len(prefix) :].rstrip("/") for s in subs)
            held.update(o["Key"][len(prefix) :] for o in objects)
        for role in sorted((VERL_ROLES | {"huggingface"}) & held):  # verl's: which folder holds it
            for _, objects in list_level(
                self.client, self.retry, self.bucket, f"{prefix}{role}/", deep=True
            ):
                for o in objects:
                    path = PurePosixPath(o["Key"][len(prefix) :])
                    held.update([str(path), *(str(p) for p in path.parents if str(p) != ".")])
        sub = model_folder(name, held.__contains__)
        if sub is None:
            return None  # looked at again next scan: its upload may not have begun
        if sub in VERL_ROLES or (not sub and "config.json" not in held):
            return f"{sub}/" if sub else ""  # not kept: weights or an adapter may follow
        self._models[prefix] = f"{sub}/" if sub else ""
        return self._models[prefix]

    def _get_or_none(self, key: str) -> bytes | None:
        try:
            return get_bytes(self.client, self.retry, self.bucket, key)
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

    def stage_spec(self, location: str) -> Stage:
        return Stage(location, str(self.cache_dir), self.endpoint_url, self.request_timeout)

    def hold(self, location: str) -> None:
        """Stage the due checkpoint now, into the cache its job's worker stages into: the worker
        then finds every file in place, and a prefix deleted meanwhile costs nothing."""
        stage(
            location,
            self.cache_dir,
            self.endpoint_url,
            client=self.client,
            retry=self.retry,
            request_timeout=self.request_timeout,
        )

    def held(self, location: str, write_mark: str | None = None) -> bool:
        return is_staged(self.cache_dir, location, write_mark)

    def release(self, location: str) -> None:
        if not self.keep_staged:
            remove_staged(self.cache_dir, location)

    def make_room(self, needed: list[str]) -> None:
        """Evict least recently used staged copies beyond cache_max_gb, except `needed` ones
        (locations of this source's queued and running jobs)."""
        keep = {staged_path(self.cache_dir, loc) for loc in needed}
        if self.cache_dir.is_dir():
            evict(self.cache_dir, int(self.cache_max_gb * 2**30), keep)

    def watch(self, wake: Callable[[], None]) -> bool:
        return False  # S3 has no change notifications here: polling only

    def close(self) -> None:
        pass
