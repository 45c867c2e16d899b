"""The verifiers harness's scores from both output formats its users have (0.4's traces.jsonl,
0.3's results.jsonl + metadata.json), computed by hand here for a few rollouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.harnesses.verifiers import find_output, read_results, read_traces, score


def test_verifiers_0_3_results_and_metadata_give_rewards_pass_at_k_and_errors(
    tmp_path: Path,
) -> None:
    rows = [
        {
            "example_id": 0,
            "prompt": [{"role": "user", "content": "1+1"}],
            "completion": [{"role": "assistant", "content": "2"}],
            "answer": "2",
            "reward": 1.0,
            "correct": 1.0,
        },
        {
            "example_id": 0,
            "prompt": "1+1",
            "completion": "3",
            "answer": "2",
            "reward": 0.0,
            "correct": 0.0,
        },
        {
            "example_id": 1,
            "prompt": "2+2",
            "completion": "4",
            "answer": "4",
            "reward": 1.0,
            "correct": 1.0,
        },
        {
            "example_id": 1,
            "prompt": "2+2",
            "completion": "",
            "answer": "4",
            "reward": 0.0,
            "correct": 0.0,
            "error": "timeout",
        },
    ]
    folder = tmp_path / "evals" / "env--model" / "abc"
    folder.mkdir(parents=True)
    (folder / "results.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (folder / "metadata.json").write_text(
        json.dumps({"avg_reward": 0.5, "avg_metrics": {"correct": 0.5}})
    )
    found = find_output(tmp_path)
    assert found == folder / "results.jsonl"
    parsed = score(read_results(found), "sums")
    assert parsed.metrics["reward"] == pytest.approx(0.5)
    assert parsed.metrics["reward/correct"] == pytest.approx(0.5)
    assert parsed.metrics["error_rate"] == pytest.approx(0.25)
    # each example: 1 of 2 right -> pass@1 = 0.5, pass@2 = 1
    assert parsed.metrics["reward_pass@1"] == pytest.approx(0.5)
    assert parsed.metrics["reward_pass@2"] == pytest.approx(1.0)
    assert parsed.n_samples == 2
    rec = parsed.records[0]
    assert rec["responses"] == ["2", "3"] and rec["scores"]["reward,none"] == [1.0, 0.0]


def test_verifiers_0_4_traces_weigh_rewards_and_count_an_unfinished_episode_as_an_error(
    tmp_path: Path,
) -> None:
    def episode(
        idx: int, correct: float, fmt: float, ok: bool = True, errors: list | None = None
    ) -> dict:
        return {
            "task": {"data": {"idx": idx, "prompt": f"q{idx}", "answer": "a"}},
            "ok": ok,
            "errors": errors or [],
            "traces": [
                {
                    "nodes": [
                        {"message": {"role": "user", "content": "q"}},
                        {"message": {"role": "assistant", "content": "r"}},
                    ],
                    "rewards": {
                        "correct": {"score": correct, "weight": 1.0},
                        "format": {"score": fmt, "weight": 0.5},
                    },
                }
            ],
        }

    eps = [
        episode(0, 1.0, 1.0),
        episode(0, 0.0, 1.0),
        episode(1, 1.0, 0.0, ok=False, errors=[{"message": "boom"}]),
    ]
    path = tmp_path / "run" / "traces.jsonl"
    path.parent.mkdir()
    path.write_text("".join(json.dumps(e) + "\n" for e in eps))
    parsed = score(read_traces(path), "t")
    # weighted: 1.5, 0.5, and the errored one 0
    assert parsed.metrics["reward"] == pytest.approx((1.5 + 0.5 + 0.0) / 3)
    assert parsed.metrics["reward/correct"] == pytest.approx(1 / 3)
    assert parsed.metrics["reward/format"] == pytest.approx(2 / 3)
    assert parsed.metrics["error_rate"] == pytest.approx(1 / 3)
    assert not any(k.startswith("reward_pass@") for k in parsed.metrics)  # rewards not all 0/1
    assert parsed.records[1]["errors"] == ["boom"]


def _rollouts(means: list[float], k: int = 4) -> list[dict[str, Any]]:
    """k rollouts per example whose 0/1 `correct` rewards average to each of `means`."""
    out = []
    for example, mean in enumerate(means):
        right = round(mean * k)
        for i in range(k):
            score_ = 1.0 if i < right else 0.0
            out.append(
                {
                    "example": example,
                    "prompt": f"{example}+{example}",
                    "answer": str(2 * example),
                    "reply": "x",
                    "scores": {"correct": score_},
                    "reward": score_,
                    "error": None,
                }
            )
    return out


def test_rewards_carry_their_standard_error_over_examples() -> None:
    parsed = score(_rollouts([1.0, 0.5, 0.0]), "sums")
    assert parsed.metrics["reward"] == pytest.approx(0.5)
    # per-example means 1, 0.5, 0: sample variance 0.25, over 3 examples
    assert parsed.metrics["reward_stderr"] == pytest.approx((0.25 / 3) ** 0.5)
    assert parsed.metrics["reward/correct_stderr"] == pytest.approx((0.25 / 3) ** 0.5)
    assert "reward_stderr" not in score(_rollouts([1.0]), "sums").metrics  # one example: none


def test_a_verifiers_result_is_shown_like_any_other(tmp_path: Path) -> None:
    """Its ledger lines reach the results table (with their stderr), W&B, Prometheus and the
    regression alerts as an lm-eval task's do."""
    from click.testing import CliRunner
    from prometheus_client import generate_latest

    from ckpt_watcher.cli import main
    from ckpt_watcher.ledger import append
    from ckpt_watcher.sinks.alerts import RegressionWatch
    from ckpt_watcher.sinks.prometheus import DaemonMetrics
    from ckpt_watcher.sinks.wandb import logged_values

    from .conftest import idle_config

    good, bad = [1.0] * 12 + [0.5] * 4 + [0.0] * 4, [0.0] * 14 + [0.5] * 6
    lines = [
        {
            "schema": 1,
            "run": "r",
            "run_path": "r",
            "step": step,
            "label": f"r_step{step}",
            "task": "sums",
            "name": "sums",
            "num_fewshot": None,
            "status": "ok",
            "metrics": score(_rollouts(means), "sums").metrics,
            "harness": "verifiers",
            "harness_version": "0.4.0",
            "duration_s": 12.5,
        }
        for step, means in ((100, good), (200, bad))
    ]
    watch = RegressionWatch(2.0, [], "base")
    assert watch.observe(lines[0]) == []
    found = watch.observe(lines[1])
    assert {r.metric for r in found} >= {"reward", "reward/correct"}, found
    logged = logged_values(lines[1])
    assert logged is not None and logged["train/step"] == 200
    assert logged["eval/sums/default/reward"] == pytest.approx(lines[1]["metrics"]["reward"])
    assert not any(k.endswith("_stderr") for k in logged)
    m = DaemonMetrics()
    for line in lines:
        m.ledger_line(line)
    exposed = generate_latest(m.registry).decode()
    assert 'ckpt_watcher_ledger_lines_total{status="ok"} 2.0' in exposed
    assert 'ckpt_watcher_eval_seconds_count{task="sums"} 2.0' in exposed
    cfg = idle_config(tmp_path)  # its ledger_dir is tmp_path / "l"
    for line in lines:
        append(tmp_path / "l", line)
    out = CliRunner().invoke(main, ["results", "-c", str(cfg), "r", "--format", "json"])
    assert out.exit_code == 0, out.output
    rows = json.loads(out.output)
    assert [r["step"] for r in rows] == [100, 200]
    reward = "sums reward"  # no "(default-shot)": shots are lm-eval's
    assert rows[0][reward] > rows[1][reward] == pytest.approx(lines[1]["metrics"]["reward"])
