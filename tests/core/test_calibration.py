"""Calibration: ECE / AUC on hand examples, STS and Platt scaling on synthetic miscalibrated rollouts,
calibration.json round trip."""

from __future__ import annotations

import json
import math
import shutil

import numpy as np
import pytest

from dspark_core import calibration as cal
from dspark_core.errors import InvalidArgument


def test_ece_hand_example():
    # bin of 0.2: mean p 0.2 vs frequency 0.5 -> 0.3 * 2/4; bin of 0.8: 0.8 vs 1.0 -> 0.2 * 2/4
    assert cal.ece([0.2, 0.2, 0.8, 0.8], [0, 1, 1, 1]) == pytest.approx(0.25)
    assert cal.ece([0.5, 0.5, 0.5, 0.5], [0, 1, 0, 1]) == pytest.approx(0.0)
    assert cal.ece([1.0, 1.0], [1, 1]) == pytest.approx(0.0)  # 1.0 falls in the last bin
    assert cal.ece([0.0, 1.0], [1, 0]) == pytest.approx(1.0)
    assert math.isnan(cal.ece([], []))


def _brute_expected_auc(scores, alpha):
    num = den = 0.0
    for i, (si, ai) in enumerate(zip(scores, alpha)):
        for j, (sj, aj) in enumerate(zip(scores, alpha)):
            if i != j:
                w = ai * (1 - aj)
                den += w
                num += w * (1.0 if si > sj else 0.5 if si == sj else 0.0)
    return num / den


def test_expected_auc_matches_brute_force_and_the_sampled_auc():
    rng = np.random.default_rng(0)
    alpha = rng.uniform(0, 1, 60)
    scores = np.round(alpha + rng.normal(0, 0.2, 60), 1)  # rounded: plenty of ties
    assert cal.expected_auc(scores, alpha) == pytest.approx(_brute_expected_auc(scores, alpha), abs=1e-12)
    assert cal.expected_auc(alpha, alpha) == pytest.approx(_brute_expected_auc(alpha, alpha), abs=1e-12)
    # the mean AUC over many coin draws approaches the expectation
    big = rng.uniform(0, 1, 4000)
    draws = [cal.roc_auc(big, rng.uniform(size=big.size) < big) for _ in range(40)]
    assert np.mean(draws) == pytest.approx(cal.expected_auc(big, big), abs=0.005)
    # certain outcomes are perfectly separable; constant scores are chance; no spread in alpha caps it at 1/2
    assert cal.expected_auc([0.1, 0.2, 0.9, 0.8], [0.0, 0.0, 1.0, 1.0]) == 1.0
    assert cal.expected_auc([1, 1, 1, 1], [0.2, 0.9, 0.4, 0.7]) == pytest.approx(0.5)
    assert cal.expected_auc([0.5, 0.5, 0.5], [0.5, 0.5, 0.5]) == pytest.approx(0.5)
    assert math.isnan(cal.expected_auc([0.3, 0.4], [1.0, 1.0]))
    with pytest.raises(InvalidArgument, match="alpha"):
        cal.expected_auc([0.1, 0.2], [0.5, 1.5])


def test_auc_hand_examples_with_ties():
    assert cal.roc_auc([0.3, 0.3, 0.3, 0.3], [0, 1, 0, 1]) == pytest.approx(0.5)  # constant scores
    assert cal.roc_auc([0.1, 0.2, 0.8, 0.9], [0, 0, 1, 1]) == pytest.approx(1.0)  # perfect ranking
    assert cal.roc_auc([0.9, 0.8, 0.2, 0.1], [0, 0, 1, 1]) == pytest.approx(0.0)
    assert cal.roc_auc([0.1, 0.4, 0.35, 0.8], [0, 0, 1, 1]) == pytest.approx(0.75)
    assert cal.roc_auc([0.5, 0.5, 0.7], [0, 1, 1]) == pytest.approx(0.75)  # a tied pair counts 1/2
    assert math.isnan(cal.roc_auc([0.1, 0.2], [1, 1]))


def test_reliability_bins():
    r = cal.reliability([0.02, 0.04, 0.97], [0, 1, 1], bins=20)
    assert r["count"][0] == 2 and r["count"][19] == 1 and sum(r["count"]) == 3
    assert r["confidence"][0] == pytest.approx(0.03) and r["accuracy"][0] == pytest.approx(0.5)
    assert r["confidence"][5] is None


def test_records_exclude_positions_not_proposed():
    rec = cal.RolloutRecords.from_rounds([[1.0, 2.0, 3.0], [0.5], [0.0, 0.0]], accepted=[3, 0, 1], gamma=3)
    scores, labels = cal.position_view(rec, 2, view="survival")
    assert len(scores) == 2 and labels.tolist() == [1.0, 0.0]  # the round that proposed 1 is out at k = 2
    scores, labels = cal.position_view(rec, 3, view="conditional")
    assert labels.tolist() == [1.0]  # only round 0 proposed 3 with 2 accepted
    with pytest.raises(InvalidArgument):
        cal.RolloutRecords.from_rounds([[1.0]], accepted=[2])


def synthetic_records(n=6000, gamma=4, overconfidence=3.0, seed=0, shift=0.0):
    """True per-position acceptance p_k = sigmoid(z); the head reports logit overconfidence * z + shift."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.3, 1.2, size=(n, gamma))
    p = 1 / (1 + np.exp(-z))
    ok = rng.random((n, gamma)) < p
    accepted = np.where(ok.all(axis=1), gamma, np.argmin(ok, axis=1))
    return cal.RolloutRecords(overconfidence * z + shift, np.full(n, gamma), accepted.astype(np.int64))


def test_sts_reduces_ece_and_keeps_conditional_ranking():
    rec = synthetic_records()
    temps = cal.fit_sts(rec)
    # undoes the 3x overconfidence; later positions are weakly identified (a_k is dominated by earlier
    # factors and sits in the lowest bins), so only the first two temperatures are pinned down
    assert all(2.0 < t < 4.0 for t in temps[:2]), temps
    table = cal.calibration_table(rec, None, temps)
    for row in table:
        assert row["ece_survival_sts"] < row["ece_survival_raw"]
        assert row["ece_survival_sts"] < 0.03
    for k in range(1, rec.gamma + 1):
        raw, y = cal.position_view(rec, k, None, "conditional")
        scaled, _ = cal.position_view(rec, k, temps, "conditional")
        assert cal.roc_auc(raw, y) == pytest.approx(cal.roc_auc(scaled, y), abs=1e-12)


def test_sts_leaves_calibrated_confidences_nearly_alone():
    temps = cal.fit_sts(synthetic_records(overconfidence=1.0, seed=1))
    assert all(0.7 < t < 1.4 for t in temps[:2]), temps


def test_write_calibration_round_trips_through_load_drafter(shared_fixtures, tmp_path):
    from dspark_core.drafters import load_drafter

    d = tmp_path / "dspark"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(shared_fixtures / "dspark" / f, d / f)
    path = cal.write_calibration(d, [1.5, 0.8, 2.0, 1.0], {"fitted_on": {"rounds": np.int64(7)}})
    body = json.loads(path.read_text())
    assert body["method"] == "sts" and body["fitted_on"]["rounds"] == 7
    drafter = load_drafter(d)
    assert drafter.config.sts_temperatures == (1.5, 0.8, 2.0, 1.0)
    with pytest.raises(InvalidArgument):
        cal.write_calibration(d, [1.0, -1.0])


def test_positions_with_too_few_rounds_keep_temperature_one():
    rec = synthetic_records(n=300, seed=2)
    short = cal.RolloutRecords(rec.logits, np.where(np.arange(300) < 40, 4, 1), np.minimum(rec.accepted, 1))
    temps = cal.fit_sts(short, min_rounds=50)
    assert temps[1:] == (1.0, 1.0, 1.0) and temps[0] != 1.0


def test_platt_removes_a_shift_that_sts_cannot():
    """A head over-confident by +1.2 in logit space (right scale, wrong centre): no temperature fixes it, a
    bias does; the fit recovers (t, b) ~ (1, -1.2) at the identified positions, is out of sample better than
    STS, and keeps the conditional ranking."""
    rec = synthetic_records(n=8000, overconfidence=1.0, shift=1.2, seed=3)
    check = synthetic_records(n=8000, overconfidence=1.0, shift=1.2, seed=4)
    platt = cal.fit_platt(rec, min_rounds=50)
    assert platt.method == "platt" and len(platt.biases) == rec.gamma
    for t, b in zip(platt.temperatures[:2], platt.biases[:2]):
        assert 0.85 < t < 1.15 and -1.45 < b < -0.95, (platt.temperatures, platt.biases)
    sts = cal.fit_sts(rec, min_rounds=50)
    t_platt = cal.calibration_table(check, None, platt)
    t_sts = cal.calibration_table(check, None, sts)
    # Platt within a point of the sampling-noise floor at position 1, STS several points off it
    assert t_platt[0]["ece_survival_sts"] < t_platt[0]["ece_survival_floor"] + 0.01
    assert t_sts[0]["ece_survival_sts"] > 0.05
    assert sum(r["ece_survival_sts"] for r in t_platt) < sum(r["ece_survival_sts"] for r in t_sts)
    for k in range(1, rec.gamma + 1):
        raw, y = cal.position_view(check, k, None, "conditional")
        fitted, _ = cal.position_view(check, k, platt, "conditional")
        assert cal.roc_auc(raw, y) == pytest.approx(cal.roc_auc(fitted, y), abs=1e-12)


def test_platt_leaves_a_calibrated_head_alone_and_stays_finite_on_one_class():
    calib = cal.fit_platt(synthetic_records(overconfidence=1.0, seed=5))
    assert all(0.85 < t < 1.15 for t in calib.temperatures[:2]) and all(abs(b) < 0.15 for b in calib.biases[:2])
    # every draft accepted: the likelihood wants b -> +inf; the one-round prior keeps it finite and in range
    rec = cal.RolloutRecords(np.full((200, 3), 0.5), np.full(200, 3), np.full(200, 3))
    calib = cal.fit_platt(rec)
    assert all(np.isfinite(calib.temperatures)) and all(0 < b <= cal.B_RANGE[1] for b in calib.biases)
    assert cal.conditional_confidences(rec, calib)[0, 0] > 0.95
    # too few rounds: identity kept
    few = cal.fit_platt(cal.RolloutRecords(np.zeros((10, 2)), np.full(10, 2), np.ones(10, dtype=np.int64)),
                        min_rounds=50)
    assert few.temperatures == (1.0, 1.0) and few.biases is None and few.method == "sts"
    with pytest.raises(InvalidArgument, match="method"):
        cal.fit_calibration(rec, "isotonic")


def test_calibration_values_are_checked():
    with pytest.raises(InvalidArgument, match="biases"):
        cal.Calibration((1.0, 1.0), (0.0,))
    with pytest.raises(InvalidArgument, match="biases"):
        cal.Calibration((1.0,), (float("inf"),))
    with pytest.raises(InvalidArgument, match="temperatures"):
        cal.Calibration((0.0,))


def test_write_platt_calibration_round_trips_through_load_drafter(shared_fixtures, tmp_path):
    from dspark_core.drafters import load_drafter

    d = tmp_path / "dspark"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(shared_fixtures / "dspark" / f, d / f)
    calib = cal.Calibration((1.5, 0.8, 2.0, 1.0), (-0.3, 0.0, 0.2, 0.1))
    body = json.loads(cal.write_calibration(d, calib).read_text())
    assert body["method"] == "platt" and body["biases"] == [-0.3, 0.0, 0.2, 0.1]
    config = load_drafter(d).config
    assert config.sts_temperatures == (1.5, 0.8, 2.0, 1.0)
    assert config.calibration_bias_values == (-0.3, 0.0, 0.2, 0.1)
    # a greedy-regime write keeps the sampled Platt calibration, and vice versa
    cal.write_calibration(d, cal.Calibration((0.5,) * 4, (1.0,) * 4), greedy=True)
    body = json.loads((d / "calibration.json").read_text())
    assert body["biases"] == [-0.3, 0.0, 0.2, 0.1] and body["greedy"]["biases"] == [1.0] * 4
    cal.write_calibration(d, [2.0] * 4)
    config = load_drafter(d).config
    assert config.calibration_bias_values == (0.0,) * 4 and config.calibration_bias_values_greedy == (1.0,) * 4


# ---- request-history recalibration -----------------------------------------------------------------

def request_effect_records(requests=300, rounds=40, gamma=3, spread=1.2, seed=0):
    """Each request has its own offset u_r ~ N(0, spread) that the head does not see: true acceptance at slot
    k is sigmoid(z_k + u_r), the head reports z_k. Rows come request by request, in round order."""
    rng = np.random.default_rng(seed)
    u = rng.normal(0.0, spread, size=requests)
    req = np.repeat(np.arange(requests), rounds)
    z = rng.normal(0.0, 1.0, size=(requests * rounds, gamma))
    ok = rng.random(z.shape) < 1 / (1 + np.exp(-(z + u[req][:, None])))
    accepted = np.where(ok.all(axis=1), gamma, np.argmin(ok, axis=1))
    return cal.RolloutRecords(z, np.full(req.size, gamma), accepted.astype(np.int64), req)


def test_history_offsets_read_only_earlier_rounds_of_the_same_request():
    # request 7: rounds accept, reject, (proposes nothing), accept; request 3 interleaved between them
    rec = cal.RolloutRecords(np.array([[0.0], [0.0], [5.0], [np.nan], [0.0]]), np.array([1, 1, 1, 0, 1]),
                             np.array([1, 0, 1, 0, 1]), np.array([7, 7, 3, 7, 7]))
    h = cal.RequestHistory((1.0,), strength=2.0, prior=0.5)
    g = cal.history_offsets(rec, np.zeros(5), h)  # every calibrated c_1 = 0.5
    assert g[0] == 0.0 and g[2] == 0.0  # first rounds of each request: no history
    assert g[1] == pytest.approx(h.offset(1, 1, 0.5)) and g[1] > 0  # one accepted round at c = 0.5
    assert g[3] == pytest.approx(h.offset(2, 1, 1.0)) == pytest.approx(0.0)  # 1 of 2 at c = 0.5: on par
    assert g[4] == g[3]  # the round that verified no draft does not count
    # changing a later round never changes an earlier offset
    later = cal.RolloutRecords(rec.logits, rec.proposed, np.array([1, 0, 1, 0, 0]), rec.request)
    assert np.array_equal(cal.history_offsets(later, np.zeros(5), h), g)
    # no request ids: no history
    assert not cal.history_offsets(rec.with_requests(None), np.zeros(5), h).any()


def test_request_history_removes_a_per_request_error_platt_cannot():
    rec = request_effect_records()
    odd = rec.request % 2 == 1
    fit_on, check = rec.subset(~odd), rec.subset(odd)
    platt = cal.fit_calibration(fit_on, "platt", min_rounds=50)
    hist = cal.fit_calibration(fit_on, "platt", min_rounds=50, request_history=True)
    assert platt.history is None and hist.history is not None
    # (t, b) are refitted with the weights: Platt softened slot 1 for the spread between requests that the
    # history now explains, so the joint fit's temperature is lower
    assert hist.temperatures[0] < platt.temperatures[0] - 0.1, (hist.temperatures, platt.temperatures)
    assert hist.history.weights[0] > 0.5, hist.history  # the slot-1 history says where the request stands
    before = cal.calibration_table(check, None, platt)
    after = cal.calibration_table(check, None, hist)
    assert after[0]["auc_survival"] > before[0]["auc_survival"] + 0.02
    for b, a in zip(before, after):
        assert a["ece_survival_sts"] < b["ece_survival_sts"] + 0.003
    # a head that has no per-request error gets (nearly) nothing from it
    flat = request_effect_records(spread=0.0, seed=1)
    assert abs(cal.fit_calibration(flat, "platt", request_history=True).history.weights[0]) < 0.3
    with pytest.raises(InvalidArgument, match="request"):
        cal.fit_history(rec.with_requests(None), platt)


def test_requests_from_runs_and_history_values_are_checked():
    assert cal.requests_from_runs([4, 4, 2, 2, 2, 4]).tolist() == [0, 0, 1, 1, 1, 2]
    with pytest.raises(InvalidArgument, match="request_history.prior"):
        cal.RequestHistory((1.0,), prior=1.0)
    with pytest.raises(InvalidArgument, match="request_history.strength"):
        cal.RequestHistory((1.0,), strength=0.0)
    with pytest.raises(InvalidArgument, match="request_history.weights"):
        cal.RequestHistory((float("nan"),))
    with pytest.raises(InvalidArgument, match="request_history.weights"):
        cal.Calibration((1.0, 1.0), None, cal.RequestHistory((1.0,)))
    with pytest.raises(InvalidArgument, match="calibration.request_history.bogus"):
        cal.RequestHistory.from_dict({"weights": [1.0], "bogus": 1}, "calibration.request_history")
    with pytest.raises(InvalidArgument, match="x.strength"):
        cal.RequestHistory.from_dict({"weights": [1.0], "strength": "4"}, "x")
    with pytest.raises(InvalidArgument, match="records.request"):
        cal.RolloutRecords(np.zeros((2, 1)), np.ones(2, dtype=np.int64), np.ones(2, dtype=np.int64), np.zeros(3))


def test_write_request_history_round_trips_through_load_drafter(shared_fixtures, tmp_path):
    from dspark_core.drafters import load_drafter
    from dspark_core.errors import ModelLoadError

    d = tmp_path / "dspark"
    d.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(shared_fixtures / "dspark" / f, d / f)
    hist = cal.RequestHistory((0.9, -0.2, 0.1, 0.0), strength=4.0, prior=0.4)
    cal.write_calibration(d, cal.Calibration((1.2,) * 4, (-0.3,) * 4, hist))
    cal.write_calibration(d, cal.Calibration((0.8,) * 4, (0.1,) * 4), greedy=True)
    drafter = load_drafter(d)
    assert drafter.config.calibration_history == hist and drafter.config.calibration_history_greedy is None
    assert drafter.confidence_history(False) == hist
    # the fixture has no greedy output: temperature-0 requests read the sampled head and its history
    assert drafter.confidence_history(True) == hist
    assert drafter.config.to_dict()["calibration"]["request_history"] == hist.to_dict()
    body = json.loads((d / "calibration.json").read_text())
    body["request_history"]["weights"] = [1.0]
    (d / "calibration.json").write_text(json.dumps(body))
    with pytest.raises(ModelLoadError, match="calibration.request_history.weights"):
        load_drafter(d)
