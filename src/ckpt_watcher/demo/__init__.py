"""`watcher demo`: a tiny model trained on CPU writes checkpoints while the watcher evaluates them.

Everything is self-built (tokenizer, model, task data): no downloads.
"""
