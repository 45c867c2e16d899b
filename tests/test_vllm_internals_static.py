"""The tripwire read from a release's sources (`tests/internals_static.py`), for the vLLM
releases that cannot run here (0.26.0: docs/benchmarks.md): it agrees with the import-based
tripwire on the installed vLLM, and it fails, naming the entry, where a name moved."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

from .internals_static import check

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"
)


def installed_root() -> Path:
    spec = importlib.util.find_spec("vllm")
    assert spec is not None and spec.origin is not None
    return Path(spec.origin).parent.parent


def test_every_entry_is_found_in_the_installed_sources() -> None:
    problems = {k: v for k, v in check(installed_root()).items() if v}
    assert problems == {}


def test_a_moved_name_or_a_changed_signature_fails_naming_it(tmp_path: Path) -> None:
    root = tmp_path / "src"
    shutil.copytree(
        installed_root() / "vllm",
        root / "vllm",
        ignore=shutil.ignore_patterns("*.so", "__pycache__", "*.cu*", "*.json", "*.jinja"),
    )
    llm = root / "vllm" / "entrypoints" / "llm.py"
    text = llm.read_text()
    assert "def reset_prefix_cache(" in text and "def collective_rpc(" in text
    text = text.replace("def reset_prefix_cache(", "def reset_cache(")
    text = text.replace(
        "def collective_rpc(\n        self,\n        method",
        "def collective_rpc(\n        self,\n        renamed",
    )
    llm.write_text(text)
    envs = root / "vllm" / "envs.py"
    envs.write_text(envs.read_text().replace('"VLLM_CPU_KVCACHE_SPACE"', '"VLLM_CPU_KV_SPACE"'))
    out = check(root)
    assert out["vllm.entrypoints.llm.LLM.reset_prefix_cache"] == (
        "vllm.entrypoints.llm.LLM.reset_prefix_cache: no 'reset_prefix_cache'"
    )
    assert "takes ['renamed'" in str(out["vllm.entrypoints.llm.LLM.collective_rpc"])
    assert out["env"] == "vLLM no longer reads ['VLLM_CPU_KVCACHE_SPACE']"
    assert out["vllm.entrypoints.llm.LLM.generate"] is None  # the rest still found
