"""Tripwires for the vLLM internals warm engines rely on (evaluators/vllm_internals.py): an
upgrade that moves one fails here, naming it, instead of every swap silently loading cold.
Imports only: no engine starts."""

from __future__ import annotations

import importlib.util

import pytest

from ckpt_watcher.evaluators.vllm_internals import (
    RELIED_ON,
    RELIED_ON_ASSIGNED,
    RELIED_ON_ENV,
    RELOAD_WRAPPER,
    SWAP_EXTENSION,
)

from .internals import assert_assigns, assert_takes_in_order

pytestmark = [
    pytest.mark.vllm,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed"),
]


@pytest.fixture(autouse=True)
def _cpu_platform(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("VLLM_TARGET_DEVICE", "cpu")


@pytest.mark.parametrize(
    "module, attr, params", RELIED_ON, ids=[f"{m}.{a}" for m, a, _ in RELIED_ON]
)
def test_each_relied_on_internal_exists_with_its_parameters(
    module: str, attr: str, params: list[str]
) -> None:
    assert_takes_in_order(module, attr, params)


@pytest.mark.parametrize(
    "module, cls, line", RELIED_ON_ASSIGNED, ids=[f"{m}.{c}" for m, c, _ in RELIED_ON_ASSIGNED]
)
def test_each_attribute_set_in_a_constructor_is_still_set(module: str, cls: str, line: str) -> None:
    assert_assigns(module, cls, line)


def test_the_environment_variables_we_set_are_vllms() -> None:
    import vllm.envs

    unknown = [v for v in RELIED_ON_ENV if v not in vllm.envs.environment_variables]
    assert not unknown, f"vLLM no longer reads {unknown}"


def test_the_reload_still_wraps_loaders_under_the_name_we_unwrap() -> None:
    import inspect

    from vllm.model_executor.model_loader.reload import layerwise

    source = inspect.getsource(layerwise.make_online_process_loader)
    assert f"def {RELOAD_WRAPPER}(" in source


def test_the_swap_extension_is_importable_by_the_name_vllm_is_given() -> None:
    module, _, name = SWAP_EXTENSION.rpartition(".")
    extension = getattr(importlib.import_module(module), name)
    assert callable(extension.ckpt_watcher_swap) and callable(extension.ckpt_watcher_eager_ranks)
