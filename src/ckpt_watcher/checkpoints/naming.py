"""Checkpoint directory name -> (run, run path, step, label), by the contract's rules only; never
guessed. The run path is the run's path under its source root (`jobA/mix` for
`jobA/mix_step100`, `out/qwen3` for `out/qwen3/checkpoint-100`): two training jobs that reuse a
run name keep apart ledgers."""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ckpt_watcher.checkpoints.files import ADAPTER_CONFIG

# Run names become folder names under ledger_dir: keep them to characters that are safe there.
_RUN_RE = r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}"
_RUN_STEP = re.compile(rf"^(?P<run>{_RUN_RE})_step(?P<step>\d{{1,12}})$")
_RUN_FINAL = re.compile(rf"^(?P<run>{_RUN_RE})_final$")
# the parent folder is the run: HF Trainer, verl, prime-rl/open-instruct, DeepSpeed's tags
# (`global_step{N}`: not a run named `global`) and OpenRLHF's Hugging Face copies
# (`--ckpt.save_hf`: `<ckpt.path>/global_step{N}_hf`, beside its DeepSpeed states)
# (AReaL's Hugging Face folders: `epoch{E}epochstep{S}globalstep{G}`, step G)
_PARENT_STEP = re.compile(
    r"^(?:(?:checkpoint-|global_step_|step_)(?P<step>\d{1,12})"
    r"|global_step(?P<ds>\d{1,12})(?:_hf)?"
    r"|epoch\d{1,9}epochstep\d{1,12}globalstep(?P<areal>\d{1,12}))$"
)
_SAFE_RUN = re.compile(rf"^{_RUN_RE}$")
_VERL_STEP = re.compile(r"^global_step_\d{1,12}$")
# verl saves step N as `global_step_{N}/`: its RL trainers put the policy's FSDP shards in
# `actor/` (SkyRL, which keeps verl's layout: `policy/`), with the config and tokenizer in
# `actor/huggingface/`, and, with `hf_model` in `actor_rollout_ref.actor.checkpoint.save_contents`,
# a Hugging Face copy of the weights there too (its SFT trainer: the shards and `huggingface/` in
# the step's folder itself). An eval loads the copy where there is one, else the shards,
# converted (formats/verl_fsdp.py). Its keep-last-k (`max_actor_ckpt_to_keep`) deletes `actor/`.
# With LoRA (`actor_rollout_ref.model.lora_rank` > 0) it saves the adapter alone in
# `actor/lora_adapter/` after the rest: that is the model where `huggingface/` has no weights.
VERL_ROLES = frozenset({"actor", "policy"})
VERL_MODEL_FOLDERS = (
    *(f"{role}/{sub}" for role in sorted(VERL_ROLES) for sub in ("huggingface", "lora_adapter")),
    "huggingface",
    *sorted(VERL_ROLES),
)
# NeMo-RL saves step N as `step_{N}/` (written as `tmp_step_{N}` and renamed once whole): the
# policy's model in `policy/weights/model/` (its ranks' shards, converted:
# formats/nemo_rl.py), and with `save_consolidated: true` a Hugging Face copy in its
# `consolidated/` too
_NEMO_STEP = re.compile(r"^step_\d{1,12}$")
_NEMO_WRITING = re.compile(r"^tmp_step_\d{1,12}$")
NEMO_CONSOLIDATED = "policy/weights/model/consolidated"
_STEP_MODEL_FOLDERS = (NEMO_CONSOLIDATED, *VERL_MODEL_FOLDERS)
_VERL_HF_WEIGHTS = (  # what transformers' save_pretrained writes last: the whole model is there
    "model.safetensors",
    "model.safetensors.index.json",
    "pytorch_model.bin",
    "pytorch_model.bin.index.json",
)
# DeepSpeed's own tag for step N's engine states (OpenRLHF's `_actor/global_step{N}`): a
# checkpoint only where it holds a Hugging Face model
_DEEPSPEED_TAG = re.compile(r"^global_step\d{1,12}$")
_UNSAFE_CHARS = re.compile(r"[^A-Za-z0-9._-]")
# a DeepSpeed tag folder with rank 0's model states holds a model (formats/deepspeed.py)
_DEEPSPEED_MODEL_STATES = (
    "mp_rank_00_model_states.pt",
    "zero_pp_rank_0_mp_rank_00_model_states.pt",
)
OPENRLHF_ACTOR = "_actor"


@dataclass(frozen=True)
class CheckpointId:
    """Who a checkpoint is: its run, its step (None for a final without trainer_state), its label,
    and its run path (the run's path under the source root; the run itself when not given)."""

    run: str
    step: int | None
    label: str
    final: bool = False
    run_path: str = ""

    def __post_init__(self) -> None:
        if not self.run_path:
            object.__setattr__(self, "run_path", self.run)


def safe_component(part: str) -> str:
    """A folder name made safe for a ledger path: odd characters become `_`, no leading dot."""
    part = _UNSAFE_CHARS.sub("_", part)
    return part if part and not part.startswith(".") else f"_{part}"


def looks_like_checkpoint_name(name: str) -> bool:
    """True if a directory name follows one of the contract's checkpoint patterns."""
    return bool(_RUN_STEP.match(name) or _RUN_FINAL.match(name) or _PARENT_STEP.match(name))


def parse_name(
    name: str,
    parent: str,
    trainer_state: Callable[[], bytes | None],
    between: Sequence[str] = (),
    grandparent: str = "",
) -> CheckpointId | None:
    """Identify a checkpoint by its folder name (and its parent's); None if no pattern fits.

    `{run}_step{N}`, `{run}_final` (step from trainer_state.json, read through `trainer_state`,
    if present), or `checkpoint-{N}` / `global_step_{N}` / `step_{N}` / `global_step{N}` /
    `global_step{N}_hf` / `epoch{E}epochstep{S}globalstep{N}` with the parent as run.
    `between` are the folder names from the source root down to the checkpoint's parent: the
    run path is them plus the run (`{run}_step{N}`), or them alone (`checkpoint-{N}`).
    OpenRLHF keeps DeepSpeed's states in `<ckpt.path>/_actor/`: their run is `grandparent`.
    """
    dirs = [safe_component(d) for d in between]
    if m := _PARENT_STEP.match(name):  # first: `global_step{N}` would read as a run `global`
        if m["ds"] and parent == OPENRLHF_ACTOR and grandparent:
            parent, dirs = grandparent, dirs[:-1]  # OpenRLHF's `<ckpt.path>/_actor/global_stepN`
        if not _SAFE_RUN.match(parent):
            return None
        n = int(m["step"] or m["ds"] or m["areal"])
        return CheckpointId(run=parent, step=n, label=name, run_path="/".join(dirs))
    if m := _RUN_STEP.match(name):
        run_path = "/".join([*dirs, m["run"]])
        return CheckpointId(m["run"], int(m["step"]), name, run_path=run_path)
    if m := _RUN_FINAL.match(name):
        step = final_step(trainer_state())
        return CheckpointId(m["run"], step, name, final=True, run_path="/".join([*dirs, m["run"]]))
    return None


def parse_checkpoint_dir(path: Path, root: Path | None = None) -> CheckpointId | None:
    """Identify a local checkpoint directory by name (its run path relative to `root`)."""
    between = path.parent.relative_to(root).parts if root is not None else ()

    def trainer_state() -> bytes | None:
        try:
            return (path / "trainer_state.json").read_bytes()
        except OSError:
            return None

    return parse_name(path.name, path.parent.name, trainer_state, between, path.parent.parent.name)


def has_hf_copy(name: str, parent: str, beside_parent: Callable[[str], bool]) -> bool:
    """Whether a DeepSpeed tag folder in OpenRLHF's `_actor/` has the Hugging Face copy OpenRLHF
    saves with `--ckpt.save_hf` (`<ckpt.path>/global_step{N}_hf`, `beside_parent(name)`: a
    folder of that name beside `_actor/`): the copy is the step's checkpoint, not the states."""
    return (
        parent == OPENRLHF_ACTOR
        and bool(_DEEPSPEED_TAG.match(name))
        and beside_parent(f"{name}_hf")
    )


def being_written(name: str) -> bool:
    """A folder a trainer writes a step into before naming it (NeMo-RL's `tmp_step_{N}`): not
    looked into (its model folders would read as checkpoints of unknown names)."""
    return bool(_NEMO_WRITING.match(name))


def verl_step_folder(name: str) -> bool:
    """True for verl's name of a step's folder, `global_step_{N}`."""
    return bool(_VERL_STEP.match(name))


def contents_decide(name: str) -> bool:
    """True for the step folders whose contents say where their model is, or whether they hold
    one (`model_folder`): verl's `global_step_{N}`, DeepSpeed's `global_step{N}`, NeMo-RL's
    `step_{N}`."""
    return verl_step_folder(name) or bool(_DEEPSPEED_TAG.match(name) or _NEMO_STEP.match(name))


def model_folder(name: str, holds: Callable[[str], bool]) -> str | None:
    """Where the model an eval loads is, under a checkpoint folder named `name`: "" (the folder
    itself), or for verl's `global_step_{N}` layout one of `VERL_MODEL_FOLDERS`, decided by what
    the folder holds (`holds(relative path)`: a file or folder there): `actor/huggingface` when
    it has the weights, else `actor/lora_adapter` when a LoRA adapter is saved, else `actor`
    (the FSDP shards, converted); SkyRL's `policy/` alike; verl's SFT layout: `huggingface` or
    the step folder; DeepSpeed's tag folder `global_step{N}` itself where it holds model states
    (converted with the source's base model). None for a step folder with no model: a
    `global_step_{N}` whose save has not begun, or whose `actor/` verl's keep-last-k deleted (it
    leaves the folder, with `data.pt`, for good); a DeepSpeed tag with no model states yet."""
    if not contents_decide(name) or holds("config.json"):
        return ""
    if _NEMO_STEP.match(name):
        if holds(f"{NEMO_CONSOLIDATED}/config.json"):
            return NEMO_CONSOLIDATED
        return "policy" if holds("policy/weights") else ""
    if not verl_step_folder(name):  # DeepSpeed's tag: its states, converted (deepspeed.py)
        return "" if any(holds(f) for f in _DEEPSPEED_MODEL_STATES) else None
    for role in sorted(VERL_ROLES):
        if holds(role):
            if verl_hf_weights(holds, role):
                return f"{role}/huggingface"
            if holds(f"{role}/lora_adapter/{ADAPTER_CONFIG}"):
                return f"{role}/lora_adapter"
            return role
    if holds("huggingface"):
        return "huggingface" if verl_hf_weights(holds, "") else ""
    return None


def verl_hf_weights(holds: Callable[[str], bool], role: str = "actor") -> bool:
    """Whether a verl step's `<role>/huggingface/` has the model's weights (`hf_model` saved)."""
    folder = f"{role}/huggingface" if role else "huggingface"
    return any(holds(f"{folder}/{w}") for w in _VERL_HF_WEIGHTS)


def checkpoint_folder(location: str) -> str:
    """The folder a checkpoint is named by: its location, less verl's model folder inside it."""
    path = location.rstrip("/")
    for sub in _STEP_MODEL_FOLDERS:
        head, _, tail = path.rpartition("/" + sub)
        step = head.rsplit("/", 1)[-1]
        if not tail and head and (verl_step_folder(step) or _NEMO_STEP.match(step)):
            return head
    return path


def final_step(trainer_state: bytes | None) -> int | None:
    """The global step recorded in a trainer_state.json, if any."""
    if trainer_state is None:
        return None
    try:
        state = json.loads(trainer_state)
    except ValueError:
        return None
    step = state.get("global_step") if isinstance(state, dict) else None
    return step if isinstance(step, int) and step >= 0 else None
