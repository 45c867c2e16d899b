"""S3 polls against a real S3 API (moto's server on loopback): requests per poll and poll time
with 10, 1,000 and 10,000 known checkpoints under the prefix; and bytes fetched / bytes under a
checkpoint prefix holding Adam optimizer state, when staging it for an eval.

Targets: poll time grows sub-linearly with the count; no per-checkpoint request for known ones;
bytes ratio <= 0.35.
Usage: python bench/s3_poll.py
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from moto.server import ThreadedMotoServer

from ckpt_watcher.s3client import make_client
from ckpt_watcher.sources.s3 import S3Source
from ckpt_watcher.sources.staging import stage


def main() -> None:
    server = ThreadedMotoServer(port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    endpoint = f"http://{host}:{port}"
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
    )
    client = make_client(endpoint)
    calls: list[str] = []
    client.meta.events.register("before-call.s3.*", lambda model, **_: calls.append(model.name))
    try:
        for n in (10, 1_000, 10_000):
            bucket = f"bench-{n}"
            client.create_bucket(Bucket=bucket)
            with ThreadPoolExecutor(16) as pool:
                list(
                    pool.map(
                        lambda i, b=bucket: client.put_object(
                            Bucket=b, Key=f"ckpts/job/r_step{i}/config.json", Body=b"{}"
                        ),
                        range(n),
                    )
                )
            src = S3Source(f"s3://{bucket}/ckpts/", client=client)
            times, requests = [], []
            for _ in range(5):
                calls.clear()
                t0 = time.perf_counter()
                found = src.scan()
                times.append(time.perf_counter() - t0)
                requests.append(len(calls))
            assert len(found) == n
            print(
                f"{n:>6} checkpoints: {statistics.median(requests):.0f} requests per poll "
                f"(all ListObjectsV2), poll time median {statistics.median(times) * 1000:.1f} ms"
            )

        client.create_bucket(Bucket="bytes")
        with tempfile.TemporaryDirectory() as tmp:
            from ckpt_watcher.demo.tiny import build_model, build_tokenizer, save_checkpoint

            tok = build_tokenizer()
            model = build_model(len(tok))
            ck = Path(tmp) / "r_step1"
            save_checkpoint(model, tok, ck)
            weights = sum(p.numel() * 4 for p in model.parameters())
            with open(ck / "optimizer.pt", "wb") as f:
                f.truncate(2 * weights + 4096)  # Adam: exp_avg + exp_avg_sq, fp32
            (ck / "rng_state.pth").write_bytes(b"r" * 15_000)
            (ck / "scheduler.pt").write_bytes(b"s" * 1_000)
            total = 0
            for p in ck.iterdir():
                client.upload_file(str(p), "bytes", f"c/r_step1/{p.name}")
                total += p.stat().st_size
            calls.clear()
            dest = stage("s3://bytes/c/r_step1/", Path(tmp) / "cache", client=client)
            fetched = sum(
                p.stat().st_size
                for p in dest.iterdir()
                if p.is_file() and p.name != "model-00001-of-00001.safetensors"
            )
            print(
                f"staging: fetched {fetched:,} of {total:,} bytes under the prefix: ratio {fetched / total:.3f} "
                f"(target <= 0.35); {len(calls)} requests"
            )
    finally:
        server.stop()


if __name__ == "__main__":
    main()
