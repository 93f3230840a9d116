"""Request-history recalibration in the engine: each request's confidences are corrected by its own verified
rounds (and only those), outputs stay the target's own, and it can be switched off."""

from __future__ import annotations

import math

import pytest

from dspark_core.calibration import RequestHistory
from dspark_core.drafters import load_drafter
from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams
from dspark_core.target import TargetConfig, TargetRuntime
from tests.conftest import build_tiny_dspark

PROMPTS = [[5, 9, 12, 30, 41], [7, 7, 8], [100, 3, 19, 22, 23, 24, 60, 61, 90], [2, 4]]
HISTORY = RequestHistory((2.0, -1.0, 0.5), strength=2.0, prior=0.4)


@pytest.fixture(scope="module")
def drafter(tiny_target_dir, tmp_path_factory):
    d = load_drafter(build_tiny_dspark(tiny_target_dir, tmp_path_factory.mktemp("hist") / "dspark", seed=3))
    d.set_calibration(None, None, HISTORY)
    return d


@pytest.fixture(scope="module")
def target(tiny_target_dir, drafter):
    return TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32",
                                      tap_layer_ids=tuple(drafter.target_layer_ids)))


def _run(target, drafter, history: bool, temperature: float = 0.0):
    """Run every prompt to the end; return the outputs, what the policy read and what the drafter proposed
    per (request, round), and the finished requests."""
    read, proposed = {}, {}

    def policy(confs, sps, request_ids):
        for rid, c in zip(request_ids, confs):
            read.setdefault(rid, []).append(list(c))
        return [len(c) for c in confs]  # the whole block: the fixed length

    def observer(rec):
        for rid, p in zip(rec.request_ids, rec.proposals):
            proposed.setdefault(rid, []).append(p.confidences.tolist())

    engine = Engine(target, drafter, EngineConfig(policy="fixed", request_history=history), policy=policy,
                    observer=observer)
    rids = [engine.add_request(p, SamplingParams(temperature=temperature, seed=i, max_new_tokens=24))
            for i, p in enumerate(PROMPTS)]
    engine.run()
    reqs = {r: engine.pop(r) for r in rids}
    return reqs, read, proposed


def _flat(rounds):
    return [x for r in rounds for x in r]


def _shift(c, d):
    return 1 / (1 + math.exp(-(math.log(c / (1 - c)) + d)))


def test_confidences_follow_each_requests_own_verified_rounds(target, drafter):
    reqs, read, proposed = _run(target, drafter, history=True)
    checked = 0
    for rid, req in reqs.items():
        assert len(read[rid]) == len(proposed[rid]) == req.num_rounds
        n = a = 0
        s = 0.0
        for r, (got, base) in enumerate(zip(read[rid], proposed[rid])):
            if r == 0:
                assert got == pytest.approx(base, abs=1e-6)  # no history yet
            else:
                g = HISTORY.offset(n, a, s)
                want = [_shift(c, w * g) for c, w in zip(base, HISTORY.weights)]
                assert got == pytest.approx(want, rel=1e-5, abs=1e-7)
                checked += g != 0.0
            if req.proposed_per_round[r] >= 1:
                n, a, s = n + 1, a + int(req.accepted_per_round[r] >= 1), s + base[0]
    assert checked >= 10  # the correction was exercised, not just the first rounds


def test_outputs_are_the_targets_own_and_off_means_the_drafters_confidences(target, drafter):
    on, _, _ = _run(target, drafter, history=True)
    off, read, proposed = _run(target, drafter, history=False)
    ar = Engine(target, None, EngineConfig(policy="ar"))
    for (rid_on, a), (rid_off, b), p in zip(on.items(), off.items(), PROMPTS):
        want = ar.generate(p, SamplingParams(temperature=0, max_new_tokens=24)).output_ids
        assert a.output_ids == b.output_ids == want
        assert _flat(read[rid_off]) == pytest.approx(_flat(proposed[rid_off]), abs=1e-6)


def test_a_drafter_without_a_history_is_left_alone(target, tiny_target_dir, tmp_path):
    plain = load_drafter(build_tiny_dspark(tiny_target_dir, tmp_path / "plain", seed=3))
    assert plain.confidence_history(False) is None and plain.confidence_history(True) is None
    _, read, proposed = _run(target, plain, history=True, temperature=1.0)
    for rid in read:
        assert _flat(read[rid]) == pytest.approx(_flat(proposed[rid]), abs=1e-6)
