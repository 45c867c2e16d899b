"""Resume: a task's requests answered from its journal where an earlier attempt answered them,
the rest asked of the engine in chunks, each chunk's answers journaled as it comes back.

Chunks follow the backend's own order (lm-eval sorts a call's requests longest prompt first,
grouped by generation settings, and cuts them into batches), and a chunk is a whole number of
the backend's batches. So an uninterrupted task sends the engine exactly the batches one call
would have: the same numbers, with at most one chunk's work at risk. After a resume the missing
requests form other batches (as after any restart). The metrics are then computed by lm-eval's
own filters and aggregations over the complete set of responses, as for any task.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import structlog

from ckpt_watcher import journal
from ckpt_watcher.journal import JournalRef

log = structlog.get_logger("ckpt_watcher.evaluators.resume")

# A unit of work and the request it stands for: (key, request)
Unit = tuple[str, Any]
ProgressFn = Callable[[int, int, str], None]  # (units done, units in all, what a unit is)


@dataclass
class TaskJournal:
    """One task's journal, as the backend (`lm_eval_internals.ClampMixin`) uses it."""

    ref: JournalRef
    writer_name: str
    chunk: int  # units per chunk (a whole number of the backend's batches)
    progress: ProgressFn | None = None
    resumed: int = 0  # units taken from the journal
    computed: int = 0  # units asked of the engine
    _replay: dict[str, Any] | None = None
    _writer: journal.Writer | None = None

    @property
    def replay(self) -> dict[str, Any]:
        if self._replay is None:
            self._replay = journal.read(self.ref).values
        return self._replay

    def answer(
        self,
        units: Sequence[Unit],
        order: Callable[[Any], Any],
        compute: Callable[[list[Any]], list[Any]],
        unit: str,
        decode: Callable[[Any], Any] = lambda v: v,
    ) -> list[Any]:
        """One value per unit, in the units' order: from the journal, or computed by `compute`
        (a list of requests -> their values, in order) in chunks taken in `order`. `unit`
        names a unit for progress ("responses", "requests")."""
        out: list[Any] = [None] * len(units)
        missing = []
        for i, (key, _) in enumerate(units):
            if key in self.replay:
                out[i] = decode(self.replay[key])
            else:
                missing.append(i)
        found = len(units) - len(missing)
        self.resumed += found
        if found:
            log.info("journal.replayed", task=self.ref.identity.get("task"), units=found)
        missing.sort(key=lambda i: order(units[i][1]))
        done = found
        self._report(done, len(units), unit)
        for start in range(0, len(missing), self.chunk):
            part = missing[start : start + self.chunk]
            values = compute([units[i][1] for i in part])
            self.writer.append((units[i][0], v) for i, v in zip(part, values, strict=True))
            for i, v in zip(part, values, strict=True):
                out[i] = v
            self.computed += len(part)
            done += len(part)
            self._report(done, len(units), unit)
        return out

    @property
    def writer(self) -> journal.Writer:
        if self._writer is None:
            self._writer = journal.Writer(self.ref, self.writer_name)
        return self._writer

    def _report(self, done: int, total: int, unit: str) -> None:
        if self.progress is not None:
            self.progress(done, total, unit)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None
