"""Is a checkpoint directory completely written? The contract's rules, in order of trust:

1. a marker the writer leaves last (`.checkpoint_complete`, `STABLE`, DCP `.metadata`);
2. else every `*.safetensors` file is exactly as long as its header says, every shard of a
   `-0000k-of-0000n` series and every file the index names exists (after the naming fix),
   `config.json` parses, and an HF Trainer folder has its last file, `trainer_state.json`;
3. else (other weight formats) no size or mtime change across `stable_seconds`.

An incomplete checkpoint is never evaluated. The check reads only file metadata and headers.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path

from ckpt_watcher.checkpoints.namefix import plan_fix
from ckpt_watcher.checkpoints.safetensors_header import HeaderUnreadable, read_header
from ckpt_watcher.errors import NamingFixError

MARKERS = (".checkpoint_complete", "STABLE", ".metadata")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf")


@dataclass(frozen=True)
class Completeness:
    """The verdict: `ready`, `incomplete` (may still become ready) or `invalid` (will not)."""

    state: str
    reason: str
    fingerprint: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "ready"


def fingerprint(ckpt: Path) -> str:
    """Names, sizes and mtimes of every file in the checkpoint: changes whenever a write lands."""
    parts = []
    for p in sorted(ckpt.rglob("*")):
        try:
            st = p.lstat()
        except OSError:
            continue
        parts.append(f"{p.relative_to(ckpt)}:{st.st_size}:{st.st_mtime_ns}")
    return "\n".join(parts)


def check(
    ckpt: Path,
    *,
    now: float,
    stable_seconds: float,
    unchanged_since: float | None = None,
    previous_fingerprint: str | None = None,
) -> Completeness:
    """Decide whether `ckpt` is complete. Time is passed in; nothing is slept.

    For the stability fallback the caller keeps the previous fingerprint and since when it has
    not changed, and passes both back on the next call.
    """
    for marker in MARKERS:
        if (ckpt / marker).exists():
            cfg = _config_problem(ckpt)
            if cfg:
                return Completeness("invalid", f"marker {marker} present but {cfg}")
            return Completeness("ready", f"marker {marker}")

    shards = sorted(p for p in ckpt.glob("*.safetensors") if p.is_file())
    if shards:
        return _check_safetensors(ckpt, shards)

    if not any(any(ckpt.glob(pat)) for pat in _OTHER_WEIGHTS):
        return Completeness("incomplete", "no weight files yet")
    fp = fingerprint(ckpt)
    if previous_fingerprint != fp or unchanged_since is None:
        return Completeness(
            "incomplete", f"waiting {stable_seconds:g}s without writes (no marker)", fp
        )
    quiet = now - unchanged_since
    if quiet < stable_seconds:
        return Completeness(
            "incomplete", f"unchanged for {quiet:.0f}s of {stable_seconds:g}s (no marker)", fp
        )
    cfg = _config_problem(ckpt)
    if cfg:
        return Completeness("incomplete", cfg, fp)
    return Completeness("ready", f"unchanged for {quiet:.0f}s", fp)


def _check_safetensors(ckpt: Path, shards: list[Path]) -> Completeness:
    for p in shards:
        try:
            header = read_header(p)
            size = p.stat().st_size
        except HeaderUnreadable as e:
            if e.corrupt:
                return Completeness("invalid", f"{p.name}: corrupt safetensors header: {e}")
            return Completeness("incomplete", f"{p.name}: {e}")
        except OSError as e:
            return Completeness("incomplete", f"{p.name}: cannot read ({e.strerror})")
        if size < header.expected_size:
            return Completeness(
                "incomplete", f"{p.name}: {size} of {header.expected_size} bytes written"
            )
        if size > header.expected_size:
            return Completeness(
                "invalid",
                f"{p.name}: {size} bytes but its header accounts for {header.expected_size}: "
                "corrupt file",
            )
    series = _shard_series_gap(shards)
    if series:
        return Completeness("incomplete", series)
    try:
        plan_fix(ckpt)
    except NamingFixError as e:
        return Completeness("incomplete", str(e))
    cfg = _config_problem(ckpt)
    if cfg:
        return Completeness("incomplete", cfg)
    if (ckpt / "training_args.bin").exists() and not (ckpt / "trainer_state.json").exists():
        # The HF Trainer writes trainer_state.json last; tokenizer files may still be coming.
        return Completeness("incomplete", "HF Trainer folder without trainer_state.json yet")
    return Completeness("ready", f"{len(shards)} safetensors file(s) complete")


def _shard_series_gap(shards: list[Path]) -> str:
    totals: dict[int, set[int]] = {}
    for p in shards:
        m = _SHARD.search(p.name)
        if m:
            totals.setdefault(int(m[2]), set()).add(int(m[1]))
    for total, have in totals.items():
        if len(have) < total:
            return f"{len(have)} of {total} shards present"
    return ""


def _config_problem(ckpt: Path) -> str:
    path = ckpt / "config.json"
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return "config.json not written yet"
    except (OSError, UnicodeDecodeError, ValueError):
        return "config.json does not parse (yet)"
    if not isinstance(data, dict):
        return "config.json is not a JSON object"
    return ""
