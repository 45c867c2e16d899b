"""Loaded at the start of every Python process of an OLMES run (its folder leads PYTHONPATH):
`CUDA_VISIBLE_DEVICES` stays the job's (CKPT_WATCHER_PIN_CUDA). OLMES's vLLM class writes "0"
when one GPU is visible, which would point its engine at physical GPU 0; any write of another
value is refused and said once on stderr. Standard library only: any interpreter loads it."""

import os
import sys

_PINNED = os.environ.get("CKPT_WATCHER_PIN_CUDA")
_KEY = "CUDA_VISIBLE_DEVICES"

if _PINNED is not None:
    os.environ[_KEY] = _PINNED
    _Base = type(os.environ)

    class _PinnedEnviron(_Base):  # type: ignore[misc, valid-type]
        _said = False

        def __setitem__(self, key, value):
            if key == _KEY and value != _PINNED:
                if not _PinnedEnviron._said:
                    _PinnedEnviron._said = True
                    sys.stderr.write(
                        f"ckpt-watcher: kept {_KEY}={_PINNED!r} (the job's device) where "
                        f"{value!r} was asked\n"
                    )
                return
            super().__setitem__(key, value)

        def __delitem__(self, key):
            if key == _KEY:
                return
            super().__delitem__(key)

        def popitem(self):
            # clear() pops until empty (accelerate clears the environment and restores it):
            # the pinned key is never popped, and an environment of it alone counts as empty
            for key in self:
                if key != _KEY:
                    value = self[key]
                    super().__delitem__(key)
                    return key, value
            raise KeyError("popitem(): environment is empty")

    os.environ.__class__ = _PinnedEnviron
