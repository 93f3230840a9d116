"""Start-up on a user's own model (issue 20): a cost-table policy on a target with no sps.json starts (the
verifier profiles a quick table, or the policy runs as fixed and says so); every start-up failure is one line
naming the flag and value with exit code 2 (real processes, real ports); gRPC ports are bound exclusively;
an unreachable Redis is reported at start-up and in /health."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import svc_cluster as cluster
from svc_cluster import ids_request
from svc_redis import free_port

REPO = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))


def _serve(*args, env=None, timeout=120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dspark_cli.main", "serve", *args], cwd=REPO, env=env or ENV,
                          capture_output=True, text=True, timeout=timeout)


def _held_socket() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen()
    return s


def _assert_one_line(proc: subprocess.CompletedProcess, *needles: str) -> str:
    assert proc.returncode == 2, proc.stderr
    assert "Traceback" not in proc.stderr, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr
    for n in needles:
        assert n in lines[0], lines[0]
    return lines[0]


# -- one-line start-up failures ------------------------------------------------------------------------------

@pytest.mark.parametrize("service", ["all", "verifier", "scheduler"])
def test_grpc_port_held_by_another_socket(service):
    with _held_socket() as s:
        port = s.getsockname()[1]
        extra = ["--verifier-addresses", "127.0.0.1:1"] if service == "scheduler" else []
        _assert_one_line(_serve(service, "--host", "127.0.0.1", "--port", str(port), *extra),
                         "--port", str(port), "already in use")


def test_grpc_port_held_by_a_reuseport_grpc_server():
    """A grpc server that allows sharing (grpc's default SO_REUSEPORT) must not be joined silently."""
    server = grpc.server(__import__("concurrent.futures").futures.ThreadPoolExecutor(1))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        _assert_one_line(_serve("all", "--host", "127.0.0.1", "--port", str(port)), "--port", str(port))
    finally:
        server.stop(0)


def test_http_port_in_use():
    with _held_socket() as s:
        port = s.getsockname()[1]
        _assert_one_line(_serve("all", "--host", "127.0.0.1", "--port", "0", "--http-port", str(port)),
                         "--http-port", str(port), "already in use")


def test_metrics_port_in_use():
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        s.listen()
        port = s.getsockname()[1]
        _assert_one_line(_serve("all", "--port", "0", "--metrics-port", str(port)), "--metrics-port", str(port))


@pytest.mark.parametrize("args,needles", [
    (["--redis-url", "localhost:6379"], ["--redis-url", "'localhost:6379'", "redis://"]),
    (["--log-level", "bogus"], ["--log-level", "'bogus'", "INFO"]),
    (["--port", "70000"], ["--port", "70000"]),
])
def test_bad_flag_values(args, needles, capsys):
    """Checked before anything starts (in-process: the same code path as the processes above, minus the
    seconds of a Python start)."""
    from dspark_cli.main import main

    assert main(["serve", "all", *args]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    for n in needles:
        assert n in err, err


def test_bad_log_level_from_env(monkeypatch, capsys):
    from dspark_cli.main import main

    monkeypatch.setenv("DSPARK_LOG_LEVEL", "loud")
    assert main(["serve", "verifier"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "--log-level" in err and "'loud'" in err


@pytest.mark.parametrize("env,value,flag", [("DSPARK_DRAFT_GATE_SCOPE", "step", "--draft-gate-scope"),
                                             ("DSPARK_SLOT_CORRECTION", "maybe", "--slot-correction")])
def test_bad_scheduler_engine_settings_from_env(monkeypatch, capsys, env, value, flag):
    """argparse checks a flag's choices, not a default taken from the environment: the scheduler does."""
    from dspark_cli.main import main

    monkeypatch.setenv(env, value)
    assert main(["serve", "scheduler"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and flag in err and f"'{value}'" in err


def test_service_entry_point_reports_one_line_too():
    proc = subprocess.run([sys.executable, "-m", "services.drafter.main", "--redis-url", "localhost:6379"],
                          cwd=REPO, env=ENV, capture_output=True, text=True, timeout=120)
    assert _assert_one_line(proc, "--redis-url").startswith("dspark-drafter: error: ")


# -- serve all on a model with no sps.json, with an unreachable Redis; a second one on its port -------------------

def _health(port: int) -> int:
    with grpc.insecure_channel(f"127.0.0.1:{port}") as ch:
        return health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=2).status


def _wait_http(port: int, proc, timeout=180) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, "serve all exited"
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                return json.loads(r.read())
        except OSError:
            time.sleep(0.5)
    raise AssertionError("serve all never answered /health")


def test_serve_all_causal_without_sps_and_unreachable_redis(tiny_target_dir, tmp_path):
    from tests.conftest import build_tiny_dspark

    drafter = build_tiny_dspark(tiny_target_dir, tmp_path / "drafter")
    assert not (tiny_target_dir / "sps.json").exists()
    grpc_port, http_port, dead_redis = free_port(), free_port(), free_port()
    log = tmp_path / "all.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_cli.main", "serve", "all", "--host", "127.0.0.1", "--port", str(grpc_port),
         "--http-port", str(http_port), "--target", str(tiny_target_dir), "--drafter-path", str(drafter),
         "--policy", "causal", "--device", "cpu", "--redis-url", f"redis://127.0.0.1:{dead_redis}/0",
         "--sps-profile-seconds", "5"], cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    try:
        health = _wait_http(http_port, proc)
        assert health == {"status": "degraded", "redis": "unreachable"}
        logs = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        msgs = [r["msg"] for r in logs]
        warn = next(r for r in logs if "unreachable at start-up" in r["msg"])
        assert warn["level"] == "warning" and str(dead_redis) in warn["url"]
        assert msgs.index(warn["msg"]) < next(i for i, m in enumerate(msgs) if m == "scheduler ready")
        prof = next(r for r in logs if "profiled a quick one at start-up" in r["msg"])
        assert prof["seconds"] < 30 and json.loads(prof["batch_sizes"])[0] == 1
        ready = next(r for r in logs if r["msg"] == "scheduler ready")
        assert ready["policy"] == "causal"
        body = json.dumps({"prompt": "hello", "max_tokens": 6, "temperature": 0}).encode()
        req = urllib.request.Request(f"http://127.0.0.1:{http_port}/v1/completions", body,
                                     {"Content-Type": "application/json"})
        with urllib.request.urlopen(req, timeout=60) as r:
            assert len(json.loads(r.read())["dspark"]["token_ids"]) >= 1
        # a second `serve all` on the held gRPC port fails in one line instead of sharing it
        assert _health(grpc_port) == health_pb2.HealthCheckResponse.SERVING
        _assert_one_line(_serve("all", "--host", "127.0.0.1", "--port", str(grpc_port)), "--port", str(grpc_port))
    finally:
        proc.terminate()
        proc.wait(60)


# -- distributed: the verifier profiles, or the scheduler runs the policy as fixed and says so -------------------

@pytest.mark.parametrize("budget,policy", [(5.0, "causal"), (0.0, "fixed")])
def test_scheduler_causal_on_a_target_without_sps(aio, fixtures_dir, reference, budget, policy, caplog):
    assert not (fixtures_dir / "target" / "sps.json").exists()
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    v = dr = s = None
    try:
        with caplog.at_level("WARNING"):
            v = cluster.verifier(aio, t, d, profile_budget_s=budget)
            dr = cluster.drafter(aio, d)
            s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",),
                                  drafter_addresses=(f"127.0.0.1:{dr.port}",), policy="causal")
        assert s.engine.config.policy == policy
        if policy == "fixed":
            assert any("running as fixed" in r.getMessage() for r in caplog.records)
        else:
            assert any("profiled a quick one" in r.getMessage() for r in caplog.records)
        stub, ch = cluster.scheduler_stub(s)
        prompt, greedy = reference[0]
        out = stub.GenerateUnary(ids_request(prompt, 16), timeout=120)
        ch.close()
        assert list(out.token_ids) == greedy[:16]  # lossless whatever the policy
    finally:
        cluster.stop(aio, s, dr, v)


@pytest.mark.slow  # a Python process loading torch and two models: ~50 s on the 2-core development machine
def test_verifier_with_its_drafter_beside_it_in_one_process(aio, fixtures_dir, reference, tmp_path):
    """`serve verifier --drafter-port`: one process (one GPU in a pod) serves both; a scheduler drafts with it."""
    import signal

    vport, dport = free_port(), free_port()
    log = tmp_path / "v.log"
    proc = subprocess.Popen(
        [sys.executable, "-m", "dspark_cli.main", "serve", "verifier", "--host", "127.0.0.1", "--port", str(vport),
         "--drafter-port", str(dport), "--target", str(fixtures_dir / "target"), "--drafter-path",
         str(fixtures_dir / "dspark"), "--device", "cpu", "--sps-profile-seconds", "0", "--drain-seconds", "1"],
        cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=open(log, "w"))
    s = None
    try:
        cluster.wait_serving(vport, 180, proc)
        cluster.wait_serving(dport, 180, proc)
        s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{vport}",),
                              drafter_addresses=(f"127.0.0.1:{dport}",), policy="fixed")
        assert s.frontend.card.drafter == "dspark"
        stub, ch = cluster.scheduler_stub(s)
        prompt, greedy = reference[0]
        out = stub.GenerateUnary(ids_request(prompt, 16), timeout=120)
        ch.close()
        assert list(out.token_ids) == greedy[:16] and out.summary.accepted_per_round > 0  # it drafted
        cluster.stop(aio, s)
        s = None
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    finally:
        cluster.stop(aio, s)
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)


# -- a drafter trained for another target is refused at start-up, in one line naming both ----------------------

def test_embedded_and_distributed_refuse_a_drafter_of_another_target(aio, fixtures_dir):
    from dspark_cli.models import models_dir
    from dspark_core.errors import ModelLoadError

    shipped = models_dir() / "dspark"  # trained for the bundled target (vocab 4096, hidden 256)
    with pytest.raises(ModelLoadError, match=r"trained for target 'target' .*not for .*vocabulary differs"):
        cluster.scheduler(aio, embedded_target=str(fixtures_dir / "target"), embedded_drafter=str(shipped))
    v = cluster.verifier(aio, fixtures_dir / "target", tap_layer_ids=(1, 3))  # the taps differ too; hidden first
    dr = cluster.drafter(aio, shipped)
    try:
        with pytest.raises(ModelLoadError, match=r"drafter pods \(dspark\) were trained for .*hidden 256.*hidden 64"):
            cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",),
                              drafter_addresses=(f"127.0.0.1:{dr.port}",))
    finally:
        cluster.stop(aio, dr, v)


def test_serve_all_auto_drafter_beside_a_same_shape_target_serves_without_it(aio, tmp_path, caplog):
    """`serve all --drafter auto` (the default) on a target shaped like the bundled one but with other weights:
    the embedding fingerprint differs, so it serves autoregressively and says so (a named drafter is refused)."""
    import shutil

    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from dspark_cli.models import models_dir
    from dspark_core.errors import ModelLoadError

    bundled, own = models_dir() / "target", tmp_path / "own"
    torch.manual_seed(3)
    AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(bundled)).save_pretrained(own)
    for f in bundled.glob("tokenizer*"):
        shutil.copy(f, own / f.name)
    shipped = str(models_dir() / "dspark")
    s = None
    try:
        with caplog.at_level("WARNING"):
            s = cluster.scheduler(aio, embedded_target=str(own), embedded_drafter=shipped, embedded_drafter_auto=True,
                                  policy="causal")
        assert s.frontend.card.drafter is None and s.frontend.card.policy == "ar"
        assert any("its embedding differs" in r.getMessage() and "serving without a drafter" in r.getMessage()
                   for r in caplog.records)
    finally:
        cluster.stop(aio, s)
    with pytest.raises(ModelLoadError, match="embedding"):
        cluster.scheduler(aio, embedded_target=str(own), embedded_drafter=shipped)
