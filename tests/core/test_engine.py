"""The engine: greedy output equals the target's own under every policy and batch mix; requests come and go."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark_core.engine import Engine, EngineConfig
from dspark_core.errors import InvalidArgument, NotFound
from dspark_core.sampling import SamplingParams
from dspark_core.target import TargetConfig, TargetRuntime

from drafter_doubles import OracleDrafter

PROMPTS = [[5, 9, 12, 30, 41], [7, 7, 8], [100, 3, 19, 22, 23, 24, 60, 61, 90], [2]]


def hf_greedy(model_dir, prompt, n):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(n):
            ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
    return ids[len(prompt):]


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def expected(tiny_target_dir):
    return [hf_greedy(tiny_target_dir, p, 12) for p in PROMPTS]


def run_all(engine, params, stagger=True):
    """Add requests at different steps (a batch mix that changes every step) and run to completion."""
    rids = []
    for p in PROMPTS:
        rids.append(engine.add_request(p, params))
        if stagger:
            engine.step()
    engine.run()
    return [engine.pop(r) for r in rids]


def test_autoregressive_greedy_equals_hf_greedy(target, expected):
    engine = Engine(target, None, EngineConfig(policy="ar"))
    outs = run_all(engine, SamplingParams(temperature=0, max_new_tokens=12))
    assert [o.output_ids for o in outs] == expected
    assert target.num_active == 0


@pytest.mark.parametrize("policy,stagger", [("fixed", True), ("fixed", False), ("gamma1", True), ("threshold", True)])
def test_speculative_greedy_equals_target_greedy(tiny_target_dir, target, expected, policy, stagger):
    drafter = OracleDrafter(tiny_target_dir, block_size=4, corrupt=0.3)
    engine = Engine(target, drafter, EngineConfig(policy=policy))
    outs = run_all(engine, SamplingParams(temperature=0, max_new_tokens=12), stagger=stagger)
    assert [o.output_ids for o in outs] == expected
    # drafts were really accepted, and never more than proposed
    assert sum(sum(o.accepted_per_round) for o in outs) > 0
    for o in outs:
        assert all(a <= p for a, p in zip(o.accepted_per_round, o.proposed_per_round))
        if policy == "gamma1":
            assert max(o.proposed_per_round) <= 1


def test_sampling_is_reproducible_per_seed(tiny_target_dir, target):
    drafter = OracleDrafter(tiny_target_dir, block_size=3, corrupt=0.5)

    def once(seed, stagger):
        engine = Engine(target, drafter, EngineConfig(policy="fixed"))
        rid = engine.add_request(PROMPTS[0], SamplingParams(temperature=1.0, seed=seed, max_new_tokens=16))
        if stagger:  # other requests in the batch must not change this request's stream
            engine.add_request(PROMPTS[1], SamplingParams(temperature=0.8, seed=99, max_new_tokens=16))
        engine.run()
        return engine.requests[rid].output_ids

    assert once(7, False) == once(7, False)
    assert once(7, False) != once(8, False)


def test_stop_token_ends_request(target, expected):
    stop = expected[0][3]
    engine = Engine(target, None, EngineConfig(policy="ar"))
    req = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(stop,)))
    assert req.output_ids == expected[0][: expected[0].index(stop) + 1]
    assert req.finish_reason == "stop"


def test_cancel_frees_the_sequence(target):
    engine = Engine(target, None, EngineConfig(policy="ar"))
    rid = engine.add_request(PROMPTS[2], SamplingParams(temperature=0, max_new_tokens=50))
    engine.step()
    assert target.num_active == 1
    engine.cancel(rid)
    assert target.num_active == 0 and not engine.has_work
    assert engine.pop(rid).finish_reason == "cancelled"
    with pytest.raises(NotFound):
        engine.cancel("nope")


def test_bad_requests_are_refused_with_the_field(target):
    engine = Engine(target, None, EngineConfig(policy="ar"))
    with pytest.raises(InvalidArgument, match="prompt"):
        engine.add_request([], SamplingParams())
    with pytest.raises(InvalidArgument, match="context window"):
        engine.add_request([1] * target.max_context, SamplingParams())
    with pytest.raises(InvalidArgument, match="prompt_ids"):
        engine.add_request([target.vocab_size], SamplingParams())
    with pytest.raises(InvalidArgument, match="policy"):
        EngineConfig(policy="fastest")
    with pytest.raises(InvalidArgument, match="SPS"):
        Engine(target, None, EngineConfig(policy="causal"))


@pytest.mark.parametrize("policy", ["causal", "async"])
def test_confidence_policies_read_the_sps_row_of_the_steps_request_count(tiny_target_dir, target, expected, policy):
    from dspark_core.cost_model import SpsTable

    # B alone: extra tokens cost more than they can return (B x SPS(B) < SPS(1) for every B > 1, so not even
    # certain drafts pay); one request: tokens are free
    plain = SpsTable(batch_sizes=(1, 2, 3, 8), steps_per_second=(100.0, 45.0, 20.0, 5.0))
    one = SpsTable(batch_sizes=(1, 8), steps_per_second=(100.0, 100.0))
    for table, drafts in ((plain, False), (SpsTable(batch_sizes=plain.batch_sizes,
                                                    steps_per_second=plain.steps_per_second,
                                                    by_requests=((1, one),)), True)):
        drafter = OracleDrafter(tiny_target_dir, block_size=4, corrupt=0.3)
        engine = Engine(target, drafter, EngineConfig(policy=policy, count_draft_time=False), sps=table)
        out = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12))
        assert out.output_ids == expected[0]
        assert (sum(out.proposed_per_round) > 0) == drafts


@pytest.mark.parametrize("policy", ["causal", "async"])
def test_drafting_time_counts_as_a_fixed_cost_of_the_step(tiny_target_dir, target, expected, policy):
    from dspark_core.cost_model import SpsTable

    class SlowOracle(OracleDrafter):
        def propose(self, items):
            time.sleep(0.05)  # a drafter that costs five forward passes of the table below
            return super().propose(items)

    # each token past the first costs as much as the first: worth it only when the step has a fixed cost
    # (tokens/s of the pass alone: 100 at B = 1, at most 2 x 50 = 100 at B = 2 with certain drafts)
    table = SpsTable(batch_sizes=tuple(range(1, 9)), steps_per_second=tuple(100.0 / b for b in range(1, 9)))
    proposed = {}
    for count in (False, True):
        engine = Engine(target, SlowOracle(tiny_target_dir, block_size=4, corrupt=0.0),
                        EngineConfig(policy=policy, count_draft_time=count), sps=table)
        out = engine.generate(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=12))
        assert out.output_ids == expected[0]
        proposed[count] = sum(out.proposed_per_round)
    assert proposed[False] == 0 < proposed[True]


def test_observer_gets_one_record_per_step_aligned_with_the_round(tiny_target_dir, target, expected):
    records = []
    seen = []

    def policy(confidences, sps, request_ids):
        seen.append(list(request_ids))
        return [min(2, len(row)) for row in confidences]  # a caller's own policy: at most two drafts

    engine = Engine(target, OracleDrafter(tiny_target_dir, block_size=4, corrupt=0.3), EngineConfig(),
                    policy=policy, observer=records.append)
    outs = run_all(engine, SamplingParams(temperature=0, max_new_tokens=12))
    assert [o.output_ids for o in outs] == expected  # a policy of its own changes nothing but speed
    assert [r.step for r in records] == list(range(1, engine.num_steps + 1))
    first = records[0]
    assert first.admitted == (outs[0].request_id,) and set(first.timings) == {"prefill", "draft", "schedule", "verify"}
    rounds = [r for r in records if r.request_ids]
    assert [list(r.request_ids) for r in rounds] == seen  # the policy saw the rows' requests, in order
    for r in rounds:
        assert len(r.proposals) == len(r.lengths) == len(r.request_ids)
        assert all(0 <= n <= 2 and len(p.tokens) == 4 for p, n in zip(r.proposals, r.lengths))
        for stage, (a, b) in r.timings.items():
            assert a <= b, stage
    by_request = {o.request_id: o for o in outs}
    for rid, out in by_request.items():
        lengths = [n for r in rounds for q, n in zip(r.request_ids, r.lengths) if q == rid]
        assert lengths == out.proposed_per_round  # one entry per round the request took part in
    events = [e.request_id for r in records for e in r.events if e.finished]
    assert sorted(events) == sorted(by_request)


@pytest.mark.parametrize("isolate", [True, False])
def test_seeded_requests_run_alone_unless_batching_them_is_allowed(target, isolate, monkeypatch):
    passes = []
    real = target.forward

    def counting(batch, **kw):
        passes.append(len(batch))
        return real(batch, **kw)

    monkeypatch.setattr(target, "forward", counting)
    engine = Engine(target, None, EngineConfig(policy="ar", isolate_seeded=isolate))
    rids = [engine.add_request(p, SamplingParams(temperature=1.0, seed=i, max_new_tokens=4))
            for i, p in enumerate(PROMPTS)]
    engine.run()
    outs = [engine.pop(r) for r in rids]
    assert all(len(o.output_ids) == 4 for o in outs)
    decode = passes[1:]  # after the (batched) prefill
    assert (max(decode) == 1) if isolate else (max(decode) == len(PROMPTS))
