"""The OpenAI-surface parameters on gRPC: penalties, min_p, min_tokens, ignore_eos and logprobs in
SamplingParams, logprobs on every chunk, the speculative metrics in the summary. Embedded (`serve all`'s
scheduler) and distributed (verifier + drafter + scheduler services on loopback, static addresses), both on
the bundled model: greedy output and logprobs equal the target's own decode with the same processing.
"""

from __future__ import annotations

import json
from pathlib import Path

import grpc
import pytest

from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams
from dspark_core.target import TargetConfig, TargetRuntime
from dspark_protos.dspark.v1 import types_pb2

import svc_cluster as cluster

MODELS = Path(__file__).resolve().parents[2] / "models"
PROMPT = "def reverse(s):\n"
NEW = 20
FIELDS = dict(presence_penalty=0.5, frequency_penalty=0.75, repetition_penalty=1.25, min_p=0.125, min_tokens=6)


@pytest.fixture(scope="module")
def target():
    return TargetRuntime(TargetConfig(str(MODELS / "target"), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def prompt_ids(target):
    return target.tokenizer.encode(PROMPT, add_special_tokens=False)


def _reference(target, prompt_ids, eos: bool = True):
    params = SamplingParams(temperature=0, max_new_tokens=NEW, logprobs=2,
                            stop_token_ids=target.eos_token_ids if eos else (), **FIELDS)
    return Engine(target, None, EngineConfig(policy="ar")).generate(prompt_ids, params)


def _request(cls, ignore_eos=False):
    return cls(prompt_text=PROMPT, sampling=types_pb2.SamplingParams(
        max_new_tokens=NEW, logprobs=2, ignore_eos=ignore_eos, **FIELDS))


def _check(stub, target, prompt_ids):
    want = _reference(target, prompt_ids)
    resp = stub.GenerateUnary(_request(types_pb2.GenerateUnaryRequest), timeout=120)
    assert list(resp.token_ids) == want.output_ids
    assert [m.token_id for m in resp.logprobs] == want.output_ids
    assert max(abs(m.logprob - w.logprob) for m, w in zip(resp.logprobs, want.logprobs)) < 1e-4
    assert [[t.token_id for t in m.top] for m in resp.logprobs] == [[t for t, _ in w.top] for w in want.logprobs]
    s = resp.summary
    assert s.num_accepted_tokens <= s.num_draft_tokens and sum(s.accepted_per_position) == s.num_accepted_tokens
    assert s.num_draft_tokens > 0 and s.mean_verification_length > 0
    chunks = list(stub.Generate(_request(types_pb2.GenerateRequest), timeout=120))
    assert [t for c in chunks for t in c.token_ids] == want.output_ids
    assert all(len(c.logprobs) == len(c.token_ids) for c in chunks)
    assert chunks[-1].summary.num_draft_tokens == s.num_draft_tokens
    # ignore_eos: the model's end-of-sequence ids no longer stop it
    long = stub.GenerateUnary(_request(types_pb2.GenerateUnaryRequest, ignore_eos=True), timeout=120)
    assert list(long.token_ids) == _reference(target, prompt_ids, eos=False).output_ids
    assert len(long.token_ids) == NEW


@pytest.fixture(scope="module")
def embedded(aio):
    s = cluster.scheduler(aio, embedded_target=str(MODELS / "target"), embedded_drafter=str(MODELS / "dspark"))
    yield s
    cluster.stop(aio, s)


def test_embedded_grpc_serves_the_processing_and_logprobs(embedded, target, prompt_ids):
    stub, ch = cluster.scheduler_stub(embedded)
    _check(stub, target, prompt_ids)
    ch.close()


def test_dspark_client_sends_the_processing_and_prints_logprobs_and_speculation(embedded, target, prompt_ids,
                                                                               capsys):
    from dspark_cli.main import main

    want = _reference(target, prompt_ids)
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in FIELDS.items()]
    rc = main(["client", "generate", "--address", f"127.0.0.1:{embedded.port}", "--json", "--temperature", "0",
               "--max-new-tokens", str(NEW), "--logprobs", "2", *flags, PROMPT])
    assert rc == 0
    out = json.loads(capsys.readouterr().out)
    assert out["token_ids"] == want.output_ids
    assert [m["token_id"] for m in out["logprobs"]] == want.output_ids
    assert max(abs(m["logprob"] - w.logprob) for m, w in zip(out["logprobs"], want.logprobs)) < 1e-4
    spec = out["speculative"]
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    rc = main(["client", "generate", "--address", f"127.0.0.1:{embedded.port}", "--min-p", "3", PROMPT])
    assert rc == 2 and "min_p" in capsys.readouterr().err


def test_distributed_grpc_carries_the_processing_and_logprobs_across_services(aio, target, prompt_ids):
    v = cluster.verifier(aio, MODELS / "target", MODELS / "dspark")
    d = cluster.drafter(aio, MODELS / "dspark")
    s = cluster.scheduler(aio, verifier_addresses=(f"127.0.0.1:{v.port}",), drafter_addresses=(f"127.0.0.1:{d.port}",),
                          tokenizer_dir=str(MODELS / "target"))
    try:
        stub, ch = cluster.scheduler_stub(s)
        _check(stub, target, prompt_ids)
        ch.close()
    finally:
        cluster.stop(aio, s, d, v)


def test_bad_processing_values_are_invalid_argument_naming_the_field(embedded):
    stub, ch = cluster.scheduler_stub(embedded)
    for field, value in (("min_p", 2.0), ("presence_penalty", 5.0), ("logprobs", 21), ("min_tokens", 999)):
        req = types_pb2.GenerateUnaryRequest(prompt_text=PROMPT, sampling=types_pb2.SamplingParams(
            max_new_tokens=8, **{field: value}))
        with pytest.raises(grpc.RpcError) as err:
            stub.GenerateUnary(req, timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"sampling.{field}" in err.value.details()
    ch.close()


def test_grpc_n_choices_are_seeded_and_reproducible(embedded):
    stub, ch = cluster.scheduler_stub(embedded)

    def request(cls, n):
        return cls(prompt_text=PROMPT, n=n, sampling=types_pb2.SamplingParams(
            temperature=1.0, seed=2024, max_new_tokens=12, logprobs=0, presence_penalty=0.5))

    target = embedded.engine.target
    prefilled, forward = [], target.forward

    def counting(batch, **kw):
        if kw.get("last_logits_only"):
            prefilled.append(sum(len(toks) for _, toks in batch))
        return forward(batch, **kw)

    target.forward = counting
    try:
        three = stub.GenerateUnary(request(types_pb2.GenerateUnaryRequest, 3), timeout=120)
    finally:
        del target.forward
    # the three choices joined the engine in one step and their shared prompt ran through the target once
    assert prefilled == [len(target.tokenizer.encode(PROMPT, add_special_tokens=False))]
    assert [c.index for c in three.choices] == [0, 1, 2]
    assert list(three.token_ids) == list(three.choices[0].token_ids)
    assert len({tuple(c.token_ids) for c in three.choices}) > 1
    assert all(len(c.logprobs) == len(c.token_ids) for c in three.choices)
    again = stub.GenerateUnary(request(types_pb2.GenerateUnaryRequest, 3), timeout=120)
    assert [list(c.token_ids) for c in again.choices] == [list(c.token_ids) for c in three.choices]
    one = stub.GenerateUnary(request(types_pb2.GenerateUnaryRequest, 1), timeout=120)
    assert not one.choices and one.token_ids
    chunks = list(stub.Generate(request(types_pb2.GenerateRequest, 3), timeout=120))
    for c in three.choices:  # streamed: the same three choices, each ending once
        mine = [k for k in chunks if k.choice_index == c.index]
        assert [t for k in mine for t in k.token_ids] == list(c.token_ids)
        assert sum(1 for k in mine if k.finish_reason) == 1 and mine[-1].finish_reason
    with pytest.raises(grpc.RpcError) as err:
        stub.GenerateUnary(request(types_pb2.GenerateUnaryRequest, 17), timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "n" in err.value.details()
    ch.close()
