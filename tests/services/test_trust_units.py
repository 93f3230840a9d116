"""The pieces of trust on their own: wire limits, caller-keyed tables with quotas and idle eviction,
API keys, `dspark certs`, and the TLS health probe the chart runs."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest

from dspark_core.errors import InvalidArgument, ResourceExhausted
from dspark_core.sampling import SamplingParams
from services.common.identity import OwnedTable, key, split
from services.common.limits import check_request_id, check_sampling
from services.common.security import key_ok, parse_api_keys

import svc_cluster as cluster

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("params,field", [
    (dict(max_new_tokens=2**33), "max_new_tokens"),
    (dict(temperature=1e39), "temperature"),
    (dict(temperature=1e-50), "temperature"),
    (dict(temperature=1e-9), "temperature"),  # the scaled logits would overflow float32
    (dict(repetition_penalty=1e-30), "repetition_penalty"),
    (dict(top_p=1e-50), "top_p"),
    (dict(top_k=2**40), "top_k"),
    (dict(stop_token_ids=tuple(range(100))), "stop_token_ids"),
])
def test_values_beyond_the_wire_are_named(params, field):
    with pytest.raises(InvalidArgument) as e:
        check_sampling(SamplingParams(**params), names={"max_new_tokens": "max_tokens"})
    assert e.value.field == {"max_new_tokens": "max_tokens"}.get(field, field)
    check_sampling(SamplingParams(temperature=2.0, top_k=50, top_p=0.9, max_new_tokens=2**32 - 1))


def test_request_ids_are_bounded_and_printable():
    assert check_request_id("cmpl-abc:1/2@x") == "cmpl-abc:1/2@x"
    for bad in ("a" * 129, "has space", "nul\x00", "new\nline", "trailing\n", ""):
        with pytest.raises(InvalidArgument):
            check_request_id(bad)


def test_owned_table_quota_per_caller_and_idle_eviction_when_full():
    t = OwnedTable(capacity=4, per_caller=3, evict_idle_s=0.2)
    a = [key("/sched-a", f"r{i}") for i in range(3)]
    assert t.make_room(a, "pod") == []
    t.touch(a)
    with pytest.raises(ResourceExhausted) as e:
        t.make_room([key("/sched-a", "r9")], "pod")
    assert "max_per_caller" in str(e.value)
    b = key("/sched-b", "r0")
    t.touch([b])  # full: 4 of 4
    with pytest.raises(ResourceExhausted):  # nobody idle long enough to give way
        t.make_room([key("/sched-b", "r1")], "pod")
    time.sleep(0.25)
    t.touch(a[1:] + [b])  # a[0] alone stays idle
    assert t.make_room([key("/sched-b", "r1")], "pod") == [a[0]]
    assert split(a[0]) == ("/sched-a", "r0") and t.held_by("/sched-a") == 3


def test_api_keys_are_bearer_tokens_of_a_minimum_length():
    keys = parse_api_keys(["k" * 16], "x" * 20 + ", " + "k" * 16)
    assert keys == ("k" * 16, "x" * 20)
    assert key_ok("Bearer " + "x" * 20, keys) and not key_ok("x" * 20, keys) and not key_ok("Bearer nope", keys)
    with pytest.raises(InvalidArgument) as e:
        parse_api_keys(["tiny-key"], None)
    assert "16" in str(e.value) and "tiny-key" not in str(e.value)  # a key is never echoed


def test_certs_cli_and_a_second_run_without_force_exits_2(tmp_path, capsys):
    from dspark_cli.main import main

    assert main(["certs", "--out", str(tmp_path / "c"), "--san", "verifier.example", "--san", "10.0.0.7"]) == 0
    for svc in ("scheduler", "verifier", "drafter"):
        assert all((tmp_path / "c" / svc / f).is_file() for f in ("ca.crt", "tls.crt", "tls.key"))
    text = subprocess.run(["openssl", "x509", "-in", str(tmp_path / "c" / "drafter" / "tls.crt"), "-noout", "-text"],
                          capture_output=True, text=True).stdout
    assert "CN = dspark-drafter" in text and "DNS:dspark" in text and "DNS:verifier.example" in text
    assert "IP Address:10.0.0.7" in text
    capsys.readouterr()
    assert main(["certs", "--out", str(tmp_path / "c")]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "--force" in err


def test_tls_health_probe_exits_0_only_with_the_pods_certificate(aio, fixtures_dir, tmp_path):
    from dspark_cli.certs import make_certs

    make_certs(tmp_path)
    v = cluster.verifier(aio, fixtures_dir / "target", tls_dir=str(tmp_path / "verifier"))
    try:
        def probe(*extra):
            return subprocess.run([sys.executable, "-m", "services.common.probe", "--port", str(v.port), *extra],
                                  cwd=REPO, capture_output=True, text=True, timeout=60,
                                  env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})

        assert probe("--tls-dir", str(tmp_path / "verifier")).returncode == 0
        bad = probe()  # plaintext against a TLS port
        assert bad.returncode == 1 and "UNAVAILABLE" in bad.stderr
    finally:
        cluster.stop(aio, v)
