"""Is a checkpoint completely written? The contract's rules, in order of trust:

1. a marker the writer leaves last (`.checkpoint_complete`, `STABLE`, DCP `.metadata`);
2. else every `*.safetensors` file is exactly as long as its header says, every shard of a
   `-0000k-of-0000n` series and every file the index names exists (after the naming fix),
   `config.json` parses, and an HF Trainer folder has its last file, `trainer_state.json`;
3. else (other weight formats) no size or mtime change across `stable_seconds`.

An incomplete checkpoint is never evaluated. Only listings and headers are read, through a
`CheckpointFiles` view, so the same rules hold for a local folder and an S3 prefix.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from fnmatch import fnmatch

from ckpt_watcher.checkpoints.files import CheckpointFiles
from ckpt_watcher.checkpoints.namefix import plan_fix
from ckpt_watcher.checkpoints.safetensors_header import read_header
from ckpt_watcher.errors import HeaderUnreadable, NamingFixError

MARKERS = (".checkpoint_complete", "STABLE", ".metadata")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.distcp")


@dataclass(frozen=True)
class Completeness:
    """The verdict: `ready`, `incomplete` (may still become ready) or `invalid` (will not)."""

    state: str
    reason: str
    write_mark: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "ready"


def check(
    files: CheckpointFiles,
    *,
    now: float,
    stable_seconds: float,
    unchanged_since: float | None = None,
    previous_mark: str | None = None,
) -> Completeness:
    """Decide whether a checkpoint is complete. Time is passed in; nothing is slept.

    For the stability fallback the caller keeps the previous write mark and since when it has
    not changed, and passes both back on the next call.
    """
    names = files.files
    for marker in MARKERS:
        if marker in names:
            cfg = _config_problem(files)
            if cfg:
                return Completeness("invalid", f"marker {marker} present but {cfg}")
            return Completeness("ready", f"marker {marker}")

    shards = sorted(n for n in names if n.endswith(".safetensors"))
    if shards:
        return _check_safetensors(files, shards)

    if not any(fnmatch(n, pat) for n in names for pat in _OTHER_WEIGHTS):
        return Completeness("incomplete", "no weight files yet")
    fp = files.write_mark()
    if previous_mark != fp or unchanged_since is None:
        return Completeness(
            "incomplete", f"waiting {stable_seconds:g}s without writes (no marker)", fp
        )
    quiet = now - unchanged_since
    if quiet < stable_seconds:
        return Completeness(
            "incomplete", f"unchanged for {quiet:.0f}s of {stable_seconds:g}s (no marker)", fp
        )
    cfg = _config_problem(files)
    if cfg:
        return Completeness("incomplete", cfg, fp)
    return Completeness("ready", f"unchanged for {quiet:.0f}s", fp)


def _check_safetensors(files: CheckpointFiles, shards: list[str]) -> Completeness:
    for name in shards:
        size = files.files[name]
        try:
            header = read_header(files, name)
        except HeaderUnreadable as e:
            if e.corrupt:
                return Completeness("invalid", f"{name}: corrupt safetensors header: {e}")
            return Completeness("incomplete", f"{name}: {e}")
        except OSError as e:
            return Completeness("incomplete", f"{name}: cannot read ({e})")
        if size < header.expected_size:
            return Completeness(
                "incomplete", f"{name}: {size} of {header.expected_size} bytes written"
            )
        if size > header.expected_size:
            return Completeness(
                "invalid",
                f"{name}: {size} bytes but its header accounts for {header.expected_size}: "
                "corrupt file",
            )
    series = _shard_series_gap(shards)
    if series:
        return Completeness("incomplete", series)
    try:
        plan_fix(files)
    except NamingFixError as e:
        return Completeness("incomplete", str(e))
    cfg = _config_problem(files)
    if cfg:
        return Completeness("incomplete", cfg)
    if "training_args.bin" in files.files and "trainer_state.json" not in files.files:
        # The HF Trainer writes trainer_state.json last; tokenizer files may still be coming.
        return Completeness("incomplete", "HF Trainer folder without trainer_state.json yet")
    return Completeness("ready", f"{len(shards)} safetensors file(s) complete")


def _shard_series_gap(shards: list[str]) -> str:
    totals: dict[int, set[int]] = {}
    for name in shards:
        m = _SHARD.search(name)
        if m:
            totals.setdefault(int(m[2]), set()).add(int(m[1]))
    for total, have in totals.items():
        if len(have) < total:
            return f"{len(have)} of {total} shards present"
    return ""


def _config_problem(files: CheckpointFiles) -> str:
    try:
        data = json.loads(files.read("config.json").decode("utf-8"))
    except FileNotFoundError:
        return "config.json not written yet"
    except (OSError, UnicodeDecodeError, ValueError):
        return "config.json does not parse (yet)"
    if not isinstance(data, dict):
        return "config.json is not a JSON object"
    return ""
