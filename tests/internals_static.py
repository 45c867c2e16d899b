"""The vLLM tripwire (`evaluators/vllm_internals.py`'s RELIED_ON lists) checked against a vLLM
release's Python sources without importing them: for releases that cannot run here (vLLM 0.26.0
pins torch 2.11, which only PyTorch's own index has; its CUDA build links libcudart.so.13).

Usage: python -m tests.internals_static ROOT   (ROOT holds `vllm/`: an unzipped wheel, or a
site-packages). Prints each entry ok or what is missing; exit 1 if any is.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

from ckpt_watcher.evaluators.vllm_internals import (
    RELIED_ON,
    RELIED_ON_ASSIGNED,
    RELIED_ON_ENV,
    RELOAD_WRAPPER,
)

Found = tuple[ast.AST, str, Path]  # the node, its module, its file


class Sources:
    def __init__(self, root: Path) -> None:
        self.root = root
        self._trees: dict[str, tuple[ast.Module, Path] | None] = {}

    def module(self, name: str) -> tuple[ast.Module, Path] | None:
        if name not in self._trees:
            base = self.root.joinpath(*name.split("."))
            for path in (base.with_suffix(".py"), base / "__init__.py"):
                if path.exists():
                    self._trees[name] = (ast.parse(path.read_text(encoding="utf-8")), path)
                    break
            else:
                self._trees[name] = None
        return self._trees[name]

    def resolve(self, module: str, name: str, depth: int = 0) -> Found | None:
        """Where `module.name` is defined, following imports and lazy re-export tables."""
        found = self.module(module)
        if found is None or depth > 10:
            return None
        tree, path = found
        for node in tree.body:
            if (
                isinstance(node, ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef)
                and node.name == name
            ):
                return node, module, path
            if isinstance(node, ast.Assign | ast.AnnAssign):
                targets = node.targets if isinstance(node, ast.Assign) else [node.target]
                if any(isinstance(t, ast.Name) and t.id == name for t in targets):
                    return node, module, path
        for node in ast.walk(tree):  # imports anywhere (try/except, TYPE_CHECKING, functions)
            if isinstance(node, ast.ImportFrom):
                for alias in node.names:
                    if (alias.asname or alias.name) == name:
                        src = _absolute(module, path, node)
                        got = self.resolve(src, alias.name, depth + 1)
                        if got is not None:
                            return got
        for node in ast.walk(tree):  # lazy tables: {"Name": "vllm.x:Name"} or ("vllm.x", "Name")
            if isinstance(node, ast.Dict):
                for k, v in zip(node.keys, node.values, strict=True):
                    if isinstance(k, ast.Constant) and k.value == name:
                        target = _lazy_target(v, module)
                        if target is not None:
                            got = self.resolve(target[0], target[1], depth + 1)
                            if got is not None:
                                return got
        return None

    def member(self, found: Found, part: str, depth: int = 0) -> Found | None:
        """`part` in a class body, or in its bases'."""
        node, module, path = found
        if not isinstance(node, ast.ClassDef) or depth > 10:
            return None
        for item in node.body:
            if (
                isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef)
                and item.name == part
            ):
                return item, module, path
            if (
                isinstance(item, ast.AnnAssign)
                and isinstance(item.target, ast.Name)
                and item.target.id == part
            ):
                return item, module, path
            if isinstance(item, ast.Assign) and any(
                isinstance(t, ast.Name) and t.id == part for t in item.targets
            ):
                return item, module, path
        for base in node.bases:
            if isinstance(base, ast.Name):
                parent = self.resolve(module, base.id)
                if parent is not None:
                    got = self.member(parent, part, depth + 1)
                    if got is not None:
                        return got
        return None


def _absolute(module: str, path: Path, node: ast.ImportFrom) -> str:
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[: len(package) - (node.level - 1)]
    return ".".join(package + ([node.module] if node.module else []))


def _lazy_target(v: ast.AST, module: str) -> tuple[str, str] | None:
    if isinstance(v, ast.Constant) and isinstance(v.value, str) and ":" in v.value:
        mod, attr = v.value.split(":", 1)
        return (module + mod if mod.startswith(".") else mod), attr
    if (
        isinstance(v, ast.Tuple)
        and len(v.elts) == 2
        and all(isinstance(e, ast.Constant) for e in v.elts)
    ):
        mod, attr = (e.value for e in v.elts)  # type: ignore[attr-defined]
        return (module + mod if str(mod).startswith(".") else str(mod)), str(attr)
    return None


def _params(node: ast.AST, sources: Sources, found: Found) -> list[str] | None:
    if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
        a = node.args
        return [
            x.arg for x in [*a.posonlyargs, *a.args, *a.kwonlyargs] if x.arg not in ("self", "cls")
        ]
    if isinstance(node, ast.ClassDef):
        init = sources.member(found, "__init__")
        if init is not None and isinstance(init[0], ast.FunctionDef):
            return _params(init[0], sources, init)
        return [
            i.target.id
            for i in node.body
            if isinstance(i, ast.AnnAssign) and isinstance(i.target, ast.Name)
        ]
    return None


def check_entry(sources: Sources, module: str, attr: str, params: list[str]) -> str | None:
    parts = attr.split(".")
    if parts[-1] == "_torchdynamo_orig_callable":  # a function compiled by torch.compile
        found = sources.resolve(module, parts[0])
        if found is None:
            return f"{module}.{parts[0]} is gone"
        text = ast.get_source_segment(found[2].read_text(encoding="utf-8"), found[0]) or ""
        decorated = any(
            "compile" in ast.unparse(d) for d in getattr(found[0], "decorator_list", [])
        )
        return (
            None if decorated or "compile" in text else f"{module}.{parts[0]} is no longer compiled"
        )
    found = sources.resolve(module, parts[0])
    if found is None:
        return f"{module}.{parts[0]} is gone"
    for part in parts[1:]:
        nxt = sources.member(found, part)
        if nxt is None:
            return f"{module}.{attr}: no {part!r}"
        found = nxt
    if not params:
        return None
    names = _params(found[0], sources, found)
    if names is None or names[: len(params)] != params:
        return f"{module}.{attr} takes {names}, not {params} first"
    return None


def check(root: Path) -> dict[str, str | None]:
    sources = Sources(root)
    out = {f"{m}.{a}": check_entry(sources, m, a, p) for m, a, p in RELIED_ON}
    for m, c, line in RELIED_ON_ASSIGNED:
        found = sources.resolve(m, c)
        text = found[2].read_text(encoding="utf-8") if found else ""
        segment = ast.get_source_segment(text, found[0]) if found else ""
        out[f"{m}.{c}"] = None if segment and line in segment else f"{m}.{c} no longer has `{line}`"
    envs = sources.module("vllm.envs")
    env_text = envs[1].read_text(encoding="utf-8") if envs else ""
    missing = [v for v in RELIED_ON_ENV if f'"{v}"' not in env_text]
    out["env"] = f"vLLM no longer reads {missing}" if missing else None
    layerwise = sources.module("vllm.model_executor.model_loader.reload.layerwise")
    wrapped = layerwise is not None and f"def {RELOAD_WRAPPER}(" in layerwise[1].read_text(
        encoding="utf-8"
    )
    out["wrapper"] = None if wrapped else f"no {RELOAD_WRAPPER} in reload/layerwise.py"
    return out


def main(argv: list[str]) -> int:
    root = Path(argv[0])
    results = check(root)
    for name, problem in results.items():
        print(
            f"{'ok  ' if problem is None else 'FAIL'}  {name}{'' if problem is None else ': ' + problem}"
        )
    return 1 if any(results.values()) else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
