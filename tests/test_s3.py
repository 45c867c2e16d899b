"""S3 sources against a real S3 API: moto's server on loopback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from ckpt_watcher.checkpoints import completeness
from ckpt_watcher.checkpoints.files import eval_mark
from ckpt_watcher.errors import S3Error, StagingError
from ckpt_watcher.s3client import Retry, S3Files, make_client
from ckpt_watcher.sources.s3 import S3Source
from ckpt_watcher.sources.staging import stage, staged_path

from .conftest import (
    base_config,
    read_ledger,
    upload_dir,
    write_config,
    write_fake_checkpoint,
    write_safetensors,
    write_two_shards,
)
from .helpers import status_json, wait_for, watcher_run

NO_WAIT = Retry(attempts=3, initial=0.0, maximum=0.0)  # retries without back-off in tests


def test_scan_lists_checkpoint_prefixes_without_a_request_per_checkpoint(
    tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    client = make_client(s3_endpoint)
    for i in range(30):
        client.put_object(Bucket=bucket, Key=f"ckpts/job1/r_step{i}/config.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="ckpts/job1/latest/config.json", Body=b"{}")
    client.put_object(Bucket=bucket, Key="ckpts/grpo/checkpoint-5/config.json", Body=b"{}")
    calls: list[str] = []
    client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    src = S3Source(f"s3://{bucket}/ckpts/", client=client, retry=NO_WAIT)
    found = {f.location.rsplit("/", 2)[-2]: f for f in src.scan()}
    assert len([f for f in found.values() if f.ident]) == 31
    assert found["checkpoint-5"].ident is not None and found["checkpoint-5"].ident.run == "grpo"
    assert found["latest"].ident is None and "follows no pattern" in found["latest"].note
    assert found["checkpoint-5"].ident.run_path == "grpo"
    assert {found[f"r_step{i}"].ident.run_path for i in range(30)} == {"job1/r"}  # type: ignore[union-attr]
    assert (
        calls == ["ListObjectsV2"] * len(calls) and len(calls) == 4
    )  # ckpts/, job1/, grpo/, latest/


def test_verl_steps_on_s3_are_found_by_their_hugging_face_prefix_with_one_list_each(
    tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    """A verl run synced to S3: `global_step_N/actor/huggingface/` is the checkpoint (one more
    LIST per `global_step` prefix, to see what it holds, and for an `actor/` one of all it
    holds: the model may be a LoRA adapter beside it); run and step from the names above.
    A step whose model is gone is passed by; DeepSpeed's engine states are a checkpoint of
    their own (converted: formats/deepspeed.py)."""
    client = make_client(s3_endpoint)
    ckpt = write_fake_checkpoint(tmp_path / "hf")
    upload_dir(client, ckpt, bucket, "verl/exp1/global_step_10/actor/huggingface/")
    client.put_object(
        Bucket=bucket, Key="verl/exp1/global_step_10/actor/model_world_size_1_rank_0.pt", Body=b"s"
    )
    upload_dir(client, ckpt, bucket, "verl/sft1/global_step_3/huggingface/")
    upload_dir(client, ckpt, bucket, "verl/plain/global_step_4/")
    client.put_object(Bucket=bucket, Key="verl/exp1/global_step_5/data.pt", Body=b"d")  # gone
    ds = "verl/ds/global_step7/mp_rank_00_model_states.pt"  # DeepSpeed's states: no model
    client.put_object(Bucket=bucket, Key=ds, Body=b"d")
    calls: list[str] = []
    client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    src = S3Source(f"s3://{bucket}/verl/", client=client, retry=NO_WAIT)
    found = {f.location.removeprefix(f"s3://{bucket}/verl/"): f.ident for f in src.scan()}
    assert set(found) == {
        "exp1/global_step_10/actor/huggingface/",
        "sft1/global_step_3/huggingface/",
        "plain/global_step_4/",
        "ds/global_step7/",
    }
    ppo = found["exp1/global_step_10/actor/huggingface/"]
    assert ppo is not None and (ppo.run, ppo.step, ppo.run_path) == ("exp1", 10, "exp1")
    sft = found["sft1/global_step_3/huggingface/"]
    assert sft is not None and (sft.run, sft.step) == ("sft1", 3)
    # verl/, its 4 runs, each global_step prefix once more, and the actor/ of one and the
    # huggingface/ of another (the weights or the shards: verl_fsdp.py)
    assert calls == ["ListObjectsV2"] * 12, calls
    calls.clear()  # the next scan: the model folders found are not looked for again, only
    # seen to be still there (one key each: verl's keep-last-k deletes them)
    assert {f.location for f in src.scan()} == {f"s3://{bucket}/verl/{k}" for k in found}
    assert len(calls) == 5 + 2 + 2, calls  # the levels, 2 prefixes without a model, 2 models
    view = src.view(f"s3://{bucket}/verl/exp1/global_step_10/actor/huggingface/")
    verdict = completeness.check(view, now=0.0, stable_seconds=0, settle_seconds=0)
    assert verdict.ready, verdict


def test_completeness_over_s3_reads_headers_only_and_waits_for_the_last_shard(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    client = make_client(s3_endpoint)
    local = write_two_shards(tmp_path / "r_step1")
    upload_dir(client, local, bucket, "c/r_step1/", skip=("model-00002-of-00002.safetensors",))
    src = S3Source(f"s3://{bucket}/c/", client=client, retry=NO_WAIT)
    loc = f"s3://{bucket}/c/r_step1/"
    v = completeness.check(src.view(loc), now=0, stable_seconds=60, settle_seconds=0)
    assert v.state == "incomplete" and "1 of 2 shards" in v.reason
    client.upload_file(
        str(local / "model-00002-of-00002.safetensors"),
        bucket,
        "c/r_step1/model-00002-of-00002.safetensors",
    )
    ranges: list[str] = []
    client.meta.events.register(
        "before-call.s3.GetObject", lambda params, **_: ranges.append(params.get("Range", ""))
    )
    assert completeness.check(src.view(loc), now=0, stable_seconds=60, settle_seconds=0).ready
    assert all(r.startswith("bytes=") for r in ranges if r != "") and len(ranges) >= 4
    # the newest object's LastModified (for the detection-latency metric), from the listing
    last = src.view(loc).last_write()
    assert last is not None and abs(time.time() - last) < 60


STAGE_ONE = """
import sys, time
from pathlib import Path
from ckpt_watcher.sources.staging import stage
go = Path(sys.argv[4])
while not go.exists():  # both start together
    time.sleep(0.01)
print(stage(sys.argv[1], Path(sys.argv[2]), sys.argv[3]))
"""


def test_two_workers_staging_one_checkpoint_at_once_both_get_it_whole(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """A split job's parts, or a job and its helper, stage one S3 checkpoint at the same time."""
    client = make_client(s3_endpoint)
    ck = write_fake_checkpoint(tmp_path / "src" / "r_step3", naming_bug=True)
    write_safetensors(ck / "model.safetensors", {"a.weight": 6 << 20, "b.weight": 8})  # 24 MiB
    upload_dir(client, ck, bucket, "two/r_step3/")
    cache, go = tmp_path / "cache", tmp_path / "go"
    location = f"s3://{bucket}/two/r_step3/"
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", STAGE_ONE, location, str(cache), s3_endpoint, str(go)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for _ in range(2)
    ]
    time.sleep(3)  # both imported and waiting
    go.touch()
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0], [err[-2000:] for _, err in outs]
    (dest,) = {Path(out.strip().splitlines()[-1]) for out, _ in outs}  # after its log lines
    assert (dest / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    assert not list(dest.glob(".*.part"))
    assert json.loads((dest / "model.safetensors.index.json").read_text())["weight_map"]


def test_a_due_s3_checkpoint_is_held_so_a_deleted_prefix_costs_nothing(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    """S3Source.hold stages a due checkpoint at once; the trainer then deletes the prefix
    (keep-last-k), an object at a time; the job's worker gets the whole copy, half way through
    the delete (the copy is of exactly the objects judged) and after it."""
    client = make_client(s3_endpoint)
    ck = write_fake_checkpoint(tmp_path / "src" / "r_step4", naming_bug=True)
    upload_dir(client, ck, bucket, "held/r_step4/")
    cache = tmp_path / "cache"
    source = S3Source(f"s3://{bucket}/held/", endpoint_url=s3_endpoint, cache_dir=cache)
    location = f"s3://{bucket}/held/r_step4/"
    judged = eval_mark(S3Files(client, NO_WAIT, bucket, "held/r_step4/"))
    assert not source.held(location)
    source.hold(location)
    assert source.held(location) and source.held(location, judged)
    assert not source.held(location, judged[:-4] + "beef")  # a copy of other objects
    client.delete_object(Bucket=bucket, Key="held/r_step4/model.safetensors.index.json")  # half way
    dest = stage(location, cache, client=client, retry=NO_WAIT, write_mark=judged)
    assert (dest / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    for obj in client.list_objects_v2(Bucket=bucket, Prefix="held/")["Contents"]:
        client.delete_object(Bucket=bucket, Key=obj["Key"])
    assert not source.exists(location)
    dest = stage(location, cache, client=client, retry=NO_WAIT)  # what the worker does
    assert (dest / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    source.release(location)  # the job ended
    assert not source.held(location)
    with pytest.raises(StagingError, match="no config.json"):
        stage(location, cache, client=client, retry=NO_WAIT)


def test_staging_fetches_only_what_an_eval_needs_and_fixes_names(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    client = make_client(s3_endpoint)
    ck = write_fake_checkpoint(tmp_path / "src" / "r_step2", naming_bug=True)
    (ck / "tokenizer.json").write_text("{}")
    big = 64 << 20
    with open(ck / "optimizer.pt", "wb") as f:
        f.truncate(big)  # Adam state: never fetched
    (ck / "rng_state_0.pth").write_bytes(b"r" * 1000)
    upload_dir(client, ck, bucket, "x/r_step2/")
    client.put_object(Bucket=bucket, Key="x/r_step2/__0_0.distcp", Body=b"d" * 1000)
    cache = tmp_path / "cache"
    dest = stage(f"s3://{bucket}/x/r_step2/", cache, client=client, retry=NO_WAIT)
    assert dest.is_relative_to(cache)
    names = sorted(p.name for p in dest.iterdir())
    assert names == [
        ".fetched.json",
        ".last_used",
        "config.json",
        "model-00001-of-00001.safetensors",
        "model.safetensors",
        "model.safetensors.index.json",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    assert (dest / "model.safetensors").read_bytes() == (ck / "model.safetensors").read_bytes()
    fetched = sum(
        p.stat().st_size for p in dest.iterdir() if p.name != "model-00001-of-00001.safetensors"
    )
    total = sum(p.stat().st_size for p in ck.iterdir()) + 1000
    assert fetched / total < 0.35


@pytest.mark.parametrize("key", ["../evil/", "a/../../evil/", "a/./b/", "a//b/"])
def test_keys_never_escape_the_cache(tmp_path: Path, key: str) -> None:
    with pytest.raises(StagingError):
        staged_path(tmp_path / "cache", f"s3://bucket/{key}")


def test_odd_characters_stay_inside_the_cache(tmp_path: Path) -> None:
    p = staged_path(tmp_path / "cache", "s3://bucket/we ird;$(x)/\u00e9\\n_step1/")
    assert p.resolve().is_relative_to((tmp_path / "cache").resolve())
    assert len(p.relative_to(tmp_path / "cache").parts) == 3


def test_missing_bucket_and_bad_credentials_fail_fast_with_a_clear_message(
    s3_endpoint: str,
) -> None:
    src = S3Source(
        "s3://no-such-bucket-here/x/",
        client=make_client(s3_endpoint),
        retry=Retry(attempts=5, initial=5),
    )
    with pytest.raises(S3Error, match="NoSuchBucket: the bucket does not exist"):
        src.scan()  # would take > 5 s if it retried


@pytest.mark.e2e
def test_checkpoint_uploaded_shard_by_shard_is_evaluated_once_after_its_last_shard(
    tmp_path: Path, s3_endpoint: str, bucket: str, addition_tasks: Path, copy_checkpoint
) -> None:
    from .test_e2e_hf import split_in_two_shards

    client = make_client(s3_endpoint)
    ck = copy_checkpoint(tmp_path / "local" / "s3run_step300")
    shard2 = split_in_two_shards(ck)
    with open(ck / "optimizer.pt", "wb") as f:
        f.truncate(1 << 30)  # 1 GB of (sparse) Adam state beside 1.3 MB of weights
    upload_dir(client, ck, bucket, "ckpts/job/s3run_step300/", skip=(shard2.name,))
    raw = base_config(tmp_path, tmp_path, addition_tasks)
    cache = tmp_path / "cache"
    raw["sources"] = [
        {
            "kind": "s3",
            "uri": f"s3://{bucket}/ckpts/",
            "poll_seconds": 1,
            "cache_dir": str(cache),
            "keep_staged": True,
        },
        {"kind": "s3", "uri": "s3://no-such-bucket-anywhere/ckpts/", "poll_seconds": 1},
    ]
    raw["ledger_mirror"] = f"s3://{bucket}/mirror/"
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        # a checkpoint is "incomplete: just seen" from its first listing until its files are
        # judged (on a fast machine `watcher status` can read that moment)
        st = wait_for(
            lambda: (
                (s := status_json(cfg)[1])
                and s["checkpoint_counts"].get("incomplete") == 1
                and s["checkpoints"][0]["reason"] != "just seen"
                and s
            ),
            60,
            "an S3 checkpoint judged incomplete",
            daemon,
            log,
        )
        assert st["checkpoints"][0]["reason"] == "1 of 2 shards present"
        broken = next(s for s in st["sources"] if "no-such-bucket" in s["name"])
        assert "NoSuchBucket: the bucket does not exist" in broken["error"]  # and the other goes on
        assert not st["queue"] and not st["running"]
        client.upload_file(str(shard2), bucket, f"ckpts/job/s3run_step300/{shard2.name}")
        wait_for(
            lambda: read_ledger(tmp_path / "ledgers", "job/s3run"), 300, "a result", daemon, log
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (line,) = read_ledger(tmp_path / "ledgers", "job/s3run")  # the run path keeps the job folder
    assert (
        line["status"] == "ok" and line["checkpoint"] == f"s3://{bucket}/ckpts/job/s3run_step300/"
    )
    mirrored = client.get_object(Bucket=bucket, Key="mirror/job/s3run/ledger.jsonl")["Body"].read()
    assert mirrored == (tmp_path / "ledgers" / "job" / "s3run" / "ledger.jsonl").read_bytes()
    # the run's HTML report, rewritten after the append, sits beside the mirrored ledger
    page = (tmp_path / "ledgers" / "job" / "s3run" / "report.html").read_bytes()
    assert b'class="point" data-step="300"' in page
    mirrored_page = client.get_object(Bucket=bucket, Key="mirror/job/s3run/report.html")
    assert mirrored_page["Body"].read() == page and mirrored_page["ContentType"] == "text/html"
    staged = staged_path(cache, line["checkpoint"])
    assert not (staged / "optimizer.pt").exists()
    assert (staged / shard2.name).read_bytes() == shard2.read_bytes()


def test_doctor_checks_s3_reachability(tmp_path: Path, s3_endpoint: str, bucket: str) -> None:
    import subprocess

    from .conftest import WATCHER

    cfg = write_config(
        tmp_path / "w.yaml",
        {
            "state_dir": str(tmp_path / "s"),
            "ledger_dir": str(tmp_path / "l"),
            "sources": [
                {"kind": "s3", "uri": f"s3://{bucket}/ckpts/"},
                {"kind": "s3", "uri": "s3://nope-missing/x/"},
            ],
            "devices": {"gpus": [], "cpu_slots": 1},
            "eval": {"backend": "hf", "tasks": [{"task": "gsm8k"}]},
        },
    )
    r = subprocess.run(
        [*WATCHER, "doctor", "-c", str(cfg)], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 1
    assert f"ok    sources[0]: s3://{bucket}/ckpts/ reachable (empty so far)" in r.stdout
    assert (
        "FAIL  sources[1]: s3://nope-missing/x/: NoSuchBucket: the bucket does not exist"
        in r.stdout
    )


class FlakyProxy:
    """A loopback HTTP proxy in front of the S3 server that fails a seeded share of requests:
    half of the failures answer 503 SlowDown, half drop the connection without a reply."""

    def __init__(self, upstream: str, fail_rate: float, seed: int) -> None:
        import http.client
        import http.server
        import random
        import threading
        from urllib.parse import urlparse

        up = urlparse(upstream)
        rng = random.Random(seed)
        lock = threading.Lock()
        self.failures = 0
        self.requests = 0
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _relay(self) -> None:
                with lock:
                    proxy.requests += 1
                    roll = rng.random()
                if roll < fail_rate / 2:
                    with lock:
                        proxy.failures += 1
                    body = b"<Error><Code>SlowDown</Code><Message>Please reduce your request rate.</Message></Error>"
                    self.send_response(503)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                    return
                if roll < fail_rate:
                    with lock:
                        proxy.failures += 1
                    self.close_connection = True
                    self.connection.shutdown(2)
                    return
                length = int(self.headers.get("Content-Length") or 0)
                body_in = self.rfile.read(length) if length else None
                conn = http.client.HTTPConnection(up.hostname, up.port, timeout=30)
                conn.request(self.command, self.path, body=body_in, headers=dict(self.headers))
                resp = conn.getresponse()
                data = resp.read()
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)
                conn.close()

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = _relay

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def test_staging_through_20_percent_failures_is_byte_identical(
    s3_endpoint: str, bucket: str, tmp_path: Path
) -> None:
    direct = make_client(s3_endpoint)
    sources = []
    for step in (1, 2, 3):
        ck = write_fake_checkpoint(tmp_path / "src" / f"f_step{step}", naming_bug=step == 2)
        write_safetensors(ck / "model.safetensors", {"a.weight": 50_000 * step, "b.weight": 8})
        upload_dir(direct, ck, bucket, f"flaky/f_step{step}/")
        sources.append(ck)
    proxy = FlakyProxy(s3_endpoint, fail_rate=0.2, seed=7)
    try:
        client = make_client(proxy.url)
        retry = Retry(attempts=12, initial=0.0, maximum=0.0)
        src = S3Source(f"s3://{bucket}/flaky/", client=client, retry=retry)
        found = sorted(f.location for f in src.scan() if f.ident)
        assert len(found) == 3
        for loc, ck in zip(found, sources, strict=True):
            view = src.view(loc)
            assert completeness.check(view, now=0, stable_seconds=60, settle_seconds=0).ready
            dest = stage(loc, tmp_path / "cache", client=client, retry=retry)
            for p in ck.iterdir():
                assert (dest / p.name).read_bytes() == p.read_bytes()
    finally:
        proxy.close()
    assert proxy.failures >= 5 and proxy.failures / proxy.requests > 0.1  # faults really happened


def _staged_copies(cache: Path, n: int) -> list[str]:
    """`n` staged copies of 1,000 bytes each, step 0 the least recently used; their locations."""
    locs = [f"s3://bkt/ck/r_step{i}/" for i in range(n)]
    for i, loc in enumerate(locs):
        d = staged_path(cache, loc)
        d.mkdir(parents=True)
        (d / "model.safetensors").write_bytes(b"x" * 1000)
        (d / ".last_used").touch()
        os.utime(d / ".last_used", (time.time() - 100 + i, time.time() - 100 + i))
    return locs


def test_cache_evicts_least_recently_used_copies_but_never_needed_ones(tmp_path: Path) -> None:
    cache = tmp_path / "cache"
    src = S3Source("s3://bkt/ck/", cache_dir=cache, cache_max_gb=2500 / 2**30)  # 2,500 bytes
    locs = _staged_copies(cache, 4)
    src.make_room(needed=[locs[0]])  # the oldest is needed by a queued job
    left = sorted(p.parent.name for p in cache.rglob(".last_used"))
    assert left == ["r_step0", "r_step3"]  # 4,000 -> 2,000 bytes: step1 and step2 went


def test_a_ray_nodes_agent_keeps_its_staged_copies_within_the_budget_once_a_job_ends(
    tmp_path: Path,
) -> None:
    """Under Ray a node's workers stage into its own cache, where nobody but its agent keeps
    it in bounds: once a job there ends, copies go least recently used first until the
    source's `cache_max_gb` holds, sparing those of jobs still running on the node."""
    from ckpt_watcher.executors.node_agent import NodeAgent
    from ckpt_watcher.jobfolder import Stage

    cache = tmp_path / "cache"
    locs = _staged_copies(cache, 4)
    settings = {"devices": {"gpus": [], "cpu_slots": 1}, "caches": {str(cache): 2500}}
    agent = NodeAgent("node-b", settings)
    try:
        agent._staged = {"j0": Stage(locs[0], str(cache)), "j3": Stage(locs[3], str(cache))}
        agent._exited("j3", 0)  # j3 ended; j0, the oldest copy's, still runs here
    finally:
        agent.close()
    left = sorted(p.parent.name for p in cache.rglob(".last_used"))
    assert left == ["r_step0", "r_step3"]  # 4,000 -> 2,000 bytes: step1 and step2 went


def test_scan_reports_keys_that_could_escape_and_never_plans_them(
    s3_endpoint: str, bucket: str
) -> None:
    client = make_client(s3_endpoint)
    for key in [
        "ck/../r_step1/config.json",
        "ck//r_step2/config.json",
        "ck/./r_step3/config.json",
        "ck/ok_step4/config.json",
    ]:
        client.put_object(Bucket=bucket, Key=key, Body=b"{}")
    found = S3Source(f"s3://{bucket}/ck/", client=client, retry=NO_WAIT).scan()
    good = [f.location for f in found if f.ident]
    assert good == [f"s3://{bucket}/ck/ok_step4/"]
    assert sum("never staged" in f.note for f in found) == 3
