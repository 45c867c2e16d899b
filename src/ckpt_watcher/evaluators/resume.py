"""Resume and spread: a task's requests answered from its journal where an earlier attempt (or
another worker) answered them, the rest asked of the engine in chunks, each chunk's answers
journaled as it comes back. Chunks are claimed from the journal's queue, so workers on several
devices can evaluate one task together.

Chunks follow the backend's own order (lm-eval sorts a call's requests longest prompt first,
grouped by generation settings, and cuts them into batches), and a chunk is a whole number of
the backend's batches. So an uninterrupted task sends the engine exactly the batches one call
would have: the same numbers, with at most one chunk's work at risk. After a resume the missing
requests form other batches (as after any restart). The metrics are then computed by lm-eval's
own filters and aggregations over the complete set of responses, as for any task.

On vLLM a generation task does not go chunk by chunk through lm-eval (`answer`): lm-eval gets
the whole task in one call, as without a journal, and at its `_model_generate` the chunks are
fed to vLLM's step loop (`stream`) while the engine still has a chunk waiting behind its running
batch. Each response is journaled as the engine finishes it, the engine's batch never runs dry
between chunks, and nothing is paid per chunk but a claim and a done mark (the per-call set-up of
lm-eval and `LLM.generate` that chunked calls paid was 7-9% of a short sampled task).
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import structlog

from ckpt_watcher import journal
from ckpt_watcher.journal import JournalRef

log = structlog.get_logger("ckpt_watcher.evaluators.resume")

# A unit of work and the request it stands for: (key, request)
Unit = tuple[str, Any]
ProgressFn = Callable[[int, int, str], None]  # (units done, units in all, what a unit is)

WAIT_SECONDS = 0.5  # how often the job's own worker looks at chunks that others hold
SYNC_SECONDS = 1.0  # a streamed journal is fsynced at least this often (and at each chunk's end)
REPORT_SECONDS = 0.5  # a stream reports progress at least this often (and at each chunk's end)


class Engine(Protocol):
    """An engine fed a few requests at a time, for `TaskJournal.stream` (vLLM's step loop:
    `vllm_internals.EngineStream`)."""

    def submit(self, units: list[Unit]) -> None:
        """Add requests, each with its unit's key."""

    def pending(self) -> int:
        """Requests added and not finished."""

    def step(self) -> list[tuple[str, Any]]:
        """Run the engine one step: (key, value) of each request that finished in it."""

    def close(self) -> None:
        """Take back every request not finished."""


class Helped(Exception):  # noqa: N818 - not an error: how a helper's part of a task ends
    """A helper (a worker that joined another job's task) found nothing left to claim, or did
    every chunk there was: either way its part ends here, and the job's own worker computes the
    metrics, once, from the complete journal (a helper never does: a code-executing task would
    run the model's code twice, and the job's results would be filed twice)."""


@dataclass
class TaskJournal:
    """One task's journal, as the backend (`lm_eval_internals.ClampMixin`) uses it.

    The task's units are cut into chunks in the backend's order, the same chunks for every
    worker, and claimed one at a time from the journal's `ChunkQueue`, so any number of workers
    can evaluate the task together. The job's own worker then waits for chunks others still hold
    and reads their records; a helper (`helper`) joins only a task the job's own worker has
    begun (its journal's folder exists), and leaves when nothing is left to claim."""

    ref: JournalRef
    writer_name: str
    chunk: int  # units per chunk (a whole number of the backend's batches)
    progress: ProgressFn | None = None
    device: str = ""  # the device label this worker computes on (named in done marks)
    helper: bool = False
    resumed: int = 0  # units an interrupted attempt left in the journal, taken when the task began
    computed: int = 0  # units this worker asked of its engine
    _replay: dict[str, Any] | None = None
    _writer: journal.Writer | None = None
    _queue: journal.ChunkQueue | None = None

    @property
    def replay(self) -> dict[str, Any]:
        if self._replay is None:
            self._replay = journal.read(self.ref).values
        return self._replay

    @property
    def queue(self) -> journal.ChunkQueue:
        if self._queue is None:
            self._queue = journal.ChunkQueue(self.ref, journal.Holder.me(self.device))
        return self._queue

    def devices(self) -> list[str]:
        """The devices that computed this task's units (done marks, and this worker's own)."""
        found = set(self.queue.devices())
        if self.computed:
            found.add(self.device)
        return sorted(found)

    def answer(
        self,
        units: Sequence[Unit],
        order: Callable[[Any], Any],
        compute: Callable[[list[Any]], list[Any]],
        unit: str,
        decode: Callable[[Any], Any] = lambda v: v,
    ) -> list[Any]:
        """One value per unit, in the units' order: from the journal, or computed by `compute`
        (a list of requests -> their values, in order) one claimed chunk at a time, chunks
        taken in `order`. `unit` names a unit for progress ("responses", "requests")."""
        ranked = sorted(range(len(units)), key=lambda i: (order(units[i][1]), i))
        chunks = [ranked[s : s + self.chunk] for s in range(0, len(ranked), self.chunk)]
        names = [_chunk_name(n, [units[i][0] for i in c]) for n, c in enumerate(chunks)]
        out: list[Any] = [None] * len(units)
        filled = [False] * len(units)
        fill = _filler(units, out, filled, decode)
        # bookkeeping stays linear in chunks: units done are counted as they come, and the
        # chunks others finished are looked up only when progress is due (at most every
        # REPORT_SECONDS, and once a pass is over), never after every chunk
        done = 0
        last_report = 0.0

        def open_chunks(among: Iterable[int]) -> list[int]:
            return [c for c in among if not all(filled[i] for i in chunks[c])]

        def report(todo: Sequence[int]) -> None:
            nonlocal last_report
            last_report = time.monotonic()
            marked = self.queue.done_names()  # one listing, not a look per chunk
            elsewhere = sum(
                sum(not filled[i] for i in chunks[c]) for c in todo if names[c] in marked
            )
            self._report(done + elsewhere, len(units), unit)

        self._await_begun()
        done = self._replayed(fill(self.replay), chunks, names)
        todo = open_chunks(range(len(chunks)))
        report(todo)
        synced = time.monotonic()
        while todo:
            waiting = []
            for n, c in enumerate(todo):
                if not self.queue.claim(names[c]):
                    waiting.append(c)  # done or held by another worker
                    continue
                part = [i for i in chunks[c] if not filled[i]]
                try:
                    values = compute([units[i][1] for i in part])
                    records = ((units[i][0], v) for i, v in zip(part, values, strict=True))
                    self.writer.append(records, sync=False)
                    if time.monotonic() - synced >= SYNC_SECONDS:
                        self.writer.sync()
                        synced = time.monotonic()
                    self.queue.done(names[c])
                except BaseException:
                    self.queue.release(names[c])  # whatever failed, the chunk is free again
                    raise
                for i, v in zip(part, values, strict=True):
                    out[i], filled[i] = v, True
                self.computed += len(part)
                done += len(part)
                if self.progress and time.monotonic() - last_report >= REPORT_SECONDS:
                    report(waiting + todo[n + 1 :])
            if self._writer is not None:
                self._writer.sync()
            report(waiting)  # where the pass left the task
            if not waiting:
                break
            if self.helper:
                raise Helped(f"{self.ref.identity.get('task')}: no chunk left to claim")
            todo = self._wait_for(waiting, names, fill, open_chunks)
            done = sum(filled)
            report(todo)
        if self.helper:  # every chunk was this helper's: the job's own worker scores them
            raise Helped(f"{self.ref.identity.get('task')}: every chunk journaled")
        return out

    def stream(
        self,
        units: Sequence[Unit],
        engine: Engine,
        unit: str,
        decode: Callable[[Any], Any] = lambda v: v,
    ) -> list[Any]:
        """One value per unit, in the units' order (the backend's own order, as one call would
        send them): from the journal, or from `engine`'s step loop. Claimed chunks are fed to
        the engine while it still has a chunk's worth of requests waiting behind its running
        batch, so its batch never runs dry between chunks and it schedules them as one call
        would; each value is journaled as the engine finishes it (flushed at once, fsynced at
        least every `SYNC_SECONDS`), and a chunk is marked done once all its values are durable.
        A journaled value that `decode` turns into None is computed again."""
        chunks = [
            list(range(s, min(s + self.chunk, len(units))))
            for s in range(0, len(units), self.chunk)
        ]
        names = [_chunk_name(n, [units[i][0] for i in c]) for n, c in enumerate(chunks)]
        chunk_of = {i: c for c, members in enumerate(chunks) for i in members}
        at = {key: i for i, (key, _) in enumerate(units)}
        out: list[Any] = [None] * len(units)
        filled = [False] * len(units)
        fill = _filler(units, out, filled, decode)

        def open_chunks(among: Iterable[int]) -> list[int]:
            return [c for c in among if not all(filled[i] for i in chunks[c])]

        self._await_begun()
        self._replayed(fill(self.replay), chunks, names)
        todo = open_chunks(range(len(chunks)))
        waiting: list[int] = []  # done or held by other workers
        mine: dict[int, set[int]] = {}  # claimed chunks: their units still in the engine
        synced = reported = time.monotonic()
        self._report(sum(filled), len(units), unit)
        try:
            while True:
                while todo and engine.pending() < 2 * self.chunk:
                    c = todo.pop(0)
                    if not self.queue.claim(names[c]):
                        waiting.append(c)
                        continue
                    part = [i for i in chunks[c] if not filled[i]]
                    engine.submit([units[i] for i in part])
                    mine[c] = set(part)
                if not mine:
                    if not waiting:
                        break
                    if self.helper:
                        raise Helped(f"{self.ref.identity.get('task')}: no chunk left to claim")
                    todo, waiting = self._wait_for(waiting, names, fill, open_chunks), []
                    self._report(sum(filled), len(units), unit)
                    continue
                finished = engine.step()
                if not finished:
                    continue
                self.writer.append(finished, sync=False)
                for key, value in finished:
                    i = at[key]
                    out[i], filled[i] = decode(value), True
                    mine[chunk_of[i]].discard(i)
                self.computed += len(finished)
                complete = [c for c, left in mine.items() if not left]
                now = time.monotonic()
                if complete or now - synced >= SYNC_SECONDS:
                    self.writer.sync()
                    synced = now
                for c in complete:
                    self.queue.done(names[c])
                    del mine[c]
                if complete or now - reported >= REPORT_SECONDS:
                    self._report(sum(filled), len(units), unit)
                    reported = now
        finally:
            engine.close()  # requests of a failed or interrupted stream leave the engine
            for c in mine:
                self.queue.release(names[c])
        if self.helper:  # every chunk was this helper's: the job's own worker scores them
            raise Helped(f"{self.ref.identity.get('task')}: every chunk journaled")
        return out

    def _await_begun(self) -> None:
        """A helper joins a task only once the job's own worker has begun it (made its
        journal's folder): it never runs a task that worker has not reached. It waits; the
        daemon stops it when the job ends or a queued job needs its device."""
        if not self.helper:
            return
        folder = Path(self.ref.folder)
        while not folder.is_dir():
            time.sleep(WAIT_SECONDS)

    def _replayed(self, found: int, chunks: list[list[int]], names: list[str]) -> int:
        """`found` units came from the journal as the task began: count those an interrupted
        attempt left (what helpers of this attempt computed before this worker began was not
        interrupted), and make the journal's folder for the job's own worker. Returns `found`."""
        if found:
            log.info("journal.replayed", task=self.ref.identity.get("task"), units=found)
            others = self.queue.done_alongside()
            alongside = sum(len(chunks[c]) for c, n in enumerate(names) if n in others)
            self.resumed += max(0, found - alongside)
        if not self.helper:  # helpers only join a journal the job's own worker has
            Path(self.ref.folder).mkdir(parents=True, exist_ok=True)
        return found

    def _wait_for(
        self,
        waiting: list[int],
        names: list[str],
        fill: Callable[[dict[str, Any]], int],
        open_chunks: Callable[[Iterable[int]], list[int]],
    ) -> list[int]:
        """Chunks other workers hold: wait a moment, read what they journaled, and give back
        the open ones (a dead holder's chunk is then claimed again; a done mark whose records
        are not in the journal, a torn write, is dropped so that its chunk is computed again)."""
        time.sleep(WAIT_SECONDS)
        done = [c for c in waiting if self.queue.is_done(names[c])]
        if done:
            fill(journal.read(self.ref).values)
            for c in open_chunks(done):
                log.warning("journal.done_without_records", chunk=names[c])
                self.queue.undo(names[c])
        return open_chunks(waiting)

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


def _filler(
    units: Sequence[Unit], out: list[Any], filled: list[bool], decode: Callable[[Any], Any]
) -> Callable[[dict[str, Any]], int]:
    """`fill(values)`: the units not yet filled whose keys `values` has, decoded into `out`
    (a value `decode` turns into None stays unfilled, to be computed); how many it filled."""

    def fill(values: dict[str, Any]) -> int:
        n = 0
        for i, (key, _) in enumerate(units):
            if not filled[i] and key in values:
                value = decode(values[key])
                if value is not None:
                    out[i], filled[i] = value, True
                    n += 1
        return n

    return fill


def _chunk_name(n: int, keys: list[str]) -> str:
    """A chunk's name in the queue: its place and a digest of its units (workers that somehow
    cut different chunks never mistake one for another)."""
    return f"{n:05d}-{hashlib.sha256(''.join(keys).encode()).hexdigest()[:12]}"
