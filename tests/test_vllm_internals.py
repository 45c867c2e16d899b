"""Tripwires for the vLLM internals warm engines rely on (evaluators/vllm_internals.py): an
upgrade that moves one fails here, naming it, instead of every swap silently loading cold.

Imports only, no engine: one subprocess (a worker's environment: vLLM's platform is chosen at
its first import, and this test process may have imported it for another platform already)
checks every entry and reports each by name."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from typing import Any

import pytest

from ckpt_watcher.evaluators.vllm_internals import RELIED_ON, RELIED_ON_ASSIGNED

from .conftest import REPO

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]

CHECKS = """
import importlib, inspect, json
from ckpt_watcher.evaluators.vllm_internals import (
    RELIED_ON, RELIED_ON_ASSIGNED, RELIED_ON_ENV, RELOAD_WRAPPER, SWAP_EXTENSION,
    prepare_cpu_process,
)
prepare_cpu_process()  # as a worker does before its first vLLM import
from tests.internals import assert_assigns, assert_takes_in_order

def check(fn, *args):
    try:
        fn(*args)
    except Exception as e:  # AssertionError, ImportError, AttributeError: all a moved name
        return f"{type(e).__name__}: {e}"
    return None

def env():
    import vllm.envs
    unknown = [v for v in RELIED_ON_ENV if v not in vllm.envs.environment_variables]
    assert not unknown, f"vLLM no longer reads {unknown}"

def wrapper():
    from vllm.model_executor.model_loader.reload import layerwise
    assert f"def {RELOAD_WRAPPER}(" in inspect.getsource(layerwise.make_online_process_loader)

def extension():
    module, _, name = SWAP_EXTENSION.rpartition(".")
    ext = getattr(importlib.import_module(module), name)
    assert callable(ext.ckpt_watcher_swap) and callable(ext.ckpt_watcher_eager_ranks)

out = {f"{m}.{a}": check(assert_takes_in_order, m, a, p) for m, a, p in RELIED_ON}
out |= {f"{m}.{c}": check(assert_assigns, m, c, line) for m, c, line in RELIED_ON_ASSIGNED}
out |= {"env": check(env), "wrapper": check(wrapper), "extension": check(extension)}
print(json.dumps(out))
"""


@pytest.fixture(scope="module")
def problems() -> dict[str, Any]:
    r = subprocess.run(
        [sys.executable, "-c", CHECKS],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=dict(os.environ, CUDA_VISIBLE_DEVICES=""),
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


@pytest.mark.parametrize("name", [f"{m}.{a}" for m, a, _ in RELIED_ON])
def test_each_relied_on_internal_exists_with_its_parameters(
    problems: dict[str, Any], name: str
) -> None:
    assert problems[name] is None, problems[name]


@pytest.mark.parametrize("name", [f"{m}.{c}" for m, c, _ in RELIED_ON_ASSIGNED])
def test_each_attribute_set_in_a_constructor_is_still_set(
    problems: dict[str, Any], name: str
) -> None:
    assert problems[name] is None, problems[name]


def test_the_environment_variables_we_set_are_vllms(problems: dict[str, Any]) -> None:
    assert problems["env"] is None, problems["env"]


def test_the_reload_still_wraps_loaders_under_the_name_we_unwrap(problems: dict[str, Any]) -> None:
    assert problems["wrapper"] is None, problems["wrapper"]


def test_the_swap_extension_is_importable_by_the_name_vllm_is_given(
    problems: dict[str, Any],
) -> None:
    assert problems["extension"] is None, problems["extension"]
