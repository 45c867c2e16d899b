"""The served harnesses' proxy and its watch over the model server, against a stand-in server
(`standins/model_server.py`) started as the real one is (under the reaper, on a Unix socket):
a hung server is killed and its entry fails to be retried; a slow one making progress is left
alone; a dead one fails the entry even once the harness has ended; only a harness's routes are
forwarded; a journal replays sampled answers in the order they were given. The same paths on
vLLM's own server: test_harness_verifiers.py.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import os
import signal
import stat
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest

from ckpt_watcher.errors import AdapterNotServed, EvalError, ServerLost
from ckpt_watcher.evaluators.failures import classify
from ckpt_watcher.harnesses.endpoint import Endpoint, serve
from ckpt_watcher.harnesses.server import Servers
from ckpt_watcher.jobfolder import EvalRequest
from ckpt_watcher.journal import JournalRef
from ckpt_watcher.proctable import children

from .helpers import gone

STANDIN = Path(__file__).parent / "standins" / "model_server.py"


def request(tmp: Path) -> EvalRequest:
    return EvalRequest(
        str(tmp), "vllm", {"max_model_len": 64}, [], 42, {}, None, None, None, None, str(tmp), "cpu"
    )


@contextmanager
def served(tmp: Path, mode: str, ref: JournalRef | None = None, **spec: Any) -> Iterator[Endpoint]:
    servers = Servers(
        argv_of=lambda req, spec, sock, swappable: [sys.executable, str(STANDIN), sock, mode]
    )
    servers.job(request(tmp))
    try:
        with serve(servers, spec, tmp, ref) as endpoint:
            yield endpoint
    finally:
        servers.stop()


def call(endpoint: Endpoint, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    host, port = endpoint.url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        data = json.dumps(body).encode() if body is not None else None
        conn.request(method, path, body=data, headers={"Content-Type": "application/json"})
        r = conn.getresponse()
        raw = r.read()
        return r.status, json.loads(raw) if raw.strip() else None
    finally:
        conn.close()


def complete_body(endpoint: Endpoint, **extra: Any) -> dict[str, Any]:
    body = {"model": endpoint.model, "prompt": "12+34=", "max_tokens": 4} | extra
    return {k: v for k, v in body.items() if v is not None}


def complete(endpoint: Endpoint, **extra: Any) -> tuple[int, Any]:
    return call(endpoint, "POST", "/v1/completions", complete_body(endpoint, **extra))


def raw_call(endpoint: Endpoint, body: dict[str, Any]) -> bytes:
    """A completion's answer as bytes (a streamed one is not JSON)."""
    host, port = endpoint.url.split("//")[1].split("/")[0].split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=60)
    try:
        conn.request(
            "POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"}
        )
        return conn.getresponse().read()
    finally:
        conn.close()


def in_background(fn: Any) -> tuple[threading.Thread, dict[str, Any]]:
    out: dict[str, Any] = {}
    thread = threading.Thread(target=lambda: out.setdefault("answer", fn()), daemon=True)
    thread.start()
    return thread, out


def test_each_steps_adapter_is_asked_for_under_a_new_name_and_answers_as_the_checkpoint(
    tmp_path: Path,
) -> None:
    """A LoRA step served to a harness: the base's server started once, each step's adapter
    loaded under a name never used before (the last one unloaded), the harness's requests for
    `checkpoint` sent to it and answered as `checkpoint` (what the journal keeps); an adapter
    the server refuses raises AdapterNotServed (the worker merges it)."""
    servers = Servers(
        argv_of=lambda req, spec, sock, swappable: [sys.executable, str(STANDIN), sock, "ok"]
    )
    base = request(tmp_path)
    seen = []
    try:
        for step in ("checkpoint-10", "checkpoint-20", "checkpoint-10"):
            servers.job(dataclasses.replace(base, lora=str(tmp_path / step)))
            with serve(servers, {}, tmp_path, None) as endpoint:
                status, answer = complete(endpoint, seed=7)
                assert status == 200 and answer["model"] == "checkpoint", answer
                assert complete(endpoint, seed=7) == (status, answer)  # one name for the job
                # no model, or an empty one (the base, to vLLM): the checkpoint all the same
                assert complete(endpoint, seed=7, model="") == (status, answer)
                assert complete(endpoint, seed=7, model=None) == (status, answer)
                seen.append((endpoint.engine, answer["choices"][0]["text"]))
                # the model list and a streamed answer name the checkpoint only
                models = call(endpoint, "GET", "/v1/models")[1]["data"]
                assert [m["id"] for m in models] == ["checkpoint"], models
                streamed = raw_call(endpoint, complete_body(endpoint, seed=7, stream=True))
                assert streamed.count(b'"model": "checkpoint"') == 2, streamed
                assert f'"model": "{servers.adapter}"'.encode() not in streamed, streamed
                assert b" by " + str(servers.adapter).encode() in streamed  # the adapter's
        assert [engine for engine, _ in seen] == ["cold", "warm", "warm"]
        names = [text.split(" by ")[1] for _, text in seen]
        steps = ["checkpoint-10", "checkpoint-20", "checkpoint-10"]
        assert [n.rsplit("-", 1)[0] for n in names] == steps, names
        assert len(set(names)) == 3, names  # the same step again: a new name all the same
        servers.job(dataclasses.replace(base, lora=str(tmp_path / "refused")))
        with pytest.raises(AdapterNotServed, match="cannot serve the adapter"):
            with serve(servers, {}, tmp_path, None):
                pass
        servers.stop()
        exits = Servers(
            argv_of=lambda req, spec, sock, swappable: [sys.executable, str(STANDIN), sock, "exit"]
        )
        exits.job(dataclasses.replace(base, lora=str(tmp_path / "checkpoint-30")))
        with pytest.raises(AdapterNotServed, match="would not start") as refused:
            with serve(exits, {}, tmp_path, None):
                pass
        assert refused.value.base_refused  # its next adapters are merged at once
        servers.job(base)  # the base alone (no LoRA flags here): answered as itself
        with serve(servers, {}, tmp_path, None) as endpoint:
            assert complete(endpoint, seed=7)[1]["choices"][0]["text"] == "seed 7"
    finally:
        servers.stop()


def test_a_hung_server_is_killed_and_its_entry_fails_so_that_it_is_retried(tmp_path: Path) -> None:
    with served(tmp_path, "hang", stall_seconds=2) as endpoint:
        pid = endpoint.servers._proc.pid  # type: ignore[union-attr]
        thread, out = in_background(lambda: complete(endpoint))
        began = time.monotonic()
        with pytest.raises(ServerLost, match=r"made no progress for \d+ s with 1 request"):
            while time.monotonic() - began < 30:
                endpoint.check()
                time.sleep(0.2)
        thread.join(30)
        assert out["answer"][0] == 502  # the waiting request is let go, not held for hours
        assert gone(pid)  # the server and all it started
        assert endpoint.servers.died() is None and not endpoint.servers.socket
    assert classify(ServerLost("x")).heals  # the daemon retries it, resuming from the journal


def test_a_slow_server_making_progress_is_not_taken_for_hung(tmp_path: Path) -> None:
    with served(tmp_path, "slow", stall_seconds=1.5) as endpoint:
        thread, out = in_background(lambda: complete(endpoint))
        while thread.is_alive():  # a 4 s answer, well past the stall limit
            endpoint.check()
            time.sleep(0.2)
        assert out["answer"][0] == 200
        endpoint.ended()


def test_a_server_that_died_fails_the_entry_even_after_the_harness_ended(tmp_path: Path) -> None:
    with served(tmp_path, "ok") as endpoint:
        assert complete(endpoint)[0] == 200
        proc = endpoint.servers._proc  # type: ignore[union-attr]
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        status, said = complete(endpoint, prompt="7+8=")
        assert status == 502, said  # what the harness saw: it may still exit 0
        with pytest.raises(ServerLost, match=r"the model server .* was killed by signal 9"):
            endpoint.ended()


def test_a_reaper_killed_9_leaves_no_server_behind(tmp_path: Path) -> None:
    """The OOM killer, or a user, may kill the server's reaper rather than the server: the
    server is then no one's child, and must still go with the entry."""
    with served(tmp_path, "ok") as endpoint:
        reaper = endpoint.servers._proc  # type: ignore[union-attr]
        (server,) = children(reaper.pid)
        reaper.send_signal(signal.SIGKILL)
        reaper.wait()
        with pytest.raises(ServerLost, match="was killed by signal 9"):
            endpoint.check()
        endpoint.servers.stop()
        assert gone(server)


def test_a_server_that_exits_while_starting_fails_at_once_saying_what_it_printed(
    tmp_path: Path,
) -> None:
    # The message is the exit path's: the 900 s readiness wait would say "did not answer within".
    with pytest.raises(EvalError, match=r"exited with status 3:\n.*the engine could not start"):
        with served(tmp_path, "exit"):
            pass


def test_the_proxy_forwards_only_a_harness_routes_and_the_server_is_on_a_private_socket(
    tmp_path: Path,
) -> None:
    with served(tmp_path, "ok") as endpoint:
        for path in ("/collective_rpc", "/reset_prefix_cache", "/sleep", "/v1/load_lora_adapter"):
            status, said = call(endpoint, "POST", path, {"method": "ckpt_watcher_swap"})
            assert status == 404 and "is not served here" in said["error"]["message"], said
        assert call(endpoint, "GET", "/health")[0] == 200
        assert complete(endpoint)[0] == 200
        sock = Path(endpoint.servers.socket)
        assert stat.S_ISSOCK(sock.stat().st_mode)
        assert stat.S_IMODE(sock.parent.stat().st_mode) == 0o700  # no other user reaches it


def test_a_journal_replays_sampled_answers_in_the_order_they_were_given(tmp_path: Path) -> None:
    """K identical sampled requests are K samples (each occurrence seeded on its own); a rerun
    is answered from the journal occurrence by occurrence, then computes what is new."""
    ref = JournalRef(str(tmp_path / "journal"), {"fingerprint": "f", "settings": "s"})
    with served(tmp_path, "ok", ref) as endpoint:
        first = [complete(endpoint, temperature=0.7)[1]["choices"][0]["text"] for _ in range(5)]
    assert len(set(first)) == 5  # five samples, not one answer five times
    with served(tmp_path, "ok", ref) as endpoint:
        again = [complete(endpoint, temperature=0.7)[1]["choices"][0]["text"] for _ in range(7)]
        assert endpoint.resumed == 5 and endpoint.computed == 2
    assert again[:5] == first  # the journal's answers, in the order given
    assert len(set(again)) == 7  # then the sixth and seventh samples
    # another request's occurrences are its own
    with served(tmp_path, "ok", ref) as endpoint:
        other = complete(endpoint, temperature=0.7, prompt="7+8=")[1]["choices"][0]["text"]
        assert endpoint.resumed == 0
    assert other not in again


@pytest.mark.vllm
def test_every_model_arg_reaches_the_server_as_vllm_reads_it(tmp_path: Path) -> None:
    """The server's command line, read by vLLM's own parser: a `false` overrides vLLM's
    default (enable_prefix_caching is on by default; `false` was left off the command line)."""
    pytest.importorskip("vllm")
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    try:
        from vllm.entrypoints.openai.cli_args import make_arg_parser
    except ImportError:  # vLLM 0.32 moved it
        from vllm.entrypoints.launchers.cli_args import make_arg_parser

    from ckpt_watcher.harnesses.server import server_argv

    req = request(tmp_path)
    req.model_args |= {"enable_prefix_caching": False, "enforce_eager": True, "dtype": "float32"}
    argv = server_argv(req, {}, str(tmp_path / "s.sock"))
    args = make_arg_parser(FlexibleArgumentParser()).parse_args(argv[3:])
    assert args.enable_prefix_caching is False
    assert args.enforce_eager is True
    assert (args.dtype, args.max_model_len, args.seed) == ("float32", 64, 42)
    assert args.uds == str(tmp_path / "s.sock") and args.tensor_parallel_size == 1
