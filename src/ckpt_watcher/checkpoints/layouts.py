"""Which trainer's own format a checkpoint folder is, by its file names alone: the files that
make it a checkpoint (fingerprinted, staged from S3, pinned), and the folders beside them that
are part of it. No I/O, no torch: the listing layer (files.py) asks this before anything else
reads a file; reading and converting are formats/.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Collection
from dataclasses import dataclass

# What an eval reads of a Hugging Face folder besides its weights and index (files.py's
# NEEDED): config, generation config, tokenizer and chat template
HF_META = frozenset(
    {
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "tokenizer.model",
        "special_tokens_map.json",
        "added_tokens.json",
        "vocab.json",
        "vocab.txt",
        "merges.txt",
        "chat_template.jinja",
        "chat_template.json",
        "preprocessor_config.json",
    }
)


@dataclass(frozen=True)
class Layout:
    """A native format's files, named relative to the checkpoint's folder: `weights` matches a
    file holding the model (or a piece of it), `also` names the other files a conversion
    reads, `config` and `tokenizer` the folders holding those ("": none, they come from the
    source's base model), `probes` the folders its weights may be in when not at the top,
    `skip` the weight-like files a conversion never reads (optimizer states beside the
    model's), `top_meta`: the folder's own config and tokenizer files count too."""

    name: str
    weights: re.Pattern[str]
    also: frozenset[str]
    config: str
    tokenizer: str
    probes: tuple[str, ...] = ()
    skip: re.Pattern[str] | None = None
    top_meta: bool = False

    @property
    def needs_base(self) -> bool:
        """Whether config and tokenizer come from the source's base model."""
        return not self.config and not self.top_meta

    @property
    def folders(self) -> list[str]:
        """The folders whose files are part of the checkpoint, besides its own."""
        return sorted({f for f in (*self.probes, self.config, self.tokenizer) if f})

    def matches(self, names: Collection[str]) -> bool:
        return any(self.weights.match(n) for n in names)

    def needed(self, names: Collection[str]) -> list[str]:
        skip = self.skip if self.skip is not None and self._skips(names) else None
        meta = {f"{f}/" for f in (self.config, self.tokenizer) if f}
        return sorted(
            n
            for n in names
            if (self.weights.match(n) and not (skip and skip.match(n)))
            or n in self.also
            or any(n.startswith(m) and n[len(m) :] in HF_META for m in meta)
            or (self.top_meta and n in HF_META)
        )

    def _skips(self, names: Collection[str]) -> bool:
        # DeepSpeed: the optimizer states hold the weights only under ZeRO-3 (no full model file)
        return self.name != DEEPSPEED_NAME or any(_DS_FULL.match(n) for n in names)


# verl's FSDP checkpoints (rllm's and SkyRL's too): formats/verl_fsdp.py
VERL_FSDP = Layout(
    "verl-fsdp",
    re.compile(r"^model_world_size_(\d+)_rank_(\d+)\.pt$"),
    frozenset({"fsdp_config.json"}),
    config="huggingface",
    tokenizer="huggingface",
)
# DeepSpeed's engine states (OpenRLHF's default): formats/deepspeed.py. ZeRO-1/2: the whole
# model in mp_rank_00_model_states.pt; ZeRO-3: each rank's model states (shapes) and optimizer
# states (its flat fp32 partition of the weights).
DEEPSPEED_NAME = "deepspeed"
_DS_FULL = re.compile(r"^mp_rank_\d{2}_model_states\.pt$")
DEEPSPEED = Layout(
    DEEPSPEED_NAME,
    re.compile(
        r"^(?:mp_rank_\d{2}_model_states\.pt"
        r"|(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d{2}_(?:model|optim)_states\.pt)$"
    ),
    frozenset(),
    config="",
    tokenizer="",
    skip=re.compile(r"^(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d{2}_optim_states\.pt$"),
)
# NeMo-RL's DTensor policy (`step_N/policy/`): each rank's slice of every tensor in its own
# safetensors file, written by torch's HuggingFaceStorageWriter: formats/nemo_rl.py
NEMO_RL = Layout(
    "nemo-rl",
    re.compile(r"^weights/model/shard-\d{5}-model-\d{5}-of-\d{5}\.safetensors$"),
    frozenset(),
    config="weights/model/.hf_metadata",
    tokenizer="tokenizer",
    probes=("weights/model",),
)
# torch distributed checkpoints (DCP: `.metadata` written last, `__R_I.distcp` data): accelerate
# under FSDP2 (`checkpoint-N/pytorch_model_fsdp_0/`, config and tokenizer beside it), NeMo-RL's
# `model_save_format: torch_save` (`policy/weights/`), torchtitan's `step-N/`, Megatron's dist
# checkpoints. Those whose keys are Hugging Face names under `model.` are read as they are
# (formats/dcp.py); the others need the trainer's own mapping, the source's `convert` command
# (formats/command.py)
DCP = Layout(
    "dcp",
    re.compile(r"^(?:(?:pytorch_model_fsdp_\d+|weights)/)?__\d+_\d+\.distcp$"),
    frozenset({".metadata", "pytorch_model_fsdp_0/.metadata", "weights/.metadata", "common.pt"}),
    config="",
    tokenizer="",
    probes=("pytorch_model_fsdp_0", "weights"),
    top_meta=True,
)
LAYOUTS = (VERL_FSDP, DEEPSPEED, NEMO_RL, DCP)


def native_layout(names: Collection[str]) -> Layout | None:
    """The native format whose files these are (names relative to the folder), if any: none
    where Hugging Face weights are there too (they are what an eval reads)."""
    if any(_hf_weights(n) for n in names if "/" not in n):
        return None
    return next((lay for lay in LAYOUTS if lay.matches(names)), None)


def _hf_weights(name: str) -> bool:
    """A Hugging Face weights file (not a Trainer's `training_args.bin` or optimizer states)."""
    return name.endswith(".safetensors") or (
        name.startswith(("pytorch_model", "adapter_model")) and name.endswith(".bin")
    )


def listing(level: Callable[[str], dict[str, int]]) -> dict[str, int]:
    """A checkpoint folder's files (names -> sizes): its own (`level("")`), and for a native
    format those of its folders (`level("<folder>/")`, named `<folder>/<name>`). A folder with
    no weights of its own is probed for the formats that keep them below it."""
    out = level("")
    layout = native_layout(out)
    if layout is None and not any(_hf_weights(n) for n in out):
        layout = next(
            (lay for lay in LAYOUTS for p in lay.probes if lay.matches(level(f"{p}/"))), None
        )
    if layout is not None:
        for folder in layout.folders:
            out.update(level(f"{folder}/"))
    return out
