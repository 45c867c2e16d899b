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

import json
import re
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ckpt_watcher.durable import write_atomic

REDACTED = "<redacted>"
SECRET_KEY = re.compile(
    r"(?i)^(?:tokens?|authorization|cookies?|.*(?:passwords?|passwd|secrets?|api[-_.]?keys?"
    r"|access[-_.]?keys?|private[-_.]?keys?|credentials?|signature|sig"
    r"|(?:api|auth|access|hf|bearer|refresh|session)[-_.]?tokens?))$"
)
TOKEN_SHAPES = re.compile(
    r"\b(?:sk-[A-Za-z0-9_-]{16,}|hf_[A-Za-z0-9]{20,}|gh[pousr]_[A-Za-z0-9]{20,}"
    r"|xox[abprs]-[A-Za-z0-9-]{10,}|AKIA[0-9A-Z]{16})\b"
)
URL_USERINFO = re.compile(r"(?<=://)[^/\s@]+@")  # user:password@, or a token@
# name=value pairs (a URL's query, lm-eval's model_args string): the value of a secret name
NAME_VALUE = re.compile(r"(?<![\w.-])([A-Za-z][\w.-]*)=([^&#,\s\"']+)")
URL_PATH = re.compile(r"^([a-z][a-z0-9+.-]*://[^/?#]+)[/?#].*$", re.IGNORECASE)
SHORTEST_SECRET = 6  # a shorter value (`on`, `1`) is left in text: it would blank out words
# env values that are settings, never credentials: numbers, switches, absolute paths
_NOT_SECRET = re.compile(r"(?i)^(?:[-+]?[\d.]+|true|false|yes|no|on|off|none|/[^\s]*)$")


def secret_key(name: str) -> bool:
    """Whether a config key or environment variable names a secret."""
    return bool(SECRET_KEY.match(name))


def text(value: str, secrets: Iterable[str] = ()) -> str:
    """`value` with the given secret values (where they stand as words of their own, never
    inside a longer one), token shapes and URL credentials (userinfo, secret query values)
    redacted."""
    for secret in sorted(set(secrets), key=len, reverse=True):
        if len(secret) >= SHORTEST_SECRET:
            value = re.sub(rf"(?<![\w]){re.escape(secret)}(?![\w])", REDACTED, value)
    value = TOKEN_SHAPES.sub(REDACTED, value)
    value = URL_USERINFO.sub(f"{REDACTED}@", value)
    return NAME_VALUE.sub(
        lambda m: f"{m[1]}={REDACTED}" if secret_key(m[1].rsplit(".", 1)[-1]) else m[0], value
    )


def url(value: str) -> str:
    """A URL that is itself a credential (a webhook's) with its path and query redacted."""
    return text(URL_PATH.sub(rf"\1/{REDACTED}", value))


def resolved(data: Any, key: str = "") -> Any:
    """Plain settings (a config's dump, the engine's arguments, lm-eval's results) with their
    secrets redacted, for whatever is written beside the ledgers."""
    if key == "env" and isinstance(data, dict):
        return {k: REDACTED for k in data}
    if secret_key(key) and data not in (None, "", [], {}):
        return REDACTED  # all of it, whatever it holds
    if isinstance(data, dict):
        out = {k: resolved(v, str(k)) for k, v in data.items()}
        if data.get("kind") == "webhook" and isinstance(data.get("url"), str):
            out["url"] = url(data["url"])
        return out
    if isinstance(data, list | tuple):
        return [resolved(v, key) for v in data]
    if isinstance(data, str):
        return text(data)
    return data


def secret_values(data: Any, key: str = "") -> list[str]:
    """The secret values in plain config data: the values of an entry's `env` (whatever their
    name: `OPENROUTER_KEY`, `GH_TOKEN` and `JUDGE_KEY` are as secret as `HF_TOKEN`; but numbers,
    switches and paths, which are settings), everything under a secret key, webhook URLs."""
    found: list[str] = []
    if isinstance(data, dict):
        for k, v in data.items():
            if key == "env":
                if isinstance(v, str) and not _NOT_SECRET.match(v.strip()):
                    found.append(v)
            elif secret_key(str(k)) or (k == "url" and data.get("kind") == "webhook"):
                found += _leaves(v)
            else:
                found += secret_values(v, str(k))
    elif isinstance(data, list | tuple):
        for v in data:
            found += secret_values(v, key)
    return found


def _leaves(data: Any) -> list[str]:
    if isinstance(data, str):
        return [data]
    if isinstance(data, dict):
        return [x for v in data.values() for x in _leaves(v)]
    if isinstance(data, list | tuple):
        return [x for v in data for x in _leaves(v)]
    return []


def in_file(path: Path, redactor: Redactor) -> None:
    """Rewrite a file a harness left (its log, its results) with its secrets redacted; nothing
    when it holds none. JSON stays JSON: its strings are redacted, its numbers never."""
    try:
        raw = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError):  # not text: left as it is
        return
    clean = redactor(raw)
    if path.suffix in (".json", ".jsonl"):
        try:
            docs = (
                [json.loads(raw)]
                if path.suffix == ".json"
                else [json.loads(x) for x in raw.splitlines() if x.strip()]
            )
        except ValueError:
            pass
        else:  # each string redacted as it is, not as JSON escapes it
            redacted = [_strings(d, redactor) for d in docs]
            if redacted == docs:
                return
            dumped = [json.dumps(d, ensure_ascii=False) for d in redacted]
            clean = dumped[0] if path.suffix == ".json" else "".join(x + "\n" for x in dumped)
    if clean != raw:
        write_atomic(path, clean)


def _strings(data: Any, redactor: Redactor) -> Any:
    if isinstance(data, str):
        return redactor(data)
    if isinstance(data, dict):
        return {k: _strings(v, redactor) for k, v in data.items()}
    if isinstance(data, list):
        return [_strings(v, redactor) for v in data]
    return data


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
