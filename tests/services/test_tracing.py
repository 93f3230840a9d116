"""Tracing: one trace per request (a `generate` span with a `round` span per round, each with its
prefill / draft / verify stage spans), and the trace context crosses gRPC into the verifier and drafter."""

from __future__ import annotations

import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter


import svc_cluster as cluster


@pytest.fixture(scope="module")
def spans():
    exporter = InMemorySpanExporter()
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    if not isinstance(trace.get_tracer_provider(), TracerProvider):
        trace.set_tracer_provider(provider)
    else:  # another test module installed one first
        trace.get_tracer_provider().add_span_processor(SimpleSpanProcessor(exporter))
    return exporter


def test_one_trace_per_request_with_round_and_stage_spans_across_services(aio, spans, fixtures_dir, reference):
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    v = cluster.verifier(aio, t, d)
    dr = cluster.drafter(aio, d)
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), drafter_addresses=(f"127.0.0.1:{dr.port}",))
    try:
        spans.clear()
        stub, ch = cluster.scheduler_stub(s)
        out = stub.GenerateUnary(cluster.ids_request(reference[0][0], 8), timeout=60)
        ch.close()
    finally:
        cluster.stop(aio, s, dr, v)
    got = spans.get_finished_spans()
    gen = [x for x in got if x.name == "generate"]
    assert len(gen) == 1
    tid = gen[0].context.trace_id
    server = [x for x in got if x.name == "GenerateUnary"]
    assert server and server[0].context.trace_id == tid  # the RPC's server span is the root of the trace
    rounds = [x for x in got if x.name == "round" and x.context.trace_id == tid]
    assert len(rounds) == out.summary.num_rounds  # the admitting step prefills and runs round 1
    stages = {x.name for x in got if x.context.trace_id == tid and x.parent is not None
              and x.parent.span_id in {r.context.span_id for r in rounds}}
    assert {"prefill", "draft", "verify"} <= stages
    # the engine step's batched calls carry their trace into the verifier and drafter servers
    steps = {x.context.trace_id for x in got if x.name == "engine.step"}
    assert any(x.name == "Verify" and x.context.trace_id in steps for x in got)
    assert any(x.name == "Propose" and x.context.trace_id in steps for x in got)
