"""A stand-in for vLLM's OpenAI server, for the proxy's own tests (`test_endpoint.py`): what
those need of the real one, and nothing of a model. `python model_server.py SOCKET MODE`:

- listens on the Unix socket SOCKET (vLLM's `--uds`); `GET /health` answers 200;
- `POST /v1/completions` answers, as vLLM's sampler would with the request's own seed, a text
  made of that seed (`seed 123`), so the order a journal replays answers in can be seen;
- `POST /v1/load_lora_adapter` and `/v1/unload_lora_adapter` as vLLM answers them (a name loaded
  twice, or a path whose name ends in `refused`, is a 400); a completion for an adapter says
  which (`seed 123 by NAME`), one for no model or an empty one is the base's, and one for
  a model that is neither `checkpoint` nor a loaded adapter is a 404; `GET /v1/models` lists
  `checkpoint` and the adapters loaded; `stream: true` answers in server-sent events, each
  naming the model;
- `POST /tokenize` counts one token per character; `GET /metrics` exposes vLLM's token
  counters (`vllm:generation_tokens_total`), in Prometheus' text format as vLLM does;
- MODE `hang`: completions are never answered and the counters never move (a server whose
  engine is stuck); `slow`: each completion takes 4 s while the counters move every call (a
  long generation making progress); `ok`: answered at once; `exit`: exits with status 3 before
  it listens (a server that cannot start: no memory, a bad argument).

Standard library only.
"""

import json
import os
import socketserver
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler

SOCKET, MODE = sys.argv[1], sys.argv[2]
tokens = [0]
lock = threading.Lock()
adapters: set[str] = set()


class Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def address_string(self) -> str:  # a Unix socket has no client address
        return "uds"

    def _send(self, status: int, body: bytes, ctype: str = "application/json") -> None:
        self.send_response(status)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        if self.path == "/health":
            self._send(200, b"")
        elif self.path == "/v1/models":
            listed = [{"id": m, "object": "model"} for m in ["checkpoint", *sorted(adapters)]]
            self._send(200, json.dumps({"object": "list", "data": listed}).encode())
        elif self.path == "/metrics":
            with lock:
                if MODE == "slow":
                    tokens[0] += 1
                n = tokens[0]
            text = (
                "# TYPE vllm:generation_tokens_total counter\n"
                f'vllm:generation_tokens_total{{engine="0",model_name="checkpoint"}} {n}.0\n'
            )
            self._send(200, text.encode(), "text/plain; version=0.0.4")
        else:
            self._send(404, b'{"detail": "Not Found"}')

    def do_POST(self) -> None:
        body = json.loads(self.rfile.read(int(self.headers.get("Content-Length") or 0)) or b"{}")
        if self.path == "/tokenize":
            self._send(200, json.dumps({"count": len(str(body.get("prompt", "")))}).encode())
            return
        name = body.get("lora_name")
        if self.path == "/v1/load_lora_adapter":
            if name in adapters or str(body.get("lora_path")).endswith("refused"):
                self._send(400, json.dumps({"error": {"message": f"cannot load {name}"}}).encode())
                return
            adapters.add(name)
            self._send(
                200, f"Success: LoRA adapter '{name}' added successfully.".encode(), "text/plain"
            )
            return
        if self.path == "/v1/unload_lora_adapter":
            if name not in adapters:
                self._send(404, b'{"error": {"message": "not loaded"}}')
                return
            adapters.discard(name)
            self._send(200, b"Success", "text/plain")
            return
        if self.path != "/v1/completions":
            self._send(404, b'{"detail": "Not Found"}')
            return
        model = body.get("model") or "checkpoint"
        if model != "checkpoint" and model not in adapters:
            self._send(404, json.dumps({"error": {"message": f"no model {model}"}}).encode())
            return
        if MODE == "hang":
            time.sleep(3600)
        if MODE == "slow":
            time.sleep(4)
        with lock:
            tokens[0] += 2
        answer = {
            "object": "text_completion",
            "model": body.get("model"),
            "choices": [
                {
                    "index": 0,
                    "text": f"seed {body.get('seed')}"
                    + ("" if model == "checkpoint" else f" by {model}"),
                    "finish_reason": "length",
                }
            ],
        }
        if body.get("stream"):
            events = [answer, {**answer, "choices": []}]
            text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
            self._send(200, text.encode(), "text/event-stream; charset=utf-8")
            return
        self._send(200, json.dumps(answer).encode())

    def log_message(self, format: str, *args: object) -> None:
        pass


class Server(socketserver.ThreadingMixIn, socketserver.UnixStreamServer):
    daemon_threads = True


if MODE == "exit":
    print("the engine could not start", flush=True)
    sys.exit(3)
if os.path.exists(SOCKET):
    os.unlink(SOCKET)
Server(SOCKET, Handler).serve_forever()
