"""Stage an S3 checkpoint into the local cache: only what an eval needs, verified, then fixed.

Fetched: config, generation config, tokenizer files, the index and the safetensors weights (or,
with no safetensors, `pytorch_model*.bin`); for a trainer's own format (checkpoints/layouts.py)
its model shards and metadata. Never optimizer states, RNG states or DCP shards.
Each file is downloaded with boto3's transfer manager (parallel ranged parts), to a temporary
name, checked (size, and for safetensors the header's expected size), then renamed into place.
The naming fix is applied to the staged copy. Runs inside the worker process, and on the daemon's
hold lane as soon as a checkpoint is due (`S3Source.hold`), so a prefix deleted before its eval
costs nothing.

The staged copy holds exactly the objects the checkpoint was judged with: given the write mark
it was judged with, the listing must match it, each object fetched must still have the listed
ETag once it is down, and a file kept from an earlier staging is kept only if its
ETag (in `.fetched.json`) is the listed one. Anything else is `CheckpointChanged`: the daemon
judges the checkpoint again, and nothing reads a mix of two versions.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import time
from functools import partial
from pathlib import Path
from typing import Any
from urllib.parse import quote

import structlog

from ckpt_watcher.checkpoints.files import (
    ADAPTER_CONFIG,
    LocalFiles,
    check_unchanged,
    comparable,
    eval_mark,
    needed_files,
)
from ckpt_watcher.checkpoints.namefix import apply_fix
from ckpt_watcher.checkpoints.safetensors_header import read_header
from ckpt_watcher.durable import write_json_atomic
from ckpt_watcher.errors import CheckpointChanged, HeaderUnreadable, StagingError
from ckpt_watcher.formats.torchzip import EOCD_SIZE, zip_whole
from ckpt_watcher.s3client import DEFAULT_REQUEST_TIMEOUT, Retry, S3Files, make_client, split_uri

log = structlog.get_logger("ckpt_watcher.sources.staging")

LAST_USED = ".last_used"
MANIFEST = ".fetched.json"  # the objects the staged files were fetched from (`_manifest`)


def _safe_part(part: str, location: str) -> str:
    if part in ("", ".", "..") or "\0" in part:
        raise StagingError(f"{location}: key component {part!r} cannot be a local path component")
    # percent-encode anything unusual: the local name is plain, and two keys never collide
    return quote(part, safe="-_.+=@,")


def staged_path(cache_dir: Path, location: str) -> Path:
    """Where `s3://bucket/key/` is staged: always strictly inside `cache_dir`."""
    bucket, key = split_uri(location)
    parts = [bucket, *key.rstrip("/").split("/")]
    path = cache_dir.joinpath(*(_safe_part(p, location) for p in parts))
    root = cache_dir.resolve()
    if not path.resolve().is_relative_to(root) or path.resolve() == root:
        raise StagingError(f"{location}: would be staged outside the cache folder {cache_dir}")
    return path


def stage(
    location: str,
    cache_dir: Path,
    endpoint_url: str | None = None,
    client: Any = None,
    retry: Retry | None = None,
    request_timeout: float = DEFAULT_REQUEST_TIMEOUT,
    write_mark: str | None = None,
) -> Path:
    """Download what an eval of `location` needs into the cache; returns the local folder.
    With `write_mark` (the S3 write mark the checkpoint was judged with), raises
    CheckpointChanged unless what is staged is exactly those objects."""
    dest = staged_path(cache_dir, location)
    if comparable(write_mark) and is_staged(cache_dir, location, write_mark):
        # held when it was due (S3Source.hold), of exactly the objects judged: the eval reads
        # it, whatever the prefix holds now (a keep-last-k may be deleting it object by object)
        (dest / LAST_USED).touch()
        return dest
    client = client or make_client(endpoint_url, request_timeout)
    retry = retry or Retry()
    bucket, key = split_uri(location)
    view = S3Files(client, retry, bucket, key)
    names = needed_files(view.files)
    if not any(n.rpartition("/")[2] in ("config.json", ADAPTER_CONFIG) for n in names):
        if is_staged(cache_dir, location):  # held when it was due (S3Source.hold); gone since
            log.info("staging.prefix_gone_copy_held", location=location, path=str(dest))
            held = _manifest(dest).get("mark")
            if comparable(write_mark) and comparable(held) and held != write_mark:
                raise CheckpointChanged(f"{location}: the copy held is of other objects")
            return dest
        raise StagingError(f"{location}: no config.json (nor {ADAPTER_CONFIG}) under this prefix")
    check_unchanged(view, write_mark, location)
    dest.mkdir(parents=True, exist_ok=True)
    # workers of one checkpoint on several devices (a split job, a helper) stage it one at a
    # time: the second finds every file in place, checked, and names already fixed
    with open(_lock_path(dest), "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        return _stage_into(dest, location, client, retry, view, names)


def _stage_into(
    dest: Path, location: str, client: Any, retry: Retry, view: S3Files, names: list[str]
) -> Path:
    from boto3.s3.transfer import TransferConfig

    bucket, key = split_uri(location)
    transfer = TransferConfig(
        multipart_threshold=64 << 20, multipart_chunksize=64 << 20, max_concurrency=8
    )
    started = time.monotonic()
    fetched = 0
    etags: dict[str, str] = _manifest(dest).get("etags") or {}
    for name in names:
        _safe_part(name, location)
        size = view.files[name]
        target = dest / name
        etag = view.etag(name)
        kept = target.is_file() and target.stat().st_size == size and etags.get(name) == etag
        if kept and _verified(dest, name, size):
            continue  # staged before, from this very object (a retry of the same job)
        target.parent.mkdir(parents=True, exist_ok=True)  # a native format's folders
        tmp = target.with_name(f".{target.name}.part")
        retry(
            partial(_fetch, client, bucket, key + name, tmp, etag, transfer, location),
            f"{location}{name}",
        )
        got = tmp.stat().st_size
        if got != size:
            tmp.unlink(missing_ok=True)
            raise OSError(f"{location}{name}: downloaded {got} bytes, the listing said {size}")
        os.replace(tmp, target)
        if not _verified(dest, name, size):
            target.unlink(missing_ok=True)
            raise OSError(f"{location}{name}: not whole (its header or end record is amiss)")
        etags[name] = etag
        write_json_atomic(dest / MANIFEST, {"etags": etags})
        fetched += size
    # and of the whole copy, for one held after its prefix went
    write_json_atomic(dest / MANIFEST, {"etags": etags, "mark": eval_mark(view)})
    for action in apply_fix(dest):
        log.info("staging.names_fixed", location=location, action=action.describe())
    (dest / LAST_USED).touch()
    log.info(
        "staging.done",
        location=location,
        path=str(dest),
        files=len(names),
        bytes=fetched,
        seconds=round(time.monotonic() - started, 2),
    )
    return dest


def _fetch(
    client: Any, bucket: str, key: str, tmp: Path, etag: str, transfer: Any, location: str
) -> None:
    """Download one object, and make sure it was still the listed one (its ETag) once it is
    down: one that changed meanwhile may have given a mix of both versions."""
    client.download_file(bucket, key, str(tmp), Config=transfer)
    if etag and client.head_object(Bucket=bucket, Key=key).get("ETag", etag) != etag:
        tmp.unlink(missing_ok=True)
        raise CheckpointChanged(
            f"{location}{key.rsplit('/', 1)[-1]}: rewritten while it was staged"
        )


def _manifest(dest: Path) -> dict[str, Any]:
    """What the staged copy was fetched from: `etags` (name -> ETag) and, once complete, the
    `mark` of the objects (an empty dict for a copy staged by an earlier version)."""
    try:
        data = json.loads((dest / MANIFEST).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}


def is_staged(cache_dir: Path, location: str, write_mark: str | None = None) -> bool:
    """A complete staged copy of `location` is in the cache (its last step marks it); with
    `write_mark`, a copy of exactly the objects judged with that mark."""
    dest = staged_path(cache_dir, location)
    if not (dest / LAST_USED).is_file():
        return False
    return not comparable(write_mark) or _manifest(dest).get("mark") == write_mark


def _verified(folder: Path, name: str, size: int) -> bool:
    if name.endswith(".pt"):  # a trainer's shard (formats/): torch.save's zip ends whole
        with open(folder / name, "rb") as f:
            f.seek(max(0, size - EOCD_SIZE))
            return zip_whole(f.read(EOCD_SIZE))
    if not name.endswith(".safetensors"):
        return True
    try:
        return read_header(LocalFiles(folder), name).expected_size == size
    except (HeaderUnreadable, OSError):
        return False


def evict(cache_dir: Path, max_bytes: int, keep: set[Path]) -> list[Path]:
    """Remove least recently used staged copies until the cache holds at most `max_bytes`;
    copies in `keep` (needed by queued or running jobs) are never removed. Returns what went."""
    staged = []
    for marker in cache_dir.rglob(LAST_USED):
        folder = marker.parent
        try:
            size = sum(p.stat().st_size for p in folder.iterdir() if p.is_file())
            staged.append((marker.stat().st_mtime, folder, size))
        except OSError:  # removed meanwhile (its release; another host's evict, under Ray)
            continue
    total = sum(s for _, _, s in staged)
    removed = []
    for _, folder, size in sorted(staged, key=lambda t: t[0]):
        if total <= max_bytes:
            break
        if folder in keep:
            continue
        shutil.rmtree(folder, ignore_errors=True)
        total -= size
        removed.append(folder)
        log.info("staging.evicted", path=str(folder), bytes=size)
    return removed


def remove_staged(cache_dir: Path, location: str) -> None:
    """Delete a staged copy (after its job ended)."""
    dest = staged_path(cache_dir, location)
    try:
        shutil.rmtree(dest)
    except FileNotFoundError:
        pass
    _lock_path(dest).unlink(missing_ok=True)


def _lock_path(dest: Path) -> Path:
    """Beside a staged copy: held by whoever stages it (one stager at a time)."""
    return dest.parent / f".{dest.name}.lock"
