"""Secrets kept out of what the watcher writes beside the results and prints.

The ledger folder is shared (EFS) and mirrored to S3 with the ledgers, and `watcher status`
and `doctor` are pasted into issues. A harness entry's `env` carries API keys and hub tokens
for the harness's own process; a webhook's URL is itself a credential (Slack's). So:

- every setting the watcher writes (`resolved`: the config saved beside the ledgers, the
  engine's arguments on each ledger line, lm-eval's results files) has every `env` value, every
  value under a key that names a secret (`api_key`, `hf_token`, `password`, ...), a webhook
  URL's path and a URL's password replaced by `<redacted>`;
- text the watcher writes or prints (`text`: failure messages, harness logs, its own log,
  status, doctor) has the secret values of the config (`Redactor.of(cfg)`: every value of an
  entry's `env`, whatever its name, values under secret keys, webhook URLs), well-known token
  shapes (`sk-...`, `hf_...`, `ghp_...`, `xox.-...`, `AKIA...`) and URL passwords replaced.

What a harness's process receives is not changed: it gets its environment as configured.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.durable import write_atomic

REDACTED = "<redacted>"
SECRET_KEY = re.compile(
    r"(?i)^(?:token|.*(?:password|passwd|secret|api[-_.]?key|access[-_.]?key|private[-_.]?key"
    r"|credentials?|(?:api|auth|access|hf|bearer|refresh|session)[-_.]?token))$"
)
TOKEN_SHAPES = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})\b"
)
URL_PASSWORD = re.compile(r"(?<=://)([^/\s:@]+):[^/\s@]+@")
URL_PATH = re.compile(r"^([a-z][a-z0-9+.-]*://[^/]+)/.+$", re.IGNORECASE)
SHORTEST_SECRET = 6  # a shorter value (`on`, `1`) is left in text: it would blank out words


def secret_key(name: str) -> bool:
    """Whether a config key or environment variable names a secret."""
    return bool(SECRET_KEY.match(name))


def text(value: str, secrets: Iterable[str] = ()) -> str:
    """`value` with the given secret values, token shapes and URL passwords redacted."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= SHORTEST_SECRET:
            value = value.replace(secret, REDACTED)
    value = TOKEN_SHAPES.sub(REDACTED, value)
    return URL_PASSWORD.sub(rf"\1:{REDACTED}@", value)


def url(value: str) -> str:
    """A URL that is itself a credential (a webhook's) with its path and password redacted."""
    return text(URL_PATH.sub(rf"\1/{REDACTED}", value))


def resolved(data: Any, key: str = "") -> Any:
    """Plain settings (a config's dump, the engine's arguments, lm-eval's results) with their
    secrets redacted, for whatever is written beside the ledgers."""
    if isinstance(data, dict):
        if key == "env":
            return {k: REDACTED for k in data}
        out = {k: resolved(v, str(k)) for k, v in data.items()}
        if data.get("kind") == "webhook" and isinstance(data.get("url"), str):
            out["url"] = url(data["url"])
        return out
    if isinstance(data, list):
        return [resolved(v, key) for v in data]
    if secret_key(key) and data not in (None, ""):
        return REDACTED
    if isinstance(data, str):
        return text(data)
    return data


def secret_values(data: Any, key: str = "") -> list[str]:
    """The secret values in plain config data: every value of an entry's `env` (whatever its
    name: `OPENROUTER_KEY`, `GH_TOKEN` and `JUDGE_KEY` are as secret as `HF_TOKEN`), values
    under secret keys, and webhook URLs."""
    found: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            if isinstance(v, str) and (
                key == "env" or secret_key(str(k)) or (k == "url" and data.get("kind") == "webhook")
            ):
                found.append(v)
            else:
                found += secret_values(v, str(k))
    elif isinstance(data, list):
        for v in data:
            found += secret_values(v, key)
    return found


def in_file(path: Path, redactor: Redactor) -> None:
    """Rewrite a log in place with its secrets redacted (a harness's own output, kept in the
    ledger folder); nothing when it holds none."""
    try:
        raw = path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return
    clean = redactor(raw)
    if clean != raw:
        write_atomic(path, clean)


@dataclass(frozen=True)
class Redactor:
    """Redacts one config's secrets (and well-known token shapes) from text."""

    secrets: tuple[str, ...] = ()

    @classmethod
    def of(cls, config: Any) -> Redactor:
        """For a WatcherConfig, or its plain data."""
        data = config.model_dump(mode="json") if hasattr(config, "model_dump") else config
        return cls(tuple(secret_values(data)))

    def __call__(self, value: str) -> str:
        return text(value, self.secrets)
