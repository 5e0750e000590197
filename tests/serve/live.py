"""A live `flexgen-sparpr serve` child process on 127.0.0.1 (a free port), driven over plain HTTP."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
API_KEY = "test-key"


class Server:
    """`flexgen-sparpr serve ARGS --port 0` as a child process; url once it listens."""

    def __init__(self, args: list[str], offload_dir: Path, ready: bool = True, timeout: float = 120):
        self.offload_dir = offload_dir
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        self.proc = subprocess.Popen([sys.executable, "-m", "flexgen_sparpr", "serve", "--port", "0",
                                      "--offload-dir", str(offload_dir), *args], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        line = self.proc.stdout.readline()
        if "http://" not in line:
            self.proc.kill()
            raise RuntimeError(f"serve did not start: {line!r} {self.proc.stderr.read()[-2000:]}")
        self.url = line.split("on ", 1)[1].split()[0]
        self.port = int(self.url.rsplit(":", 1)[1])
        if ready:
            self.wait_ready(timeout)

    def wait_ready(self, timeout: float) -> None:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if self.get("/health")[0] == 200:
                return
            if self.proc.poll() is not None:
                raise RuntimeError(f"serve exited {self.proc.returncode}: {self.proc.stderr.read()[-2000:]}")
            time.sleep(0.1)
        raise TimeoutError("the model did not load in time")

    def get(self, path: str, timeout: float = 10) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(self.url + path, timeout=timeout) as r:
                return r.status, r.read().decode()
        except urllib.error.HTTPError as e:
            return e.code, e.read().decode()
        except OSError:
            return 0, ""

    def post(self, path: str, body, key: str | None = API_KEY, timeout: float = 60) -> tuple[int, dict]:
        data = body if isinstance(body, bytes) else json.dumps(body).encode()
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        req = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(req, timeout=timeout) as r:
                return r.status, json.loads(r.read())
        except urllib.error.HTTPError as e:
            return e.code, json.loads(e.read())

    def metric(self, name: str) -> float:
        """The sum of a metric's samples named exactly `name` (any labels)."""
        total = 0.0
        for line in self.get("/metrics")[1].splitlines():
            if line.startswith(name + "{") or line.startswith(name + " "):
                total += float(line.rsplit(" ", 1)[1])
        return total

    def stop(self, timeout: float = 60) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(timeout)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
            self.proc.stdout.close()
            self.proc.stderr.close()


def kv_files(offload_dir: Path) -> list[Path]:
    """The offload files of live runs (each run keeps them in its run-<pid>-* folder)."""
    return [p for p in offload_dir.glob("run-*/*") if p.is_file() and p.name != "owner.json"]
