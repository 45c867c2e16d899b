"""Discovery: each source's scans and checks on its own lane; their results applied to the state.

A scan runs on the source's lane (thread): list the tree, then judge completeness of every
checkpoint that is new or still waiting, and apply the naming fix to those now ready. The loop
only submits scans and applies finished ones (SQLite writes stay on the loop's thread), so a
source that hangs or fails delays only itself:

- a scan that fails (after its bounded retries) marks the source `unreachable since T: why`;
- a scan with no answer for `unanswered_after(source)` seconds marks it so while it runs on;
- the next scan that succeeds clears it: the source resumes without a restart.

Checkpoint life cycle handled here: seen -> incomplete | invalid | unrecognised -> ready;
missed when a checkpoint not yet evaluated disappears.

Readiness (`checkpoints/completeness.py`): everything an eval reads is there, whole, and has
not changed for `settle_seconds` across two looks. A look that finds a checkpoint settling asks
its source to look again when the window ends (`_Watched.recheck_at`), so the common case costs
the settle time and a listing, not a poll interval; inotify wakes a look at every file closed.

Identity: a checkpoint judged ready gets its content fingerprint (`checkpoints/fingerprint.py`)
and its write mark over the files an eval reads (names, sizes, mtimes or ETags). Scans re-read
the write mark of evaluated checkpoints (all of them for a local source, `recheck_per_scan` in
turn for S3); one that moved goes back to `incomplete` and is judged again, and a new
fingerprint then makes it a new version: `rewritten`, evaluated again. A trainer's files an eval
does not read (optimizer states, logs, markers), and the watcher's own pins, are no change.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import structlog

from ckpt_watcher import formats
from ckpt_watcher.checkpoints import adapter, completeness
from ckpt_watcher.checkpoints.completeness import DEFAULT_SETTLE_SECONDS, Completeness
from ckpt_watcher.checkpoints.files import (
    MARK_VERSION,
    CheckpointFiles,
    LocalFiles,
    check_unchanged,
    eval_mark,
)
from ckpt_watcher.checkpoints.fingerprint import fingerprint
from ckpt_watcher.checkpoints.layouts import native_layout
from ckpt_watcher.checkpoints.naming import checkpoint_folder
from ckpt_watcher.errors import AdapterError, CheckpointChanged, NamingFixError, WatcherError
from ckpt_watcher.jobfolder import Stage
from ckpt_watcher.lane import Lane
from ckpt_watcher.sources.base import Found, Source, diff
from ckpt_watcher.state import CheckpointRow, State
from ckpt_watcher.timestamps import iso

log = structlog.get_logger("ckpt_watcher.discovery")

# Checkpoint states that a fresh scan re-examines (the writer may still change them).
RECHECK = ("incomplete", "invalid")
# States in which a vanished checkpoint counts as missed (it was never evaluated).
MISSABLE = ("incomplete", "invalid", "ready", "planned")
# Evaluated states whose files scans re-examine for a rewrite in place.
EVALUATED = ("done", "failed")
# ... and a checkpoint whose jobs wait: rewritten before any of them starts, it is judged again
LOOKED_AGAIN = (*EVALUATED, "planned")
# States of a checkpoint judged ready: its step's model stays where it was judged (a failed
# evaluation gives way to the step's other model folder, if it has one)
JUDGED_READY = ("ready", "planned", "done")
REWRITE_CHECK = "files changed after it was evaluated: checking the content again"
# the event logged when a checkpoint is judged into each state (completeness.check's verdicts)
JUDGED_EVENTS = {
    "ready": "checkpoint.ready",
    "incomplete": "checkpoint.incomplete",
    "invalid": "checkpoint.invalid",
}


def unanswered_after(source: Source) -> float:
    """How long a scan may run before its source is shown unreachable (it may still answer)."""
    timeout = getattr(source, "request_timeout", 30.0)
    return max(10.0, 2 * timeout)


@dataclass(frozen=True)
class Judged:
    """A completeness verdict from the lane, and what the naming fix did for a ready one."""

    verdict: Completeness
    observed_at: float = 0.0  # when the look's listing was done: its files were so from then
    fixes: list[str] = field(default_factory=list)
    fix_failed: bool = False
    write_mark: str = ""  # of a ready checkpoint, after the naming fix
    fingerprint: str | None = None  # of a ready checkpoint
    last_write: float | None = None  # of a ready checkpoint: its newest file's mtime


@dataclass(frozen=True)
class Remark:
    """An evaluated checkpoint looked at again: its write mark now, whether that moved, and
    (for one evaluated before fingerprints existed) its fingerprint."""

    write_mark: str
    changed: bool
    fingerprint: str | None = None


@dataclass(frozen=True)
class ScanResult:
    found: list[Found]
    judged: dict[str, Judged]
    watching: bool
    remarks: dict[str, Remark] = field(default_factory=dict)


@dataclass
class _Watched:
    """One source and its lane, as the loop sees them."""

    source: Source
    lane: Lane
    hold_lane: Lane  # holds due checkpoints (S3: staging) without delaying the scans
    snapshot: dict[str, Found] = field(default_factory=dict)
    next_scan: float = 0.0
    woken: bool = False
    watching: bool = False
    scan: Future[ScanResult] | None = None
    scan_started: float = 0.0
    scan_started_mono: float = 0.0
    recheck_at: float | None = None  # a checkpoint settling: look again then, poll or not
    marked_unanswered: bool = False
    rechecked: dict[str, float] = field(default_factory=dict)  # location -> last looked at


class Discovery:
    def __init__(
        self,
        sources: list[Source],
        state: State,
        stable_seconds: float,
        wake: Callable[[], None],
        on_ready: Callable[[float], None] | None = None,
        pin_of: Callable[[str], str | None] = lambda location: None,
        *,
        settle_seconds: float = DEFAULT_SETTLE_SECONDS,
        tokenizer_required: bool = True,
        clock: Callable[[], float] = time.time,
    ) -> None:
        """`clock` times the looks at a checkpoint (on the sources' lanes): the daemon's."""
        self.state = state
        self.stable_seconds = stable_seconds
        self.settle_seconds = settle_seconds
        self.tokenizer_required = tokenizer_required
        self.clock = clock
        self._wake = wake
        self._on_ready = on_ready  # seconds from a checkpoint's last write to judging it ready
        self._pin_of = pin_of  # its pinned copy (pins.py): a delete is no loss
        self.on_held_deleted: Callable[[], None] = lambda: None
        self._said_held: dict[str, str] = {}  # location -> its files' mark when last said changed
        self.watched = [
            _Watched(s, Lane(f"source-{i}", wake), Lane(f"hold-{i}", wake))
            for i, s in enumerate(sources)
        ]

    # --- which source holds a location -----------------------------------------------------
    def source_named(self, name: str) -> Source | None:
        return next((w.source for w in self.watched if w.source.name == name), None)

    def _lane_of(self, name: str) -> _Watched | None:
        return next((w for w in self.watched if w.source.name == name), None)

    def stage_spec(self, source_name: str, location: str) -> Stage | None:
        src = self.source_named(source_name)
        return src.stage_spec(location) if src is not None else None

    def adapter_base(self, source_name: str) -> str | None:
        """The base model its source's LoRA/PEFT adapters are merged into, if configured."""
        src = self.source_named(source_name)
        base = src.adapter_base if src is not None else None
        return str(base) if base is not None else None

    def convert(self, source_name: str) -> list[str] | None:
        """Its source's converter, for the formats only a trainer's converter reads."""
        src = self.source_named(source_name)
        return src.convert if src is not None else None

    def exists(self, source_name: str, location: str) -> Future[bool] | None:
        """Ask (on the source's lane) whether a checkpoint is still there; None if its source
        left the config."""
        w = self._lane_of(source_name)
        if w is None:
            return None
        return w.lane.submit(functools.partial(w.source.exists, location))

    def hold(self, source_name: str, location: str) -> None:
        """`location` is due: its source holds what the eval reads (S3: stages it), on a lane
        of its own so that a long download never delays the source's scans."""
        w = self._lane_of(source_name)
        if w is not None:
            w.hold_lane.submit(_logged("source.hold_failed", w.source.hold, location))

    def held(self, source_name: str, location: str, write_mark: str | None = None) -> bool:
        """A complete copy of what the eval reads is held (a delete at the source costs
        nothing): pinned (a local checkpoint, pins.py), or staged by its source (S3). With
        `write_mark`: a copy of exactly the files judged with that mark."""
        pin = self._pin_of(location)
        if pin is not None:
            try:
                check_unchanged(LocalFiles(Path(pin)), write_mark, location)
                return True
            except (CheckpointChanged, OSError):  # written through its links, in place
                return False
        src = self.source_named(source_name)
        return src is not None and src.held(location, write_mark)

    def release(self, source_name: str, location: str) -> None:
        """A checkpoint's jobs ended: the source may drop what it staged (on its lane)."""
        w = self._lane_of(source_name)
        if w is not None:
            w.lane.submit(_logged("source.release_failed", w.source.release, location))

    def look_again(self, source_name: str, location: str, now: float, why: str) -> None:
        """A ready checkpoint whose files changed before anything read them (a pin found
        them other than judged): judged again from scratch, at its source's next tick."""
        self.state.upsert_checkpoint(
            location, source_name, now, state="incomplete", reason=why, fingerprint=None
        )
        log.warning("checkpoint.changed_before_eval", location=location, reason=why)
        w = self._lane_of(source_name)
        if w is not None:
            w.recheck_at = now

    def make_room(self, needed: dict[str, list[str]]) -> None:
        """Before jobs start: each source keeps its cache in bounds, sparing its own `needed`
        locations (source name -> locations of its queued and running jobs)."""
        for name, locations in needed.items():
            w = self._lane_of(name)
            if w is not None:
                w.lane.submit(_logged("source.make_room_failed", w.source.make_room, locations))

    # --- the loop's part -------------------------------------------------------------------
    def tick(self, now: float, *, force: bool = False, polls: bool = True) -> None:
        """Apply finished scans, flag unanswered ones, and start the scans due: forced ones,
        looks again at settling checkpoints, and (if `polls`) polls and inotify wake-ups."""
        for w in self.watched:
            if w.scan is not None:
                if w.scan.done():
                    self._finish(w, now)
                else:
                    self._flag_unanswered(w, now)
            if w.scan is not None:
                continue
            settle_due = w.recheck_at is not None and now >= w.recheck_at
            if force or settle_due or (polls and (w.woken or now >= w.next_scan)):
                self._start(w, now)

    def scanning(self) -> bool:
        return any(w.scan is not None for w in self.watched)

    def settling(self) -> bool:
        """Some checkpoint waits for its settle window, and will be looked at again."""
        return any(w.recheck_at is not None for w in self.watched)

    def next_deadline(self, polls: bool = True) -> float | None:
        idle = [w for w in self.watched if w.scan is None]
        times = [w.recheck_at for w in idle if w.recheck_at is not None]
        if polls:
            times += [w.next_scan for w in idle]
        return min(times) if times else None

    def close(self) -> None:
        for w in self.watched:
            w.lane.close()
            w.hold_lane.close()
            try:
                w.source.close()
            except Exception as e:  # closing must never stop the shutdown
                log.warning("source.close_failed", source=w.source.name, error=str(e))

    def _start(self, w: _Watched, now: float) -> None:
        name = w.source.name
        rows = self.state.checkpoints(source=name)
        settled = {r.location for r in rows if r.state not in (*RECHECK, "missed")}
        recheck = {
            r.location: (r.write_mark, r.unchanged_since) for r in rows if r.state in RECHECK
        }
        evaluated = self._due_for_recheck(w, rows, now)
        w.woken = False
        w.recheck_at = None  # this look takes it; its verdicts set the next one
        w.next_scan = now + w.source.poll_seconds
        w.scan_started = now
        w.scan_started_mono = time.monotonic()
        w.marked_unanswered = False
        wake_source = functools.partial(self._wake_source, w)
        w.scan = w.lane.submit(
            functools.partial(
                self._scan, w.source, w.watching, wake_source, settled, recheck, evaluated
            )
        )

    @staticmethod
    def _due_for_recheck(
        w: _Watched, rows: list[CheckpointRow], now: float
    ) -> dict[str, tuple[str | None, bool]]:
        """Evaluated checkpoints this scan re-reads (location -> (write mark, has fingerprint)):
        all of them, or the source's `recheck_per_scan` looked at longest ago."""
        rows = [r for r in rows if r.state in LOOKED_AGAIN]
        w.rechecked = {r.location: w.rechecked.get(r.location, 0.0) for r in rows}
        rows.sort(key=lambda r: w.rechecked[r.location])
        limit = w.source.recheck_per_scan
        chosen = rows if limit is None else rows[:limit]
        for r in chosen:
            w.rechecked[r.location] = now
        return {r.location: (r.write_mark, bool(r.fingerprint)) for r in chosen}

    def _wake_source(self, w: _Watched) -> None:
        w.woken = True
        self._wake()

    def _flag_unanswered(self, w: _Watched, now: float) -> None:
        waited = time.monotonic() - w.scan_started_mono
        if w.marked_unanswered or waited < unanswered_after(w.source):
            return
        w.marked_unanswered = True
        error = f"no answer for {waited:.0f}s (the scan is still waiting)"
        self.state.mark_unreachable(w.source.name, w.scan_started, error)
        log.warning("source.unreachable", source=w.source.name, error=error)

    # --- on the source's lane: I/O only, no state ------------------------------------------
    def _scan(
        self,
        source: Source,
        watching: bool,
        wake: Callable[[], None],
        settled: set[str],
        recheck: dict[str, tuple[str | None, float | None]],
        evaluated: dict[str, tuple[str | None, bool]],
    ) -> ScanResult:
        if not watching:
            watching = source.watch(wake)
        found = source.scan()
        judged = {}
        for f in found:
            if f.ident is None or f.location in settled:
                continue
            mark, since = recheck.get(f.location, (None, None))
            j = self._judge(source, f.location, mark, since)
            if j is not None:
                judged[f.location] = j
        present = {f.location for f in found}
        remarks = {}
        for location, (mark, has_fp) in evaluated.items():
            if location in present:
                r = self._remark(source, location, mark, has_fp)
                if r is not None:
                    remarks[location] = r
                if r is not None and r.changed:  # judged now: `once` sees a rewrite in one pass
                    j = self._judge(source, location, r.write_mark, None)
                    if j is not None:
                        judged[location] = j
        return ScanResult(found, judged, watching, remarks)

    def _remark(
        self, source: Source, location: str, mark: str | None, has_fp: bool
    ) -> Remark | None:
        try:
            view = source.view(location)
            now_mark = eval_mark(view)
            if mark is None or not mark.startswith(MARK_VERSION):
                # evaluated before marks and fingerprints were kept, or marked by a version that
                # marked every file: adopt them (a rewrite since then shows in the fingerprint)
                fp = None if has_fp else _fingerprint(source, location, view)
                return Remark(now_mark, False, fp)
            return Remark(now_mark, True) if now_mark != mark else None
        except (OSError, WatcherError) as e:  # looked at again next time
            log.warning("checkpoint.recheck_failed", location=location, error=str(e))
            return None

    def _judge(
        self, source: Source, location: str, mark: str | None, since: float | None
    ) -> Judged | None:
        try:
            view = source.view(location)
            verdict = completeness.check(
                view,
                now=self.clock(),
                stable_seconds=self.stable_seconds,
                settle_seconds=self.settle_seconds,
                unchanged_since=since,
                previous_mark=mark,
                tokenizer_required=self.tokenizer_required,
                folder_name=checkpoint_folder(location).rsplit("/", 1)[-1],
                base_model=source.adapter_base,
                convert=source.convert,
                native=formats.detect(view.files),
            )
            observed = self.clock()
            if not verdict.ready:
                return Judged(verdict, observed)
            try:
                fixes = source.prepare(location)
            except NamingFixError as e:
                failed = Completeness("invalid", str(e), verdict.write_mark)
                return Judged(failed, observed, fix_failed=True)
            if fixes:  # its own links are part of the folder from now on: a fresh listing
                view = source.view(location)
            try:
                fp = _fingerprint(source, location, view)
            except AdapterError as e:  # looked at again each scan: the base may appear
                return Judged(Completeness("invalid", str(e), verdict.write_mark), observed)
            return Judged(
                verdict,
                observed,
                fixes,
                write_mark=eval_mark(view),
                fingerprint=fp,
                last_write=view.last_write(),
            )
        except (OSError, WatcherError) as e:  # unreadable now (S3 down?): judged next scan
            log.warning("checkpoint.check_failed", location=location, error=str(e))
            return None
        except (ValueError, TypeError, AttributeError, IndexError, KeyError, RecursionError) as e:
            # what its files hold is not what any reader expects: this checkpoint is invalid
            # (until it is written again), and the rest of its source is judged as usual
            log.exception("checkpoint.unreadable", location=location)
            why = f"its files cannot be read as a checkpoint ({type(e).__name__}: {e})"
            return Judged(Completeness("invalid", why[:500], mark or ""), self.clock())

    # --- back on the loop: apply a finished scan -------------------------------------------
    def _finish(self, w: _Watched, now: float) -> None:
        future, w.scan = w.scan, None
        assert future is not None
        name = w.source.name
        try:
            result = future.result()
        except (OSError, WatcherError) as e:  # one failing source never stops the others
            self._record(name, now, str(e), None)
            return
        except Exception as e:  # a bug in a source must not take the daemon down
            log.exception("source.scan_crashed", source=name)
            self._record(name, now, f"{type(e).__name__}: {e}", None)
            return
        w.watching = result.watching
        snapshot = {f.location: f for f in result.found}
        added, removed = diff(w.snapshot, snapshot)
        w.snapshot = snapshot
        for f in added:
            self._register(name, f, now)
        # a step folder whose model is now in another of its folders (verl's LoRA adapter,
        # saved after the Hugging Face folder's config): the same checkpoint, not a missed one
        moved_to = {checkpoint_folder(f.location): f.location for f in added if f.ident}
        for f in removed:
            if not self._moved(f, moved_to.get(checkpoint_folder(f.location))):
                self._forget(f, now)
        for location, remark in result.remarks.items():
            row = self.state.checkpoint(location)
            if row is not None and row.state in EVALUATED:
                self._apply_remark(row, remark, now)
            elif row is not None and row.state == "planned" and remark.changed:
                self._changed_while_queued(row, remark, now)
        for location, judged in result.judged.items():
            row = self.state.checkpoint(location)
            if row is not None and row.state in RECHECK:
                self._apply(row, judged, now)
                self._recheck_at(w, row, judged)
        self._record(name, now, None, sum(1 for f in result.found if f.ident))

    def _record(self, name: str, now: float, error: str | None, n: int | None) -> None:
        before = next((r for r in self.state.sources() if r["name"] == name), None)
        was_down = before is not None and before["unreachable_since"] is not None
        self.state.record_scan(name, now, error, n)
        if error is not None:
            log.warning("source.scan_failed", source=name, error=error)
        elif was_down:
            since = iso(before["unreachable_since"]) if before is not None else "?"
            log.info("source.reachable", source=name, unreachable_since=since)

    def _register(self, source: str, f: Found, now: float) -> None:
        row = self.state.checkpoint(f.location)
        if f.ident is None:
            if row is None or row.state != "unrecognised":
                self.state.upsert_checkpoint(
                    f.location, source, now, state="unrecognised", reason=f.note
                )
                log.warning("checkpoint.unrecognised", location=f.location, reason=f.note)
            return
        if row is not None and row.state != "missed":
            if row.run_path != f.ident.run_path:  # a row from before run paths held its run
                self.state.upsert_checkpoint(f.location, source, now, run_path=f.ident.run_path)
            return  # known from before a restart: its state stands
        if row is None and (judged := self._judged_elsewhere(f.location)) is not None:
            log.info(
                "checkpoint.model_kept",
                location=judged.location,
                also=f.location,
                run=judged.run,
                step=judged.step,
            )
            return
        ident = f.ident
        self.state.upsert_checkpoint(
            f.location,
            source,
            now,
            run=ident.run,
            run_path=ident.run_path,
            step=ident.step,
            label=ident.label,
            final=int(ident.final),
            state="incomplete",
            reason="just seen",
        )
        log.info("checkpoint.seen", location=f.location, run=ident.run, step=ident.step)

    def _moved(self, f: Found, to: str | None) -> bool:
        """Whether a vanished location is its step's model found `to` another of the step's
        folders (then it is not forgotten): a row never judged ready moves there (deleted here);
        one judged ready stays, and its jobs with it (its files are still there; the other folder
        is not registered: `_judged_elsewhere`)."""
        row = self.state.checkpoint(f.location)
        if to is None or f.ident is None or row is None:
            return False
        if row.state not in RECHECK:
            return row.state in JUDGED_READY
        self.state.delete_checkpoint(f.location)
        self._said_held.pop(f.location, None)
        log.info("checkpoint.model_moved", location=f.location, to=to, run=row.run, step=row.step)
        return True

    def _judged_elsewhere(self, location: str) -> CheckpointRow | None:
        """The checkpoint of the same step folder judged ready at another of its model folders:
        verl with LoRA and `hf_model` has two, the adapter and the merged model; on S3 the adapter
        can be uploaded whole before the merged weights. That step is that checkpoint: seen at
        its other folder (later, or by a daemon started again), it is not evaluated twice."""
        folder = checkpoint_folder(location)
        if folder == location.rstrip("/"):
            return None
        others = self.state.checkpoints_in(folder)
        return next((r for r in others if r.location != location and r.state in JUDGED_READY), None)

    def _forget(self, f: Found, now: float) -> None:
        self._said_held.pop(f.location, None)
        row = self.state.checkpoint(f.location)
        if row is None or row.state not in MISSABLE:
            return
        if row.state == "incomplete":
            # evaluated, then its files changed (checked again as a rewrite), then gone:
            # keep-last-k's rmtree takes a file at a time and a scan in the middle saw a
            # change. Deleted, not rewritten: it stays what its jobs made it, never `missed`
            ok = self.state.jobs("ok", location=f.location)
            failed = self.state.jobs("failed", location=f.location)
            if ok or failed:
                self.state.upsert_checkpoint(
                    f.location,
                    row.source,
                    now,
                    state="done" if ok else "failed",
                    reason="deleted after evaluation",
                )
                log.info(
                    "checkpoint.deleted_after_eval", location=f.location, run=row.run, step=row.step
                )
                return
        if self.held(row.source, f.location):
            log.info("checkpoint.deleted_pinned", location=f.location, run=row.run, step=row.step)
            self.on_held_deleted()  # its files now cost disk only its pin (or copy) holds
            return
        for job in self.state.jobs("queued", location=f.location):
            self.state.update_job(
                job.id, state="skipped", error="checkpoint deleted before evaluation"
            )
        if not self.state.jobs("running", location=f.location):
            self.state.upsert_checkpoint(
                f.location, row.source, now, state="missed", reason="deleted before evaluation"
            )
            log.warning("checkpoint.missed", location=f.location, run=row.run, step=row.step)

    def _apply(self, row: CheckpointRow, judged: Judged, now: float) -> None:
        verdict = judged.verdict
        for action in judged.fixes:
            log.info("checkpoint.names_fixed", location=row.location, action=action)
        if judged.fix_failed:
            log.error("checkpoint.names_unfixable", location=row.location, error=verdict.reason)
        fields: dict[str, Any] = {"state": verdict.state, "reason": verdict.reason}
        if verdict.write_mark and verdict.write_mark != row.write_mark:
            fields |= {"write_mark": verdict.write_mark, "unchanged_since": judged.observed_at}
        if verdict.ready:
            fields |= {"ready_at": now, "write_mark": judged.write_mark}
            fields |= self._version(row, judged.fingerprint, now)
        if verdict.state != row.state or verdict.reason != row.reason:
            self.state.upsert_checkpoint(row.location, row.source, now, **fields)
            if verdict.ready and judged.last_write is not None and self._on_ready is not None:
                self._on_ready(max(0.0, now - judged.last_write))
            log.info(
                JUDGED_EVENTS[verdict.state],
                location=row.location,
                run=row.run,
                step=row.step,
                reason=verdict.reason,
            )
        elif "write_mark" in fields:
            self.state.upsert_checkpoint(row.location, row.source, now, **fields)

    @staticmethod
    def _recheck_at(w: _Watched, row: CheckpointRow, judged: Judged) -> None:
        """A checkpoint waiting out a settle or quiet window: its source looks again when the
        window ends, whether or not a poll or a write is due by then."""
        wait = judged.verdict.recheck_in
        if wait is None or judged.verdict.ready:
            return
        at = judged.observed_at + wait
        w.recheck_at = at if w.recheck_at is None else min(w.recheck_at, at)

    @staticmethod
    def _version(row: CheckpointRow, new: str | None, now: float) -> dict[str, Any]:
        """Fields for a checkpoint judged ready with fingerprint `new`: a new version when an
        earlier one was fingerprinted and differs."""
        old = row.fingerprint
        fields: dict[str, Any] = {"fingerprint": new}
        if old and new != old:
            fields |= {"previous_fingerprint": old, "rewritten_at": now}
            fields["reason"] = f"rewritten: content {old} -> {new}; evaluated again"
            log.warning("checkpoint.rewritten", location=row.location, old=old, new=new)
        elif old and row.reason == REWRITE_CHECK:
            fields["reason"] = "files changed but the content is the same: results stand"
        return fields

    def _changed_while_queued(self, row: CheckpointRow, remark: Remark, now: float) -> None:
        """A checkpoint rewritten while its jobs wait: none of them starts on files other than
        judged; they go, and it is judged again. Once one runs, its worker watches the files it
        reads (worker/job.py), and a rewrite after the job is a new version, as always.
        A checkpoint whose judged files are held (pinned, staged) is not touched: its eval reads
        that copy, and what changed may be the trainer's keep-last-k deleting it file by file
        (a rewrite is then judged once its job is done, as any rewrite after a job)."""
        if self.state.jobs("running", location=row.location):
            return
        if self.held(row.source, row.location, row.write_mark):
            if self._said_held.get(row.location) == remark.write_mark:
                return
            self._said_held[row.location] = remark.write_mark
            log.info(
                "checkpoint.changed_held",
                location=row.location,
                run=row.run,
                step=row.step,
                reason="its files changed while its eval waited; the eval reads the copy held",
            )
            return
        for job in self.state.jobs("queued", location=row.location):
            self.state.delete_job(job.id)
        self.release(row.source, row.location)
        self.look_again(row.source, row.location, now, "rewritten while its eval waited")

    def _apply_remark(self, row: CheckpointRow, remark: Remark, now: float) -> None:
        """An evaluated checkpoint looked at again: adopt its marks, or judge it again."""
        where = (row.location, row.source, now)
        if not remark.changed:
            fp = remark.fingerprint or row.fingerprint
            self.state.upsert_checkpoint(*where, write_mark=remark.write_mark, fingerprint=fp)
            return
        self.state.upsert_checkpoint(
            *where,
            state="incomplete",
            reason=REWRITE_CHECK,
            write_mark=remark.write_mark,
            unchanged_since=now,
        )
        log.warning("checkpoint.files_changed", location=row.location, run=row.run, step=row.step)


def _logged(event: str, fn: Callable[[Any], Any], arg: Any) -> Callable[[], None]:
    """`fn(arg)` for a lane, where a failure is logged (nobody waits on its Future)."""

    def call() -> None:
        try:
            fn(arg)
        except Exception as e:
            log.warning(event, error=f"{type(e).__name__}: {e}")

    return call


def _fingerprint(source: Source, location: str, view: CheckpointFiles) -> str:
    """What a result on this checkpoint is of: its files' fingerprint, and for a LoRA/PEFT
    adapter saved alone, or DeepSpeed's states, its base's too (raises AdapterError when an
    adapter's base is not found)."""
    fp = fingerprint(view, source.fingerprint_mode)
    layout = native_layout(view.files)
    if layout is not None and layout.needs_base and source.adapter_base is not None:
        # DeepSpeed's states: the config and tokenizer are the base model's
        return adapter.with_base(fp, source.adapter_base, source.fingerprint_mode)
    if not adapter.is_adapter(view.files):
        return fp
    base = adapter.resolve_base(view, source.adapter_base, location)
    return adapter.with_base(fp, base, source.fingerprint_mode)
