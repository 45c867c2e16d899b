"""Where checkpoints appear: each source lists its tree into a snapshot; discovery diffs them."""

from __future__ import annotations

from pathlib import Path

from ckpt_watcher.config import LocalSource as LocalSourceConfig
from ckpt_watcher.config import S3Source as S3SourceConfig
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.sources.base import Found, Source, diff

__all__ = ["Found", "Source", "baseline_source", "build_sources", "diff"]


def build_sources(cfg: WatcherConfig) -> list[Source]:
    """One Source per `sources:` entry, in config order."""
    from ckpt_watcher.sources.local import LocalSource
    from ckpt_watcher.sources.s3 import S3Source

    out: list[Source] = []
    for s in cfg.sources:
        if isinstance(s, LocalSourceConfig):
            out.append(
                LocalSource(
                    s.path,
                    s.poll_seconds,
                    s.max_depth,
                    s.inotify,
                    fingerprint=s.fingerprint,
                    adapter_base=s.adapter_base,
                    convert=s.convert,
                )
            )
        else:
            out.append(
                S3Source(
                    s.uri,
                    s.poll_seconds,
                    s.endpoint_url,
                    cache_dir=s.cache_dir,
                    keep_staged=s.keep_staged,
                    cache_max_gb=s.cache_max_gb,
                    request_timeout=s.request_timeout_seconds,
                    fingerprint=s.fingerprint,
                    adapter_base=s.adapter_base,
                    convert=s.convert,
                )
            )
    if cfg.baseline is not None and cfg.baseline.checkpoint is not None:
        out.append(baseline_source(cfg))
    return out


def baseline_source(cfg: WatcherConfig) -> Source:
    """`baseline.checkpoint` as a source of that one checkpoint; S3 settings from a source on
    the same bucket, with a cache folder of its own."""
    from ckpt_watcher.s3client import split_uri
    from ckpt_watcher.sources.baseline import BaselineSource
    from ckpt_watcher.sources.local import LocalSource
    from ckpt_watcher.sources.s3 import S3Source

    assert cfg.baseline is not None and cfg.baseline.checkpoint is not None
    where = cfg.baseline.checkpoint
    if not where.startswith("s3://"):
        path = Path(where)
        return BaselineSource(
            LocalSource(path.parent, poll_seconds=300, inotify=False), where, path
        )
    bucket, prefix = split_uri(where)
    parent = prefix.rstrip("/").rpartition("/")[0]
    same = [
        s for s in cfg.sources if isinstance(s, S3SourceConfig) and split_uri(s.uri)[0] == bucket
    ]
    endpoint = cfg.baseline.endpoint_url or (same[0].endpoint_url if same else None)
    inner = S3Source(
        f"s3://{bucket}/{parent}/" if parent else f"s3://{bucket}/",
        poll_seconds=300,
        endpoint_url=endpoint,
        cache_dir=cfg.state_dir / "baseline-cache",
        request_timeout=same[0].request_timeout_seconds if same else 30.0,
        fingerprint=same[0].fingerprint if same else "sampled",
    )
    return BaselineSource(inner, where, None)
