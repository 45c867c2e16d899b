"""Where checkpoints appear: each source lists its tree into a snapshot; the daemon diffs them."""

from ckpt_watcher.sources.base import Found, Source, diff

__all__ = ["Found", "Source", "diff"]
