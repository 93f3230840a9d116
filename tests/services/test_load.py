"""A short run of scripts/load_test.py: the real deployment as processes (redis, two verifiers, a drafter,
a scheduler) under concurrent greedy load, one verifier SIGKILLed and restarted mid-run. Nothing fails or
is lost, every output is the target's own greedy output, and no service keeps request state afterwards.
Slow: five Python processes load torch, and the load itself runs for 40 seconds."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from svc_redis import redis_executable

REPO = Path(__file__).resolve().parents[2]
pytestmark = pytest.mark.slow


def test_short_load_with_a_verifier_killed_and_restarted(tmp_path):
    redis_executable()  # skips without a redis-server
    data = REPO / "data" / "dev"
    if not data.is_dir():
        pytest.skip(f"no held-out prompts at {data}")
    out = tmp_path / "load"
    proc = subprocess.run(
        [sys.executable, str(REPO / "scripts" / "load_test.py"), "--duration", "40", "--concurrency", "8",
         "--kill-at", "15", "--restart-after", "5", "--max-new-tokens", "32", "--num-prompts", "64",
         "--out", str(out), "--log-dir", str(tmp_path / "logs")],
        cwd=REPO, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True, timeout=900)
    assert (out / "summary.json").exists(), proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    req = summary["requests"]
    assert req["failed"] == 0 and req["lost"] == 0, summary["errors"]
    assert req["completed"] > 0 and req["completed_across_kill"] > 0
    assert summary["events"]["kill"] and summary["events"]["serving"]
    assert summary["correctness"]["checked_requests"] == req["completed"]
    assert summary["correctness"]["mismatches"] == []
    assert summary["state_clean"], summary["leftover_state"]
    assert (out / "load.png").stat().st_size > 0
    assert proc.returncode == 0, summary["problems"]
