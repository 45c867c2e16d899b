"""Is a checkpoint completely written? Two questions, both answered from listings and headers
only (through a `CheckpointFiles` view, so the same rules hold for a local folder and an S3
prefix), with time passed in and nothing slept.

1. **Is everything an eval reads there, whole?** (`structure`)
   - every `*.safetensors` file is exactly as long as its header says, every shard of a
     `-0000k-of-0000n` series and every file the index names exists (after the naming fix);
     a marker the writer leaves (`.checkpoint_complete`, `STABLE`, DCP `.metadata`) does not
     waive this: a marker uploaded before its shards (parallel S3 uploads) proves nothing;
   - other weight formats (`pytorch_model.bin`, ...) with no marker: no write across
     `stable_seconds`, the only evidence they offer;
   - `config.json` parses, and beside weights transformers loads (safetensors, `pytorch_model`
     bins) a tokenizer is there: an eval loads it from the checkpoint, unless
     `eval.model_args.tokenizer` names one elsewhere; a LoRA/PEFT adapter saved alone has
     `adapter_config.json` instead, of a kind that merges into its base (adapter.py), and
     needs no tokenizer (its base has one);
   - an HF Trainer folder (`training_args.bin`, or a `checkpoint-N` with optimizer, scheduler
     or RNG states) has `trainer_state.json`, the file the Trainer writes last.
2. **Has the writer stopped?** (`check`) The files an eval reads (`files.eval_files`) have not
   changed (names, sizes, mtimes or ETags: the write mark) for `settle_seconds`, as seen by two
   looks at least that far apart. A writer that adds the tokenizer, the generation config or a
   shard a moment after the weights is caught by it whatever its order; one that pauses longer
   between files than the settle time is caught by the structural rules above where they can
   tell (the tokenizer, the index, the Trainer's last file).

An incomplete checkpoint is never evaluated; the caller keeps the write mark and since when it
has not changed, passes both back on the next look, and looks again at `recheck_at`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from fnmatch import fnmatch
from pathlib import Path
from typing import Protocol

from ckpt_watcher.checkpoints import adapter
from ckpt_watcher.checkpoints.files import (
    NOT_YET,
    TOKENIZER_FILES,
    CheckpointFiles,
    eval_files,
    eval_mark,
    read_json,
)
from ckpt_watcher.checkpoints.namefix import plan_fix
from ckpt_watcher.checkpoints.safetensors_header import read_header
from ckpt_watcher.errors import HeaderUnreadable, NamingFixError

MARKERS = (".checkpoint_complete", "STABLE", ".metadata")
# What the HF Trainer writes after the model and before `trainer_state.json`, its last file.
TRAINER_FILES = ("training_args.bin", "optimizer.pt", "scheduler.pt", "scaler.pt", "rng_state*.pth")
TRAINER_STATE = "trainer_state.json"
DEFAULT_SETTLE_SECONDS = 0.5
_NO_TRAINER_STATE = f"HF Trainer folder without {TRAINER_STATE} yet (it writes it last)"
_HF_TRAINER_FOLDER = re.compile(r"^checkpoint-\d+$")
_SHARD = re.compile(r"-(\d{5})-of-(\d{5})\.safetensors$")
_OTHER_WEIGHTS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.distcp")


@dataclass(frozen=True)
class Problem:
    """Why a native checkpoint is not ready: `incomplete` or `invalid`, and what an incomplete
    one becomes if its files then stay unchanged (`quiet_verdict`: a rank that never comes)."""

    state: str
    reason: str
    quiet_verdict: str = ""


class Native(Protocol):
    """A trainer's own format, as far as completeness asks it (formats/: `NativeFormat`)."""

    def structure(
        self,
        files: CheckpointFiles,
        tokenizer_required: bool,
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> Problem | str: ...


@dataclass(frozen=True)
class Completeness:
    """The verdict: `ready`, `incomplete` (may still become ready) or `invalid` (will not).

    `write_mark` is the mark of the files it was judged on; `recheck_in`, when set, is how many
    seconds after this look the verdict may change with no further write (a settle or quiet
    window ends there). `quiet_verdict`: what an incomplete verdict becomes once the files have
    not changed for `stable_seconds` (a rank's file that never comes is a broken save).
    """

    state: str
    reason: str
    write_mark: str = ""
    recheck_in: float | None = None
    quiet_verdict: str = ""

    @property
    def ready(self) -> bool:
        return self.state == "ready"


def check(
    files: CheckpointFiles,
    *,
    now: float,
    stable_seconds: float,
    settle_seconds: float = DEFAULT_SETTLE_SECONDS,
    unchanged_since: float | None = None,
    previous_mark: str | None = None,
    tokenizer_required: bool = True,
    folder_name: str = "",
    base_model: Path | None = None,
    convert: list[str] | None = None,
    native: Native | None = None,
) -> Completeness:
    """Decide whether a checkpoint is complete (see the module's docstring). `native`: the
    trainer's own format its files are in (`formats.detect`'s), which judges its structure.

    `previous_mark` and `unchanged_since` are what the caller kept from its last look (the
    returned `write_mark`, and since when it has been the same); `now` is taken before this
    look's listing.
    """
    mark = eval_mark(files)
    quiet = now - unchanged_since if mark == previous_mark and unchanged_since is not None else None
    problem, evidence, window = structure(
        files,
        tokenizer_required=tokenizer_required,
        folder_name=folder_name,
        stable_seconds=stable_seconds,
        settle_seconds=settle_seconds,
        base_model=base_model,
        convert=convert,
        native=native,
    )
    if problem is not None and problem.quiet_verdict:
        if quiet is not None and quiet >= stable_seconds:
            reason = f"{problem.reason}, and no write for {quiet:.0f}s: the save is not whole"
            return Completeness(problem.quiet_verdict, reason, mark)
        left = stable_seconds - (quiet or 0.0)
        return Completeness(problem.state, problem.reason, mark, left)
    if problem is not None:
        return Completeness(problem.state, problem.reason, mark)
    if window <= 0 or (quiet is not None and quiet >= window):
        return Completeness("ready", evidence, mark)
    left = window if quiet is None else window - quiet
    if window == settle_seconds:  # short: one steady reason, not a countdown
        reason = f"settling: waiting until the files an eval reads are unchanged for {window:g}s"
    elif quiet is None:
        reason = f"waiting {window:g}s without writes (no marker)"
    else:
        reason = f"unchanged for {quiet:.0f}s of {window:g}s (no marker)"
    return Completeness("incomplete", reason, mark, left)


def structure(
    files: CheckpointFiles,
    *,
    tokenizer_required: bool,
    folder_name: str,
    stable_seconds: float,
    settle_seconds: float,
    base_model: Path | None = None,
    convert: list[str] | None = None,
    native: Native | None = None,
) -> tuple[Completeness | None, str, float]:
    """Whether everything an eval reads is there, whole: (the problem, or None; what proves it
    complete, for the ready verdict's reason; how long its files must then stay unchanged)."""
    names = files.files
    if native is not None:
        said = native.structure(files, tokenizer_required, base_model, convert)
        if isinstance(said, Problem):
            verdict = Completeness(said.state, said.reason, quiet_verdict=said.quiet_verdict)
            return verdict, "", settle_seconds
        if TRAINER_STATE not in names and _hf_trainer_folder(names, folder_name):
            # accelerate's FSDP2 shards in a Trainer's folder: the Trainer still writes
            return Completeness("incomplete", _NO_TRAINER_STATE), "", settle_seconds
        return None, said, settle_seconds
    marker = next((m for m in MARKERS if m in names), None)
    shards = sorted(n for n in names if n.endswith(".safetensors"))
    window = settle_seconds
    if shards:
        problem = _check_safetensors(files, shards)
        if problem is not None:
            return problem, "", window
        evidence = f"{len(shards)} safetensors file(s) complete"
        if marker:
            evidence = f"marker {marker}, {evidence}"
    elif marker:
        evidence = f"marker {marker}"
    elif any(fnmatch(n, pat) for n in names for pat in _OTHER_WEIGHTS):
        evidence = "no writes (no marker)"
        window = max(stable_seconds, settle_seconds)
    else:
        return Completeness("incomplete", "no weight files yet"), "", window
    lora = adapter.is_adapter(names)
    if lora:  # merged into its base to be evaluated, with the base's tokenizer if it has none
        config = adapter.read_config(files)
        cfg = config if isinstance(config, str) else adapter.unmergeable(config)
        if cfg and not isinstance(config, str):
            return Completeness("invalid", cfg), "", window
        evidence = f"LoRA/PEFT adapter, {evidence}"
    else:
        cfg = _config_problem(files)
    if cfg:
        state = "invalid" if marker and not cfg.endswith(NOT_YET) else "incomplete"
        if marker and state == "invalid":
            cfg = f"marker {marker} present but {cfg}"
        return Completeness(state, cfg), "", window
    hf_weights = eval_files(names) is not None and not lora  # what transformers and vLLM load
    if tokenizer_required and hf_weights and not any(n in names for n in TOKENIZER_FILES):
        return (
            Completeness(
                "incomplete",
                "no tokenizer files yet (an eval loads its tokenizer from the checkpoint; if "
                "this trainer saves none, set eval.model_args.tokenizer)",
            ),
            "",
            window,
        )
    if TRAINER_STATE not in names and _hf_trainer_folder(names, folder_name):
        return Completeness("incomplete", _NO_TRAINER_STATE), "", window
    return None, evidence, window


def _hf_trainer_folder(names: dict[str, int], folder_name: str) -> bool:
    if "training_args.bin" in names:
        return True
    return bool(_HF_TRAINER_FOLDER.match(folder_name)) and any(
        fnmatch(n, pat) for n in names for pat in TRAINER_FILES
    )


def _check_safetensors(files: CheckpointFiles, shards: list[str]) -> Completeness | None:
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
    return None


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
    config = read_json(files, "config.json")
    return config if isinstance(config, str) else ""
