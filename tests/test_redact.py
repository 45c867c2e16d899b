"""Secrets out of the ledger folder and the printed status: which keys and values count."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckpt_watcher.redact import REDACTED, Redactor, resolved, secret_key, text


def test_secret_names_and_the_settings_that_only_look_alike() -> None:
    for name in (
        "HF_TOKEN",
        "OPENAI_API_KEY",
        "api-key",
        "aws_secret_access_key",
        "password",
        "token",
        "client_secret",
        "WANDB_API_KEY",
        "credentials",
        "auth_token",
    ):
        assert secret_key(name), name
    for name in (
        "max_tokens",
        "think_end_token",
        "pad_token",
        "api_key_var",
        "tokenizer",
        "max_gen_toks",
        "env_id",
        "keep_staged",
        "primary_metric",
    ):
        assert not secret_key(name), name


def test_the_saved_config_keeps_settings_and_loses_secrets() -> None:
    data = {
        "eval": {
            "model_args": {"max_model_len": 64},
            "tasks": [
                {
                    "harness": "verifiers",
                    "name": "v",
                    "env": {"HF_TOKEN": "hf_x", "FLAG": "on"},
                    "sampling": {"max_tokens": 62},
                    "env_args": {"judge_api_key": "abc123456"},
                    "extra_args": ["--header", "Bearer sk-abcdefghijklmnop1234"],
                },
            ],
        },
        "sinks": [{"kind": "webhook", "url": "https://hooks.slack.com/services/T0/B0/XyZ"}],
        "ledger_mirror": "s3://bucket/ledgers/",
        "sources": [{"kind": "s3", "endpoint_url": "http://user:pw@minio:9000"}],
    }
    out = resolved(data)
    task = out["eval"]["tasks"][0]
    assert task["env"] == {"HF_TOKEN": REDACTED, "FLAG": REDACTED}  # every env value
    assert task["sampling"] == {"max_tokens": 62} and out["eval"]["model_args"] == {
        "max_model_len": 64
    }
    assert task["env_args"] == {"judge_api_key": REDACTED}
    assert task["extra_args"] == ["--header", f"Bearer {REDACTED}"]
    assert out["sinks"][0]["url"] == f"https://hooks.slack.com/{REDACTED}"
    assert out["ledger_mirror"] == "s3://bucket/ledgers/"
    assert out["sources"][0]["endpoint_url"] == f"http://{REDACTED}@minio:9000"
    assert data["eval"]["tasks"][0]["env"]["HF_TOKEN"] == "hf_x"  # the config itself unchanged


def test_text_loses_the_configs_secret_values_and_token_shapes_only() -> None:
    config = {
        "eval": {
            "tasks": [{"env": {"MY_KEY_TOKEN": "x", "API_KEY": "s3cret-value", "FLAG": "on"}}]
        },
        "sinks": [{"kind": "webhook", "url": "https://hooks.example/abc"}],
    }
    redact = Redactor.of(config)
    said = redact(
        "failed: key s3cret-value, flag on, posted to https://hooks.example/abc; ghp_" + "a" * 30
    )
    assert said == f"failed: key {REDACTED}, flag on, posted to {REDACTED}; {REDACTED}"
    assert text("max_tokens 62 at step 100") == "max_tokens 62 at step 100"


def test_every_env_value_is_a_secret_whatever_its_name() -> None:
    """`OPENROUTER_KEY`, `DATABRICKS_TOKEN`, `GH_TOKEN`, `HUGGING_FACE_HUB_TOKEN`, `JUDGE_KEY`:
    names no rule could list. What the user put in an entry's env is kept out of every log."""
    env = {
        "OPENROUTER_KEY": "or-v1-0123456789",
        "DATABRICKS_TOKEN": "dapi0123456789",
        "GH_TOKEN": "gh-0123456789",
        "HUGGING_FACE_HUB_TOKEN": "hub-0123456789",
        "JUDGE_KEY": "judge-0123456789",
    }
    redact = Redactor.of({"eval": {"tasks": [{"harness": "command", "env": env}]}})
    log = "\n".join(f"{k}={v} used" for k, v in env.items())
    assert redact(log) == "\n".join(f"{k}={REDACTED} used" for k in env)


def test_a_ledger_line_and_lm_evals_results_keep_the_engines_arguments_but_no_secret() -> None:
    """`eval.model_args` go into every ledger line (and lm-eval's results file, in each task's
    `metadata`), on EFS and in the S3 mirror: a token there is redacted, the settings kept."""
    from types import SimpleNamespace

    from ckpt_watcher.config import EvalConfig
    from ckpt_watcher.jobfolder import TaskOutcome
    from ckpt_watcher.ledger import result_line

    token = "hf_" + "Q" * 30
    ev = EvalConfig.model_validate(
        {
            "backend": "hf",
            "model_args": {"dtype": "float32", "hf_token": token, "api_key": "k-0123456789"},
            "tasks": [{"task": "addition", "num_fewshot": 0}],
        }
    )
    job = SimpleNamespace(
        run="r", step=1, label="r_step1", location="/c", device_label="cpu:0", attempt=1,
        id="j", settings_hash="s", run_path="r", fingerprint="f",
        tasks=[{"task": "addition", "num_fewshot": 0}],
    )  # fmt: skip
    outcome = TaskOutcome("addition", 0, "ok", metrics={"acc,none": 1.0})
    line = result_line(
        job=job, outcome=outcome, status="ok", error=None, eval_cfg=ev, ledger_dir=Path("/l")
    )
    shown = line["model_args"]
    assert (shown["dtype"], shown["hf_token"], shown["api_key"]) == ("float32", REDACTED, REDACTED)
    assert token not in json.dumps(line) and ev.model_args["hf_token"] == token
    results = {"configs": {"addition": {"metadata": {"hf_token": token, "pretrained": "/c"}}}}
    assert resolved(results)["configs"]["addition"]["metadata"] == {
        "hf_token": REDACTED,
        "pretrained": "/c",
    }


def test_text_keeps_numbers_paths_and_words_and_loses_url_credentials_and_secret_pairs() -> None:
    """An env value `1`, `true`, `8` or `/data/hf` is a setting: redacting it would blank every
    `1` of a log. A secret is redacted where it stands as a word, not inside a longer one; URL
    userinfo and the value of a secret name (`?token=`, `api_key=` in a model_args string) go."""
    env = {"CUDA_VISIBLE_DEVICES": "1", "HF_HOME": "/data/hf", "TRUST": "true", "KEY": "abc123xyz"}
    redact = Redactor.of({"eval": {"tasks": [{"env": env}]}})
    assert redact.secrets == ("abc123xyz",)
    said = redact("step 1 read /data/hf true; abc123xyz, xabc123xyzx")
    assert said == f"step 1 read /data/hf true; {REDACTED}, xabc123xyzx"
    assert text("https://bob:pw@host/x?a=1&token=t0ps3cret&b=2") == (
        f"https://{REDACTED}@host/x?a=1&token={REDACTED}&b=2"
    )
    assert text("pretrained=/c,api_key=k-1,dtype=float32") == (
        f"pretrained=/c,api_key={REDACTED},dtype=float32"
    )


def test_everything_under_a_secret_key_is_secret_and_a_harness_json_file_stays_json(
    tmp_path: Path,
) -> None:
    from ckpt_watcher.redact import in_file

    config = {"eval": {"tasks": [{"extra": {"credentials": {"user": "u", "pass": "pa55word!"}}}]}}
    assert resolved(config)["eval"]["tasks"][0]["extra"]["credentials"] == REDACTED
    redact = Redactor.of(config)
    assert "pa55word!" in redact.secrets
    results = tmp_path / "results.json"
    doc = {
        "acc": 0.5,
        "n": 12,
        "note": 'used pa55word! and "quotes"',
        "nested": [{"k": "pa55word!"}],
    }
    results.write_text(json.dumps(doc), encoding="utf-8")
    in_file(results, redact)
    back = json.loads(results.read_text(encoding="utf-8"))
    assert back == {
        "acc": 0.5, "n": 12, "note": f'used {REDACTED} and "quotes"', "nested": [{"k": REDACTED}]
    }  # fmt: skip
    clean = tmp_path / "samples.jsonl"
    clean.write_text('{"acc": 1}\n', encoding="utf-8")
    before = os.stat(clean).st_mtime_ns
    in_file(clean, redact)
    assert os.stat(clean).st_mtime_ns == before  # nothing to redact: not rewritten
