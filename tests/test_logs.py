"""The daemon's JSON log lines stay whole when other threads write to stderr too (a library's
warning from its own thread: watchdog's, seen glued to the end of a `pin.held` line)."""

from __future__ import annotations

import json
import subprocess
import sys

INTERLEAVED = """
import sys, threading, warnings
from ckpt_watcher import logs
import structlog

logs.configure("INFO", json_output=True)
log = structlog.get_logger("t")
warnings.simplefilter("always")

def other():
    for i in range(3000):
        warnings.warn(f"a library's own warning {i}", RuntimeWarning)

t = threading.Thread(target=other)
t.start()
for i in range(3000):
    log.info("pin.held", i=i, path="x" * 200)
t.join()
"""


def test_json_log_lines_stay_whole_beside_other_writers_to_stderr() -> None:
    r = subprocess.run(
        [sys.executable, "-c", INTERLEAVED], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 0, r.stderr[-2000:]
    ours = [line for line in r.stderr.splitlines() if line.startswith("{")]
    broken = []
    for line in ours:
        try:
            json.loads(line)
        except ValueError:
            broken.append(line)
    assert len(ours) == 3000 and not broken, broken[:2]
