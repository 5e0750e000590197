"""A server's life: 503 while the model loads, a 500 that is one logged line, SIGTERM draining
the requests in flight, and the command's one-line failures (exit 2)."""
from __future__ import annotations

import asyncio
import http.client
import json
import logging
import socket
import subprocess
import sys
import threading
import time

import pytest

from flexgen_sparpr.api.llm import LLM

from tests.serve.live import REPO, Server, kv_files

pytestmark = pytest.mark.slow  # the prepared SmolLM2's tokenizer (tests/serve/conftest.py)


class InProcess:
    """The app on a uvicorn thread of this process (so a test can hold the loading or break the
    engine), on a free port of 127.0.0.1."""

    def __init__(self, make_llm):
        import uvicorn

        from flexgen_sparpr.serve.app import ServerState, build_app
        self.state = ServerState(make_llm, "tiny", max_queue=4)
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(build_app(self.state), log_level="warning"))
        self.thread = threading.Thread(target=lambda: asyncio.run(self.server.serve(sockets=[self.sock])))
        self.thread.start()
        while not self.server.started:
            time.sleep(0.02)

    def request(self, method: str, path: str, body: dict | None = None) -> tuple[int, dict]:
        conn = http.client.HTTPConnection("127.0.0.1", self.port, timeout=60)
        conn.request(method, path, json.dumps(body) if body is not None else None,
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        out = r.status, json.loads(r.read())
        conn.close()
        return out

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(60)


def test_503_while_loading_then_a_500_is_one_logged_line(tiny_chat_dir, tmp_path, caplog):
    loading = threading.Event()
    app = InProcess(lambda: (loading.wait(60), LLM(str(tiny_chat_dir), gpu_batch_size=2, quiet=True,
                                                   offload_dir=str(tmp_path)))[1])
    try:
        assert app.request("GET", "/health") == (503, {"status": "loading"})
        status, err = app.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 503 and err["error"]["code"] == "loading"
        loading.set()
        end = time.monotonic() + 60
        while app.request("GET", "/health")[0] != 200 and time.monotonic() < end:
            time.sleep(0.05)
        llm = app.state.llm

        def broken(*a, **k):
            raise RuntimeError("the engine broke\nsecond line")
            yield
        llm.batch_steps, real = broken, llm.batch_steps
        with caplog.at_level(logging.ERROR, logger="flexgen_sparpr.serve"):
            status, err = app.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 500 and err["error"]["type"] == "server_error"
        assert "Traceback" not in json.dumps(err) and "engine broke" not in err["error"]["message"]
        lines = [r.getMessage() for r in caplog.records if r.name == "flexgen_sparpr.serve"]
        assert len(lines) == 1 and "RuntimeError: the engine broke second line" in lines[0] and "\n" not in lines[0]
        llm.batch_steps = real  # the server goes on answering
        status, ok = app.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2, "temperature": 0})
        assert status == 200 and ok["usage"]["completion_tokens"] == 2  # greedy: no sampled end token
    finally:
        loading.set()
        app.close()


def test_sigterm_drains_the_stream_in_flight_refuses_new_ones_and_exits_0(tiny_chat_dir, tmp_path):
    s = Server(["--model", str(tiny_chat_dir), "--gpu-batch-size", "2", "--percent", "100", "0", "50", "0", "100",
                "0", "--block-size", "16"], tmp_path)
    try:
        conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=60)
        conn.request("POST", "/v1/completions", json.dumps({"prompt": "Go on", "max_tokens": 60, "stream": True,
                                                            # greedy: a sampled token could be the end token ("stop")
                                                            "temperature": 0}),
                     {"Content-Type": "application/json"})
        r = conn.getresponse()
        assert r.readline().startswith(b"data: ")
        assert kv_files(tmp_path)
        s.proc.send_signal(15)
        time.sleep(0.5)
        with pytest.raises(OSError):  # no new connection is taken while it drains
            socket.create_connection(("127.0.0.1", s.port), timeout=5).close()
        rest = r.read().decode()  # the stream goes on to its end
        events = [line[6:] for line in rest.splitlines() if line.startswith("data: ")]
        assert events[-1] == "[DONE]" and json.loads(events[-2])["choices"][0]["finish_reason"] == "length"
        assert s.proc.wait(60) == 0
        assert not list(tmp_path.glob("run-*"))  # the offload folder is cleaned
    finally:
        s.stop()


@pytest.mark.parametrize("args, says", [
    (["--prompt", "hi"], "serve takes no --prompt"),
    (["--port", "70000"], "--port must be in"),
    (["--max-queue", "0"], "--max-queue >= 1"),
    (["--model", "no-such-model-xyz"], "error:"),
])
def test_command_failures_are_one_line_and_exit_2(tiny_chat_dir, tmp_path, args, says):
    argv = ["--model", str(tiny_chat_dir), "--offload-dir", str(tmp_path), "--port", "0", *args]
    r = subprocess.run([sys.executable, "-m", "flexgen_sparpr", "serve", *argv], cwd=REPO, capture_output=True,
                       text=True, timeout=120)
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert r.returncode == 2 and len(errors) == 1 and says in errors[0] and "Traceback" not in r.stderr


def test_a_taken_port_is_one_line_and_exit_2(tiny_chat_dir, tmp_path):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "flexgen_sparpr", "serve", "--model", str(tiny_chat_dir),
                            "--port", str(port)], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip().startswith("error: cannot listen on 127.0.0.1:")


def test_a_model_without_chat_template_or_tokenizer_is_a_clear_400(tiny_llama_dir, tmp_path):
    app = InProcess(lambda: LLM(str(tiny_llama_dir), gpu_batch_size=1, quiet=True, offload_dir=str(tmp_path)))
    try:
        end = time.monotonic() + 60
        while app.request("GET", "/health")[0] != 200 and time.monotonic() < end:
            time.sleep(0.05)
        status, err = app.request("POST", "/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]})
        assert status == 400 and "no chat template" in err["error"]["message"]
        status, err = app.request("POST", "/v1/completions", {"prompt": "hi", "max_tokens": 2})
        assert status == 400 and "no tokenizer" in err["error"]["message"]
        status, ok = app.request("POST", "/v1/completions", {"prompt": [5, 6, 7], "max_tokens": 3, "temperature": 0,
                                                             "logprobs": 1})
        assert status == 200 and ok["usage"] == {"prompt_tokens": 3, "completion_tokens": 3, "total_tokens": 6}
        assert len(ok["choices"][0]["logprobs"]["tokens"]) == 3  # token ids as text, without a tokenizer
    finally:
        app.close()
