"""The combinations a deployment uses, end to end with real processes: local and S3 sources in
one daemon, an S3 endpoint that hangs beside a local folder that works (with the ledger mirror
going on meanwhile), and a checkpoint's tasks split over two devices. (Local and S3 sources
under Ray, on two nodes: test_ray_nodes.py.)"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.s3client import make_client
from ckpt_watcher.state import State
from ckpt_watcher.status import DEGRADED_MIN_SECONDS

from .conftest import base_config, read_ledger, s3_source, upload_dir, write_config
from .helpers import HangingEndpoint, status_json, wait_for, watcher_run

pytestmark = pytest.mark.e2e

TWO_TASKS = [{"task": "addition", "num_fewshot": 0}, {"task": "addition", "num_fewshot": 1}]


def ok_lines(ledgers: Path, run: str) -> list[dict]:
    return [ln for ln in read_ledger(ledgers, run) if ln["status"] == "ok"]


def publish(src: Path, dest: Path) -> None:
    """Make a checkpoint appear complete at once, as trainers that save then rename do. Its
    config names it, so it is other content than `src` (an exact copy would reuse results)."""
    staging = dest.parent.parent / f".{dest.name}.writing"
    shutil.copytree(src, staging)
    config = json.loads((staging / "config.json").read_text())
    (staging / "config.json").write_text(json.dumps({**config, "_name_or_path": str(dest)}))
    dest.parent.mkdir(parents=True, exist_ok=True)
    os.rename(staging, dest)


def test_local_and_s3_sources_in_one_daemon_both_get_their_results(
    tmp_path: Path, s3_endpoint: str, bucket: str, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    client = make_client(s3_endpoint)
    upload_dir(client, trained_checkpoint, bucket, "ckpts/jobA/sm_step300/")
    watch = tmp_path / "efs"
    publish(trained_checkpoint, watch / "efs_step300")
    raw = base_config(tmp_path, watch, addition_tasks)
    raw["sources"].append(s3_source(f"s3://{bucket}/ckpts/", tmp_path / "cache"))
    raw["ledger_mirror"] = f"s3://{bucket}/mirror/"
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    ledgers = tmp_path / "ledgers"
    # a ledger appended just before a crash, never uploaded: the next start mirrors it
    (ledgers / "earlier").mkdir(parents=True)
    (ledgers / "earlier" / "ledger.jsonl").write_text('{"run": "earlier", "task": "t"}\n')
    with watcher_run(cfg, log) as daemon:
        wait_for(
            lambda: ok_lines(ledgers, "efs") and ok_lines(ledgers, "jobA/sm"),
            300,
            "both results",
            daemon,
            log,
        )
        code, st = status_json(cfg)
        assert code == 0 and st is not None  # the daemon is up and serving
        assert all(s["error"] is None and s["checkpoints"] == 1 for s in st["sources"])
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    (efs,) = read_ledger(ledgers, "efs")
    (sm,) = read_ledger(ledgers, "jobA/sm")  # its run path: the folders under the prefix too
    assert efs["checkpoint"] == str(watch / "efs_step300")
    assert sm["checkpoint"] == f"s3://{bucket}/ckpts/jobA/sm_step300/"
    assert efs["metrics"] == sm["metrics"]  # the same weights, from a folder and from S3
    assert "reused_from" not in efs and "reused_from" not in sm  # two contents, two evals
    for run in ("earlier", "efs", "jobA/sm"):
        mirrored = client.get_object(Bucket=bucket, Key=f"mirror/{run}/ledger.jsonl")["Body"].read()
        assert mirrored == (ledgers / run / "ledger.jsonl").read_bytes()


def test_a_hanging_s3_endpoint_delays_only_itself_and_the_mirror_keeps_up(
    tmp_path: Path, s3_endpoint: str, bucket: str, addition_tasks: Path, trained_checkpoint: Path
) -> None:
    client = make_client(s3_endpoint)
    upload_dir(client, trained_checkpoint, bucket, "ckpts/jobB/far_step300/")
    endpoint = HangingEndpoint(s3_endpoint)
    watch = tmp_path / "efs"
    watch.mkdir()
    raw = base_config(tmp_path, watch, addition_tasks)
    raw["sources"].append(
        {
            "kind": "s3",
            "uri": f"s3://{bucket}/ckpts/",
            "endpoint_url": endpoint.url,
            "poll_seconds": 1,
            "request_timeout_seconds": 1,
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    raw["ledger_mirror"] = f"s3://{bucket}/mirror/"  # the working endpoint (AWS_ENDPOINT_URL)
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    ledgers = tmp_path / "ledgers"
    heartbeats: list[float] = []

    def status() -> dict:
        code, st = status_json(cfg)
        assert code in (0, 5) and st is not None, (  # 5: running, degraded (the S3 source)
            f"watcher status exit {code}: the daemon is not serving"
        )
        heartbeats.append(st["daemon"]["heartbeat_age_s"])
        return st

    def s3_source(st: dict) -> dict:
        return next(s for s in st["sources"] if s["name"].startswith("s3://"))

    try:
        with watcher_run(cfg, log) as daemon:
            wait_for(lambda: status_json(cfg)[0] == 0, 60, "the daemon to serve", daemon, log)
            st = wait_for(
                lambda: (st := status()) and s3_source(st)["unreachable_since"] and st,
                60,
                "the S3 source to show as unreachable",
                daemon,
                log,
            )
            assert (
                "still failing" in s3_source(st)["error"] or "no answer" in s3_source(st)["error"]
            )
            publish(trained_checkpoint, watch / "near_step300")
            written = time.time()
            # (the wait includes the worker starter's imports, begun with the first job: over
            # 15 s with the Ray test's three nodes beside it)
            wait_for(
                lambda: status()["running"] or ok_lines(ledgers, "near"),
                120,
                "the local checkpoint's eval to start",
                daemon,
                log,
            )
            queued_after = _logged_at(log, "job.queued", run="near") - written
            wait_for(lambda: ok_lines(ledgers, "near"), 180, "the local result", daemon, log)
            local_ledger = (ledgers / "near" / "ledger.jsonl").read_bytes()

            def mirrored() -> bytes | None:
                try:
                    return client.get_object(Bucket=bucket, Key="mirror/near/ledger.jsonl")[
                        "Body"
                    ].read()
                except client.exceptions.NoSuchKey:
                    return None

            wait_for(lambda: mirrored() == local_ledger, 30, "the mirror", daemon, log)
            assert s3_source(status())["unreachable_since"]  # still down while all that happened
            # down for 3 polls and 30 s (its outage moved back by that, as the daemon keeps
            # the first failure's time): status says the daemon runs degraded, and exits 5
            back = State(tmp_path / "state")
            with back.conn:
                back.conn.execute(
                    "UPDATE sources SET unreachable_since = unreachable_since - ? "
                    "WHERE name LIKE 's3://%' AND unreachable_since IS NOT NULL",
                    (DEGRADED_MIN_SECONDS,),
                )
            back.close()
            st = wait_for(
                lambda: (r := status_json(cfg))[0] == 5 and r[1], 60, "exit 5", daemon, log
            )
            assert st["degraded"][0].startswith(f"source {s3_source(st)['name']} unreachable")

            endpoint.recover()
            wait_for(
                lambda: ok_lines(ledgers, "jobB/far"),
                240,
                "the S3 result after recovery",
                daemon,
                log,
            )
            st = wait_for(
                lambda: (st := status()) and not s3_source(st)["unreachable_since"] and st,
                30,
                "the S3 source to be reachable again",
                daemon,
                log,
            )
            assert s3_source(st)["error"] is None and s3_source(st)["checkpoints"] == 1
            assert status_json(cfg)[0] == 0 and st["degraded"] == []
            daemon.send_signal(signal.SIGTERM)
            assert daemon.wait(timeout=60) == 0
    finally:
        endpoint.close()
    assert queued_after < 15, queued_after  # its scans never waited for the hanging source's
    assert max(heartbeats) < 10, heartbeats  # stale after 20 s; the loop never blocked
    assert endpoint.connections > 1
    far = ok_lines(ledgers, "jobB/far")
    assert len(far) == 1 and far[0]["checkpoint"] == f"s3://{bucket}/ckpts/jobB/far_step300/"


def test_a_checkpoints_tasks_split_over_two_idle_devices_each_file_their_own_line(
    tmp_path: Path, addition_tasks: Path, copy_checkpoint
) -> None:
    """One checkpoint, two task entries, two idle devices: the scheduler splits the checkpoint's
    tasks into a job per device (`job.split`), each files its own line. (Under Ray the same
    jobs go to two nodes' devices: test_ray_nodes.py.)"""
    watch = tmp_path / "ckpts"
    copy_checkpoint(watch / "split_step300")
    raw = base_config(tmp_path, watch, addition_tasks, tasks=TWO_TASKS)
    raw["devices"] = {"gpus": [], "cpu_slots": 2}
    cfg = write_config(tmp_path / "w.yaml", raw)
    log = tmp_path / "daemon.log"
    with watcher_run(cfg, log) as daemon:
        wait_for(
            lambda: len(read_ledger(tmp_path / "ledgers", "split")) >= 2,
            300,
            "2 results",
            daemon,
            log,
        )
        daemon.send_signal(signal.SIGTERM)
        assert daemon.wait(timeout=60) == 0
    lines = read_ledger(tmp_path / "ledgers", "split")
    assert sorted((ln["status"], ln["num_fewshot"]) for ln in lines) == [("ok", 0), ("ok", 1)]
    assert {ln["device"] for ln in lines} == {"cpu:0", "cpu:1"}  # one task per device
    assert len({ln["job_id"] for ln in lines}) == 2
    assert '"event": "job.split"' in log.read_text()


def _logged_at(log: Path, event: str, **fields: Any) -> float:
    """When the daemon's JSON log first says `event` with `fields` (epoch seconds)."""
    from datetime import datetime

    for line in log.read_text().splitlines():
        if line.startswith("{") and f'"{event}"' in line:
            e = json.loads(line)
            if e.get("event") == event and all(e.get(k) == v for k, v in fields.items()):
                return datetime.fromisoformat(e["timestamp"].replace("Z", "+00:00")).timestamp()
    raise AssertionError(f"no {event} {fields} in {log}")
