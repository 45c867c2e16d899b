"""The journal of finished units and the resume on top of it, without an engine: records
survive a kill, a torn record is skipped, a journal is never replayed into other weights or
other settings, and a resumed task computes only what is missing, in the backend's order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from ckpt_watcher import journal
from ckpt_watcher.evaluators.resume import TaskJournal
from ckpt_watcher.journal import JournalRef


def _ref(state: Path, fingerprint: str = "sampled:aa", settings: str = "s1") -> JournalRef:
    ident = journal.identity(fingerprint, settings, "addition", 0)
    return JournalRef(str(journal.folder_for(state, ident)), ident)


def test_records_round_trip_and_a_torn_last_record_is_skipped(tmp_path: Path) -> None:
    ref = _ref(tmp_path)
    w = journal.Writer(ref, "w1")
    assert w.append([("a", "12+3=015"), ("b", [-1.5, True])]) == 2
    w.close()
    path = next(Path(ref.folder).glob("*.jsonl"))
    with open(path, "ab") as f:
        f.write(b'{"k": "c", "v": "cut sh')  # a kill in the middle of a write
    got = journal.read(ref)
    assert got.values == {"a": "12+3=015", "b": [-1.5, True]} and got.torn == 1
    # the same writer's file, appended again: the torn record stays alone on its line
    w = journal.Writer(ref, "w1")
    w.append([("d", "x")])
    w.close()
    got = journal.read(ref)
    assert got.values == {"a": "12+3=015", "b": [-1.5, True], "d": "x"} and got.torn == 1


def test_a_journal_is_never_replayed_into_other_weights_or_other_settings(tmp_path: Path) -> None:
    ref = _ref(tmp_path)
    journal.Writer(ref, "w1").append([("a", "old weights' answer")])
    rewritten = _ref(tmp_path, fingerprint="sampled:bb")  # the checkpoint was saved again
    other = _ref(tmp_path, settings="s2")  # another max_gen_toks, seed, template...
    assert rewritten.folder != ref.folder and other.folder != ref.folder
    assert journal.read(rewritten).values == {} and journal.read(other).values == {}
    # a file that found its way into the folder with another identity is passed over too
    stray = JournalRef(ref.folder, rewritten.identity)
    journal.Writer(stray, "w2").append([("a", "not ours")])
    got = journal.read(ref)
    assert got.values == {"a": "old weights' answer"} and len(got.foreign) == 1
    journal.remove(Path(ref.folder))
    assert journal.read(ref).values == {}


WRITE_UNTIL_KILLED = """
import sys
from ckpt_watcher import journal
from ckpt_watcher.journal import JournalRef
ref = JournalRef(sys.argv[1], {"fingerprint": "f", "settings": "s", "task": "t", "num_fewshot": 0})
w = journal.Writer(ref, "victim")
i = 0
while True:
    w.append([(f"k{i}", "v" * 200)])
    print(i, flush=True)
    i += 1
"""


def test_every_record_acknowledged_before_a_kill_9_is_read_back(tmp_path: Path) -> None:
    folder = tmp_path / "j"
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITE_UNTIL_KILLED, str(folder)], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None
    acknowledged = -1
    for line in proc.stdout:
        acknowledged = int(line)
        if acknowledged >= 300:
            break
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    ref = JournalRef(
        str(folder), {"fingerprint": "f", "settings": "s", "task": "t", "num_fewshot": 0}
    )
    got = journal.read(ref).values
    assert all(f"k{i}" in got for i in range(acknowledged + 1))  # each append was fsynced first


def test_a_resumed_task_computes_only_what_is_missing_in_the_backends_order(
    tmp_path: Path,
) -> None:
    ref = _ref(tmp_path)
    units = [(f"k{i}", f"req{i}") for i in range(10)]
    order = {f"req{i}": -i for i in range(10)}  # the backend's order: longest prompt first
    asked: list[list[str]] = []

    def compute(reqs: list[str]) -> list[str]:
        asked.append(reqs)
        return [r.upper() for r in reqs]

    seen: list[tuple[int, int]] = []
    first = TaskJournal(ref, "w1", chunk=4, progress=lambda d, t, u: seen.append((d, t)))
    assert first.answer(units[:6], order.__getitem__, compute, "responses") == [
        f"REQ{i}" for i in range(6)
    ]
    first.close()
    assert asked == [["req5", "req4", "req3", "req2"], ["req1", "req0"]]  # chunks in order
    assert seen == [(0, 6), (4, 6), (6, 6)]
    # killed after that call; the next attempt asks for all 10 and computes only 4
    asked.clear()
    again = TaskJournal(ref, "w2", chunk=4)
    out = again.answer(units, order.__getitem__, compute, "responses")
    again.close()
    assert out == [f"REQ{i}" for i in range(10)]
    assert asked == [["req9", "req8", "req7", "req6"]]
    assert (again.resumed, again.computed) == (6, 4)
    records = [
        json.loads(line)
        for f in sorted(Path(ref.folder).glob("*.jsonl"))
        for line in f.read_text().splitlines()[1:]
    ]
    assert sorted(r["k"] for r in records) == sorted(k for k, _ in units)  # each unit once


# --- one task, several workers: the chunk queue ---------------------------------------------

HOLD_A_CLAIM = """
import sys, time
from ckpt_watcher import journal
from ckpt_watcher.journal import JournalRef
ref = JournalRef(sys.argv[1], {})
q = journal.ChunkQueue(ref, journal.Holder.me("cpu:9"))
print(q.claim(sys.argv[2]), flush=True)
time.sleep(600)
"""


def _holder(ref: JournalRef, chunk: str) -> subprocess.Popen[str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", HOLD_A_CLAIM, ref.folder, chunk], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "True"
    return proc


def test_a_chunk_has_one_live_holder_and_a_dead_holders_chunk_is_taken_over(
    tmp_path: Path,
) -> None:
    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    me = journal.ChunkQueue(ref, journal.Holder.me("cpu:0"))
    other = _holder(ref, "00001-x")
    try:
        assert not me.claim("00001-x") and me.busy_elsewhere("00001-x")
        assert me.claim("00002-y") and me.claim("00002-y")  # mine stays mine
        me.release("00002-y")  # given back undone: free again
        assert me.holder("00002-y") is None
    finally:
        os.kill(other.pid, signal.SIGKILL)
        other.wait()
    assert not me.busy_elsewhere("00001-x") and me.claim("00001-x")  # its holder died
    me.done("00001-x", 16)
    assert me.is_done("00001-x") and not me.claim("00001-x")
    assert me.devices() == ["cpu:0"]
    journal.remove(Path(ref.folder))  # the result is in the ledger
    assert not me.claim("00003-z")  # nothing to join any more; nothing is created
    assert not Path(ref.folder).exists()


HELP_WITH = """
import sys, time
from ckpt_watcher.evaluators.resume import Helped, TaskJournal
from ckpt_watcher.journal import JournalRef
ref = JournalRef(sys.argv[1], {"fingerprint": "sampled:aa", "settings": "s1", "task": "addition",
                               "num_fewshot": 0})
units = [(f"k{i}", f"req{i}") for i in range(40)]
def compute(reqs):
    time.sleep(0.05)
    print("helper", *reqs, flush=True)
    return [r.upper() for r in reqs]
helper = TaskJournal(ref, "helper", chunk=4, device="cpu:1", helper=True)
print("ready", flush=True)
try:
    helper.answer(units, lambda r: int(r[3:]), compute, "responses")
except Helped:
    print("helped", helper.computed, flush=True)
"""


def _helper(ref: JournalRef, script: str) -> subprocess.Popen[str]:
    """A helper process running `script` on the task's journal (the daemon makes the journal's
    folder before a helper starts)."""
    Path(ref.folder).mkdir(parents=True)
    return subprocess.Popen(
        [sys.executable, "-c", script, ref.folder], stdout=subprocess.PIPE, text=True
    )


def test_two_workers_share_one_task_and_the_jobs_own_worker_gets_every_answer(
    tmp_path: Path,
) -> None:
    ref = _ref(tmp_path)
    helper = _helper(ref, HELP_WITH)
    assert helper.stdout is not None and helper.stdout.readline().strip() == "ready"
    units = [(f"k{i}", f"req{i}") for i in range(40)]
    mine: list[str] = []

    def compute(reqs: list[str]) -> list[str]:
        import time

        time.sleep(0.05)
        mine.extend(reqs)
        return [r.upper() for r in reqs]

    own = TaskJournal(ref, "own", chunk=4, device="cpu:0")
    out = own.answer(units, lambda r: int(r[3:]), compute, "responses")
    own.close()
    stdout, _ = helper.communicate(timeout=60)
    theirs = [
        r for line in stdout.splitlines() if line.startswith("helper ") for r in line.split()[1:]
    ]
    assert out == [f"REQ{i}" for i in range(40)]
    assert stdout.splitlines()[-1] == f"helped {len(theirs)}"
    assert theirs and mine, "both computed"
    assert sorted(mine + theirs) == sorted(r for _, r in units), "each unit computed once"
    assert own.devices() == ["cpu:0", "cpu:1"]
    assert own.resumed == 0 and own.computed == len(mine)


def test_the_jobs_own_worker_waits_for_a_held_chunk_and_takes_it_when_its_holder_dies(
    tmp_path: Path,
) -> None:
    import threading

    from ckpt_watcher.evaluators.resume import _chunk_name

    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    units = [(f"k{i}", f"req{i}") for i in range(8)]
    held = _chunk_name(1, [f"k{i}" for i in range(4, 8)])  # the second chunk
    other = _holder(ref, held)
    threading.Timer(1.0, lambda: os.kill(other.pid, signal.SIGKILL)).start()
    own = TaskJournal(ref, "own", chunk=4, device="cpu:0")
    out = own.answer(units, lambda r: int(r[3:]), lambda rs: [r.upper() for r in rs], "responses")
    other.wait()
    assert out == [f"REQ{i}" for i in range(8)] and own.computed == 8


HELP_AHEAD = """
import sys, time
from ckpt_watcher.evaluators.resume import TaskJournal
from ckpt_watcher.journal import JournalRef
ref = JournalRef(sys.argv[1], {"fingerprint": "sampled:aa", "settings": "s1", "task": "addition",
                               "num_fewshot": 0})
units = [(f"k{i}", f"req{i}") for i in range(16)]
done = []
def compute(reqs):
    if len(done) == 2:
        raise RuntimeError("stop here")
    done.append(reqs)
    return [r.upper() for r in reqs]
helper = TaskJournal(ref, "helper", chunk=4, device="cpu:1", helper=True)
try:
    helper.answer(units, lambda r: int(r[3:]), compute, "responses")
except RuntimeError:
    print("ahead", helper.computed, flush=True)
time.sleep(600)
"""


def test_chunks_a_live_helper_did_before_the_jobs_worker_began_are_not_counted_as_resumed(
    tmp_path: Path,
) -> None:
    ref = _ref(tmp_path)
    helper = _helper(ref, HELP_AHEAD)
    try:
        assert helper.stdout is not None and helper.stdout.readline().strip() == "ahead 8"
        units = [(f"k{i}", f"req{i}") for i in range(16)]
        own = TaskJournal(ref, "own", chunk=4, device="cpu:0")
        out = own.answer(units, lambda r: int(r[3:]), lambda rs: [r.upper() for r in rs], "x")
        own.close()
        assert out == [f"REQ{i}" for i in range(16)]
        assert (own.resumed, own.computed) == (0, 8), "nothing was interrupted"
    finally:
        os.kill(helper.pid, signal.SIGKILL)
        helper.wait()
    # a later attempt (here the same process, as a warm engine's retry) takes all 16 from the
    # journal: what a dead helper or an earlier attempt computed counts as resumed
    again = TaskJournal(ref, "again", chunk=4, device="cpu:0")
    again.answer(units, lambda r: int(r[3:]), lambda rs: [r.upper() for r in rs], "x")
    assert (again.resumed, again.computed) == (16, 0)
