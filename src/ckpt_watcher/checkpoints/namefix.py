"""The safetensors naming fix: add the shard names an index expects, never touch the trainer's files.

Trainers often save `model.safetensors` while the index they write names
`model-00001-of-00001.safetensors`; vLLM then refuses to load ("Weight files referenced in
index but missing"). When a file the index names is missing and exactly one other safetensors
file holds exactly the tensors the index maps to it, we add a hard link under the expected name
(a relative symlink where hard links are refused). Nothing is renamed, rewritten or deleted.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

from ckpt_watcher.checkpoints.files import CheckpointFiles, LocalFiles
from ckpt_watcher.checkpoints.safetensors_header import read_header
from ckpt_watcher.errors import HeaderUnreadable, NamingFixError

INDEX_NAME = "model.safetensors.index.json"


@dataclass(frozen=True)
class LinkAction:
    """Make `target` (a name the index expects) point at the existing file `source`."""

    target: str
    source: str
    kind: str = "planned"  # planned | hardlink | symlink

    def describe(self) -> str:
        verb = {"planned": "would link", "hardlink": "hard-linked", "symlink": "symlinked"}[
            self.kind
        ]
        return f"{verb} {self.target} -> {self.source}"


def read_index(files: CheckpointFiles, where: str = "") -> dict[str, str] | None:
    """The index's weight_map (tensor -> file name), or None if there is no index."""
    path = f"{where}{INDEX_NAME}"
    try:
        data = json.loads(files.read(INDEX_NAME).decode("utf-8"))
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as e:
        raise NamingFixError(f"{path}: cannot read the index ({e.__class__.__name__}: {e})") from e
    wm = data.get("weight_map") if isinstance(data, dict) else None
    if not isinstance(wm, dict) or not all(isinstance(v, str) for v in wm.values()):
        raise NamingFixError(f"{path}: the index has no valid weight_map")
    for name in wm.values():
        if "/" in name or name in ("", ".", ".."):
            raise NamingFixError(
                f"{path}: the index names {name!r}, which is not a plain file name"
            )
    return wm


def weight_files(checkpoint: Path) -> list[Path]:
    """The safetensors files a load of the local `checkpoint` reads: those its index maps to,
    else every one (a name the naming fix added is in neither twice); [] if none. An index
    that names no file there (the naming bug, not fixed: a base model outside any source) is
    taken for absent."""
    weight_map = read_index(LocalFiles(checkpoint, follow_links=True))
    if weight_map is not None:
        mapped = [checkpoint / n for n in sorted(set(weight_map.values()))]
        if any(p.is_file() for p in mapped):
            return mapped
    return sorted(p for p in checkpoint.glob("*.safetensors") if p.is_file())


def plan_fix(files: CheckpointFiles, where: str = "") -> list[LinkAction]:
    """The links needed so every file the index names exists; [] if none are needed.

    Raises NamingFixError when a named file is missing and no single other file holds exactly
    its tensors (the checkpoint cannot be made loadable without rewriting files).
    """
    weight_map = read_index(files, where)
    if weight_map is None:
        return []
    wanted: dict[str, set[str]] = {}
    for tensor, fname in weight_map.items():
        wanted.setdefault(fname, set()).add(tensor)
    missing = sorted(f for f in wanted if f not in files.files)
    if not missing:
        return []
    candidates: dict[str, frozenset[str]] = {}
    for name in sorted(files.files):
        if not name.endswith(".safetensors") or name in wanted:
            continue
        try:
            candidates[name] = read_header(files, name).tensors
        except (HeaderUnreadable, OSError) as e:
            raise NamingFixError(f"{where}{name}: cannot read its safetensors header ({e})") from e
    actions = []
    for fname in missing:
        matches = [c for c, tensors in candidates.items() if tensors == wanted[fname]]
        if len(matches) != 1:
            why = "no other safetensors file holds" if not matches else f"{len(matches)} files hold"
            raise NamingFixError(
                f"{where}the index names {fname}, which is missing, and {why} exactly its "
                f"{len(wanted[fname])} tensors; re-save the checkpoint or fix its index by hand"
            )
        actions.append(LinkAction(target=fname, source=matches[0]))
    return actions


def apply_fix(ckpt: Path, dry_run: bool = False) -> list[LinkAction]:
    """Plan and (unless dry_run) create the links; idempotent (a second call does nothing)."""
    actions = plan_fix(LocalFiles(ckpt), where=f"{ckpt}: ")
    if dry_run:
        return actions
    return [_link(ckpt, a) for a in actions]


def loadable_view(ckpt: Path, into: Path) -> Path:
    """`ckpt` itself where its index names only files it has; else the folder `into`, made
    again: a symlink to each of its files, and the names its index expects (`plan_fix`). A
    folder that is not ours to fix in place (a base model outside every source, the Hub's
    cache) loads through it; its own files are never touched."""
    actions = plan_fix(LocalFiles(ckpt, follow_links=True), where=f"{ckpt}: ")
    if not actions:
        return ckpt
    shutil.rmtree(into, ignore_errors=True)
    into.mkdir(parents=True)
    for f in ckpt.iterdir():
        if f.is_file():
            (into / f.name).symlink_to(f.resolve())
    for a in actions:
        (into / a.target).symlink_to((ckpt / a.source).resolve())
    return into


def _link(ckpt: Path, action: LinkAction) -> LinkAction:
    target = ckpt / action.target
    source = ckpt / action.source
    try:
        os.link(source, target)
        return LinkAction(action.target, action.source, "hardlink")
    except FileExistsError:
        return LinkAction(action.target, action.source, "hardlink")
    except OSError as e:
        if e.errno not in (errno.EPERM, errno.EXDEV, errno.EMLINK, errno.ENOTSUP, errno.EACCES):
            raise NamingFixError(f"cannot link {target} -> {source}: {e}") from e
    try:
        os.symlink(action.source, target)  # relative: stays valid if the folder moves
    except FileExistsError:
        pass
    except OSError as e:
        raise NamingFixError(f"cannot link or symlink {target} -> {source}: {e}") from e
    return LinkAction(action.target, action.source, "symlink")
