"""Suites (`{suite: NAME}` in eval.tasks, `watcher suites`, `results --suite`) and baselines
(`baseline.metrics`: a first row and a Δ column per metric in `watcher results`)."""

from __future__ import annotations

import csv
import io
import json
from pathlib import Path
from typing import Any

import pytest
import yaml
from click.testing import CliRunner

from ckpt_watcher.cli import main
from ckpt_watcher.config import WatcherConfig
from ckpt_watcher.errors import ConfigError
from ckpt_watcher.ledger import append
from ckpt_watcher.preflight import task_problems

from .conftest import COMPILE_CACHE, write_config


def _config(tmp: Path, tasks: list[Any], **extra: Any) -> dict[str, Any]:
    return {
        "state_dir": str(tmp / "state"),
        "ledger_dir": str(tmp / "ledgers"),
        "sources": [{"kind": "local", "path": str(tmp)}],
        "eval": {"tasks": tasks} | extra.pop("eval", {}),
        **extra,
    }


def test_base_model_suite_expands_to_the_battery_with_code_only_for_mbpp_and_humaneval(
    tmp_path: Path,
) -> None:
    cfg = WatcherConfig.model_validate(_config(tmp_path, [{"suite": "base-model"}]))
    got = [(t.task, t.num_fewshot) for t in cfg.eval.tasks]
    assert got == [
        ("gsm8k", 4),
        ("gsm8k", 8),
        ("gsm8k_cot", 4),
        ("gsm8k_cot", 8),
        ("minerva_math", 4),
        ("math_qwen", 4),
        ("ifeval", 0),
        ("mbpp", 3),
        ("humaneval", 0),
    ]
    assert {t.task for t in cfg.eval.tasks if t.allow_code_execution} == {"mbpp", "humaneval"}
    assert all(t.samples == 1 and t.pass_at is None and not t.gen_kwargs for t in cfg.eval.tasks)
    assert cfg.eval.seed == 42 and cfg.eval.tensor_parallel_size == 1
    assert cfg.eval.model_args["max_model_len"] == 4096


def test_math_passk_suite_is_seven_sets_of_16_samples_with_pass_at_1_to_16(tmp_path: Path) -> None:
    cfg = WatcherConfig.model_validate(
        _config(tmp_path, [{"suite": "math-passk"}, {"task": "gsm8k", "num_fewshot": 8}])
    )
    passk = cfg.eval.tasks[:7]
    assert [t.task for t in passk] == [
        "passk_aime24",
        "passk_aime25",
        "passk_amc",
        "passk_amc25",
        "passk_math500",
        "passk_minerva",
        "passk_olympiadbench",
    ]
    for t in passk:
        assert t.samples == 16 and t.pass_at == list(range(1, 17))
        assert t.gen_kwargs == {"temperature": 0.6, "top_p": 0.95}
    assert cfg.eval.tasks[7].task == "gsm8k"  # entries beside a suite stay


def test_suite_errors_name_the_fix(tmp_path: Path) -> None:
    def error(tasks: list[Any], **extra: Any) -> str:
        with pytest.raises(ConfigError) as e:
            write_config(tmp_path / "w.yaml", _config(tmp_path, tasks, **extra))
            from ckpt_watcher.config import load_config

            load_config(tmp_path / "w.yaml")
        return str(e.value)

    assert "did you mean 'base-model'" in error([{"suite": "base-modle"}])
    assert "takes only `suite`" in error([{"suite": "math-passk", "samples": 4}])
    twice = error([{"suite": "base-model"}, {"task": "ifeval", "num_fewshot": 0}])
    assert "listed twice" in twice and "suite" in twice


def test_a_users_suite_path_adds_suites_and_replaces_a_shipped_one_by_name(tmp_path: Path) -> None:
    mine = tmp_path / "suites"
    mine.mkdir()
    (mine / "quick.yaml").write_text(
        yaml.safe_dump({"tasks": [{"task": "gsm8k", "num_fewshot": 8, "headline": ["x,y"]}]})
    )
    (mine / "override.yaml").write_text(
        yaml.safe_dump({"name": "base-model", "tasks": [{"task": "ifeval"}]})
    )
    data = _config(
        tmp_path, [{"suite": "quick"}, {"suite": "base-model"}], eval={"suite_path": str(mine)}
    )
    cfg = WatcherConfig.model_validate(data)
    assert [t.task for t in cfg.eval.tasks] == ["gsm8k", "ifeval"]
    path = write_config(tmp_path / "w.yaml", data)
    out = CliRunner().invoke(main, ["suites", "-c", str(path)])
    assert out.exit_code == 0, out.output
    assert "quick" in out.output and "- gsm8k (8-shot): x,y" in out.output
    assert "math-passk" in out.output and "- passk_amc25 (0-shot; K=16" in out.output


def test_suite_task_names_resolve_offline_from_the_task_index(tmp_path: Path) -> None:
    """Names resolve against lm-eval's YAML index and the shipped tasks, on this machine:
    no dataset is fetched to check a name, so it works where the Hub cannot be reached."""
    data = _config(tmp_path, [{"suite": "base-model"}, {"suite": "math-passk"}])
    data["eval"]["compile_cache_dir"] = str(COMPILE_CACHE)  # lm-eval's index: once per test run
    cfg = WatcherConfig.model_validate(data)
    assert task_problems(cfg) == []


def _lines(ledgers: Path) -> None:
    for step, flex, se in [(100, 0.60, 0.013), (200, 0.70, 0.013), (300, 0.695, 0.013)]:
        append(
            ledgers,
            {
                "run": "r",
                "step": step,
                "label": f"r_step{step}",
                "task": "gsm8k",
                "num_fewshot": 4,
                "status": "ok",
                "metrics": {
                    "exact_match,flexible-extract": flex,
                    "exact_match_stderr,flexible-extract": se,
                    "exact_match,strict-match": flex - 0.1,
                    "exact_match_stderr,strict-match": se,
                    "other,none": 1.0,
                },
            },
        )


BASELINE = {
    "name": "Qwen3-1.7B-Base",
    "metrics": [
        {
            "task": "gsm8k",
            "num_fewshot": 4,
            "metrics": {
                "exact_match,flexible-extract": 0.6861,
                "exact_match_stderr,flexible-extract": 0.0128,
                "exact_match,strict-match": 0.5944,
            },
        }
    ],
}


def test_results_suite_columns_baseline_row_and_delta_marked_beyond_two_stderr(
    tmp_path: Path,
) -> None:
    _lines(tmp_path / "ledgers")
    cfg = write_config(
        tmp_path / "w.yaml", _config(tmp_path, [{"suite": "base-model"}], baseline=BASELINE)
    )
    run = CliRunner().invoke(
        main, ["results", "-c", str(cfg), "r", "--suite", "base-model", "--format", "csv"]
    )
    assert run.exit_code == 0, run.output
    rows = list(csv.reader(io.StringIO(run.output)))
    head = rows[0]
    flex = "gsm8k (4-shot) exact_match,flexible-extract"
    assert head[:5] == [
        "step",
        flex,
        f"Δ {flex}",
        "gsm8k (4-shot) exact_match,strict-match",
        "Δ gsm8k (4-shot) exact_match,strict-match",
    ]
    assert "humaneval (0-shot) pass@1,create_test" in head  # every headline column, even empty
    assert not any("other" in h for h in head)  # only the suite's headline metrics
    by_step = {r[0]: dict(zip(head, r, strict=True)) for r in rows[1:]}
    assert by_step["Qwen3-1.7B-Base"][flex] == "0.6861"
    # 2 x sqrt(0.013² + 0.0128²) = 0.0365: -0.0861 and +0.0139 and +0.0089
    assert by_step["100"][f"Δ {flex}"] == "-0.0861*"
    assert by_step["200"][f"Δ {flex}"] == "+0.0139"
    assert by_step["300"][f"Δ {flex}"] == "+0.0089"
    # strict-match has no baseline stderr: the checkpoint's alone (2 x 0.013 = 0.026)
    assert by_step["200"]["Δ gsm8k (4-shot) exact_match,strict-match"] == "+0.0056"
    assert by_step["100"]["Δ gsm8k (4-shot) exact_match,strict-match"] == "-0.0944*"
    md = CliRunner().invoke(
        main, ["results", "-c", str(cfg), "r", "--suite", "base-model", "--format", "md"]
    )
    assert md.exit_code == 0 and md.output.splitlines()[2].startswith("| Qwen3-1.7B-Base |")
    # --stderr: each metric's stderr right beside it, then its Δ
    with_se = CliRunner().invoke(
        main,
        ["results", "-c", str(cfg), "r", "--suite", "base-model", "--format", "csv", "--stderr"],
    )
    assert with_se.exit_code == 0, with_se.output
    assert next(csv.reader(io.StringIO(with_se.output)))[:4] == [
        "step",
        flex,
        "gsm8k (4-shot) exact_match_stderr,flexible-extract",
        f"Δ {flex}",
    ]
    # without --suite: every metric, the baseline's Δ where it has a number
    full = json.loads(
        CliRunner().invoke(main, ["results", "-c", str(cfg), "r", "--format", "json"]).output
    )
    assert full[0]["step"] == "Qwen3-1.7B-Base" and "Δ gsm8k (4-shot) other,none" not in full[0]
    assert full[1]["gsm8k (4-shot) other,none"] == 1.0
    bad = CliRunner().invoke(main, ["results", "-c", str(cfg), "r", "--suite", "nope"])
    assert bad.exit_code == 2 and "unknown suite 'nope'" in bad.output


def test_one_step_of_math_passk_by_dataset_with_an_aggregate_weighted_by_problems(
    tmp_path: Path,
) -> None:
    """`watcher results RUN --step N --suite math-passk`: DeepScaleR's table."""
    sets = {"passk_aime24": 30, "passk_amc": 83, "passk_math500": 500}
    for step in (100, 200):
        for i, (task, problems) in enumerate(sets.items()):
            metrics = {}
            for k in range(1, 17):
                p = round(min(1.0, 0.1 * (i + 1) + 0.02 * k + step / 10_000), 4)
                metrics[f"math_verify_pass@{k},final-answer"] = p
                metrics[f"math_verify_pass@{k}_stderr,final-answer"] = 0.01
                metrics[f"exact_match_pass@{k},none"] = 0.0  # another metric: not shown
            metrics["math_verify,final-answer"] = metrics["math_verify_pass@1,final-answer"]
            line = {"run": "r", "step": step, "label": f"r_step{step}", "task": task}
            append(
                tmp_path / "ledgers",
                line
                | {
                    "num_fewshot": 0,
                    "status": "ok",
                    "metrics": metrics,
                    "samples": 16,
                    "pass_at": list(range(1, 17)),
                    "n_samples": problems,
                },
            )
    cfg = write_config(tmp_path / "w.yaml", _config(tmp_path, [{"suite": "math-passk"}]))

    def results(*args: str) -> Any:
        return CliRunner().invoke(main, ["results", "-c", str(cfg), "r", *args])

    out = results("--step", "200", "--suite", "math-passk", "--format", "json")
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["dataset"] for r in rows] == [*sets, "AGGREGATE"]  # the suite's order
    assert [r["problems"] for r in rows] == [30, 83, 500, 613]
    assert list(rows[0]) == ["dataset", "problems", *(f"pass@{k}" for k in range(1, 17))]
    assert rows[0]["pass@1"] == pytest.approx(0.14) and rows[2]["pass@16"] == 0.64
    for k in (1, 8, 16):
        weighted = sum(r["problems"] * r[f"pass@{k}"] for r in rows[:3]) / 613
        assert rows[3][f"pass@{k}"] == pytest.approx(weighted)
    # without --suite: every sampled task at that step; csv and md too
    csv_out = results("--step", "100", "--format", "csv")
    assert csv_out.exit_code == 0
    table = list(csv.reader(io.StringIO(csv_out.output)))
    assert table[0][:3] == ["dataset", "problems", "pass@1"] and table[-1][:2] == [
        "AGGREGATE",
        "613",
    ]
    md = results("--step", "100", "--format", "md").output.splitlines()
    assert md[0].startswith("| dataset | problems | pass@1 |") and md[-1].startswith(
        "| AGGREGATE |"
    )
    none = results("--step", "150", "--suite", "math-passk")
    assert none.exit_code == 1 and "steps with sampled results: 100, 200" in none.output
