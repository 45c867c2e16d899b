"""Pure scheduling rules and the clamp rule (no I/O)."""

from __future__ import annotations

import pytest

from ckpt_watcher import scheduler
from ckpt_watcher.devices import FakeGpu, FakeInventory, cpu_slots, free_devices
from ckpt_watcher.evaluators.clamp import clamp_gen_toks
from ckpt_watcher.state import Job


def job(jid: str, step: int, not_before: float = 0.0, created: float = 0.0) -> Job:
    j = Job(
        id=jid,
        location=f"/c/{jid}",
        run="r",
        step=step,
        label=jid,
        tasks=[],
        settings_hash="h",
        created_at=created,
        order_key=scheduler.order_key(step, False),
    )
    j.not_before = not_before
    return j


def test_newest_first_and_oldest_first() -> None:
    jobs = [job("a", 100), job("b", 300), job("c", 200)]
    devs = cpu_slots(2)
    assert [j.id for j, _ in scheduler.assign(jobs, devs, 0, "newest_first")] == ["b", "c"]
    assert [j.id for j, _ in scheduler.assign(jobs, devs, 0, "oldest_first")] == ["a", "c"]


def test_a_run_whose_engine_waits_on_a_device_gets_that_device_and_others_leave_it_last() -> None:
    """jobs/early.py: the device whose engine was started ahead of run `r2`'s weights takes
    `r2`'s job, whatever the order; other runs' jobs go elsewhere while they can."""
    mine, other, third = job("mine", 100), job("other", 300), job("third", 200)
    mine.run_path = "r2"
    devs = cpu_slots(2)
    prefer = {"r2": "cpu:0"}
    got = {
        j.id: d.label for j, d in scheduler.assign([mine, other], devs, 0, "newest_first", prefer)
    }
    assert got == {"other": "cpu:1", "mine": "cpu:0"}
    # its run has no job yet: the others take the other device first, then that one
    got = {
        j.id: d.label for j, d in scheduler.assign([other, third], devs, 0, "newest_first", prefer)
    }
    assert got == {"other": "cpu:1", "third": "cpu:0"}
    # the waiting device is not free (gone, busy): the run's job goes where it can
    got = {j.id: d.label for j, d in scheduler.assign([mine], devs[1:], 0, "newest_first", prefer)}
    assert got == {"mine": "cpu:1"}
    # an engine waiting on a CPU slot (the GPUs were training's then) keeps no job off a GPU
    inv = FakeInventory(gpus=[FakeGpu(0, "GPU-a")], cpu=1)
    free = free_devices(inv, in_use=[], our_pids=set(), idle_memory_mib=1024)
    got = {j.id: d.label for j, d in scheduler.assign([mine], free, 0, "newest_first", prefer)}
    assert got == {"mine": "cuda:0"}


def test_early_engines_start_once_per_run_on_devices_without_a_warm_worker(tmp_path) -> None:  # type: ignore[no-untyped-def]
    """jobs/early.py with stand-ins for the state, dispatcher and executor: a step being
    written whose config and tokenizer are whole gets an engine on the first free device that
    has no warm worker; not a second one while it waits, nor one for a run whose model an idle
    engine holds; a step on S3 on its meta files, fetched into the state folder (removed once
    the step is no longer incomplete); at most TRIES_PER_STEP times per step; never where the
    executor cannot start engines ahead (Ray), nor in `watcher once`."""
    import dataclasses
    import json
    import threading
    from concurrent.futures import Future
    from pathlib import Path
    from types import SimpleNamespace

    from ckpt_watcher.executors.base import Executor
    from ckpt_watcher.jobfolder import EvalRequest, JobSpec
    from ckpt_watcher.jobs.early import TRIES_PER_STEP, EarlyEngines

    def step(run: str, n: int, meta: bool = True) -> SimpleNamespace:
        folder = tmp_path / run / f"step_{n}"
        folder.mkdir(parents=True)
        if meta:
            (folder / "config.json").write_text(json.dumps({"hidden_size": 8}))
            (folder / "tokenizer.json").write_text("{}")
        return SimpleNamespace(
            location=str(folder), source="local", run=run, run_path=run, step=n, label=""
        )

    rows = [step("A", 10), step("A", 20), step("B", 10), step("C", 10), step("D", 10, meta=False)]
    lora = step("F", 10, meta=False)  # a LoRA step saved alone: its adapter config, whole
    Path(lora.location, "adapter_config.json").write_text('{"peft_type": "LORA", "r": 4}')
    rows.append(lora)
    remote = SimpleNamespace(
        location="s3://b/E/step_10", source="s3", run="E", run_path="E", step=10, label=""
    )
    rows.append(remote)
    lora_far = SimpleNamespace(
        location="s3://b/H/step_10", source="s3", run="H", run_path="H", step=10, label=""
    )
    rows.append(lora_far)
    objects = {
        remote.location: {
            "config.json": b'{"hidden_size": 8}', "tokenizer.json": b"{}", "model.bin": b"x"
        },
        lora_far.location: {  # a LoRA step saved alone: its config and weights up, the rest not
            "adapter_config.json": b'{"peft_type": "LORA", "r": 4}',
            "adapter_model.safetensors": b"weights",
            "training_args.bin": b"x",
        },
    }  # fmt: skip
    bucket = SimpleNamespace(  # an S3 source's view of a step: its listing, its objects
        view=lambda location: SimpleNamespace(
            files={k: len(v) for k, v in objects[location].items()},
            read=lambda name: objects[location][name],
        )
    )
    queued: list[SimpleNamespace] = []
    state = SimpleNamespace(
        checkpoints=lambda *states: rows if states == ("incomplete",) else [],
        jobs=lambda *states: queued,
    )
    request = EvalRequest("", "vllm", {}, [], 0, {}, None, None, None, None, "/r", "cpu")
    dispatcher = SimpleNamespace(
        book=SimpleNamespace(all_tasks=[{"harness": "lm-eval", "task": "t"}]),
        spec=lambda job, device: JobSpec(
            job.id, device.label, dataclasses.replace(request, checkpoint=job.location)
        ),
        discovery=SimpleNamespace(source_named=lambda name: bucket if name == "s3" else None),
    )
    cfg = SimpleNamespace(
        state_dir=tmp_path / "state",
        eval=SimpleNamespace(early_engine=True, backend="vllm", model_args={}, serve_adapters=True),
    )

    class Warm(Executor):
        starts_engines_ahead = True

        def __init__(self, idle: dict[str, str | None]) -> None:
            self.idle, self.sent = idle, []

        def start(self, *a):  # type: ignore[no-untyped-def]
            raise AssertionError

        def kill(self, *a):  # type: ignore[no-untyped-def]
            raise AssertionError

        def running(self) -> set[str]:
            return set()

        def idle_engines(self) -> dict[str, str | None]:
            return dict(self.idle)

        def prepare(self, label, folder, env) -> bool:  # type: ignore[no-untyped-def]
            self.sent.append((label, Path(folder.read_spec().request.checkpoint).name))
            self.idle[label] = folder.read_spec().job_id
            return True

    devices = cpu_slots(5)
    queued.append(SimpleNamespace(run_path="C"))  # C's job is queued already: no engine
    warm = Warm({"cpu:0": "B"})  # B's last job left its engine idle on cpu:0
    early = EarlyEngines(cfg, state, warm, dispatcher)  # type: ignore[arg-type]

    def start() -> None:
        """A loop pass once the steps' files have been read (on the lane, never the loop's)."""
        for look in list(early.looks.values()):
            look.result(timeout=10)
        early.start(devices)

    early.start(devices)
    assert warm.sent == []  # the first pass asks for the files to be read
    start()
    # one for A (not one per step), one for F's base, one for E on S3 and one for H's base
    # (S3); none for B-D
    fetched, adapter = early._fetched_for(remote.location), early._fetched_for(lora_far.location)
    assert warm.sent == [
        ("cpu:1", "step_10"), ("cpu:2", "step_10"), ("cpu:3", fetched.name),
        ("cpu:4", adapter.name),
    ]  # fmt: skip
    assert early.preferred() == {
        "B": "cpu:0", "A": "cpu:1", "F": "cpu:2", "E": "cpu:3", "H": "cpu:4"
    }  # fmt: skip
    assert sorted(p.name for p in fetched.iterdir()) == ["config.json", "tokenizer.json"]
    assert sorted(p.name for p in adapter.iterdir()) == [
        "adapter_config.json", "adapter_model.safetensors"
    ]  # fmt: skip
    rows.remove(lora_far)
    del warm.idle["cpu:4"]
    # D's model is not known (no config yet): looked at again every LOOK_SECONDS, not at
    # every pass; a look that finds nothing does not wake the loop, one that finds does
    undecided = rows[4].location
    first = early.looks[undecided]
    for _ in range(3):
        assert early._known(undecided, "local") is None
    assert early.looks[undecided] is first
    early.next_look[undecided] = 0.0  # LOOK_SECONDS later
    assert early._known(undecided, "local") is None
    assert early.looks[undecided] is not first
    woke: list[int] = []
    early.wake = lambda: woke.append(1)
    for answer in (None, "/a/step"):
        done: Future[str | None] = Future()
        done.set_result(answer)
        early._found(done)
    assert woke == [1]
    rows.remove(remote)  # judged complete: its fetched files go
    del warm.idle["cpu:3"]
    start()
    assert not fetched.exists()
    warm.sent.clear()
    start()
    assert warm.sent == []  # their engines wait
    for _ in range(TRIES_PER_STEP + 1):  # given back each time
        warm.idle = {"cpu:0": "B", "cpu:2": "F"}
        start()
    steps = [name for _, name in warm.sent]
    # A's step 10 three times in all, then A's next step
    assert steps == ["step_10"] * (TRIES_PER_STEP - 1) + ["step_20"] * 2, steps
    assert {label for label, _ in warm.sent} == {"cpu:1"}
    # a step whose folder hangs (an EFS mount that stopped answering): the loop's passes go on
    hang = threading.Event()
    rows.append(step("G", 10))
    for look in list(early.looks.values()):
        look.result(timeout=10)
    early._readable = lambda *a: hang.wait(60)  # type: ignore[method-assign]
    early.start(devices)
    early.start(devices)  # returned while the read hangs
    assert not early.looks[rows[-1].location].done()
    hang.set()
    ray = Warm({})
    ray.starts_engines_ahead = False
    assert not EarlyEngines(cfg, state, ray, dispatcher).enabled  # type: ignore[arg-type]
    assert not EarlyEngines(cfg, state, Warm({}), dispatcher, once=True).enabled  # type: ignore[arg-type]


def test_backed_off_jobs_wait_and_next_retry_is_reported() -> None:
    jobs = [job("a", 100, not_before=50), job("b", 50)]
    assert [j.id for j, _ in scheduler.assign(jobs, cpu_slots(2), 10, "newest_first")] == ["b"]
    assert scheduler.next_retry_at(jobs, 10) == 50
    assert [j.id for j, _ in scheduler.assign(jobs, cpu_slots(2), 50, "newest_first")] == ["a", "b"]


def test_gpus_are_used_before_cpu_slots_and_busy_gpus_skipped() -> None:
    inv = FakeInventory(gpus=[FakeGpu(6, "GPU-a"), FakeGpu(7, "GPU-b", [(999, 30000, 95)])], cpu=1)
    free = free_devices(inv, in_use=[], our_pids=set(), idle_memory_mib=1024)
    assert [d.label for d in free] == ["cuda:6", "cpu:0"]
    assert free[0].visible == "GPU-a"
    (pair,) = scheduler.assign([job("a", 1)], free, 0, "newest_first")
    assert pair[1].label == "cuda:6"
    assert [d.label for d in free_devices(inv, ["gpu:GPU-a"], set(), 1024)] == ["cpu:0"]
    assert [d.label for d in free_devices(inv, [], {999}, 1024)] == [
        "cuda:6",
        "cuda:7",
        "cpu:0",
    ]  # 999 is ours


def test_spare_devices_help_the_least_helped_running_job_once_per_attempt() -> None:
    a, b, plain = job("a", 100), job("b", 200), job("plain", 300)
    a.fingerprint, b.fingerprint = "sampled:a", "sampled:b"  # `plain` keeps no journal
    a.started_at, b.started_at, plain.started_at = 10.0, 20.0, 5.0
    a.device = b.device = plain.device = "cpu:0"
    devs = cpu_slots(4)[1:]  # cpu:1..3
    plan = scheduler.help_plan([a, b, plain], devs, {}, set())
    # the longest running job with a journal first, then the other, then back to the first
    assert [(j.id, d.label) for j, d in plan] == [("a", "cpu:1"), ("b", "cpu:2"), ("a", "cpu:3")]
    # a job already helped by one device: the other job gets the next
    plan = scheduler.help_plan([a, b], devs[:1], {"a": 1}, set())
    assert [(j.id, d.label) for j, d in plan] == [("b", "cpu:1")]
    # a device that helped this attempt of a job does not again; the job's next attempt may
    tried = {("a", 0, "cpu:1"), ("b", 0, "cpu:1")}
    assert scheduler.help_plan([a, b], devs[:1], {}, tried) == []
    a.attempt = 1
    assert [j.id for j, _ in scheduler.help_plan([a, b], devs[:1], {}, tried)] == ["a"]


def test_a_device_helps_only_jobs_running_on_its_own_kind() -> None:
    """A CPU slot beside GPUs never joins a GPU job's task: it would hold chunks the GPU waits
    for, and mix CPU numerics into a GPU's result."""
    on_gpu, on_cpu = job("g", 100), job("c", 200)
    on_gpu.fingerprint, on_cpu.fingerprint = "sampled:g", "sampled:c"
    on_gpu.device, on_cpu.device = "gpu:GPU-a", "cpu:0"
    on_gpu.started_at, on_cpu.started_at = 1.0, 2.0
    gpu = FakeInventory(gpus=[FakeGpu(7, "GPU-b")]).devices()
    plan = scheduler.help_plan([on_gpu, on_cpu], [*gpu, *cpu_slots(2)[1:]], {}, set())
    assert [(j.id, d.label) for j, d in plan] == [("g", "cuda:7"), ("c", "cpu:1")]
    assert scheduler.help_plan([on_gpu], cpu_slots(2)[1:], {}, set()) == []


def test_every_n_steps_and_finals() -> None:
    assert scheduler.step_due(200, False, 100)
    assert not scheduler.step_due(250, False, 100)
    assert scheduler.step_due(250, True, 100)
    assert scheduler.order_key(None, True) > scheduler.order_key(10**9, False)


@pytest.mark.parametrize(
    "prompt,requested,max_len,expected",
    [
        (10, 32, 64, (32, False, False)),
        (10, 54, 64, (54, False, False)),
        (10, 32768, 64, (54, True, False)),
        (63, 32768, 64, (1, True, False)),
        (64, 5, 64, (1, True, True)),
        (500, 5, 64, (1, True, True)),
    ],
)
def test_clamp_rule(prompt: int, requested: int, max_len: int, expected: tuple) -> None:
    assert clamp_gen_toks(prompt, requested, max_len) == expected


def test_clamp_refuses_a_context_with_no_room() -> None:
    with pytest.raises(ValueError):
        clamp_gen_toks(1, 1, 1)
