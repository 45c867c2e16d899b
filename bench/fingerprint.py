"""Fingerprint cost: `sampled` vs `full` on a checkpoint with a 1 GiB safetensors file, from a
local folder and from S3 (a moto server on this machine), measured side by side in one run.

Prints per mode and place: median seconds over the rounds, bytes read and (S3) GET requests,
and the full/sampled ratio. The local figures are with the file in the page cache (it was just
written); the S3 figures include moto's HTTP handling on this machine.
Usage: python bench/fingerprint.py [--gib 1] [--rounds 3] [--work /tmp/bench-fingerprint]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import time
from pathlib import Path
from typing import Any

from ckpt_watcher.checkpoints.files import LocalFiles
from ckpt_watcher.checkpoints.fingerprint import fingerprint
from ckpt_watcher.s3client import Retry, S3Files, make_client


def write_checkpoint(folder: Path, gib: float) -> int:
    """config.json plus one safetensors file of about `gib` GiB of random bytes."""
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "llama"}))
    n = int(gib * 2**30) // 4
    header = json.dumps({"w": {"dtype": "F32", "shape": [n], "data_offsets": [0, 4 * n]}}).encode()
    chunk = os.urandom(64 << 20)
    with open(folder / "model.safetensors", "wb") as f:
        f.write(struct.pack("<Q", len(header)) + header)
        left = 4 * n
        while left:
            f.write(chunk[: min(left, len(chunk))])
            left -= min(left, len(chunk))
    return (folder / "model.safetensors").stat().st_size


class Counted:
    """A CheckpointFiles wrapper counting reads (each read is one GET on S3)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.reads, self.bytes = inner, 0, 0

    @property
    def files(self) -> dict[str, int]:
        return self.inner.files  # type: ignore[no-any-return]

    def read(self, name: str, start: int = 0, length: int | None = None) -> bytes:
        data: bytes = self.inner.read(name, start, length)
        self.reads += 1
        self.bytes += len(data)
        return data

    def write_mark(self) -> str:
        return self.inner.write_mark()  # type: ignore[no-any-return]


def measure(make_view: Any, mode: str, rounds: int) -> dict[str, Any]:
    times, value, view = [], "", None
    for _ in range(rounds):
        view = Counted(make_view())
        t0 = time.perf_counter()
        value = fingerprint(view, mode)  # type: ignore[arg-type]
        times.append(time.perf_counter() - t0)
    assert view is not None
    return {
        "seconds": statistics.median(times),
        "reads": view.reads,
        "bytes": view.bytes,
        "value": value,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--gib", type=float, default=1.0)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=Path("/tmp/bench-fingerprint"))
    args = ap.parse_args()
    shutil.rmtree(args.work, ignore_errors=True)
    folder = args.work / "big_step1"
    size = write_checkpoint(folder, args.gib)
    print(
        f"checkpoint: {size / 2**30:.2f} GiB safetensors + config.json; {args.rounds} rounds each"
    )

    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.ERROR)  # one line per request otherwise

    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    os.environ.setdefault("AWS_ACCESS_KEY_ID", "bench")
    os.environ.setdefault("AWS_SECRET_ACCESS_KEY", "bench")
    os.environ.setdefault("AWS_DEFAULT_REGION", "us-east-1")
    client = make_client(f"http://{host}:{port}", 120.0)
    client.create_bucket(Bucket="bench")
    for p in folder.iterdir():
        client.upload_file(str(p), "bench", f"ckpts/big_step1/{p.name}")
    retry = Retry(attempts=3, initial=0.0, maximum=0.0)
    t0 = time.perf_counter()
    for _ in range(5):
        client.get_object(
            Bucket="bench", Key="ckpts/big_step1/model.safetensors", Range="bytes=0-0"
        )
    one_get = (time.perf_counter() - t0) / 5
    print(f"moto: one 1-byte ranged GET of the 1 GiB object takes {one_get:.3f} s (its own cost)")
    places = {
        "local": lambda: LocalFiles(folder),
        "s3 (moto)": lambda: S3Files(client, retry, "bench", "ckpts/big_step1/"),
    }
    try:
        results = {}
        for place, make_view in places.items():
            for mode in ("sampled", "full"):
                r = measure(make_view, mode, args.rounds)
                results[(place, mode)] = r
                print(
                    f"{place:>10} {mode:>7}: {r['seconds']:8.3f} s  read {r['bytes'] / 2**20:9.1f} MiB"
                    f" in {r['reads']:4d} reads  {r['value']}"
                )
        for place in places:
            ratio = results[(place, "full")]["seconds"] / results[(place, "sampled")]["seconds"]
            print(f"{place:>10}: full / sampled = {ratio:.0f}x")
        same = {r["value"] for (p, m), r in results.items() if m == "sampled"}
        print(
            f"local and S3 agree: sampled {len(same) == 1}, full "
            f"{results[('local', 'full')]['value'] == results[('s3 (moto)', 'full')]['value']}"
        )
    finally:
        server.stop()
        shutil.rmtree(args.work, ignore_errors=True)


if __name__ == "__main__":
    main()
