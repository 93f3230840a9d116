"""Trust between clients and pods, as an attacker would try it, over real sockets.

One stack with everything on: mutual TLS between scheduler, verifier and drafter (`dspark certs`), an API
key on the scheduler's gRPC and HTTP, a Redis with a password (pods are found there only). In every case the
attacker's request fails alone and every other request's output equals the target's own greedy output.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import ssl
import time
import urllib.error
import urllib.request

import grpc
import pytest

from dspark_protos.dspark.v1 import (drafter_service_pb2_grpc, scheduler_service_pb2_grpc, types_pb2,
                                     verifier_service_pb2_grpc)
from services.common.identity import CALLER_METADATA, credentials_owner, scoped_request_id
from services.common.registry import PodRecord, Registry, RegistryConfig
from services.common.security import tls_channel_options

import svc_cluster as cluster
from svc_cluster import ids_request
from svc_redis import RedisServer

KEY = "test-key-0123456789abcdef"
AUTH = [("authorization", f"Bearer {KEY}")]
KEY2 = "other-tenant-key-9876543210"
PASSWORD = "redis-secret-42"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    from dspark_cli.certs import make_certs

    out = tmp_path_factory.mktemp("certs")
    make_certs(out)
    rogue = tmp_path_factory.mktemp("rogue-certs")  # a CA of the attacker's own
    make_certs(rogue)
    return out, rogue


@pytest.fixture(scope="module")
def redis_pw(tmp_path_factory):
    r = RedisServer(tmp_path_factory.mktemp("redis-pw"), password=PASSWORD).start()
    yield r
    r.stop()


@pytest.fixture(scope="module")
def stack(aio, redis_pw, certs, fixtures_dir):
    ca, _ = certs
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    auth = {"redis_url": redis_pw.url, "redis_password": PASSWORD}
    v = cluster.verifier(aio, t, d, vid="v-tls", tls_dir=str(ca / "verifier"), max_per_caller=48, **auth)
    dr = cluster.drafter(aio, d, did="d-tls", tls_dir=str(ca / "drafter"), max_per_caller=48, **auth)
    s = cluster.scheduler(aio, tls_dir=str(ca / "scheduler"), api_keys=(KEY, KEY2), http_port=0, http_host="127.0.0.1",
                          **auth)
    ch = grpc.secure_channel(f"127.0.0.1:{s.port}", grpc.ssl_channel_credentials((ca / "ca.crt").read_bytes()),
                             options=tls_channel_options())
    yield {"v": v, "d": dr, "s": s, "stub": scheduler_service_pb2_grpc.SchedulerServiceStub(ch), "ca": ca,
           "redis": redis_pw}
    ch.close()
    cluster.stop(aio, s, dr, v)


def _pod_channel(app, ca_dir, cert_dir=None):
    """A channel to a pod, presenting `cert_dir`'s certificate (None: no client certificate)."""
    kw = {}
    if cert_dir is not None:
        kw = {"private_key": (cert_dir / "tls.key").read_bytes(), "certificate_chain": (cert_dir / "tls.crt").read_bytes()}
    creds = grpc.ssl_channel_credentials((ca_dir / "ca.crt").read_bytes(), **kw)
    return grpc.secure_channel(f"127.0.0.1:{app.port}", creds, options=tls_channel_options())


def _generate(stack, prompt, n, rid="", key=KEY, **sampling):
    req = ids_request(prompt, n, **sampling)
    req.request_id = rid
    return list(stack["stub"].GenerateUnary(req, timeout=120, metadata=[("authorization", f"Bearer {key}")]).token_ids)


def _stream(stack, prompt, n, rid=""):
    req = ids_request(prompt, n, cls=types_pb2.GenerateRequest)
    req.request_id = rid
    return stack["stub"].Generate(req, timeout=120, metadata=AUTH)


def _http(stack, path, body=None, key=KEY):
    ctx = ssl.create_default_context(cafile=str(stack["ca"] / "ca.crt"))
    req = urllib.request.Request(f"https://127.0.0.1:{stack['s'].http_port}{path}",
                                 data=json.dumps(body).encode() if body is not None else None,
                                 headers={"Content-Type": "application/json",
                                          **({"Authorization": f"Bearer {key}"} if key else {})})
    try:
        with urllib.request.urlopen(req, timeout=120, context=ctx) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def _all_greedy(stack, reference, n=16):
    with cf.ThreadPoolExecutor(len(reference)) as pool:
        got = list(pool.map(lambda pg: _generate(stack, pg[0], n), reference))
    assert got == [g[:n] for _, g in reference]


def test_tls_and_api_keys_serve_the_targets_greedy_output(stack, reference):
    _all_greedy(stack, reference)
    prompt, greedy = reference[0]
    for md in (None, [("authorization", "Bearer wrong-key-0123456789")], [("authorization", KEY)]):
        with pytest.raises(grpc.RpcError) as e:
            stack["stub"].GenerateUnary(ids_request(prompt, 4), timeout=30, metadata=md)
        assert e.value.code() == grpc.StatusCode.UNAUTHENTICATED and "API key" in e.value.details()
    status, body = _http(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0}, key=None)
    assert status == 401 and json.loads(body)["error"]["type"] == "authentication_error"
    status, body = _http(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 8, "temperature": 0})
    assert status == 200 and json.loads(body)["dspark"]["token_ids"] == greedy[:8]
    assert _http(stack, "/health", key=None)[0] == 200  # probes need no key
    assert _http(stack, "/metrics")[0] == 404  # metrics live on their own port


def test_a_pod_without_a_ca_signed_certificate_cannot_call_verifier_or_drafter(stack, certs):
    ca, rogue = certs
    msg = types_pb2.PrefillRequest(request_id="x", prompt_token_ids=[1, 2, 3])
    for app, stub_cls, call in ((stack["v"], verifier_service_pb2_grpc.VerifierServiceStub, "Prefill"),
                                (stack["d"], drafter_service_pb2_grpc.DrafterServiceStub, "GetInfo")):
        for cert in (None, rogue / "scheduler"):  # no client certificate; one from another CA
            with _pod_channel(app, ca, cert) as ch:
                stub = stub_cls(ch)
                req = msg if call == "Prefill" else types_pb2.DrafterServiceGetInfoRequest()
                with pytest.raises(grpc.RpcError) as e:
                    getattr(stub, call)(req, timeout=10)
                assert e.value.code() == grpc.StatusCode.UNAVAILABLE
        with grpc.insecure_channel(f"127.0.0.1:{app.port}") as ch:  # plaintext
            with pytest.raises(grpc.RpcError):
                stub_cls(ch).GetInfo(types_pb2.VerifierServiceGetInfoRequest(), timeout=10)


class _Rogue(verifier_service_pb2_grpc.VerifierServiceServicer):
    """A fake verifier that would answer every prompt with its own tokens ("HACKED BY ROGUE POD")."""

    def __init__(self):
        self.calls = 0

    def GetInfo(self, request, context):
        self.calls += 1
        return types_pb2.VerifierServiceGetInfoResponse(model_name="target", vocab_size=512)

    def Prefill(self, request, context):
        self.calls += 1
        return types_pb2.PrefillResponse(request_id=request.request_id, anchor_token_id=7,
                                         anchor_position=len(request.prompt_token_ids))

    def Verify(self, request, context):
        self.calls += 1
        return types_pb2.VerifyResponse()

    def Resume(self, request, context):
        self.calls += 1
        return types_pb2.ResumeResponse(request_id=request.request_id, anchor_token_id=7)


def test_rogue_pod_record_in_redis_receives_no_traffic(stack, certs, reference):
    _, rogue_ca = certs
    rogue = _Rogue()
    servers = []
    for creds in (None, grpc.ssl_server_credentials([((rogue_ca / "verifier" / "tls.key").read_bytes(),
                                                      (rogue_ca / "verifier" / "tls.crt").read_bytes())])):
        srv = grpc.server(cf.ThreadPoolExecutor(4))
        verifier_service_pb2_grpc.add_VerifierServiceServicer_to_server(rogue, srv)
        port = srv.add_secure_port("127.0.0.1:0", creds) if creds else srv.add_insecure_port("127.0.0.1:0")
        srv.start()
        servers.append((srv, port))
    # anyone who can write to Redis advertises "verifiers" that look idle and huge
    reg = Registry(RegistryConfig(stack["redis"].url, password=PASSWORD))
    try:
        def advertise():
            for i, (_, port) in enumerate(servers):
                reg.publish_pod(PodRecord(id=f"rogue-{i}", pool="verifier", address=f"127.0.0.1:{port}",
                                          capacity=1 << 20, health="SERVING", model="target"))

        advertise()
        time.sleep(1.5)  # the scheduler's pod list refreshes every second
        advertise()
        assert any(a.endswith(str(servers[0][1])) for a in stack["s"].verifiers.pods)  # it did see them
        _all_greedy(stack, reference)
        assert rogue.calls == 0
        tried = [p for a, p in stack["s"].verifiers.pods.items() if a.rsplit(":", 1)[1] in {str(x) for _, x in servers}]
        assert tried and all(p.dead_until > 0 for p in tried)  # it did try them: the handshake failed
    finally:
        for i in range(len(servers)):
            reg.remove_pod("verifier", f"rogue-{i}")
        reg.close()
        for srv, _ in servers:
            srv.stop(0)


@pytest.mark.parametrize("field,value,words", [
    ("max_tokens", 2**33, ["max_tokens", str(2**33)]),
    ("temperature", 1e39, ["temperature", "1e+39"]),
    ("top_k", 2**40, ["top_k"]),
    ("top_p", 1e-50, ["top_p"]),
])
def test_values_the_wire_cannot_carry_fail_alone_with_400(stack, reference, field, value, words):
    prompt, greedy = reference[1]
    streams = [_stream(stack, p, 24) for p, _ in reference]
    status, body = _http(stack, "/v1/completions", {"prompt": prompt, "max_tokens": 4, field: value})
    err = json.loads(body)["error"]
    assert status == 400 and err["param"] == field, body
    for w in words:
        assert w in err["message"]
    got = [[t for c in s for t in c.token_ids] for s in streams]
    assert got == [g[:24] for _, g in reference]


def test_a_request_that_breaks_its_batch_fails_alone_and_leaves_no_checkpoint(stack, reference, aio):
    """A value that slips past the edge (here 2^33 new tokens, which no proto field holds) makes the
    batched prefill throw: that request fails, the step is retried without it, the others are untouched."""
    from dspark_core.sampling import SamplingParams

    f = stack["s"].frontend

    async def bad():
        out = []
        try:
            async for upd in f.run("bad-one", list(reference[0][0]), SamplingParams(temperature=0, max_new_tokens=2**33)):
                out.append(upd)
        except Exception as exc:  # noqa: BLE001
            return exc
        return out

    streams = [_stream(stack, p, 24) for p, _ in reference]
    fut = cf.ThreadPoolExecutor(1).submit(aio.run, bad())
    got = [[t for c in s for t in c.token_ids] for s in streams]
    err = fut.result(60)
    assert isinstance(err, Exception), err
    assert got == [g[:24] for _, g in reference]
    assert stack["redis"].client().get("dspark:request:bad-one") is None
    assert "bad-one" not in stack["s"].engine.requests


def test_duplicate_request_id_is_the_new_requests_error_alone(stack, reference):
    prompt, greedy = reference[2]
    first = _stream(stack, prompt, 40, rid="dup-1")
    it = iter(first)
    tokens = list(next(it).token_ids)
    # a client with another API key may name its request alike meanwhile: its own request, and it is not told
    # that another one exists
    assert _generate(stack, reference[0][0], 4, rid="dup-1", key=KEY2) == reference[0][1][:4]
    with pytest.raises(grpc.RpcError) as e:  # (so the first one was still running during the call above)
        _generate(stack, reference[0][0], 4, rid="dup-1")
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "'dup-1'" in e.value.details()
    assert credentials_owner(f"Bearer {KEY}") not in e.value.details()  # the id it sent, not the scoped one
    tokens += [t for c in it for t in c.token_ids]
    assert tokens == greedy[:40]
    for rid, words in (("x" * 129, ["request_id", "128"]), ("has space", ["request_id", "letters"])):
        with pytest.raises(grpc.RpcError) as e:
            _generate(stack, prompt, 4, rid=rid)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert all(w in e.value.details() for w in words)


def test_prefill_and_release_of_a_running_requests_id_by_a_neighbour_cannot_touch_it(stack, certs, reference):
    """The attacker holds a CA-signed certificate (a compromised drafter pod), reads the victim's request id
    and scheduler id from Redis and sends Prefill / Release with them: the victim's output is unchanged."""
    ca, _ = certs
    prompt, greedy = reference[0]
    victim = iter(_stream(stack, prompt, 64, rid="victim-1"))
    tokens = list(next(victim).token_ids)
    r = stack["redis"].client()
    deadline = time.monotonic() + 10
    rid = scoped_request_id(credentials_owner(f"Bearer {KEY}"), "victim-1")  # what the scheduler runs it as
    while r.get(f"dspark:request:{rid}") is None and time.monotonic() < deadline:
        time.sleep(0.05)
    sched = json.loads(r.get(f"dspark:request:{rid}"))["scheduler"]
    with _pod_channel(stack["v"], ca, ca / "drafter") as ch:
        stub = verifier_service_pb2_grpc.VerifierServiceStub(ch)
        md = [(CALLER_METADATA, sched)]
        # a context longer than the victim's: its next Verify would truncate it and run on the forgery
        forged = [9] * (len(prompt) + 60)
        for _ in range(3):
            stub.Prefill(types_pb2.PrefillRequest(request_id=rid, prompt_token_ids=forged),
                         timeout=30, metadata=md)
            tokens += list(next(victim).token_ids)
        stub.Release(types_pb2.VerifierServiceReleaseRequest(request_ids=[rid]), timeout=30, metadata=md)
    tokens += [t for c in victim for t in c.token_ids]
    assert tokens == greedy[:64]


def test_flooding_drafter_contexts_and_verifier_slots_hits_only_the_attackers_quota(stack, certs, reference):
    ca, _ = certs
    with _pod_channel(stack["d"], ca, ca / "verifier") as ch:
        resp = drafter_service_pb2_grpc.DrafterServiceStub(ch).Propose(types_pb2.ProposeRequest(items=[
            types_pb2.ProposeItem(request_id=f"fake-{i}", anchor_token_id=1, anchor_position=0)
            for i in range(1100)]), timeout=60)
    refused = [p for p in resp.proposals if p.status == types_pb2.ITEM_STATUS_RESOURCE_EXHAUSTED]
    assert len(refused) >= 1100 - 48 and "max_per_caller" in refused[0].error_message
    with _pod_channel(stack["v"], ca, ca / "drafter") as ch:
        stub = verifier_service_pb2_grpc.VerifierServiceStub(ch)
        codes = []
        for i in range(64):
            try:
                stub.Prefill(types_pb2.PrefillRequest(request_id=f"fill-{i}", prompt_token_ids=[1]), timeout=30)
                codes.append("OK")
            except grpc.RpcError as e:
                codes.append(e.code().name)
    assert codes.count("OK") == 48 and set(codes[48:]) == {"RESOURCE_EXHAUSTED"}
    _all_greedy(stack, reference, 24)
    # and the drafter still drafts for the real scheduler (drafts were accepted)
    out = stack["stub"].GenerateUnary(ids_request(reference[0][0], 24), timeout=60, metadata=AUTH)
    assert out.summary.accepted_per_round > 0


def test_seeded_output_is_the_same_whatever_else_runs(stack, reference):
    prompt, _ = reference[0]
    alone = _generate(stack, prompt, 32, temperature=1.0, seed=1234)
    with cf.ThreadPoolExecutor(6) as pool:
        noise = [pool.submit(_generate, stack, p, 32, temperature=1.0) for p, _ in reference * 2]
        busy = _generate(stack, prompt, 32, temperature=1.0, seed=1234)
        [n.result() for n in noise]
    assert busy == alone and len(alone) == 32
    assert _generate(stack, prompt, 32, temperature=1.0, seed=1235) != alone


def _client_cert(ca, out, cn, serial):
    """A client certificate with common name `cn`, signed by the stack's CA (as a platform team would issue one)."""
    import subprocess

    out.mkdir(parents=True, exist_ok=True)
    ext = out / "ext.cnf"
    ext.write_text("basicConstraints=CA:FALSE\nkeyUsage=critical,digitalSignature,keyEncipherment\n"
                   "extendedKeyUsage=clientAuth\n")
    run = lambda *a: subprocess.run(["openssl", *a], check=True, capture_output=True)  # noqa: E731
    run("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes", "-keyout", str(out / "tls.key"),
        "-out", str(out / "tls.csr"), "-subj", "/CN=" + cn.replace("/", "\\/"))
    run("x509", "-req", "-in", str(out / "tls.csr"), "-CA", str(ca / "ca.crt"), "-CAkey", str(ca / "ca.key"),
        "-set_serial", str(serial), "-days", "2", "-out", str(out / "tls.crt"), "-extfile", str(ext))
    return out


def test_a_certificate_name_with_a_slash_cannot_alias_another_callers_requests(stack, certs, tmp_path):
    """Callers are `<certificate name>/<carried id>`: CN "pod/a" carrying "b" read as CN "pod" carrying "a/b" —
    the same key — and could release (or overwrite) that caller's requests. Certificate names are escaped."""
    ca, _ = certs
    victim, attacker = (_client_cert(ca, tmp_path / "victim", "pod", 1001),
                        _client_cert(ca, tmp_path / "attacker", "pod/a", 1002))
    release = types_pb2.VerifierServiceReleaseRequest(request_ids=["r-alias"])
    with _pod_channel(stack["v"], ca, victim) as vch, _pod_channel(stack["v"], ca, attacker) as ach:
        mine = verifier_service_pb2_grpc.VerifierServiceStub(vch)
        theirs = verifier_service_pb2_grpc.VerifierServiceStub(ach)
        mine.Prefill(types_pb2.PrefillRequest(request_id="r-alias", prompt_token_ids=[1, 2, 3]), timeout=30,
                     metadata=[(CALLER_METADATA, "a/b")])
        got = theirs.Release(release, timeout=30, metadata=[(CALLER_METADATA, "b")])
        assert got.num_released == 0
        assert mine.Release(release, timeout=30, metadata=[(CALLER_METADATA, "a/b")]).num_released == 1


def test_one_api_key_holds_at_most_its_request_limit_and_the_other_keys_are_served(aio, stack, certs, reference):
    """`--max-requests-per-client 2`: a client (API key) running two requests gets RESOURCE_EXHAUSTED (HTTP 429)
    for a third, naming the flag, while another key's client is served; n choices count n; a finished or
    cancelled request gives its place back. The verifier's model thread is held meanwhile, so the requests are
    surely still running when the others arrive."""
    import threading

    ca, _ = certs
    s = cluster.scheduler(aio, tls_dir=str(ca / "scheduler"), api_keys=(KEY, KEY2), http_port=0, http_host="127.0.0.1",
                          max_requests_per_client=2, redis_url=stack["redis"].url, redis_password=PASSWORD)
    ch = grpc.secure_channel(f"127.0.0.1:{s.port}", grpc.ssl_channel_credentials((ca / "ca.crt").read_bytes()),
                             options=tls_channel_options())
    stub = scheduler_service_pb2_grpc.SchedulerServiceStub(ch)
    mine = {"stub": stub, "ca": ca, "s": s}
    gate = threading.Event()
    pool = cf.ThreadPoolExecutor(4)
    try:
        stack["v"].servicer.executor.submit(gate.wait, 60)  # the verifier computes nothing until the gate opens
        (p0, g0), (p1, g1) = reference[0], reference[1]
        running = [pool.submit(_generate, mine, p, 12) for p in (p0, p1)]
        deadline = time.monotonic() + 20
        while sum(s.frontend.held_by.values()) < 2:
            assert time.monotonic() < deadline, "the two requests never reached the scheduler"
            time.sleep(0.02)
        with pytest.raises(grpc.RpcError) as e:
            _generate(mine, p0, 4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "--max-requests-per-client" in e.value.details() and "2" in e.value.details()
        status, body = _http(mine, "/v1/completions", {"prompt": [int(t) for t in p0], "max_tokens": 4})
        assert status == 429 and "rate_limit_error" in body
        def choices(n, tokens):
            req = ids_request(p1, tokens)
            req.n = n
            return stub.GenerateUnary(req, timeout=60, metadata=[("authorization", f"Bearer {KEY2}")])

        with pytest.raises(grpc.RpcError) as e:  # three choices are three requests
            choices(3, 4)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        other = pool.submit(choices, 2, 6)
        while sum(s.frontend.held_by.values()) < 4:
            assert time.monotonic() < deadline, "the other key's request never reached the scheduler"
            time.sleep(0.02)
        gate.set()
        assert [f.result(60) for f in running] == [g0[:12], g1[:12]]
        assert [list(c.token_ids) for c in other.result(60).choices] == [g1[:6]] * 2
        assert s.frontend.held_by == {}  # every place given back
        assert _generate(mine, p0, 4) == g0[:4]
        # a cancelled stream gives its place back too
        calls = [_stream(mine, p0, 64) for _ in range(2)]
        firsts = [list(next(c).token_ids) for c in calls]
        calls[0].cancel()
        deadline = time.monotonic() + 20
        while sum(s.frontend.held_by.values()) > 1:
            assert time.monotonic() < deadline, "a cancelled request kept its place"
            time.sleep(0.02)
        assert _generate(mine, p1, 4) == g1[:4]
        assert firsts[1] + [t for c in calls[1] for t in c.token_ids] == g0[:64]
    finally:
        gate.set()
        pool.shutdown()
        ch.close()
        cluster.stop(aio, s)
