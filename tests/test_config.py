"""Config loading: defaults, --set overrides, and bad configs rejected with the field named."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import yaml

from ckpt_watcher.config import apply_overrides, load_config, parse_config
from ckpt_watcher.errors import ConfigError

from .conftest import WATCHER

MINIMAL = {
    "sources": [{"kind": "local", "path": "/data/ckpts"}],
    "eval": {"tasks": [{"task": "gsm8k", "num_fewshot": 8}]},
}


def test_minimal_config_gets_the_contract_defaults() -> None:
    cfg = parse_config(MINIMAL)
    assert cfg.eval.backend == "vllm"
    assert cfg.eval.tensor_parallel_size == 1
    assert cfg.eval.seed == 42
    assert cfg.eval.gen_kwargs == {"temperature": 0}
    assert cfg.eval.model_args["max_model_len"] == 4096
    assert cfg.devices.gpus == "all"
    assert cfg.policy.order == "newest_first"
    assert cfg.sources[0].poll_seconds == 30
    assert cfg.stable_seconds == 120


def test_example_configs_in_repo_are_valid() -> None:
    cfg = load_config(Path(__file__).parents[1] / "configs" / "example.yaml")
    assert [t.task for t in cfg.eval.tasks] == ["gsm8k", "mbpp"]
    assert cfg.eval.tasks[1].allow_code_execution is True
    path = Path(__file__).parents[1] / "configs" / "sagemaker-sidecar.yaml"
    sidecar = load_config(path)
    assert sidecar.devices.gpus == [6, 7] and sidecar.ledger_mirror
    # the recipe's last `watcher once`, once training has ended: every GPU (the idle rule holds)
    at_end = load_config(path, ["devices.gpus=all"])
    assert at_end.devices.gpus == "all" and at_end.devices.idle_memory_mib == 1024


@pytest.mark.parametrize(
    "raw, message",
    [
        (
            {"soruces": MINIMAL["sources"], "eval": MINIMAL["eval"]},
            "config field soruces: unknown key 'soruces' (did you mean 'sources'?)",
        ),
        (
            MINIMAL | {"eval": {"tasks": [{"task": "gsm8k"}], "max_atempts": 2}},
            "config field eval.max_atempts: unknown key 'max_atempts' (did you mean 'max_attempts'?)",
        ),
        (
            MINIMAL | {"sources": [{"kind": "s3", "uri": "s3://b/p/", "endpont_url": "x"}]},
            "config field sources[0].endpont_url: unknown key 'endpont_url' (did you mean 'endpoint_url'?)",
        ),
        (
            MINIMAL | {"zzz": 1},
            "config field zzz: unknown key 'zzz' (check its spelling and docs/reference/config.md)",
        ),
    ],
)
def test_a_misspelt_key_names_itself_and_the_closest_valid_key(raw: dict, message: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    assert str(e.value).startswith(message), str(e.value)


def test_set_overrides_nested_keys_lists_and_types() -> None:
    raw = yaml.safe_load(yaml.safe_dump(MINIMAL))
    cfg = parse_config(
        raw,
        [
            "eval.model_args.max_model_len=2048",
            "sources.0.poll_seconds=5",
            "devices.gpus=[6, 7]",
            "eval.seed=7",
            "policy.skip_superseded=true",
        ],
    )
    assert cfg.eval.model_args["max_model_len"] == 2048
    assert cfg.sources[0].poll_seconds == 5
    assert cfg.devices.gpus == [6, 7]
    assert cfg.eval.seed == 7
    assert cfg.policy.skip_superseded is True


def test_settings_hash_ignores_memory_knobs_but_not_scoring_settings() -> None:
    a = parse_config(MINIMAL)
    b = parse_config(MINIMAL, ["eval.model_args.gpu_memory_utilization=0.5"])
    c = parse_config(MINIMAL, ["eval.seed=1"])
    d = parse_config(MINIMAL, ["eval.model_args.max_model_len=2048"])
    assert a.eval.settings_hash() == b.eval.settings_hash()
    assert a.eval.settings_hash() != c.eval.settings_hash()
    assert a.eval.settings_hash() != d.eval.settings_hash()


# (description, raw config or YAML text, substring the one-line message must contain)
BAD = [
    ("no sources", {"eval": MINIMAL["eval"]}, "sources"),
    ("empty sources", {**MINIMAL, "sources": []}, "sources"),
    ("no eval", {"sources": MINIMAL["sources"]}, "eval"),
    ("no tasks", {**MINIMAL, "eval": {}}, "eval.tasks"),
    ("empty tasks", {**MINIMAL, "eval": {"tasks": []}}, "eval.tasks"),
    ("unknown top key", {**MINIMAL, "stat_dir": "/x"}, "stat_dir"),
    ("unknown eval key", {**MINIMAL, "eval": {**MINIMAL["eval"], "seeds": 1}}, "eval.seeds"),
    ("unknown source kind", {**MINIMAL, "sources": [{"kind": "ftp", "path": "/x"}]}, "sources[0]"),
    ("local without path", {**MINIMAL, "sources": [{"kind": "local"}]}, "sources[0].path"),
    ("s3 bad uri", {**MINIMAL, "sources": [{"kind": "s3", "uri": "bucket/x"}]}, "sources[0].uri"),
    (
        "negative poll",
        {**MINIMAL, "sources": [{"kind": "local", "path": "/x", "poll_seconds": -1}]},
        "sources[0].poll_seconds",
    ),
    (
        "poll not a number",
        {**MINIMAL, "sources": [{"kind": "local", "path": "/x", "poll_seconds": "soon"}]},
        "sources[0].poll_seconds",
    ),
    (
        "tp 2 refused",
        {**MINIMAL, "eval": {**MINIMAL["eval"], "tensor_parallel_size": 2}},
        "tensor_parallel",
    ),
    ("backend typo", {**MINIMAL, "eval": {**MINIMAL["eval"], "backend": "vlm"}}, "eval.backend"),
    (
        "negative fewshot",
        {**MINIMAL, "eval": {"tasks": [{"task": "gsm8k", "num_fewshot": -1}]}},
        "eval.tasks[0].num_fewshot",
    ),
    (
        "task without name",
        {**MINIMAL, "eval": {"tasks": [{"num_fewshot": 1}]}},
        "eval.tasks[0].task",
    ),
    (
        "duplicate task",
        {**MINIMAL, "eval": {"tasks": [{"task": "a", "num_fewshot": 1}] * 2}},
        "listed twice",
    ),
    (
        "pretrained in model_args",
        {**MINIMAL, "eval": {**MINIMAL["eval"], "model_args": {"pretrained": "x"}}},
        "pretrained",
    ),
    ("cpu_slots negative", {**MINIMAL, "devices": {"cpu_slots": -1}}, "devices.cpu_slots"),
    ("gpus wrong type", {**MINIMAL, "devices": {"gpus": "some"}}, "devices.gpus"),
    ("order typo", {**MINIMAL, "policy": {"order": "newest"}}, "policy.order"),
    ("every_n_steps zero", {**MINIMAL, "policy": {"every_n_steps": 0}}, "policy.every_n_steps"),
    (
        "max_attempts zero",
        {**MINIMAL, "eval": {**MINIMAL["eval"], "max_attempts": 0}},
        "eval.max_attempts",
    ),
    ("executor typo", {**MINIMAL, "executor": {"kind": "slurm"}}, "executor.kind"),
    ("mirror not s3", {**MINIMAL, "ledger_mirror": "/tmp/x"}, "ledger_mirror"),
    ("top level a list", [1, 2], "top level"),
    ("tasks not a list", {**MINIMAL, "eval": {"tasks": "gsm8k"}}, "eval.tasks"),
]


@pytest.mark.parametrize("raw,needle", [(b[1], b[2]) for b in BAD], ids=[b[0] for b in BAD])
def test_bad_config_is_one_line_naming_the_field(raw: object, needle: str) -> None:
    with pytest.raises(ConfigError) as e:
        parse_config(raw)
    msg = str(e.value)
    assert "\n" not in msg
    assert needle in msg


@pytest.mark.parametrize(
    "override,needle",
    [
        ("eval", "KEY=VALUE"),
        ("eval.seed=[1", "eval.seed"),
        ("sources.5.path=/x", "index 5"),
        (".a=1", "empty key"),
    ],
)
def test_bad_override_is_rejected(override: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=None) as e:
        apply_overrides({"sources": [{}]}, [override])
    assert needle in str(e.value)


def test_cli_exits_2_with_one_line_for_bad_yaml_and_bad_field(tmp_path: Path) -> None:
    bad_yaml = tmp_path / "bad.yaml"
    bad_yaml.write_text("sources: [\n  - kind: local\n eval: {")
    r = subprocess.run([*WATCHER, "once", "-c", str(bad_yaml)], capture_output=True, text=True)
    assert r.returncode == 2
    assert "invalid YAML at line" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1

    bad_field = tmp_path / "field.yaml"
    bad_field.write_text(
        yaml.safe_dump({**MINIMAL, "eval": {"tasks": [{"task": "x", "num_fewshot": "eight"}]}})
    )
    r = subprocess.run([*WATCHER, "run", "-c", str(bad_field)], capture_output=True, text=True)
    assert r.returncode == 2
    assert r.stderr.strip().startswith("watcher: config field eval.tasks[0].num_fewshot:")
    assert len(r.stderr.strip().splitlines()) == 1

    missing = tmp_path / "nope.yaml"
    r = subprocess.run([*WATCHER, "run", "-c", str(missing)], capture_output=True, text=True)
    assert r.returncode == 2 and "does not exist" in r.stderr

    r = subprocess.run(
        [*WATCHER, "run", "-c", str(bad_field), "--set", "eval.tasks=[]"],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 2 and "eval.tasks" in r.stderr


def test_model_args_merge_over_defaults_and_null_drops_one() -> None:
    cfg = parse_config(MINIMAL, ["eval.model_args.max_model_len=2048"])
    assert cfg.eval.model_args == {
        "dtype": "bfloat16",
        "gpu_memory_utilization": 0.8,
        "max_model_len": 2048,
    }
    cfg = parse_config(MINIMAL, ["eval.model_args.gpu_memory_utilization=null"])
    assert "gpu_memory_utilization" not in cfg.eval.model_args
