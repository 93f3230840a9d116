"""Fixtures for service tests: a real redis-server on a free loopback port, and an event-loop thread
that runs in-process grpc.aio servers (verifier, drafter, scheduler apps) while tests call them with
ordinary blocking gRPC clients over real sockets."""

from __future__ import annotations

import asyncio
import json
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))  # svc_cluster, the shared app harness

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec-tiny-a"


from svc_redis import RedisServer, free_port, redis_executable  # noqa: E402,F401 - re-exported helpers


@pytest.fixture(scope="module")
def redis_server(tmp_path_factory):
    r = RedisServer(tmp_path_factory.mktemp("redis")).start()
    yield r
    r.stop()


class LoopThread:
    """An asyncio loop on its own thread: `run(coro)` blocks until the coroutine finishes there."""

    def __init__(self):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="test-aio", daemon=True)
        self.thread.start()

    def run(self, coro, timeout: float = 120):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)

    def close(self):
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(scope="module")
def aio():
    lt = LoopThread()
    yield lt
    lt.close()


@pytest.fixture(scope="module")
def fixtures_dir() -> Path:
    if not FIXTURES.exists():
        pytest.skip(f"shared fixtures not found at {FIXTURES}")
    return FIXTURES


@pytest.fixture(scope="module")
def reference(fixtures_dir):
    """[(prompt_ids, target greedy tokens)] for the fixture prompts."""
    meta = json.loads((fixtures_dir / "target" / "reference.json").read_text())
    out = []
    for p in meta["prompts"]:
        greedy = p.get("greedy_tokens") or p.get("greedy_new_tokens") or p.get("new_tokens")
        out.append((list(p["prompt_ids"]), list(greedy)))
    return out
