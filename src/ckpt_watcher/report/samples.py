"""Per-document records of a result (`samples_file` in its ledger line), and which documents
flipped between two steps: what `watcher samples` shows.

A record is one document: its task, doc_id, prompt, target, the K responses, per filter the
answer extracted from each, and per `<metric>,<filter>` each response's score; a code task's
adds, per filter, each program's verdict (`passed`, `failed`, `timeout`, `memory`,
`runtime_error`, `syntax_error`) and the first lines of its error. A document is
*right* when the mean of its scores over its responses is at least 0.5 (with one response:
when it is right); it *flipped* between two steps when it is right at one and not the other.
"""

from __future__ import annotations

import gzip
import json
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.errors import WatcherError
from ckpt_watcher.report.paired import PairedDelta, paired_delta
from ckpt_watcher.report.table import Pairing, entry_name, newest_versions, task_label


@dataclass(frozen=True)
class Records:
    line: dict[str, Any]  # the ledger line they belong to
    by_doc: dict[tuple[str, Any], dict[str, Any]]  # (task, doc_id) -> record


def find_line(
    lines: list[dict[str, Any]], step: int, task: str, num_fewshot: int | None
) -> dict[str, Any]:
    """The newest `ok` line for (step, task[, num_fewshot]) that has per-document records."""
    ok = [ln for ln in newest_versions(lines) if ln.get("status") == "ok"]
    at_step = [ln for ln in ok if ln.get("step") == step]
    if not at_step:
        steps = sorted({ln["step"] for ln in ok if ln.get("step") is not None})
        raise WatcherError(f"no ok result at step {step}; steps with results: {steps or 'none'}")
    match = [ln for ln in at_step if entry_name(ln) == task]
    if not match:  # an lm-eval task that named entries run
        match = [ln for ln in at_step if ln["task"] == task]
    if num_fewshot is not None:
        match = [ln for ln in match if ln.get("num_fewshot") == num_fewshot]
    if not match:
        tasks = sorted({task_label(ln) for ln in at_step})
        raise WatcherError(f"no ok result for task {task!r} at step {step}; it has: {tasks}")
    if len({entry_name(ln) for ln in match}) > 1:
        names = ", ".join(sorted({entry_name(ln) for ln in match}))
        raise WatcherError(f"task {task!r} is run by the entries {names}: give --task one of them")
    if len(match) > 1:
        shots = sorted(str(ln.get("num_fewshot")) for ln in match)
        raise WatcherError(f"task {task!r} ran with num_fewshot {', '.join(shots)}: add --shots")
    line = match[0]
    if not line.get("samples_file"):
        raise WatcherError(
            f"the step {step} result of {task!r} has no per-document records (it was evaluated "
            "before they were saved); `watcher requeue` does not redo ok results, so compare "
            "newer steps"
        )
    return line


def read_records(ledger_dir: Path, run_path: str, line: dict[str, Any]) -> Records:
    path = ledger_dir / run_path / line["samples_file"]  # run_path: as the user named the run
    if not path.exists():
        raise WatcherError(f"per-document records missing: {path} (moved or deleted?)")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        recs = [json.loads(x) for x in f if x.strip()]
    return Records(line, {(r["task"], r["doc_id"]): r for r in recs})


def headline_metric(records: Records, metric: str | None) -> str:
    """The `<metric>,<filter>` key to judge documents by: `metric` if given (a bare metric name
    takes its first filter), else the first key of the records."""
    keys: list[str] = []
    for rec in records.by_doc.values():
        keys = list(rec["scores"])
        break
    if not keys:
        raise WatcherError("these records have no scores")
    if metric is None:
        return keys[0]
    found = [k for k in keys if k == metric or k.partition(",")[0] == metric]
    if not found:
        raise WatcherError(f"no metric {metric!r} in these records; they have: {', '.join(keys)}")
    return found[0]


def doc_score(rec: dict[str, Any], key: str) -> float:
    values = [float(v) for v in rec["scores"].get(key, []) if isinstance(v, bool | int | float)]
    return sum(values) / len(values) if values else 0.0


def is_right(rec: dict[str, Any], key: str) -> bool:
    return doc_score(rec, key) >= 0.5


def flips(a: Records, b: Records, key: str, only_wrong: bool = False) -> list[tuple[dict, dict]]:
    """Documents right at one step and not the other (`only_wrong`: right at `a`, wrong at `b`)."""
    out = []
    for doc, rb in sorted(b.by_doc.items(), key=lambda kv: _doc_order(kv[0])):
        ra = a.by_doc.get(doc)
        if ra is None or is_right(ra, key) == is_right(rb, key):
            continue
        if only_wrong and is_right(rb, key):
            continue
        out.append((ra, rb))
    return out


def paired_change(a: Records, b: Records, key: str) -> PairedDelta | None:
    """The change of `key` from `a` to `b` over the documents both have, each document's mean
    over its responses (`report.paired`); None without two documents in common."""
    return paired_scores(scores_of(a.by_doc.values()), scores_of(b.by_doc.values()), key)


# A result's documents, each with its score per `<metric>,<filter>` key (its mean over its
# responses): all a paired comparison needs, a few floats per document
DocScores = dict[tuple[str, Any], dict[str, float]]
_SCORES: OrderedDict[tuple[str, int, int], DocScores | None] = OrderedDict()
# files kept: a 1,319-document task's scores (2 metrics) take about 0.7 MB; a re-read of a file
# that fell out costs about 30 ms
_SCORES_KEPT = 64
_SCORES_LOCK = threading.Lock()


def scores_of(recs: Iterable[dict[str, Any]]) -> DocScores:
    return {(r["task"], r["doc_id"]): {k: doc_score(r, k) for k in r["scores"]} for r in recs}


def doc_scores(path: Path | None) -> DocScores | None:
    """The scores in a records file (None: no file, or unreadable), kept for the files read
    last: a records file is written once (a rewritten checkpoint's result is another file),
    so its path, mtime and size name its content."""
    if path is None:
        return None
    try:
        st = path.stat()
    except OSError:
        return None
    key = (str(path), st.st_mtime_ns, st.st_size)
    with _SCORES_LOCK:  # the daemon's alerts (its loop) and its pages (their lane) share it
        if key in _SCORES:
            _SCORES.move_to_end(key)
            return _SCORES[key]
    found: DocScores | None
    try:
        with gzip.open(path, "rt", encoding="utf-8") as f:
            found = scores_of(json.loads(x) for x in f if x.strip())
    except (OSError, EOFError, ValueError, KeyError, TypeError):
        found = None
    with _SCORES_LOCK:
        _SCORES[key] = found
        while len(_SCORES) > _SCORES_KEPT:
            _SCORES.popitem(last=False)
    return found


def paired_scores(before: DocScores, after: DocScores, key: str) -> PairedDelta | None:
    """`key`'s paired change from `before` to `after` over the documents both scored (None
    under two: a pass@k estimate, say, has no per-document scores)."""
    common = sorted(
        (d for d, m in after.items() if key in m and key in before.get(d, {})), key=_doc_order
    )
    if len(common) < 2:
        return None
    return paired_delta([before[d][key] for d in common], [after[d][key] for d in common])


def paired_files(before: Path | None, after: Path | None, key: str) -> PairedDelta | None:
    """`key`'s paired change between two results' records files (`doc_scores`); None where
    either has none, or they pair under two documents."""
    a, b = doc_scores(before), doc_scores(after)
    return paired_scores(a, b, key) if a and b else None


def baseline_records(
    ledger_dir: Path, baseline_lines: list[dict[str, Any]]
) -> dict[tuple[str, int | None], Path]:
    """The evaluated baseline's records files by (task entry's name, shots): its newest ok
    line of each that kept records."""
    return {
        (entry_name(ln), ln.get("num_fewshot")): path
        for ln in newest_versions(baseline_lines)
        if ln.get("status") == "ok" and (path := records_path(ledger_dir, ln)) is not None
    }


def baseline_pairing(ledger_dir: Path, baseline_lines: list[dict[str, Any]]) -> Pairing | None:
    """A results table's `Pairing` against an evaluated baseline: whether a line's metric is
    beyond the noise from the baseline's, by the paired test over documents (None where either
    side kept no records of it). None without an evaluated baseline that kept records."""
    refs = baseline_records(ledger_dir, baseline_lines)
    if not refs:
        return None

    def paired(line: dict[str, Any], metric: str) -> bool | None:
        ref = refs.get((entry_name(line), line.get("num_fewshot")))
        change = paired_files(ref, records_path(ledger_dir, line), metric) if ref else None
        return None if change is None else change.real

    return paired


def records_path(ledger_dir: Path, line: dict[str, Any]) -> Path | None:
    """Where a ledger line's per-document records are (None: it kept none)."""
    name = line.get("samples_file")
    return ledger_dir / (line.get("run_path") or line["run"]) / name if name else None


def _doc_order(doc: tuple[str, Any]) -> tuple[str, int, str]:
    task, doc_id = doc
    return (task, doc_id, "") if isinstance(doc_id, int) else (task, -1, str(doc_id))


def _clip(text: Any, width: int = 160) -> str:
    s = text if isinstance(text, str) else json.dumps(text, default=str)
    s = s.replace("\n", "\\n")
    return s if len(s) <= width else s[: width - 1] + "…"


def _responses(rec: dict[str, Any], key: str, label: str = "") -> list[str]:
    filt = key.partition(",")[2]
    answers = rec["extracted"].get(filt, [])
    scores = rec["scores"].get(key, [])
    verdicts = (rec.get("verdicts") or {}).get(filt) or []  # a code task's, per program
    out = []
    for i, response in enumerate(rec["responses"]):
        mark = "✓" if i < len(scores) and float(scores[i] or 0) >= 0.5 else "✗"
        if i < len(verdicts) and verdicts[i]:
            said = verdicts[i]
            why = said["error"].strip().splitlines()[-1] if said.get("error") else ""
            out.append(
                f"  {label}#{i + 1} {mark} {said['status']}{': ' + _clip(why, 100) if why else ''}"
            )
            out.append(f"      {_clip(response)}")
            continue
        answer = _clip(answers[i], 40) if i < len(answers) else "?"
        out.append(f"  {label}#{i + 1} {mark} answer {answer}: {_clip(response)}")
    return out


def _right_count(rec: dict[str, Any], key: str) -> str:
    scores = rec["scores"].get(key, [])
    right = sum(1 for v in scores if isinstance(v, bool | int | float) and float(v) >= 0.5)
    return f"{right}/{len(scores)} right"


def render_docs(recs: list[dict[str, Any]], key: str) -> list[str]:
    out = []
    for rec in recs:
        out.append(
            f"doc {rec['doc_id']} [{rec['task']}]  {_right_count(rec, key)}  "
            f"target: {_clip(rec['target'], 60)}"
        )
        out.append(f"  prompt: {_clip(rec['prompt'], 300)}")
        out.extend(_responses(rec, key))
    return out


def render_flips(pairs: list[tuple[dict, dict]], key: str, step_a: int, step_b: int) -> list[str]:
    out = []
    for ra, rb in pairs:
        out.append(
            f"doc {rb['doc_id']} [{rb['task']}]  step {step_a}: {_right_count(ra, key)} -> "
            f"step {step_b}: {_right_count(rb, key)}  target: {_clip(rb['target'], 60)}"
        )
        out.append(f"  prompt: {_clip(rb['prompt'], 300)}")
        out.extend(_responses(ra, key, f"step {step_a} "))
        out.extend(_responses(rb, key, f"step {step_b} "))
    return out
