"""A source's `convert` command: the trainer's own converter, for checkpoints whose conversion
needs the model's architecture (torch distributed checkpoints with the trainer's own key names:
torchtitan, Megatron). An argv, no shell: `{input}` is the checkpoint's folder, `{output}` an
empty folder in the worker's scratch where it must write a Hugging Face folder, `{base_model}`
the source's base model. Where set, it converts every DCP of its source (dcp.py reads those
with Hugging Face names itself).

Without a `convert` command a DCP that dcp.py cannot read is `invalid` once, saying which
converter to set, never left waiting. With one, it is complete once the DCP's `.metadata`
(written last) is there and nothing moves. The output is checked: a `config.json` and weights;
config and tokenizer files the command did not write are taken from the checkpoint's folder,
else the base model.
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

from ckpt_watcher.checkpoints.files import NEEDED, CheckpointFiles, LocalFiles
from ckpt_watcher.checkpoints.layouts import DCP
from ckpt_watcher.errors import NativeFormatError
from ckpt_watcher.formats import Problem

CONVERTERS = (
    "a torch distributed checkpoint (DCP), whose keys need the trainer's own mapping: set the "
    "source's convert command to the trainer's converter, e.g. accelerate's `accelerate "
    "merge-weights {input}/pytorch_model_fsdp_0 {output}`, NeMo-RL's "
    "`examples/converters/convert_dcp_to_hf.py`, torchtitan's "
    "`scripts/checkpoint_conversion/convert_to_hf.py`, Megatron's checkpoint converter"
)


class Command:
    name = DCP.name

    def structure(
        self,
        files: CheckpointFiles,
        tokenizer_required: bool,
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> Problem | str:
        if not command:
            return Problem("invalid", CONVERTERS)
        markers = [n for n in files.files if n.rpartition("/")[2] == ".metadata"]
        if not markers:
            return Problem("incomplete", "no .metadata yet (a DCP writes it last)")
        return f"marker {markers[0]} (a DCP, converted by the source's convert command)"

    def convert(
        self,
        folder: Path,
        out: Path,
        dtype: str | None,
        progress: Callable[[int, int], None],
        base: Path | None = None,
        command: list[str] | None = None,
    ) -> None:
        if not command:
            raise NativeFormatError(f"{folder}: {CONVERTERS}")
        fields = {"input": str(folder), "output": str(out), "base_model": str(base or "")}
        argv = [arg.format(**fields) for arg in command]
        # what it prints goes to the worker's log (kept with the job's attempt), and its end
        # into the error; nothing is left in the shared folder of converted copies
        with tempfile.TemporaryFile() as said:
            done = subprocess.run(argv, stdout=said, stderr=subprocess.STDOUT, cwd=out.parent)
            said.seek(0)
            printed = said.read()
        sys.stderr.write(printed.decode(errors="replace"))
        tail = printed[-2000:].decode(errors="replace").strip()
        if done.returncode != 0:
            raise NativeFormatError(
                f"the convert command {argv[0]} exited with status {done.returncode}: {tail}"
            )
        for source in (folder, base):  # config and tokenizer it did not write
            have = set(LocalFiles(out).files)
            if source is not None:
                for name in sorted((NEEDED & set(LocalFiles(source).files)) - have):
                    shutil.copyfile(source / name, out / name)
        written = LocalFiles(out).files
        if "config.json" not in written or not any(
            n.endswith((".safetensors", ".bin")) for n in written
        ):
            raise NativeFormatError(
                f"the convert command {argv[0]} wrote no Hugging Face folder into {{output}} "
                f"(found: {sorted(written) or 'nothing'}): {tail}"
            )


FORMAT = Command()
