"""Secrets out of the ledger folder and the printed status: which keys and values count."""

from __future__ import annotations

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
    assert out["sources"][0]["endpoint_url"] == f"http://user:{REDACTED}@minio:9000"
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
