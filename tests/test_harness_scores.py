"""The verifiers harness's scores from both output formats its users have (0.4's traces.jsonl,
0.3's results.jsonl + metadata.json), computed by hand here for a few rollouts."""

from __future__ import annotations

import json
from pathlib import Path

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
