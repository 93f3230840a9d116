"""Tests of dspark_core.scheduling: paper Algorithm 1, the async variant, the baselines."""

from __future__ import annotations

import random

import numpy as np
import pytest

from dspark_core.cost_model import SpsTable
from dspark_core.errors import InvalidArgument
from dspark_core.scheduling import (
    POLICY_NAMES,
    AsyncScheduler,
    ar_schedule,
    async_capacity,
    async_topk_schedule,
    benchmark_schedule_overhead,
    causal_prefix_schedule,
    fixed_schedule,
    gamma1_schedule,
    make_policy,
    retrospective_global_schedule,
    threshold_schedule,
)

# Paper Appendix A: SPS(1) = 1.0, SPS(2) = 0.5, SPS(3) = 0.45 (index 0 of a sequence is ignored).
APPENDIX_A_SPS = [0.0, 1.0, 0.5, 0.45]


# -- reference implementations, written literally from algorithms.md section 9 ---------------------------


def reference_algorithm_1(confidences, sps, early_stop=True):
    """Algorithm 1 as written: record a copy of the lengths at every improvement."""
    sps = sps if callable(sps) else sps.__getitem__
    num = len(confidences)
    cands = []
    for r, row in enumerate(confidences):
        a = 1.0
        for j, c in enumerate(row, 1):
            a *= c
            if a > 0:
                cands.append((-a, r, j))
    cands.sort()
    lengths = [0] * num
    b, tau = num, float(num)
    best = num * sps(num)
    recorded = list(lengths)
    for neg_a, r, j in cands:
        lengths[r] = j
        b += 1
        tau += -neg_a
        theta = tau * sps(b)
        if theta > best:
            best, recorded = theta, list(lengths)
        elif early_stop:
            break
    return recorded


def random_confidences(rng, num_requests, gamma, zero_rate=0.1, ragged=True):
    rows = []
    for _ in range(num_requests):
        n = rng.randint(0, gamma) if ragged else gamma
        rows.append([0.0 if rng.random() < zero_rate else rng.choice([1.0, rng.random()]) for _ in range(n)])
    return rows


def random_sps(rng, top):
    """A decreasing, sometimes jagged, SPS sequence indexed by B (index 0 unused)."""
    values, s = [0.0], 1.0
    for _ in range(top):
        values.append(s)
        s *= rng.choice([1.0, 0.99, 0.95, 0.8, 1.02])
    return values


# -- paper Appendix A ----------------------------------------------------------------------------------


@pytest.mark.parametrize("c2", [0.9, 0.0])
def test_appendix_a_causal_decision_does_not_depend_on_later_confidence(c2):
    assert causal_prefix_schedule([[0.8, c2]], APPENDIX_A_SPS) == [0]
    assert causal_prefix_schedule([[0.8, c2]], lambda b: APPENDIX_A_SPS[b]) == [0]


@pytest.mark.parametrize("c2, expected", [(0.9, [2]), (0.0, [0])])
def test_appendix_a_retrospective_search_looks_ahead(c2, expected):
    assert retrospective_global_schedule([[0.8, c2]], APPENDIX_A_SPS) == expected


def first_token_distribution(policy):
    """Exact distribution of the first emitted token in the Appendix A setting: vocabulary {0, 1}, target
    p = (0.7, 0.3), draft q = (0.5, 0.5); the drafter reports c_1 = 0.8 and, after sampling x_1, c_2 = 0.9
    when x_1 = 0 and 0.0 when x_1 = 1. Verified drafts follow lossless speculative sampling (accept with
    min(1, p/q), else sample normalise(max(0, p - q))); with l = 0 the target samples on its own."""
    p, q = (0.7, 0.3), (0.5, 0.5)
    residual = [max(0.0, pi - qi) for pi, qi in zip(p, q)]
    residual = [x / sum(residual) for x in residual]
    out = [0.0, 0.0]
    for x1 in (0, 1):
        length = policy([[0.8, 0.9 if x1 == 0 else 0.0]], APPENDIX_A_SPS)[0]
        if length == 0:
            for tok in (0, 1):
                out[tok] += q[x1] * p[tok]
        else:
            accept = min(1.0, p[x1] / q[x1])
            out[x1] += q[x1] * accept
            for tok in (0, 1):
                out[tok] += q[x1] * (1.0 - accept) * residual[tok]
    return out


def test_appendix_a_causal_schedule_keeps_target_distribution():
    assert first_token_distribution(causal_prefix_schedule) == pytest.approx([0.7, 0.3])


def test_appendix_a_retrospective_search_biases_output_distribution():
    assert first_token_distribution(retrospective_global_schedule) == pytest.approx([0.85, 0.15])


# -- Algorithm 1 behaviour -----------------------------------------------------------------------------


def test_light_load_verifies_full_blocks():
    confidences = [[0.9, 0.8, 0.5, 0.3], [0.6, 0.4], [0.99] * 7]
    flat = SpsTable(batch_sizes=(1, 4096), steps_per_second=(50.0, 50.0))
    assert causal_prefix_schedule(confidences, flat) == [4, 2, 7]


def test_heavy_load_trims_low_confidence_tails_first():
    # survival a: r0 = 0.95, 0.855, 0.257; r1 = 0.6, 0.12; r2 = 0.9, 0.81, 0.729, 0.066
    confidences = [[0.95, 0.9, 0.3], [0.6, 0.2], [0.9, 0.9, 0.9, 0.09]]
    # each extra token adds 20% of the anchors-only step time: theta_k = (3 + sum of top-k a) / (1 + 0.2 k)
    # = 3, 3.29, 3.46, 3.57, 3.62, 3.62 (k = 5, a = 0.729), then 3.57 with a = 0.6: stop
    steep = lambda b: 1.0 / (1.0 + 0.2 * (b - 3))  # noqa: E731
    lengths = causal_prefix_schedule(confidences, steep)
    assert lengths == [2, 0, 3] == reference_algorithm_1(confidences, steep)
    # tails go first: every trimmed candidate has a lower a than every admitted one
    survival = [list(np.cumprod(row)) for row in confidences]
    admitted = [a for row, n in zip(survival, lengths) for a in row[:n]]
    trimmed = [a for row, n in zip(survival, lengths) for a in row[n:]]
    assert min(admitted) > max(trimmed)
    # the same pool under a flat curve is verified in full
    assert causal_prefix_schedule(confidences, lambda b: 1.0) == [3, 2, 4]
    # steeper still: shorter, and always a subset of the lighter-load choice
    steeper = causal_prefix_schedule(confidences, lambda b: 1.0 / (1.0 + 0.3 * (b - 3)))
    assert steeper == [1, 0, 0]
    assert all(s <= n for s, n in zip(steeper, lengths))


def test_scheduler_stops_at_first_throughput_drop():
    # one request, certain drafts; SPS dips at B = 3 then recovers (a jagged curve): theta =
    # 1, 2 * 0.9 = 1.8, 3 * 0.5 = 1.5 (drop: stop), 4 * 0.9 = 3.6 (would be better, never reached)
    jagged = [0.0, 1.0, 0.9, 0.5, 0.9]
    assert causal_prefix_schedule([[1.0, 1.0, 1.0]], jagged) == [1]
    assert retrospective_global_schedule([[1.0, 1.0, 1.0]], jagged) == [3]


def test_scheduler_requires_strict_improvement():
    # theta equal to the best so far is not an improvement: stop
    equal = lambda b: 1.0 / b  # noqa: E731  tau = B when every a = 1, so theta = 1 throughout
    assert causal_prefix_schedule([[1.0, 1.0], [1.0]], equal) == [0, 0]


def test_ties_in_survival_are_broken_by_request_then_position():
    # all a = 1: the first two candidates are (r0, j1), (r0, j2); theta = 2, 2.7, 3.2, then 2.5 (stop)
    sps = [0.0, 1.0, 1.0, 0.9, 0.8, 0.5]
    assert causal_prefix_schedule([[1.0, 1.0], [1.0]], sps) == [2, 0]
    assert async_topk_schedule([[1.0, 1.0], [1.0]], 1) == [1, 0]
    assert async_topk_schedule([[1.0, 1.0], [1.0]], 2) == [2, 0]
    assert async_topk_schedule([[1.0, 1.0], [1.0]], 3) == [2, 1]


def test_causal_matches_literal_algorithm_1_on_random_inputs():
    rng = random.Random(1234)
    for _ in range(300):
        confidences = random_confidences(rng, rng.randint(1, 12), rng.randint(0, 8))
        sps = random_sps(rng, len(confidences) * 9 + 2)
        assert causal_prefix_schedule(confidences, sps) == reference_algorithm_1(confidences, sps)
        retro = reference_algorithm_1(confidences, sps, early_stop=False)
        assert retrospective_global_schedule(confidences, sps) == retro


def test_every_policy_returns_lengths_within_bounds_and_never_admits_zero_survival():
    rng = random.Random(99)
    for _ in range(200):
        confidences = random_confidences(rng, rng.randint(1, 10), 8, zero_rate=0.3)
        sps = random_sps(rng, 100)
        first_zero = [next((j for j, c in enumerate(row) if c == 0.0), len(row)) for row in confidences]
        positive_policies = [
            causal_prefix_schedule(confidences, sps),
            retrospective_global_schedule(confidences, sps),
            async_topk_schedule(confidences, rng.randint(0, 100)),
            threshold_schedule(confidences, rng.choice([0.01, 0.3, 0.9, 1.0])),
        ]
        for lengths in positive_policies:
            assert len(lengths) == len(confidences)
            assert all(0 <= n <= z for n, z in zip(lengths, first_zero))
        for lengths in (fixed_schedule(confidences), gamma1_schedule(confidences), ar_schedule(confidences)):
            assert all(0 <= n <= len(row) for n, row in zip(lengths, confidences))


def test_sequence_callable_and_table_sps_give_the_same_lengths():
    rng = random.Random(7)
    for _ in range(100):
        confidences = random_confidences(rng, rng.randint(1, 16), 7)
        top = len(confidences) * 8 + 1
        values = random_sps(rng, top)
        table = SpsTable(batch_sizes=tuple(range(1, top + 1)), steps_per_second=tuple(values[1:]))
        expected = causal_prefix_schedule(confidences, values)
        assert causal_prefix_schedule(confidences, lambda b: values[b]) == expected
        assert causal_prefix_schedule(confidences, table) == expected
        assert causal_prefix_schedule(confidences, np.array(values)) == expected
        assert async_capacity(confidences, values) == async_capacity(confidences, table)


def test_every_request_counts_its_anchor_even_without_drafts():
    seen = []

    def sps(b):
        seen.append(b)
        return 1.0

    assert causal_prefix_schedule([[], [0.9, 0.5], []], sps) == [0, 2, 0]
    assert seen == [3, 4, 5]


def test_empty_batch_schedules_nothing():
    assert causal_prefix_schedule([], APPENDIX_A_SPS) == []
    assert async_capacity([], APPENDIX_A_SPS) == 0
    assert retrospective_global_schedule([], APPENDIX_A_SPS) == []
    assert all(make_policy(name, **({"threshold": 0.5} if name == "threshold" else {}))([], APPENDIX_A_SPS) == []
               for name in POLICY_NAMES)


def test_numpy_and_tuple_inputs_are_accepted():
    confidences = np.array([[0.9, 0.8], [0.7, 0.1]])
    expected = causal_prefix_schedule([[0.9, 0.8], [0.7, 0.1]], lambda b: 1.0 / (1 + 0.2 * b))
    assert causal_prefix_schedule(confidences, lambda b: 1.0 / (1 + 0.2 * b)) == expected
    assert causal_prefix_schedule(((0.9, 0.8), (0.7, 0.1)), lambda b: 1.0 / (1 + 0.2 * b)) == expected
    assert causal_prefix_schedule([np.array([0.9, 0.8]), [np.float32(0.7), 0.1]],
                                  lambda b: 1.0 / (1 + 0.2 * b)) == expected


# -- input validation ----------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", [1.5, -0.1, float("nan"), "0.5", True, None])
def test_invalid_confidence_raises_naming_field_and_value(bad):
    confidences = [[0.9], [0.8, 0.0, bad]]  # after a zero: still validated
    for call in (
        lambda: causal_prefix_schedule(confidences, APPENDIX_A_SPS * 3),
        lambda: async_capacity(confidences, APPENDIX_A_SPS * 3),
        lambda: async_topk_schedule(confidences, 2),
        lambda: threshold_schedule(confidences, 0.5),
        lambda: retrospective_global_schedule(confidences, APPENDIX_A_SPS * 3),
    ):
        with pytest.raises(InvalidArgument) as info:
            call()
        assert info.value.field == "confidences[1][2]"
        assert str(info.value) == f"confidences[1][2] must be a number in [0, 1]; got {bad!r}"


@pytest.mark.parametrize("bad, field", [("abc", "confidences"), (0.5, "confidences"), ([[0.5], 0.5], "confidences[1]"),
                                        ([[0.5], "ab"], "confidences[1]")])
def test_malformed_confidences_raise_naming_field(bad, field):
    with pytest.raises(InvalidArgument) as info:
        causal_prefix_schedule(bad, APPENDIX_A_SPS)
    assert info.value.field == field


def test_sps_sequence_too_short_for_the_batch_raises_naming_sps():
    with pytest.raises(InvalidArgument) as info:
        causal_prefix_schedule([[0.9]] * 4, APPENDIX_A_SPS)  # needs SPS(4)
    assert info.value.field == "sps" and "B=4" in str(info.value)


def test_sps_sequence_only_needs_to_cover_the_batch_sizes_the_walk_reaches():
    # early stop at the first candidate: SPS(3) is never read, so a two-entry table suffices
    assert causal_prefix_schedule([[0.8, 0.9]], [0.0, 1.0, 0.5]) == [0]


def test_callable_sps_returning_nonpositive_raises_naming_sps():
    with pytest.raises(InvalidArgument) as info:
        causal_prefix_schedule([[0.9]], lambda b: 0.0)
    assert info.value.field == "sps"


# -- async ---------------------------------------------------------------------------------------------


def test_async_capacity_is_the_global_best_over_the_lagged_pool():
    jagged = [0.0, 1.0, 0.9, 0.5, 0.9]  # early stop would halt at K = 1
    assert async_capacity([[1.0, 1.0, 1.0]], jagged) == 3
    assert async_capacity([[0.8, 0.9]], APPENDIX_A_SPS) == 2
    assert async_capacity([[0.8, 0.0]], APPENDIX_A_SPS) == 0


def test_async_capacity_matches_brute_force_over_every_prefix():
    rng = random.Random(5)
    for _ in range(200):
        confidences = random_confidences(rng, rng.randint(1, 8), 6)
        sps = random_sps(rng, 60)
        pool = sorted(-a for row in confidences for a in np.cumprod(row) if a > 0)
        num = len(confidences)
        thetas = [(num - sum(pool[:k])) * sps[num + k] for k in range(len(pool) + 1)]
        best = max(thetas)
        assert async_capacity(confidences, sps) == thetas.index(best)  # first k reaching the best


def test_async_topk_admits_highest_survival_candidates_as_prefixes():
    # survival: r0 = 0.9, 0.45; r1 = 0.8, 0.72, 0.648; r2 = 0.3
    confidences = [[0.9, 0.5], [0.8, 0.9, 0.9], [0.3]]
    assert async_topk_schedule(confidences, 0) == [0, 0, 0]
    assert async_topk_schedule(confidences, 1) == [1, 0, 0]
    assert async_topk_schedule(confidences, 3) == [1, 2, 0]
    assert async_topk_schedule(confidences, 5) == [2, 3, 0]
    assert async_topk_schedule(confidences, 100) == [2, 3, 1]
    assert async_topk_schedule([[0.9, 0.0, 1.0]], 3) == [1]


@pytest.mark.parametrize("bad", [-1, 1.5, True, None])
def test_async_topk_rejects_invalid_capacity(bad):
    with pytest.raises(InvalidArgument, match="^capacity "):
        async_topk_schedule([[0.5]], bad)


def test_async_scheduler_falls_back_to_causal_for_the_first_two_steps():
    sched = AsyncScheduler()
    steep = lambda b: 1.0 / b**2  # noqa: E731  causal admits nothing
    steps = [[[0.9, 0.9]], [[0.8, 0.7]]]
    for confidences in steps:
        assert sched.next_capacity(steep) is None
        assert sched.schedule(confidences, steep) == causal_prefix_schedule(confidences, steep)


def test_async_scheduler_uses_the_pool_from_two_steps_earlier():
    rng = random.Random(11)
    sps = random_sps(rng, 200)
    pools = [random_confidences(rng, rng.randint(1, 6), 7, ragged=False) for _ in range(8)]
    sched = AsyncScheduler()
    for t, confidences in enumerate(pools):
        lengths = sched.schedule(confidences, sps)
        if t >= 2:
            assert lengths == async_topk_schedule(confidences, async_capacity(pools[t - 2], sps))


def test_async_capacity_at_step_t_ignores_steps_t_minus_1_and_t():
    # two histories that agree at t-2 and differ at t-1 and t admit the same number of tokens at t
    sps = [0.0] + [1.0 / (1 + 0.05 * b) for b in range(1, 100)]
    step0 = [[0.9, 0.8, 0.7], [0.95, 0.9, 0.2]]
    results = []
    for step1, step2 in (([[0.1, 0.1, 0.1]] * 2, [[0.99] * 3] * 2), ([[0.99] * 3] * 2, [[0.98] * 3] * 2)):
        sched = AsyncScheduler()
        sched.schedule(step0, sps)
        sched.schedule(step1, sps)
        results.append(sum(sched.schedule(step2, sps)))
    assert results[0] == results[1] == async_capacity(step0, sps)


def test_async_scheduler_announces_next_capacity_and_resets():
    sps = [0.0, 1.0, 0.9, 0.5, 0.9, 0.8, 0.7]
    sched = make_policy("async")
    sched([[1.0, 1.0, 1.0]], sps)
    sched([[0.1, 0.1, 0.1]], sps)
    k = sched.next_capacity(sps)
    assert k == async_capacity([[1.0, 1.0, 1.0]], sps) == 3
    assert sum(sched([[0.9, 0.9, 0.9]], sps)) == k
    sched.reset()
    assert sched.next_capacity(sps) is None
    assert sched([[1.0, 1.0, 1.0]], sps) == causal_prefix_schedule([[1.0, 1.0, 1.0]], sps) == [1]


# -- baselines -----------------------------------------------------------------------------------------


def test_threshold_stops_before_first_position_below_threshold():
    confidences = [[0.9, 0.6, 0.95], [0.4, 0.9], [0.7, 0.7], []]
    assert threshold_schedule(confidences, 0.5) == [3, 0, 2, 0]
    assert threshold_schedule(confidences, 0.65) == [1, 0, 2, 0]
    assert threshold_schedule(confidences, 0.7) == [1, 0, 2, 0]  # c = threshold passes
    assert threshold_schedule(confidences, 0.0) == fixed_schedule(confidences)


@pytest.mark.parametrize("bad", [-0.1, 1.1, float("nan"), "0.5", None])
def test_threshold_rejects_out_of_range_threshold(bad):
    with pytest.raises(InvalidArgument, match="^threshold "):
        threshold_schedule([[0.5]], bad)


def test_fixed_gamma1_and_ar_schedules():
    confidences = [[0.1, 0.2, 0.3], [], [0.5]]
    assert fixed_schedule(confidences) == [3, 0, 1]
    assert fixed_schedule(confidences, length=2) == [2, 0, 1]
    assert gamma1_schedule(confidences) == [1, 0, 1]
    assert ar_schedule(confidences) == [0, 0, 0]
    # length-only policies accept placeholder confidences from a drafter without a confidence head
    assert fixed_schedule([[float("nan")] * 4]) == [4]
    with pytest.raises(InvalidArgument, match="^length "):
        fixed_schedule(confidences, length=-1)


def test_make_policy_builds_every_named_policy_with_one_signature():
    confidences = [[0.9, 0.8, 0.2], [0.6]]
    sps = [0.0] + [1.0] * 20
    expected = {
        "causal": causal_prefix_schedule(confidences, sps),
        "async": causal_prefix_schedule(confidences, sps),  # first step: causal fallback
        "threshold": [2, 1],
        "fixed": [3, 1],
        "gamma1": [1, 1],
        "ar": [0, 0],
    }
    assert set(POLICY_NAMES) == set(expected)
    for name in POLICY_NAMES:
        policy = make_policy(name, **({"threshold": 0.5} if name == "threshold" else {}))
        assert policy(confidences, sps) == expected[name], name
    assert make_policy("fixed", length=1)(confidences, sps) == [1, 1]


def test_make_policy_rejects_unknown_names_options_and_the_biased_search():
    with pytest.raises(InvalidArgument, match="^policy "):
        make_policy("retrospective")
    with pytest.raises(InvalidArgument, match="^threshold "):
        make_policy("threshold")
    with pytest.raises(InvalidArgument, match="^threshold "):
        make_policy("threshold", threshold=2.0)
    with pytest.raises(InvalidArgument, match="^gamma "):
        make_policy("causal", gamma=3)
    assert make_policy("async") is not make_policy("async")  # stateful: one per stream


# -- overhead ------------------------------------------------------------------------------------------


def test_benchmark_schedule_overhead_reports_median_seconds():
    # reported, never asserted against a budget: the machine is shared and noisy
    seconds = benchmark_schedule_overhead(num_requests=64, gamma=7, repeats=50)
    print(f"\ncausal_prefix_schedule, 64 requests x gamma 7, no early stop: {seconds * 1e6:.0f} us median")
    assert seconds > 0


def test_one_registry_serves_the_engine_the_bench_and_aliases():
    from dspark_core import benchmark
    from dspark_core.engine import EngineConfig
    from dspark_core.scheduling import POLICIES, POLICY_ALIASES, policy_spec

    assert set(benchmark.POLICIES) == set(POLICY_NAMES) == set(POLICIES)
    assert set(benchmark.SPS_POLICIES) == {"causal", "async"}
    assert set(benchmark.CONFIDENCE_POLICIES) == {"causal", "async", "threshold"}
    for alias, name in POLICY_ALIASES.items():
        assert EngineConfig(policy=alias).policy == name == policy_spec(alias).name
        assert type(make_policy(alias)) is type(make_policy(name))
    with pytest.raises(InvalidArgument, match="^policy "):
        EngineConfig(policy="fastest")


# -- the engine's causal refinements: slack (the budget does not bind) and lookahead --------------------


def test_refined_causal_keeps_the_appendix_a_distribution():
    for kw in ({"lookahead": True}, {"slack": 0.05}, {"slack": 0.6, "lookahead": True}):
        policy = make_policy("causal", **kw)
        assert first_token_distribution(policy) == pytest.approx([0.7, 0.3]), kw


def test_when_the_budget_does_not_bind_causal_verifies_what_fixed_verifies():
    # a nearly flat table (GPU, memory-bound): 8 slots cost 3% more than none; low confidences that the
    # literal walk trims, the slack admits every candidate with a > 0, exactly the fixed lengths
    flat = lambda b: 1.0 - 0.01 * (b > 1) - 0.02 * (b > 4)  # noqa: E731 - jagged and nearly flat
    rows = [[0.3, 0.2, 0.9, 0.5, 0.5, 0.5, 0.5]]
    assert causal_prefix_schedule(rows, flat) == [3]  # stops at the 2% dip at B = 5
    assert causal_prefix_schedule(rows, flat, slack=0.05) == fixed_schedule(rows) == [7]
    # a zero confidence still ends the row: nothing past it is admitted
    assert causal_prefix_schedule([[0.5, 0.0, 0.9]], flat, slack=0.05) == [1]
    # the test reads only the row lengths: the binding check is the same whatever the confidences
    steep = lambda b: 1.0 / b  # noqa: E731
    assert causal_prefix_schedule(rows, steep, slack=0.05) == causal_prefix_schedule(rows, steep)
    with pytest.raises(InvalidArgument, match="slack"):
        causal_prefix_schedule(rows, flat, slack=1.0)


def test_lookahead_walks_past_a_dip_of_a_jagged_table():
    jagged = [0.0, 1.0, 0.9, 0.5, 0.9]  # theta 1, 1.8, 1.5 (dip), 3.6
    assert causal_prefix_schedule([[1.0, 1.0, 1.0]], jagged) == [1]
    assert causal_prefix_schedule([[1.0, 1.0, 1.0]], jagged, lookahead=True) == [3]
    # with nothing left to project (the row ends at the dip) the walk stops as before
    assert causal_prefix_schedule([[1.0, 1.0]], jagged, lookahead=True) == [1]


def test_refined_causal_never_admits_zero_survival_and_never_less_than_the_literal_walk():
    rng = random.Random(7)
    for _ in range(300):
        confidences = random_confidences(rng, rng.randint(1, 8), 7, zero_rate=0.2)
        sps = random_sps(rng, 80)
        literal = causal_prefix_schedule(confidences, sps)
        refined = causal_prefix_schedule(confidences, sps, slack=0.05, lookahead=True)
        first_zero = [next((j for j, c in enumerate(row) if c == 0.0), len(row)) for row in confidences]
        assert all(0 <= n <= z for n, z in zip(refined, first_zero))
        assert sum(refined) >= sum(literal)
