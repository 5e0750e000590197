"""`flexgen-sparpr chat` in a pseudo-terminal, as a person uses it: three turns whose third
prefills only its own tokens (/stats), Ctrl-C that stops an answer and then clears the prompt
line, /reset, and Ctrl-D that ends the chat with exit 0 and leaves no offload files."""
from __future__ import annotations

import os
import pty
import re
import select
import sys
import time

import pytest

pytestmark = pytest.mark.slow


class Terminal:
    def __init__(self, argv: list[str], env: dict):
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: the chat, on the terminal's other side
            os.execve(sys.executable, [sys.executable, "-m", "flexgen_sparpr", *argv], env)
        self.out = ""

    def expect(self, pattern: str, timeout: float = 240) -> re.Match:
        """Read until `pattern` matches the output since the last match; returns the match."""
        end = time.monotonic() + timeout
        while True:
            m = re.search(pattern, self.out)
            if m:
                self.out = self.out[m.end():]
                return m
            left = end - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no {pattern!r} in {self.out[-2000:]!r}")
            if select.select([self.fd], [], [], min(left, 1.0))[0]:
                try:
                    self.out += os.read(self.fd, 4096).decode("utf-8", "replace")
                except OSError:  # the child is gone
                    raise AssertionError(f"ended before {pattern!r}: {self.out[-2000:]!r}") from None

    def type(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60) -> int:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
            try:  # keep draining, so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.2)[0]:
                    self.out += os.read(self.fd, 4096).decode("utf-8", "replace")
            except OSError:
                pass
        os.kill(self.pid, 9)
        raise AssertionError("the chat did not end")


def test_a_three_turn_chat_with_ctrl_c_reset_and_ctrl_d(smollm2_dir, tmp_path):
    off = tmp_path / "off"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    term = Terminal(["chat", "--model", "smollm2-135m", "--max-tokens", "160", "--offload-dir", str(off),
                     "--percent", "100", "0", "0", "0", "100", "0"], env)
    term.expect(r"chatting with smollm2-135m")
    prompt = r">>> "
    term.expect(prompt)
    for question in ("What is the capital of France?", "And of Italy?", "Say hello."):
        term.type(question + "\n")
        term.expect(prompt)
    term.type("/stats\n")
    stats = term.expect(r"last turn: (\d+) positions prefilled.*\n")
    assert int(stats.group(1)) <= 16, stats.group(0)
    assert int(re.search(r"context (\d+) /", stats.string).group(1)) > 60  # "Say hello." templated, not the conversation
    term.expect(prompt)
    term.type("Write a long story about a dragon who learns to cook.\n")
    term.expect(r"cook\.\r\n\S")  # the answer has begun
    term.type("\x03")  # Ctrl-C: the answer stops, the chat goes on
    term.expect(r"\[stopped\]")
    term.expect(prompt)
    term.type("half a line")
    term.expect("half a line")
    # a person's Ctrl-C comes a moment later: CPython's readline checks signals only when its wait
    # for a key is interrupted, so a signal landing while it still handles the last key is seen at
    # the next key, not at once
    time.sleep(0.5)
    term.type("\x03")  # Ctrl-C at the prompt: a fresh line
    term.expect(prompt)
    term.type("/reset\n")
    term.expect(r"a new conversation")
    term.expect(prompt)
    term.type("\x04")  # Ctrl-D: the end
    assert term.wait() == 0
    assert not any(off.rglob("*.bin")) and not [p for p in off.glob("run-*")], list(off.rglob("*"))
