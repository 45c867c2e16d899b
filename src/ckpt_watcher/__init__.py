"""ckpt-watcher: evaluate LLM checkpoints while they train."""

__version__ = "0.1.0"
