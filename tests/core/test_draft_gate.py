"""The draft gate (EngineConfig.gate_drafts) on the bundled model and its DSpark drafter: where drafts cannot pay
for themselves (each extra verified token costs a whole step) requests stop drafting, probe again later with
growing gaps, and decode exactly what the target decodes; where they pay (a flat cost curve) every step drafts."""

from __future__ import annotations

from pathlib import Path

import pytest

from dspark_core.cost_model import SpsTable
from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams

REPO = Path(__file__).resolve().parents[2]
PROMPTS = ("Write a Python function that reverses a string.", "for i in range(10):", "What is 12 * 7?")
pytestmark = pytest.mark.usefixtures("one_torch_thread")

# a pass of b tokens costs b^2 tenths of a second, at every size (no interpolation between rows): each extra
# token costs more than a whole one-token step, so no draft can pay whatever the drafter's measured time. (A
# pass time linear in b was only just unpayable, and between sparse rows the interpolated speed sat above the
# curve: a confident request's drafts paid or not with the machine's timing.)
STEEP = SpsTable(batch_sizes=tuple(range(1, 65)), steps_per_second=tuple(10.0 / b ** 2 for b in range(1, 65)))
# a pass costs the same whatever it carries (drafting at ~1 ms against 1 s steps): every draft pays
FLAT = SpsTable(batch_sizes=(1, 64), steps_per_second=(1.0, 1.0))


@pytest.fixture(scope="module")
def stack():
    from dspark_cli.models import load_stack

    return load_stack(str(REPO / "models" / "target"), str(REPO / "models" / "dspark"), "cpu", "float32")


def _run(target, drafter, sps, gate: bool, temperature: float = 0.0):
    engine = Engine(target, drafter, EngineConfig(policy="causal", gate_drafts=gate, draft_gate_min=2,
                                                  draft_gate_max=8), sps=sps)
    ids = []
    for i, text in enumerate(PROMPTS):
        p = target.tokenizer.encode(text, add_special_tokens=False)
        ids.append(engine.add_request(p, SamplingParams(temperature=temperature, max_new_tokens=48, seed=i)))
    calls = []  # (step, requests drafted) of every drafter call
    propose = drafter.propose
    drafter.propose = lambda items: calls.append((engine.num_steps, len(items))) or propose(items)
    try:
        engine.run()
    finally:
        del drafter.propose
    return engine, [engine.pop(r) for r in ids], calls


def test_requests_stop_drafting_where_drafts_cannot_pay_and_their_output_is_the_targets(stack):
    target, drafter = stack
    ar = Engine(target, None, EngineConfig(policy="ar"))
    ref = []
    for text in PROMPTS:
        rid = ar.add_request(target.tokenizer.encode(text, add_special_tokens=False),
                             SamplingParams(temperature=0.0, max_new_tokens=48))
        ar.run()
        ref.append(ar.pop(rid).output_ids)
    gated, out, calls = _run(target, drafter, STEEP, gate=True)
    ungated, out_ungated, calls_ungated = _run(target, drafter, STEEP, gate=False)
    assert [r.output_ids for r in out] == ref == [r.output_ids for r in out_ungated]
    rounds = sum(len(r.proposed_per_round) for r in out)
    assert gated.num_gated_drafts > rounds / 2  # most request-rounds skipped the drafter
    assert sum(n for _, n in calls) < sum(n for _, n in calls_ungated) / 2 and ungated.num_gated_drafts == 0
    # it keeps looking: drafter calls spread over the run (probes), never more than the cap apart
    steps = [s for s, _ in calls]
    assert len(steps) >= 4 and steps[-1] > gated.num_steps / 2
    assert max(b - a for a, b in zip(steps, steps[1:])) <= 2 * 8 + 1  # the cap, rounded to a multiple of it


def test_where_drafts_pay_every_step_drafts(stack):
    target, drafter = stack
    engine, out, calls = _run(target, drafter, FLAT, gate=True, temperature=1.0)
    assert engine.num_gated_drafts == 0 and sum(n for _, n in calls) == sum(len(r.proposed_per_round) for r in out)
    assert sum(sum(r.accepted_per_round) for r in out) > 0


def test_a_catch_up_pass_does_not_gate_requests_whose_drafts_pay(stack):
    """A request's first pass extends the drafter over its whole prompt (and a pass after a gated stretch over
    the positions it skipped): slower than drafting will be from then on. The gate charges such a pass at the
    steady drafting time, so it does not stop drafts that pay."""
    import time

    target, drafter = stack
    gamma = drafter.block_size
    propose = drafter.propose

    def slow_catch_up(items):
        if any(it.new_features is not None and it.new_features.shape[0] > gamma + 1 for it in items):
            time.sleep(0.25)  # at 20 steps/s: five steps' worth, several times what any drafts could earn
        return propose(items)

    drafter.propose = slow_catch_up  # _run wraps it once more, and removes the instance's override after
    try:
        engine, out, calls = _run(target, drafter, SpsTable(batch_sizes=(1, 64), steps_per_second=(20.0, 20.0)),
                                  gate=True)
    finally:
        drafter.__dict__.pop("propose", None)
    assert engine.num_gated_drafts == 0
    assert sum(n for _, n in calls) == sum(len(r.proposed_per_round) for r in out)


def test_a_gated_stretch_reaches_the_drafter_whole_and_in_order(stack):
    """While a request is gated its committed positions pile up (one part a step); its next draft gets them as one
    block: every position from 0 to the anchor exactly once, in order, with the tokens committed there."""
    target, drafter = stack
    engine = Engine(target, drafter, EngineConfig(policy="causal", draft_gate_min=2, draft_gate_max=8), sps=STEEP)
    ids = [engine.add_request(target.tokenizer.encode(t, add_special_tokens=False),
                              SamplingParams(temperature=0.0, max_new_tokens=48)) for t in PROMPTS]
    seen: dict[str, list[tuple[int, list[int], int, int]]] = {}  # request -> (start, tokens, rows, anchor) a call
    propose = drafter.propose

    def record(items):
        for it in items:
            rid = next(r.request_id for r in engine.active if r.draft_state is it.state)
            rows = 0 if it.new_features is None else int(it.new_features.shape[0])
            seen.setdefault(rid, []).append((it.new_positions_start, list(it.new_tokens), rows, it.anchor_pos))
        return propose(items)

    drafter.propose = record
    try:
        engine.run()
    finally:
        del drafter.propose
    assert engine.num_gated_drafts > 0
    backlog = 0
    for rid in ids:
        req = engine.pop(rid)
        committed = req.prompt_ids + req.output_ids
        position = 0
        for start, tokens, rows, anchor_pos in seen[rid]:
            assert start == position and rows == len(tokens) and start + rows == anchor_pos
            assert tokens == committed[start:anchor_pos]
            position = anchor_pos
            if start > 0:
                backlog = max(backlog, rows)
    assert backlog > drafter.block_size + 1  # some call carried a gated stretch of several steps


def test_a_gated_backlog_waits_in_the_precision_the_drafter_reads(tmp_path):
    """A drafter trained on bf16 features (`context_feature_dtype`): the engine keeps a gated request's backlog in
    bf16 (half the memory of float32 while it waits), the drafter gets it so, and the output is the target's."""
    import json
    import shutil

    import torch

    from dspark_cli.models import load_stack

    d = tmp_path / "dspark-bf16"
    shutil.copytree(REPO / "models" / "dspark", d)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "context_feature_dtype": "bfloat16"}))
    target, drafter = load_stack(str(REPO / "models" / "target"), str(d), "cpu", "float32")
    engine = Engine(target, drafter, EngineConfig(policy="causal", draft_gate_min=2, draft_gate_max=8), sps=STEEP)
    ar = Engine(target, None, EngineConfig(policy="ar"))
    params = SamplingParams(temperature=0.0, max_new_tokens=48)
    prompts = [target.tokenizer.encode(t, add_special_tokens=False) for t in PROMPTS]
    ids = [engine.add_request(p, params) for p in prompts]
    ar_ids = [ar.add_request(p, params) for p in prompts]
    dtypes = set()
    propose = drafter.propose
    drafter.propose = lambda items: dtypes.update(it.new_features.dtype for it in items) or propose(items)
    try:
        engine.run()
    finally:
        del drafter.propose
    ar.run()
    assert engine.num_gated_drafts > 0 and dtypes == {torch.bfloat16}
    assert [engine.pop(r).output_ids for r in ids] == [ar.pop(r).output_ids for r in ar_ids]


def test_the_policy_plans_the_whole_pass_when_some_requests_are_gated(stack):
    """A step where some requests are gated still verifies their anchors in the same pass: the policy must
    price the drafts on that pass (one row per request, the gated ones empty), not on a batch of the drafted
    requests alone (a smaller batch's steeper curve, which shortened the probes)."""
    from dspark_core import scheduling

    target, drafter = stack
    causal = scheduling.make_policy("causal")
    planned = {}  # step -> (rows, empty rows, request ids)

    def policy(confs, sps, request_ids):
        planned[engine.num_steps] = (len(confs), sum(1 for c in confs if len(c) == 0), list(request_ids))
        return causal(confs, sps, request_ids)

    engine = Engine(target, drafter, EngineConfig(policy="causal", draft_gate_min=2, draft_gate_max=8), sps=STEEP,
                    policy=policy)
    passes = {}  # step -> request ids verified
    verify = engine.verifier.verify

    def recording_verify(items):
        passes[engine.num_steps] = [i.request_id for i in items]
        return verify(items)

    engine.verifier.verify = recording_verify
    for i, text in enumerate(PROMPTS):  # admitted a few steps apart: their gates reach different skip lengths
        engine.add_request(target.tokenizer.encode(text, add_special_tokens=False),
                           SamplingParams(temperature=0.0, max_new_tokens=48, seed=i))
        for _ in range(5):
            engine.step()
    engine.run()
    mixed = [s for s, (_, empty, _) in planned.items() if empty]
    assert mixed, "no step had gated and drafting requests together"
    for s, (rows, empty, ids) in planned.items():
        assert rows == len(passes[s]) and sorted(ids) == sorted(passes[s])  # every request of the pass, once


def test_verification_time_beyond_the_tables_forward_is_a_fixed_cost_of_every_step(stack):
    """A verifier pod's transport (here a 30 ms sleep in every verify call) is paid by every step, drafted or
    not, and the drafts of a round amortise it: the engine measures it against the table's forward time and
    adds it, with the drafting time, to the curve the policy plans on (and to the gate's plain step)."""
    import time as _time

    target, drafter = stack
    table = SpsTable.load(REPO / "models" / "target" / "sps.json")

    def run(delay):
        engine = Engine(target, drafter, EngineConfig(policy="causal", gate_drafts=False), sps=table)
        verify = engine.verifier.verify

        def slow_verify(items):
            _time.sleep(delay)
            return verify(items)

        engine.verifier.verify = slow_verify
        for i, text in enumerate(PROMPTS):
            engine.add_request(target.tokenizer.encode(text, add_special_tokens=False),
                               SamplingParams(temperature=0.0, max_new_tokens=24, seed=i))
        for _ in range(20):
            engine.step()
        return engine

    quick, slow = run(0.0), run(0.03)
    assert 0.015 < slow._step_overhead - quick._step_overhead < 0.05
    r = len(slow.active)
    fixed = 1.0 / slow._sps_for(r)(r) - 1.0 / table.for_requests(r)(r)
    assert fixed == pytest.approx(slow._draft_seconds + slow._step_overhead, rel=0.1)


def test_in_batch_scope_requests_whose_drafts_do_not_pay_probe_together(stack):
    """Batch scope (the default): once no request's drafts pay, the drafter runs only on the batch's probe steps,
    and each probe holds every request in flight, one pass, where request scope probed each request on its own
    ladder (several small passes, each paying the drafter's fixed cost)."""
    target, drafter = stack
    propose = drafter.propose

    def run(scope):
        engine = Engine(target, drafter, EngineConfig(policy="causal", draft_gate_min=2, draft_gate_max=8,
                                                      draft_gate_scope=scope), sps=STEEP)
        calls = []  # (requests in the pass, requests in flight) of the passes once every request has drafted

        def recording(items):
            if all(r.draft_gate_surplus is not None for r in engine.active):
                calls.append((len(items), len(engine.active)))
            return propose(items)

        drafter.propose = recording
        try:
            ids = []
            for i, text in enumerate(PROMPTS):  # admitted apart: their own ladders fall on different steps
                ids.append(engine.add_request(target.tokenizer.encode(text, add_special_tokens=False),
                                              SamplingParams(temperature=0.0, max_new_tokens=48, seed=i)))
                for _ in range(3):
                    engine.step()
            engine.run()
        finally:
            del drafter.propose
        return engine, [engine.pop(r).output_ids for r in ids], calls

    batch, out_batch, calls_batch = run("batch")
    request, out_request, calls_request = run("request")
    assert out_batch == out_request
    assert calls_batch and all(n == active for n, active in calls_batch)  # the batch's probes: all, one pass
    assert batch.num_probe_passes == len(calls_batch) and request.num_probe_passes == 0
    assert any(n < active for n, active in calls_request)  # request scope: passes that held part of the batch
    assert len(calls_batch) < len(calls_request)


def test_the_draft_gate_scope_is_checked():
    with pytest.raises(Exception, match="draft_gate_scope"):
        EngineConfig(draft_gate_scope="step")
