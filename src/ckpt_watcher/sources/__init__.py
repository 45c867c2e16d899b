"""Where checkpoints appear: each source lists its tree into a snapshot; discovery diffs them."""

from __future__ import annotations

from ckpt_watcher.config import LocalSource as LocalSourceConfig
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.sources.base import Found, Source, diff

__all__ = ["Found", "Source", "build_sources", "diff"]


def build_sources(cfg: WatcherConfig) -> list[Source]:
    """One Source per `sources:` entry, in config order."""
    from ckpt_watcher.sources.local import LocalSource
    from ckpt_watcher.sources.s3 import S3Source

    out: list[Source] = []
    for s in cfg.sources:
        if isinstance(s, LocalSourceConfig):
            out.append(
                LocalSource(
                    s.path, s.poll_seconds, s.max_depth, s.inotify, fingerprint=s.fingerprint
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
                )
            )
    return out
