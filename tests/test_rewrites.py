"""Rewrites in place, seen by discovery on S3: evaluated checkpoints are looked at again a few
per scan, in turn, and one whose content changed becomes a new version."""

from __future__ import annotations

import json
import time
from pathlib import Path

from ckpt_watcher.discovery import Discovery
from ckpt_watcher.s3client import Retry, make_client
from ckpt_watcher.sources.s3 import S3Source
from ckpt_watcher.state import State

from .conftest import upload_dir, write_safetensors

NO_WAIT = Retry(attempts=3, initial=0.0, maximum=0.0)


def scan(discovery: Discovery, now: float) -> None:
    discovery.tick(now, force=True)
    deadline = time.monotonic() + 30
    while discovery.scanning():
        assert time.monotonic() < deadline, "scan did not finish"
        time.sleep(0.02)
        discovery.tick(now, polls=False)


def put_checkpoint(client, tmp: Path, bucket: str, key: str, fill: int) -> None:
    folder = tmp / key.replace("/", "_")
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (folder / "tokenizer.json").write_text("{}")
    write_safetensors(folder / "model.safetensors", {"w": 1000})
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-100:] = bytes([fill]) * 100  # other weights, same layout and size
    (folder / "model.safetensors").write_bytes(bytes(data))
    upload_dir(client, folder, bucket, key)


def test_an_s3_checkpoint_rewritten_after_evaluation_is_a_new_version(
    tmp_path: Path, s3_endpoint: str, bucket: str
) -> None:
    client = make_client(s3_endpoint)
    for step in (1, 2, 3):
        put_checkpoint(client, tmp_path, bucket, f"ck/r_step{step}/", fill=step)
    source = S3Source(f"s3://{bucket}/ck/", client=client, retry=NO_WAIT)
    source.recheck_per_scan = 2
    state = State(tmp_path / "state")
    # one look judges (the settle window has tests of its own: test_writers.py)
    discovery = Discovery([source], state, stable_seconds=1, wake=lambda: None, settle_seconds=0)
    lists: list[str] = []
    client.meta.events.register(
        "provide-client-params.s3.ListObjectsV2",
        lambda params, **_: lists.append(params.get("Prefix", "")),
    )
    try:
        scan(discovery, 100.0)
        rows = {r.step: r for r in state.checkpoints()}
        assert {r.state for r in rows.values()} == {"ready"}
        first = {s: r.fingerprint for s, r in rows.items()}
        assert len(set(first.values())) == 3 and all(
            v.startswith("sampled:") for v in first.values()
        )
        for r in rows.values():  # evaluated
            state.upsert_checkpoint(r.location, r.source, 101.0, state="done")

        put_checkpoint(client, tmp_path, bucket, "ck/r_step3/", fill=9)  # resumed, saved again
        lists.clear()
        scan(discovery, 110.0)  # looks at 2 of 3 again: steps 1 and 2
        assert sum(1 for p in lists if p.startswith("ck/r_step")) == 2
        assert {r.state for r in state.checkpoints()} == {"done"}
        lists.clear()
        scan(discovery, 120.0)  # now step 3 (and step 1, looked at longest ago)
        assert sorted(p for p in lists if p.startswith("ck/r_step"))[:2] == [
            "ck/r_step1/",
            "ck/r_step3/",
        ]
        row = state.checkpoint(f"s3://{bucket}/ck/r_step3/")
        assert row is not None and row.state == "ready" and row.rewritten_at == 120.0
        assert row.previous_fingerprint == first[3] != row.fingerprint
        assert "rewritten" in row.reason
        # the others stand, untouched
        assert [r.state for r in state.checkpoints() if r.step != 3] == ["done", "done"]
    finally:
        discovery.close()
        state.close()
