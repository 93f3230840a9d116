"""STS calibration: ECE / AUC on hand examples, STS on synthetic miscalibrated rollouts, calibration.json round trip."""

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


def synthetic_records(n=6000, gamma=4, overconfidence=3.0, seed=0):
    """True per-position acceptance p_k = sigmoid(z); the head reports logit overconfidence * z."""
    rng = np.random.default_rng(seed)
    z = rng.normal(0.3, 1.2, size=(n, gamma))
    p = 1 / (1 + np.exp(-z))
    ok = rng.random((n, gamma)) < p
    accepted = np.where(ok.all(axis=1), gamma, np.argmin(ok, axis=1))
    return cal.RolloutRecords(overconfidence * z, np.full(n, gamma), accepted.astype(np.int64))


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
