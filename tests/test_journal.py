"""The journal of finished units and the resume on top of it, without an engine: records
survive a kill, a torn record is skipped, a journal is never replayed into other weights or
other settings, and a resumed task computes only what is missing, in the backend's order."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
from structlog.testing import CapturingLogger

from ckpt_watcher import journal, status
from ckpt_watcher.errors import ConfigError
from ckpt_watcher.evaluators.resume import Helped, TaskJournal
from ckpt_watcher.jobs import journals
from ckpt_watcher.jobs.journals import Journals
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
    # progress as the task begins and ends (in between at most every REPORT_SECONDS)
    assert seen[0] == (0, 6) and seen[-1] == (6, 6)
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
    me.done("00001-x")
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
from ckpt_watcher.evaluators.resume import Helped, TaskJournal
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


# --- the review's defects (issue 37) ----------------------------------------------------------


def test_a_helper_never_scores_a_task_even_when_it_journaled_every_chunk(tmp_path: Path) -> None:
    """With no other worker on the task, a helper claims every chunk; it still leaves the
    metrics to the job's own worker (which replays them all), so results are filed once and a
    code-executing task runs the model's code once."""
    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)  # the job's own worker has begun the task
    units = [(f"k{i}", f"req{i}") for i in range(12)]
    helper = TaskJournal(ref, "helper", chunk=4, device="cpu:1", helper=True)
    try:
        helper.answer(units, lambda r: int(r[3:]), lambda rs: [r.upper() for r in rs], "x")
    except Helped as e:
        assert "every chunk" in str(e)
    else:
        raise AssertionError("a helper returned a task's answers: it would score the task")
    helper.close()
    own = TaskJournal(ref, "own", chunk=4, device="cpu:0")
    out = own.answer(units, lambda r: int(r[3:]), lambda rs: 1 / 0, "x")  # computes nothing
    assert out == [f"REQ{i}" for i in range(12)] and own.computed == 0


def test_a_helper_joins_only_a_task_the_jobs_own_worker_has_begun(tmp_path: Path) -> None:
    import threading

    ref = _ref(tmp_path)
    units = [(f"k{i}", f"req{i}") for i in range(40)]
    theirs: list[str] = []
    ended: list[BaseException] = []

    def slow(reqs: list[str], into: list[str]) -> list[str]:
        import time

        time.sleep(0.02)
        into.extend(reqs)
        return [r.upper() for r in reqs]

    def help_out() -> None:
        helper = TaskJournal(ref, "helper", chunk=4, device="cpu:1", helper=True)
        try:
            helper.answer(units, lambda r: int(r[3:]), lambda rs: slow(rs, theirs), "x")
        except BaseException as e:  # Helped, or a failure the test reports
            ended.append(e)

    thread = threading.Thread(target=help_out)
    thread.start()
    thread.join(1.5)
    assert thread.is_alive() and not theirs, "a helper ran a task nobody had begun"
    assert not Path(ref.folder).exists()
    mine: list[str] = []
    own = TaskJournal(ref, "own", chunk=4, device="cpu:0")
    out = own.answer(units, lambda r: int(r[3:]), lambda rs: slow(rs, mine), "x")
    thread.join(30)
    assert out == [f"REQ{i}" for i in range(40)]
    assert len(ended) == 1 and isinstance(ended[0], Helped), ended
    assert sorted(mine + theirs) == sorted(r for _, r in units)  # each unit computed once


def test_a_chunk_whose_done_mark_cannot_be_written_is_given_back(
    tmp_path: Path, monkeypatch
) -> None:
    """ENOSPC, EIO or NFS's ESTALE while marking a chunk done fails the task, and gives the
    chunk back: a holder that lives on (an idle warm worker) must not block the job's worker."""
    import errno

    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)

    def full(self: journal.ChunkQueue, chunk: str) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(journal.ChunkQueue, "done", full)
    units = [(f"k{i}", f"req{i}") for i in range(8)]
    helper = TaskJournal(ref, "helper", chunk=4, device="cpu:1", helper=True)
    with pytest.raises(OSError, match="No space"):
        helper.answer(units, lambda r: int(r[3:]), lambda rs: [r.upper() for r in rs], "x")
    monkeypatch.undo()
    from ckpt_watcher.evaluators.resume import _chunk_name

    first = _chunk_name(0, [f"k{i}" for i in range(4)])
    assert helper.queue.holder(first) is None, "the claim was left behind"
    own = TaskJournal(ref, "own", chunk=4, device="cpu:0")
    assert own.answer(units, lambda r: int(r[3:]), lambda rs: [r.upper() for r in rs], "x") == [
        f"REQ{i}" for i in range(8)
    ]


def test_journal_bookkeeping_is_linear_in_chunks(tmp_path: Path, monkeypatch) -> None:
    """With compute doing nothing, the queue is asked about each chunk a bounded number of
    times: after every chunk the old bookkeeping looked at every chunk still to do (2,000
    chunks: ~2 million looks; bench/journal_bookkeeping.py times it)."""
    looks = [0]
    is_done = journal.ChunkQueue.is_done

    def counted(self: journal.ChunkQueue, chunk: str) -> bool:
        looks[0] += 1
        return is_done(self, chunk)

    monkeypatch.setattr(journal.ChunkQueue, "is_done", counted)
    n = 2000
    units = [(f"k{i}", i) for i in range(n)]
    reports: list[int] = []
    own = TaskJournal(_ref(tmp_path), "own", chunk=1, progress=lambda d, t, u: reports.append(d))
    out = own.answer(units, lambda r: r, lambda rs: rs, "x")
    assert out == list(range(n)) and reports[-1] == n
    assert looks[0] <= 4 * n, looks[0]


def test_a_live_claim_moved_aside_by_mistake_is_put_back(tmp_path: Path) -> None:
    """Two takers of a dead holder's chunk: the first moves the dead claim aside and claims;
    the second, which read the dead holder a moment before, must not move the live claim."""
    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    late = journal.ChunkQueue(ref, journal.Holder.me("cpu:0"))
    alive = _holder(ref, "00001-x")  # the first taker, now holding the chunk
    try:
        claim = late.folder / "00001-x.claim"
        late._move_aside_if_dead(claim)  # the second taker's move, on what it read before
        assert late.busy_elsewhere("00001-x") and not late.claim("00001-x")
        assert late.holder("00001-x") is not None and late.holder("00001-x").pid == alive.pid  # type: ignore[union-attr]
    finally:
        os.kill(alive.pid, signal.SIGKILL)
        alive.wait()


def test_journals_are_kept_only_while_a_job_can_use_them_and_within_their_budget(
    tmp_path: Path,
) -> None:
    """Swept at the daemon's start and every minute: a journal no queued or running job names
    goes (a result filed but killed before its removal, a failed or skipped job, a rewritten
    checkpoint's old content, a helper's empty folder). Over policy.journal_max_gb the queued
    jobs' journals go, never a running job's; status shows what is left."""
    from ckpt_watcher.state import Job

    from .helpers import simulated_daemon

    daemon = simulated_daemon(tmp_path, policy={"journal_max_gb": 1})
    cfg = daemon.cfg
    state, book = daemon.state, daemon.book

    def job_with_journal(jid: str, status: str, size: int) -> Path:
        job = Job(jid, f"/c/{jid}", "r", 1, jid, [{"task": "t1", "num_fewshot": None}], "h", 0, 1)
        job.fingerprint, job.settings_hash = f"sampled:{jid}", book.settings_hash
        state.add_job(job)
        state.update_job(jid, state=status)
        ref = book.journal_ref(job, job.tasks[0])
        assert ref is not None
        journal.Writer(ref, "w").append([("k", "v" * size)])
        return Path(ref.folder)

    try:
        running = job_with_journal("run", "running", 1000)
        queued = job_with_journal("wait", "queued", 1000)
        filed = job_with_journal("done", "ok", 1000)  # killed between the ledger and removal
        failed = job_with_journal("bad", "failed", 1000)
        empty = journal.journals_root(cfg.state_dir) / "0123456789abcdef01234567"
        empty.mkdir()  # a helper's
        daemon.journals.sweep()
        assert running.exists() and queued.exists()
        assert not filed.exists() and not failed.exists() and not empty.exists()
        left = state.get_meta("journals")
        assert left["folders"] == 2 and left["bytes"] > 2000 and left["max_bytes"] == 2**30
        daemon.journals.max_bytes = 1500  # the two hold more: the queued job's goes first
        daemon.journals.sweep()
        assert running.exists() and not queued.exists()
        daemon.journals.max_bytes = 10  # the running job's alone: kept (its result needs it)
        daemon.journals.sweep()
        assert running.exists() and state.get_meta("journals")["folders"] == 1
        shown = status.gather(cfg)
        assert shown["journals"]["folders"] == 1 and shown["journals"]["max_bytes"] == 10
        assert "journals: 1, 0.0 MiB of " in status.render(shown)
    finally:
        state.close()


def test_a_worker_whose_claim_or_done_file_has_all_the_links_it_may_have_writes_another(
    tmp_path: Path, monkeypatch
) -> None:
    """Claims and done marks are hard links to one file per worker; a filesystem caps links to
    one file (ext4: 65,000; btrfs: a few hundred in one folder). At the cap the worker writes
    another file and goes on (found by bench/journal_bookkeeping.py at 100,000 chunks)."""
    import errno

    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    real_link = os.link
    links = [0]

    def capped(src: str, dst: str) -> None:  # each file takes 3 links, then EMLINK
        if src.endswith((".1", ".2", ".3")) and links[0] >= 3:
            links[0] = 0
            raise OSError(errno.EMLINK, "Too many links")
        links[0] += 1
        real_link(src, dst)

    monkeypatch.setattr(journal.os, "link", capped)
    units = [(f"k{i}", f"req{i}") for i in range(40)]
    own = TaskJournal(ref, "own", chunk=2, device="cpu:0")
    assert own.answer(units, lambda r: int(r[3:]), lambda rs: rs, "x") == [r for _, r in units]
    monkeypatch.undo()
    own.close()
    marks = own.queue.done_by()
    assert len(marks) == 20 and {m["device"] for m in marks.values()} == {"cpu:0"}
    templates = [p.name for p in own.queue.folder.iterdir() if p.name.startswith(".")]
    assert len(templates) > 2, templates  # the cap was met, and more files written


def test_the_journals_folder_is_checked_at_start_and_ray_without_a_shared_one_is_named(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A `shared_dir` that cannot be created stops the start naming the key; under Ray with
    journals under state_dir the daemon says a retry on another node starts from zero."""
    import pytest

    blocker = tmp_path / "a-file"
    blocker.write_text("")
    book = SimpleNamespace(journal_home=journal.journal_home(tmp_path, blocker / "efs"))
    with pytest.raises(ConfigError, match="executor.shared_dir: cannot create"):
        Journals(book, None, None).check_home(ray=True, shared=True)  # type: ignore[arg-type]
    book = SimpleNamespace(journal_home=journal.journal_home(tmp_path / "state", None))
    logs = CapturingLogger()  # (the module's logger: cached loggers escape capture_logs)
    monkeypatch.setattr(journals, "log", logs)
    Journals(book, None, None).check_home(ray=True, shared=False)  # type: ignore[arg-type]
    Journals(book, None, None).check_home(ray=False, shared=False)  # type: ignore[arg-type]
    assert [c.args[0] for c in logs.calls] == [
        "executor.journals_on_this_host",
        "executor.journals",
    ]
    assert journal.journals_root(book.journal_home).is_dir()


def test_a_holder_on_another_host_is_alive_while_its_lease_touches_its_claim(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Spread over Ray nodes, a chunk's holder may be on another host, where its pid means
    nothing here: it holds its claim while its lease thread touches it, and once it stops (its
    node died) the claim is taken over after LEASE_SECONDS."""
    monkeypatch.setattr(journal, "LEASE_SECONDS", 0.8)  # touched every 0.2 s
    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    me = journal.ChunkQueue(ref, journal.Holder.me("node-a/cuda:0"))
    far = journal.Holder("node-b", 1, "0", "node-b/cuda:6")  # pid 1 here is not it
    remote = journal.ChunkQueue(ref, far)
    assert remote.claim("00001-x")
    time.sleep(1.2)  # longer than a lease: only its touches keep it
    assert me.busy_elsewhere("00001-x") and not me.claim("00001-x")
    (own,) = [p for p in remote._own_files.values()]
    journal._lease.drop(own)  # node-b is gone: nobody touches its claim any more
    time.sleep(1.0)
    assert not me.busy_elsewhere("00001-x") and me.claim("00001-x")
    assert me.holder("00001-x") == me.me


def test_a_holder_of_our_host_name_on_another_node_is_judged_by_its_lease_not_by_pid(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two nodes with one host name (KubeRay `hostNetwork` pods, two `--network host` nodes on
    one box): the other's holder has a pid that means nothing in our /proc. It keeps its live
    claim while its lease touches it, and loses it once the touches stop."""
    import socket

    monkeypatch.setattr(journal, "LEASE_SECONDS", 0.8)
    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    me = journal.ChunkQueue(ref, journal.Holder.me("pod-a/cuda:0"))
    dead_here = 2**22 + 12345  # no process of ours has this pid
    twin = journal.Holder(socket.gethostname(), dead_here, "0", "pod-b/cuda:1", "other-boot/4026")
    assert twin.node != journal.node_identity()
    remote = journal.ChunkQueue(ref, twin)
    assert remote.claim("00001-x")
    time.sleep(1.2)
    assert me.busy_elsewhere("00001-x") and not me.claim("00001-x")  # alive by its lease
    (own,) = remote._own_files.values()
    journal._lease.drop(own)
    time.sleep(1.0)
    assert me.claim("00001-x") and me.holder("00001-x") == me.me


def test_a_lease_outlives_a_transient_touch_error_and_ends_only_when_its_file_is_gone(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """EIO or ESTALE on one touch (EFS/NFS hiccups) must not give the chunk away while its
    worker still computes it: the file is touched again at the next turn; a file that is gone
    (the journal removed: its result is filed) leaves the lease."""
    import errno

    monkeypatch.setattr(journal, "LEASE_SECONDS", 0.8)
    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    mine = journal.ChunkQueue(ref, journal.Holder("far", 1, "0", "far/cuda:0", "far-node"))
    assert mine.claim("00001-x")
    (own,) = mine._own_files.values()
    real_utime, failures = os.utime, []

    def flaky(path: str, *args: object, **kw: object) -> None:
        if path == own and len(failures) < 2:
            failures.append(path)
            raise OSError(errno.EIO, "Input/output error")
        real_utime(path, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(journal.os, "utime", flaky)
    time.sleep(0.9)  # two turns failed, the third touched it
    assert len(failures) == 2 and own in journal._lease.files
    other = journal.ChunkQueue(ref, journal.Holder.me("here/cuda:1"))
    time.sleep(0.5)
    assert other.busy_elsewhere("00001-x") and not other.claim("00001-x")
    os.unlink(own)
    time.sleep(0.5)
    assert own not in journal._lease.files


def test_lease_liveness_reads_the_filesystems_clock_not_this_hosts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A node whose clock runs 45 s ahead of the file server's must still see a live claim as
    alive: a lease's age is the time of a file touched now minus the claim's last touch, both
    stamped by the filesystem."""
    monkeypatch.setattr(journal, "LEASE_SECONDS", 0.8)
    ref = _ref(tmp_path)
    Path(ref.folder).mkdir(parents=True)
    remote = journal.ChunkQueue(ref, journal.Holder("far", 1, "0", "far/cuda:0", "far-node"))
    assert remote.claim("00001-x")
    ahead = time.time
    monkeypatch.setattr(journal.time, "time", lambda: ahead() + 45.0)  # this host's clock
    me = journal.ChunkQueue(ref, journal.Holder.me("here/cuda:1"))
    time.sleep(0.3)
    assert me.busy_elsewhere("00001-x") and not me.claim("00001-x")
    (own,) = remote._own_files.values()
    journal._lease.drop(own)
    time.sleep(1.3)  # the server's clock moved past its last touch by more than a lease
    assert not me.busy_elsewhere("00001-x") and me.claim("00001-x")


def test_an_older_claim_naming_only_our_host_is_judged_by_its_pid_and_a_touch_from_the_future_is_no_lease(
    tmp_path: Path,
) -> None:
    """A claim written by a version before node identities names its host only: on that host it
    is judged by its pid (a dead pid frees the chunk at once, not a lease later). A claim touched
    more than a lease ahead of the filesystem's clock (the server's clock stepped back) is not
    kept alive by that touch."""
    import socket

    dead_here = 2**22 + 12345
    old = journal.Holder(socket.gethostname(), dead_here, "0", "old/cuda:0")  # no node
    assert not old.alive(touched=None)
    me = journal.Holder.me("here/cuda:0")
    old_live = journal.Holder(me.host, me.pid, me.start, "old/cuda:0")
    assert old_live.alive(touched=None)
    far = journal.Holder("far", 1, "0", "far/cuda:0", "far-node")
    claim = tmp_path / "claim"
    claim.write_text("{}", encoding="utf-8")
    now = os.stat(claim).st_mtime
    assert far.alive(claim, clock=lambda: now + 0.5)
    os.utime(claim, (now + 3600, now + 3600))
    assert not far.alive(claim, clock=lambda: now)
