"""Sampled tasks: K responses per document, each scored alone, unbiased pass@k, per-document
records; and `watcher samples` on them."""

from __future__ import annotations

import gzip
import itertools
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.config import TaskSpec, task_settings_hash
from ckpt_watcher.errors import ConfigError
from ckpt_watcher.evaluators.passk import pass_at_k, sampled_metrics
from ckpt_watcher.report.samples import Records, flips, is_right

from .conftest import WATCHER, base_config, write_config
from .helpers import (
    check_lengths_against_records,
    check_pass_at_k_from_records,
    watcher_once,
)


def test_pass_at_k_is_the_chance_that_k_of_n_samples_hold_a_correct_one() -> None:
    for n in range(1, 9):
        for c in range(n + 1):
            correct = set(range(c))
            for k in range(1, n + 1):
                subsets = list(itertools.combinations(range(n), k))
                hit = sum(1 for s in subsets if correct & set(s)) / len(subsets)
                assert pass_at_k(n, c, k) == pytest.approx(hit, abs=1e-12), (n, c, k)
    # the biased "any of the first k" would say 1.0 here (the correct one came first)
    assert pass_at_k(16, 1, 1) == pytest.approx(1 / 16)
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)


def test_sampled_metrics_mean_over_samples_pass_at_k_and_stderr_over_problems() -> None:
    rows = [[1, 0, 0, 0], [1, 1, 1, 1], [0, 0, 0, 0]]
    m = sampled_metrics("exact_match,strict-match", rows, [1, 2, 4])
    assert m["exact_match,strict-match"] == pytest.approx(5 / 12)
    assert m["exact_match_pass@1,strict-match"] == pytest.approx(5 / 12)
    assert m["exact_match_pass@2,strict-match"] == pytest.approx((0.5 + 1 + 0) / 3)
    assert m["exact_match_pass@4,strict-match"] == pytest.approx(2 / 3)
    assert m["exact_match_pass@4_stderr,strict-match"] == pytest.approx(
        (sum((x - 2 / 3) ** 2 for x in (1, 1, 0)) / 2) ** 0.5 / 3**0.5
    )
    # one sample per problem: the figures lm-eval itself computes (its mean and mean_stderr)
    from lm_eval.api.metrics import mean, mean_stderr

    single = [[True], [False], [True], [True]]
    m1 = sampled_metrics("acc,none", single, [1])
    flat = [r[0] for r in single]
    assert m1["acc,none"] == mean(flat) and m1["acc_stderr,none"] == mean_stderr(flat)
    # scores that are not right/wrong get no pass@k; another aggregation gets every sample
    assert "f1_pass@1,none" not in sampled_metrics("f1,none", [[0.5, 1.0]], [1])
    agg = sampled_metrics("bleu,none", [["a", "b"], ["c", "d"]], [1], aggregate=len)
    assert agg == {"bleu,none": 4, "bleu_stderr,none": "N/A"}


def test_task_entries_sampling_settings_validate_and_enter_the_settings_hash() -> None:
    assert TaskSpec(task="aime25", samples=16).pass_at == [1, 2, 4, 8, 16]
    assert TaskSpec(task="aime25", samples=6).pass_at == [1, 2, 4, 6]
    assert TaskSpec(task="aime25").pass_at is None
    assert TaskSpec(task="aime25", samples=1).pass_at == [1]  # through the sampled path
    with pytest.raises(ValueError, match=r"pass_at \[32\] must be between 1 and samples \(16\)"):
        TaskSpec(task="aime25", samples=16, pass_at=[1, 32])
    plain = TaskSpec(task="gsm8k", num_fewshot=8).model_dump()
    assert task_settings_hash("abc123", plain) == "abc123"  # older lines still count
    sampled = TaskSpec(task="gsm8k", num_fewshot=8, samples=4).model_dump()
    warm = TaskSpec(task="gsm8k", num_fewshot=8, gen_kwargs={"temperature": 0.6}).model_dump()
    chat = TaskSpec(task="gsm8k", num_fewshot=8, apply_chat_template=True).model_dump()
    hashes = {task_settings_hash("abc123", t) for t in (plain, sampled, warm, chat)}
    assert len(hashes) == 4


def test_samples_with_greedy_decoding_are_refused_naming_the_fix(tmp_path: Path) -> None:
    """K greedy responses are K equal ones: pass@k would be pass@1 at K times the compute."""
    from ckpt_watcher.config import load_config

    def load(task: dict[str, Any], **eval_over: Any) -> None:
        raw = base_config(tmp_path, tmp_path, tmp_path, tasks=[task], **eval_over)
        load_config(write_config(tmp_path / "w.yaml", raw))

    fix = r"give the entry gen_kwargs: \{temperature: 0.6\}"
    with pytest.raises(ConfigError, match=r"task 'addition': samples: 4 with greedy .*" + fix):
        load({"task": "addition", "samples": 4})  # eval.gen_kwargs: temperature 0, the default
    with pytest.raises(ConfigError, match="identical responses"):
        load({"task": "addition", "samples": 4, "gen_kwargs": {"do_sample": False}})
    load({"task": "addition", "samples": 4, "gen_kwargs": {"temperature": 0.6}})
    load({"task": "addition", "samples": 4}, gen_kwargs={"temperature": 0.7})
    load({"task": "addition", "samples": 1})  # one greedy response is a plain result


def test_one_task_twice_needs_a_name_on_an_entry_and_other_settings(tmp_path: Path) -> None:
    """A greedy and a sampled figure of one task: `name:` tells the entries apart."""
    from ckpt_watcher.config import load_config

    def load(*tasks: dict[str, Any]) -> Any:
        raw = base_config(tmp_path, tmp_path, tmp_path, tasks=list(tasks))
        return load_config(write_config(tmp_path / "w.yaml", raw))

    greedy = {"task": "addition", "num_fewshot": 0}
    sampled = greedy | {"samples": 4, "gen_kwargs": {"temperature": 0.6}}
    with pytest.raises(ConfigError, match="listed twice.*give each entry its own `name:`"):
        load(greedy, sampled)
    cfg = load(greedy, sampled | {"name": "addition_k"})
    assert [(t.task, t.name) for t in cfg.eval.tasks] == [
        ("addition", None),
        ("addition", "addition_k"),
    ]
    with pytest.raises(
        ConfigError, match="'addition' and 'addition_2' run 'addition' with the same"
    ):
        load(greedy, greedy | {"name": "addition_2"})  # a name alone: the same result twice
    with pytest.raises(ConfigError, match="listed twice"):
        load(sampled | {"name": "addition"}, greedy)  # a name that is another entry's task
    with pytest.raises(ConfigError, match="name"):
        load(sampled | {"name": "has space"})


def test_a_bad_pass_at_is_a_config_error_naming_the_task(tmp_path: Path) -> None:
    from ckpt_watcher.config import load_config

    raw = base_config(tmp_path, tmp_path, tmp_path)
    raw["eval"]["tasks"] = [{"task": "addition", "samples": 4, "pass_at": [8]}]
    with pytest.raises(ConfigError, match="task 'addition': pass_at"):
        load_config(write_config(tmp_path / "w.yaml", raw))


def _recs(*docs: tuple[int, list[float]]) -> Records:
    return Records(
        {},
        {
            ("t", d): {"task": "t", "doc_id": d, "scores": {"acc,none": s}, "extracted": {}}
            for d, s in docs
        },
    )


def test_flipped_documents_are_right_at_one_step_and_wrong_at_the_other() -> None:
    a = _recs((0, [1.0]), (1, [0.0]), (2, [1.0, 1.0, 0.0]), (3, [0.0]))
    b = _recs((0, [0.0]), (1, [1.0]), (2, [1.0, 0.0, 0.0]), (3, [0.0]))
    assert is_right(a.by_doc[("t", 2)], "acc,none") and not is_right(b.by_doc[("t", 2)], "acc,none")
    assert [rb["doc_id"] for _, rb in flips(a, b, "acc,none")] == [0, 1, 2]
    assert [rb["doc_id"] for _, rb in flips(a, b, "acc,none", only_wrong=True)] == [0, 2]


CUT = {
    "task": "addition",
    "name": "addition_cut",
    "num_fewshot": 0,
    "gen_kwargs": {"max_gen_toks": 2},
}
SAMPLED = {  # the same lm-eval task as a plain entry, told apart by its name
    "task": "addition",
    "name": "addition_k",
    "num_fewshot": 0,
    "samples": 8,
    "gen_kwargs": {"temperature": 0.8},
    "pass_at": [1, 2, 4, 8],
}


def _once(tmp: Path, watch: Path, tasks_dir: Path, **eval_over: Any) -> list[dict[str, Any]]:
    cfg = write_config(tmp / "w.yaml", base_config(tmp, watch, tasks_dir, **eval_over))
    return watcher_once(cfg, tmp / "ledgers", "s")


def _records(tmp: Path, line: dict[str, Any]) -> list[dict[str, Any]]:
    with gzip.open(tmp / "ledgers" / "s" / line["samples_file"], "rt") as f:
        return [json.loads(x) for x in f]


@pytest.mark.e2e
def test_sampled_task_pass_at_k_from_its_records_and_one_greedy_sample_is_plain(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    """(That a sampled task is reproducible, seeded per document and sample, record for record
    from another process: tests/test_spread.py, whose two workers recompute the task.)"""
    tmp = tmp_path / "r1"
    watch = tmp / "ckpts"
    copy_checkpoint(watch / "s_step300", same_content=True)
    entries = [
        {"task": "addition", "num_fewshot": 0},
        {"task": "addition", "name": "addition_same", "num_fewshot": 0, "samples": 1},
        SAMPLED,
        CUT,
    ]
    lines = _once(tmp, watch, addition_tasks, tasks=entries, limit=20)
    first = {ln.get("name") or ln["task"]: ln for ln in lines}
    assert sorted(first) == ["addition", "addition_cut", "addition_k", "addition_same"]
    # how long each response was and why it stopped, per response in the records; greedy
    # answers end at "\n" within the task's max_gen_toks of 4, the cut entry's 2 stop them all
    for name in ("addition", "addition_same", "addition_k"):
        check_lengths_against_records(first[name], _records(tmp, first[name]), cap=4)
    cut = check_lengths_against_records(
        first["addition_cut"], _records(tmp, first["addition_cut"]), 2
    )
    assert first["addition_cut"]["length_capped_rate"] == 1.0 and set(cut) == {(2, "length")}
    plain_measures = check_lengths_against_records(
        first["addition"], _records(tmp, first["addition"]), cap=4
    )
    assert {f for _, f in plain_measures} == {"stop"}
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tmp / "ckpts" / "s_step300")
    for rec in _records(tmp, first["addition"]):  # as generated: the answer and the "\n"
        ids = tokenizer(rec["responses"][0] + "\n", add_special_tokens=False)["input_ids"]
        assert rec["response_tokens"] == [len(ids)], rec
    line = first["addition_k"]
    assert line["task"] == "addition" and line["name"] == "addition_k"
    assert "name" not in first["addition"]
    assert line["samples"] == 8 and line["pass_at"] == [1, 2, 4, 8]
    assert line["gen_kwargs"]["temperature"] == 0.8
    check_pass_at_k_from_records(line, _records(tmp, line), 8)
    # one greedy sample through the sampled path: exactly lm-eval's own figures
    plain, same = first["addition"]["metrics"], first["addition_same"]["metrics"]
    for key in ("exact_match,none", "exact_match_stderr,none"):
        assert same[key] == plain[key], key
    assert same["exact_match_pass@1,none"] == plain["exact_match,none"]
    # a plain task's records hold lm-eval's own per-document scores
    recs = _records(tmp, first["addition"])
    assert sum(r["scores"]["exact_match,none"][0] for r in recs) / len(recs) == pytest.approx(
        plain["exact_match,none"]
    )
    assert first["addition"]["settings_hash"] != line["settings_hash"]
    out = subprocess.run(
        [*WATCHER, "samples", "-c", str(tmp / "w.yaml"), "s", "--step", "300"]
        + ["--task", "addition_k", "--max", "1"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert "/8 right" in out.stdout and "#8 " in out.stdout and "more (--max 0" in out.stdout
    # each entry its own columns, under its name
    out = subprocess.run(
        [*WATCHER, "results", "-c", str(tmp / "w.yaml"), "s", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    (row,) = json.loads(out.stdout)
    assert row["addition (0-shot) exact_match,none"] == plain["exact_match,none"]
    assert (
        row["addition_k (0-shot) exact_match_pass@8,none"]
        == (line["metrics"]["exact_match_pass@8,none"])
    )
    assert row["addition_same (0-shot) exact_match_pass@1,none"] == plain["exact_match,none"]
    # the step's table by dataset: its 20 problems and pass@1..8, as the ledger line has them
    out = subprocess.run(
        [*WATCHER, "results", "-c", str(tmp / "w.yaml"), "s", "--step", "300", "--format", "json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["dataset"]: r for r in json.loads(out.stdout)}
    assert list(rows) == ["addition_k", "addition_same", "AGGREGATE"]  # the sampled-path ones
    assert [r["problems"] for r in rows.values()] == [20, 20, 40]
    for k in (1, 2, 4, 8):
        assert rows["addition_k"][f"pass@{k}"] == line["metrics"][f"exact_match_pass@{k},none"]
    assert rows["addition_same"]["pass@1"] == plain["exact_match,none"]
    both = (plain["exact_match,none"] + line["metrics"]["exact_match_pass@1,none"]) / 2
    assert rows["AGGREGATE"]["pass@1"] == pytest.approx(both)
    assert rows["AGGREGATE"]["pass@2"] is None  # addition_same has no pass@2: not skewed


@pytest.mark.e2e
def test_a_task_entry_can_wrap_its_prompts_in_the_checkpoints_chat_template(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    """`apply_chat_template: true`, as lm_eval --apply_chat_template: the prompt the model saw
    (kept in the records) is the template's, few-shot exemplars as turns; the entry gets a
    settings hash of its own, a plain entry keeps eval's."""
    ckpt = copy_checkpoint(tmp_path / "ckpts" / "s_step300")
    tok_cfg = json.loads((ckpt / "tokenizer_config.json").read_text())
    tok_cfg["chat_template"] = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}</{{ m['role'] }}>{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    (ckpt / "tokenizer_config.json").write_text(json.dumps(tok_cfg))
    entries = [
        {"task": "addition", "num_fewshot": 0},
        {"task": "addition", "num_fewshot": 2, "apply_chat_template": True},
    ]
    lines = {
        ln["num_fewshot"]: ln
        for ln in _once(tmp_path, tmp_path / "ckpts", addition_tasks, tasks=entries, limit=5)
    }
    assert {ln["status"] for ln in lines.values()} == {"ok"}
    plain, chat = (_records(tmp_path, lines[k])[0]["prompt"] for k in (0, 2))
    assert "<user>" not in plain
    assert chat.startswith("<user>") and chat.endswith("</user><assistant>")
    assert chat.count("<user>") == 3 and chat.count("<assistant>") == 3  # 2 shots as turns
    cfg_hash = lines[0]["settings_hash"]
    assert lines[2]["settings_hash"] != cfg_hash and lines[2]["apply_chat_template"] is True
    assert "apply_chat_template" not in lines[0]


def test_a_step_to_step_change_carries_its_paired_95_percent_interval() -> None:
    """The paired t-interval over documents: known t quantiles, a clear drop is real, the same
    scores again are not, and the interval is mean ± t·sd/√n of the differences."""
    import math

    from ckpt_watcher.report.paired import paired_delta, t_quantile

    for df, exact in [(4, 2.776445), (9, 2.262157), (29, 2.045230), (1000, 1.962339)]:
        assert t_quantile(0.975, df) == pytest.approx(exact, abs=2e-3 if df == 4 else 1e-4)
    before = [1.0, 0.75, 0.5, 0.25, 1.0, 0.0, 0.5, 0.75]
    after = [b - 0.25 if b >= 0.25 else b for b in before]  # 7 of 8 documents lose 0.25
    change = paired_delta(before, after)
    d = [a - b for b, a in zip(before, after, strict=True)]
    sd = math.sqrt(sum((x - sum(d) / 8) ** 2 for x in d) / 7)
    assert change.delta == pytest.approx(-0.21875)
    assert change.high == pytest.approx(-0.21875 + t_quantile(0.975, 7) * sd / math.sqrt(8))
    assert change.real and "over 8 paired documents" in change.text()
    same = paired_delta(before, before)
    assert same.delta == 0 and not same.real and "within noise" in same.text()
    with pytest.raises(ValueError):
        paired_delta([1.0], [1.0, 0.0])


def test_length_summary_reads_its_measures_once_each_and_judges_only_with_a_marker() -> None:
    from ckpt_watcher.evaluators.lengths import summary

    measures = [(4, "stop", False), (2, "length", True), (3, "stop", None), (None, None, None)]
    got = summary(m for m in measures)  # a generator, as the harness passes it
    assert got is not None and got["measured_responses"] == 3
    assert got["response_tokens"] == {"mean": 3.0, "p50": 3.0, "p90": 3.8, "max": 4}
    assert got["length_capped_rate"] == pytest.approx(1 / 3)
    assert got["unterminated_rate"] == 0.5  # of the two judged
    assert summary(iter([(4, "stop", None)]))["unterminated_rate"] is None  # type: ignore[index]
    assert summary([]) is None
