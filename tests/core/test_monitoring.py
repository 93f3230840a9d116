"""CalibrationMonitor, CollapseDetector and OnlineSpsTable on synthetic rounds and timings."""

from __future__ import annotations

import random

import pytest

from dspark_core.calibration import ece
from dspark_core.cost_model import OnlineSpsTable, SpsTable
from dspark_core.errors import InvalidArgument
from dspark_core.monitoring import CalibrationMonitor, CollapseDetector, RoundRecord


def rounds(rng, n, predicted, true_rate, gamma=4):
    """Rounds whose confidences say `predicted` per position while each draft survives with `true_rate`."""
    out = []
    for _ in range(n):
        acc = 0
        while acc < gamma and rng.random() < true_rate:
            acc += 1
        conf = tuple(min(1.0, max(0.0, predicted + rng.uniform(-0.05, 0.05))) for _ in range(gamma))
        out.append(RoundRecord("d", conf, acc))
    return out


def test_calibrated_rounds_stay_ok_and_the_ece_matches_the_offline_one():
    rng = random.Random(0)
    mon = CalibrationMonitor(4, window=1000, min_rounds=100, bound=0.05)
    for rec in rounds(rng, 1000, 0.7, 0.7):
        assert mon.observe(rec) is None
    mon.check()
    assert mon.ok
    # the running ECE is the same statistic as dspark_core.calibration.ece on the window (10 bins)
    survival = [[], []]
    for rec in mon.rounds:
        a = 1.0
        for k in range(1):
            a *= rec.confidences[k]
            survival[0].append(a)
            survival[1].append(float(rec.accepted > k))
    assert mon.ece[0] == pytest.approx(ece(survival[0], survival[1], bins=10))
    assert all(x < 0.05 for x in mon.excess())
    assert sum(mon.expected_tokens) == pytest.approx(sum(sum(_prefix(r.confidences)) for r in mon.rounds))


def _prefix(confs):
    a, out = 1.0, []
    for c in confs:
        a *= c
        out.append(a)
    return out


def test_an_overconfident_head_trips_the_bound_then_recovers_with_hysteresis():
    rng = random.Random(1)
    mon = CalibrationMonitor(4, window=600, min_rounds=100, bound=0.1, check_every=50)
    for rec in rounds(rng, 300, 0.7, 0.7):
        mon.observe(rec)
    assert mon.ok
    changes = [mon.observe(rec) for rec in rounds(rng, 600, 0.95, 0.4)]  # the target changed under the head
    assert False in changes and not mon.ok
    assert mon.worst_position() is not None and max(x for x in mon.excess() if x == x) > 0.1
    changes = [mon.observe(rec) for rec in rounds(rng, 900, 0.4, 0.4)]  # refitted: calibrated again
    assert True in changes and mon.ok
    assert mon.transitions == 2


def test_round_records_round_trip_and_reject_bad_json():
    rec = RoundRecord("dspark", (0.9, 0.5), 1, greedy=True)
    assert RoundRecord.from_json(rec.to_json()) == rec
    with pytest.raises(InvalidArgument, match="accepted"):
        RoundRecord.from_json('{"confidences": [0.5], "accepted": 3}')
    with pytest.raises(InvalidArgument, match="confidences"):
        RoundRecord.from_json('{"confidences": [1.5], "accepted": 0}')


def test_collapse_is_flagged_probed_backed_off_and_cleared():
    det = CollapseDetector(ratio=0.25, window=24, min_rounds=12, probe_every=8, probe_rounds=4, max_probe_every=32)
    good = RoundRecord("d", (0.8,), 1)
    bad = RoundRecord("d", (0.8,), 0)
    for step in range(30):
        assert det.observe("d", [good if step % 5 else bad], step) is None
    assert det.should_draft("d", 30)
    flagged_at = None
    for step in range(30, 80):
        if det.observe("d", [bad], step):
            flagged_at = step
            break
    assert flagged_at is not None and flagged_at - 30 <= 24
    assert det.is_collapsed("d") and det.collapses["d"] == 1
    # no drafting until the probe step
    assert not det.should_draft("d", flagged_at + 1) and det.should_draft("d", flagged_at + 8)
    step = flagged_at + 8
    for _ in range(4):  # four failed probes: the spacing doubles
        assert det.should_draft("d", step)
        det.observe("d", [bad], step)
        step = det._next_probe["d"]
    assert det._interval["d"] == 16
    for _ in range(4):  # four good probes: cleared
        assert det.should_draft("d", step)
        changed = det.observe("d", [good], step)
        step = det._next_probe.get("d", step) if changed is None else step
    assert changed is False and not det.is_collapsed("d") and det.should_draft("d", step + 1)


def test_rounds_without_drafts_and_other_drafters_do_not_count():
    det = CollapseDetector(min_rounds=2, window=4)
    for step in range(10):
        det.observe("a", [RoundRecord("a", (), 0)], step)
        det.observe("b", [RoundRecord("b", (0.9,), 1)], step)
    assert not det.is_collapsed("a") and not det.is_collapsed("b")
    assert det.acceptance_ratio("b") == pytest.approx(1 / 0.9)


# -- OnlineSpsTable ------------------------------------------------------------------------------------

PRIOR = SpsTable(batch_sizes=(1, 2, 4, 8, 16, 32, 64), steps_per_second=(100, 99, 97, 90, 70, 45, 25))


def test_a_lone_spike_never_moves_the_table_and_a_regime_change_does():
    live = OnlineSpsTable(PRIOR, window=9, spike=4.0, persist=3)
    for _ in range(9):
        live.observe(8, PRIOR.step_time(8))
    assert live.table()(8) == pytest.approx(PRIOR(8))
    assert not live.observe(8, 50 * PRIOR.step_time(8))  # out of range of the prior
    assert not live.observe(8, 6 * PRIOR.step_time(8))  # a spike against the knot's median
    assert live.table()(8) == pytest.approx(PRIOR(8))
    for _ in range(3):  # the machine really got 6x slower at this size: after `persist` outliers it goes in
        live.observe(8, 6 * PRIOR.step_time(8))
    assert live.table()(8) == pytest.approx(PRIOR(8) / 6, rel=0.01)


def test_the_live_table_is_monotone_and_unmeasured_sizes_follow_their_neighbours():
    live = OnlineSpsTable(PRIOR, refresh_every=1)
    for _ in range(5):
        live.observe(16, 2 * PRIOR.step_time(16))  # B = 16 doubled
        live.observe(32, 1.0 * PRIOR.step_time(32))  # B = 32 as profiled: now faster than B = 16, impossible
    t = live.table()
    times = [t.step_time(b) for b in t.batch_sizes]
    assert times == sorted(times)
    assert live.correction(64) == pytest.approx(1.0)  # nearest measured knot: 32
    assert live.correction(1) == pytest.approx(2.0)  # nearest measured knot: 16


def test_exploration_names_the_stalest_size_in_reach_and_context_buckets_are_separate():
    live = OnlineSpsTable(PRIOR, stale_after=10, refresh_every=1)
    assert live.stale_batch(1, 8) == 1  # never measured: all stale, the first oldest
    for i in range(30):
        live.observe(4, PRIOR.step_time(4))
        live.observe(8, PRIOR.step_time(8))
        if i < 3:
            live.observe(2, PRIOR.step_time(2))
    assert live.stale_batch(4, 4) is None and live.stale_batch(8, 8) is None
    assert live.stale_batch(2, 2) == 2  # measured, but 54 passes ago
    assert live.stale_batch(2, 8) == 3  # never measured beats measured long ago
    # a long context doubles the step: only that bucket's table moves
    for _ in range(9):
        live.observe(8, 2 * PRIOR.step_time(8), context_length=10000)
    assert live.table(10000)(8) == pytest.approx(PRIOR(8) / 2, rel=0.01)
    assert live.table(100)(8) == pytest.approx(PRIOR(8), rel=0.01)
    assert live.table(10000).context_length == 10000
    assert live.points(100)[0] == [1, pytest.approx(PRIOR(1), rel=0.01)]


def test_bad_settings_and_samples_are_refused():
    with pytest.raises(InvalidArgument, match="prior"):
        OnlineSpsTable([1, 2])
    with pytest.raises(InvalidArgument, match="context_buckets"):
        OnlineSpsTable(PRIOR, context_buckets=(5, 1))
    live = OnlineSpsTable(PRIOR)
    assert not live.observe(0, 0.1) and not live.observe(4, float("nan")) and not live.observe(4, -1.0)
    assert live.rejected == 3 and live.accepted == 0


def test_online_platt_refit_composes_with_the_served_calibration():
    """Rounds served with (t, b) = (0.5, +1.0) while the truth is sigmoid(raw): the refit on the recorded
    confidences returns about (1, 0) on the raw logits, i.e. t * t' and b / t' + b' undo the served pair."""
    import math

    from dspark_core.monitoring import refit_calibration, refit_temperatures

    rng = random.Random(7)
    served_t, served_b = (0.5, 0.5), (1.0, 1.0)
    records = []
    for _ in range(6000):
        raw = [rng.gauss(0.3, 1.5) for _ in range(2)]
        conf = tuple(1 / (1 + math.exp(-(z / t + b))) for z, t, b in zip(raw, served_t, served_b))
        acc = 0
        while acc < 2 and rng.random() < 1 / (1 + math.exp(-raw[acc])):
            acc += 1
        records.append(RoundRecord("d", conf, acc))
    calib, table = refit_calibration(records, served_t, served_b, min_rounds=50)
    t, b = calib.temperatures, calib.bias_list()
    assert 0.85 < t[0] < 1.15 and abs(b[0]) < 0.15, (t, b)
    assert table[0]["ece_survival_sts"] < table[0]["ece_survival_raw"]
    # temperatures alone cannot undo the served bias
    temps, sts_table = refit_temperatures(records, served_t, min_rounds=50)
    assert sts_table[0]["ece_survival_sts"] > table[0]["ece_survival_sts"] + 0.02
    with pytest.raises(InvalidArgument, match="biases"):
        refit_calibration(records, served_t, (0.0,), min_rounds=50)
    # a request history served beside them: its term was inside the recorded logits, so its weights scale by 1 / t'
    from dspark_core.calibration import RequestHistory

    hist = RequestHistory((1.0, -0.5), strength=4.0, prior=0.4)
    with_hist, _ = refit_calibration(records, served_t, served_b, min_rounds=50, history=hist)
    fit_t = [a / s for a, s in zip(with_hist.temperatures, served_t)]
    assert with_hist.history.weights == pytest.approx([w / f for w, f in zip(hist.weights, fit_t)])
    assert (with_hist.history.strength, with_hist.history.prior) == (4.0, 0.4)
    assert calib.history is None


def test_a_pass_is_filed_against_the_prior_of_its_own_shape():
    """One request verifying 8 tokens costs what the prior's one-request row says, far less than 8 requests'
    one-token pass: observed at exactly the row's cost, the live table must stay the prior. Filed against
    the plain curve it read as the machine having become ~2.4x faster at every size."""
    row = SpsTable(batch_sizes=(1, 2, 4, 8), steps_per_second=(100, 98, 95, 85))
    prior = SpsTable(batch_sizes=PRIOR.batch_sizes, steps_per_second=(100, 80, 60, 35, 20, 11, 6),
                     by_requests=((1, row),))
    live = OnlineSpsTable(prior, refresh_every=1)
    for _ in range(9):
        assert live.observe(8, row.step_time(8), requests=1)
    assert live.correction(8) == pytest.approx(1.0)
    assert live.table().for_requests(1)(8) == pytest.approx(85, rel=0.01)
    assert live.table()(8) == pytest.approx(35, rel=0.01)
    # a slower machine shows as such in both shapes
    for _ in range(9):
        live.observe(8, 1.5 * prior.step_time(8), requests=8)
    assert live.table()(8) == pytest.approx(35 / 1.5, rel=0.01)


def _true_rounds(rng, n, predicted, true_rates, greedy):
    """Rounds verifying len(predicted) drafts; draft k survives (given the earlier ones did) with true_rates[k]."""
    out = []
    for _ in range(n):
        acc = 0
        while acc < len(true_rates) and rng.random() < true_rates[acc]:
            acc += 1
        out.append(RoundRecord("d", tuple(predicted), acc, greedy))
    return out


def test_slot_correction_learns_each_positions_level_per_kind():
    from dspark_core.monitoring import SlotCorrection

    rng = random.Random(1)
    corr = SlotCorrection(4, rate=0.02)
    raw = [0.5, 0.2, 0.6, 0.6]
    truth_greedy, truth_sampled = [0.5, 0.35, 0.6, 0.6], [0.3, 0.2, 0.6, 0.6]
    tail = {True: [], False: []}
    for i in range(6000):
        for greedy, truth in ((True, truth_greedy), (False, truth_sampled)):
            # what the policy read: the raw confidences with the offsets learned so far
            seen = corr.apply(raw, greedy)
            (rec,) = _true_rounds(rng, 1, seen, truth, greedy)
            corr.observe(rec)
            if i >= 3000:
                tail[greedy].append(seen)
    # over the last half (SGD at a fixed rate keeps jittering around the level it learned)
    g, s = ([sum(x[k] for x in tail[kind]) / len(tail[kind]) for k in range(4)] for kind in (True, False))
    # the conditional level of every position converges to the truth (each kind on its own)
    assert abs(g[0] - 0.5) < 0.03 and abs(g[1] - 0.35) < 0.04, g
    assert abs(s[0] - 0.3) < 0.03 and abs(s[1] - 0.2) < 0.04, s
    # slot 2 is seen only after slot 1 was accepted: ~half the greedy rounds, ~a third of the sampled ones
    assert 0.4 < corr.observed[True][1] / corr.observed[True][0] < 0.6
    assert 0.2 < corr.observed[False][1] / corr.observed[False][0] < 0.4
    assert corr.offsets[True][1] > 0.4 and corr.offsets[False][0] < -0.5
    # undo gives back what apply was given
    assert corr.apply(corr.apply(raw, False), False, undo=True) == pytest.approx(raw, abs=1e-9)
    snap = corr.snapshot()
    assert snap["greedy"]["offsets"][1] == round(corr.offsets[True][1], 4)
    assert snap["sampled"]["observed"][0] == 6000


def test_slot_correction_is_clamped_and_skips_bad_rounds():
    from dspark_core.monitoring import SlotCorrection

    corr = SlotCorrection(2, rate=0.5, limit=1.0)
    for _ in range(50):  # a drafter whose first draft is never accepted at confidence 0.9
        corr.observe(RoundRecord("d", tuple(corr.apply([0.9, 0.9], False)), 0, False))
    assert corr.offsets[False][0] == -1.0 and corr.offsets[False][1] == 0.0  # clamped; slot 2 never seen
    assert corr.offsets[True] == [0.0, 0.0]
    corr.observe(RoundRecord("d", (float("nan"), 0.5), 1, True))
    assert corr.offsets[True] == [0.0, 0.0] and corr.observed[True] == [0, 0]
    for bad in ({"gamma": 0}, {"gamma": 2, "rate": 0.0}, {"gamma": 2, "rate": 2.0}, {"gamma": 2, "limit": -1.0}):
        with pytest.raises(InvalidArgument):
            SlotCorrection(bad.pop("gamma"), **bad)
