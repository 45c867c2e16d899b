"""Checks for the internals lists of `evaluators/lm_eval_internals.py` and
`evaluators/vllm_internals.py`: each name we rely on is still there, taking what we pass it.
Imports only; nothing is built or started."""

from __future__ import annotations

import dataclasses
import importlib
import inspect


def _lookup(module: str, attr: str) -> object:
    obj: object = importlib.import_module(module)
    for part in attr.split("."):
        if inspect.isclass(obj) and dataclasses.is_dataclass(obj):
            if part in {f.name for f in dataclasses.fields(obj)}:
                return dataclasses.fields(obj)  # a dataclass field: no class attribute
        fields = getattr(obj, "model_fields", None) if inspect.isclass(obj) else None
        if isinstance(fields, dict) and part in fields:
            return fields[part]  # a pydantic model's field: no class attribute either
        assert hasattr(obj, part), f"{module}.{attr}: no longer has {part!r}"
        obj = inspect.getattr_static(obj, part) if inspect.isclass(obj) else getattr(obj, part)
    return obj


def _parameters(obj: object) -> list[str]:
    fn = obj.__func__ if isinstance(obj, classmethod | staticmethod) else obj
    return [p for p in inspect.signature(fn).parameters if p != "self"]  # type: ignore[arg-type]


def assert_takes_in_order(module: str, attr: str, params: list[str]) -> None:
    """`module.attr` exists and its first parameters (after self) are `params`, in order."""
    obj = _lookup(module, attr)
    if isinstance(obj, property) or not params:
        return
    names = _parameters(obj)
    assert names[: len(params)] == params, f"{module}.{attr}{inspect.signature(obj)}"  # type: ignore[arg-type]


def assert_takes_keywords(module: str, attr: str, keywords: list[str]) -> None:
    """`module.attr` exists and takes each of `keywords` (in any order)."""
    names = _parameters(_lookup(module, attr))
    missing = [k for k in keywords if k not in names]
    assert not missing, f"{module}.{attr} no longer takes {missing}"


def assert_assigns(module: str, cls: str, line: str) -> None:
    """`module.cls`'s source (its own or a base's) still has `line` (an attribute it sets)."""
    klass = _lookup(module, cls)
    assert inspect.isclass(klass), f"{module}.{cls} is no class"
    sources = [
        inspect.getsource(k) for k in klass.__mro__ if k.__module__.startswith(module.split(".")[0])
    ]
    assert any(line in src for src in sources), f"{module}.{cls} no longer has `{line}`"
