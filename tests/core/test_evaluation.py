"""Evaluation metrics on hand-made rounds, the offline threshold sweep, and a real engine run on the fixtures."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core.errors import InvalidArgument
from dspark_core.evaluation import (RoundLog, conditional_acceptance, measure_head_cost, resize_block, run_rounds,
                                    summarize, survival, tau, threshold_sweep)

# six rounds, block 4; the last one proposed only 2 drafts (end of the context window)
ACCEPTED = [0, 1, 2, 4, 4, 1]
PROPOSED = [4, 4, 4, 4, 4, 2]


def test_tau_counts_the_bonus_token():
    log = RoundLog(accepted=ACCEPTED, proposed=PROPOSED, committed=[a + 1 for a in ACCEPTED])
    assert tau(log) == pytest.approx(18 / 6)
    assert math.isnan(tau(RoundLog()))


def test_conditional_acceptance_vs_survival_by_hand():
    cond = conditional_acceptance(ACCEPTED, PROPOSED, 4)
    # k=1: 5 of 6; k=2: rounds with >=1 accepted: 5, of which 3 reach 2; k=3: (a>=2, p>=3) = 3, 2 reach 3;
    # k=4: both rounds with 3 accepted also accepted the 4th
    assert cond == pytest.approx([5 / 6, 3 / 5, 2 / 3, 1.0])
    surv = survival(ACCEPTED, PROPOSED, 4)
    # unconditional; the round that proposed only 2 is left out at k = 3, 4
    assert surv == pytest.approx([5 / 6, 3 / 6, 2 / 5, 2 / 5])
    assert conditional_acceptance([0], [4], 4)[1] is None  # nobody reached position 2


def test_summarize_has_the_contract_metrics():
    log = RoundLog(accepted=ACCEPTED, proposed=PROPOSED, committed=[a + 1 for a in ACCEPTED], tokens=18)
    s = summarize(log, 4)
    assert s["tau"] == pytest.approx(3.0) and s["rounds"] == 6 and s["tokens"] == 18
    assert s["committed_histogram"] == [0, 1, 2, 1, 0, 2]
    assert len(s["conditional_acceptance"]) == len(s["survival"]) == 4


def test_threshold_sweep_truncates_rounds_offline():
    # confidences 0.88, 0.12, 0.88; all 3 accepted
    log = RoundLog(accepted=[3], proposed=[3], committed=[4], confidence_logits=[[2.0, -2.0, 2.0]])
    rows = {r["threshold"]: r for r in threshold_sweep(log, None, [0.0, 0.5, 0.9])}
    assert (rows[0.0]["tau"], rows[0.0]["verified_per_round"]) == (4, 4)
    assert (rows[0.5]["tau"], rows[0.5]["verified_per_round"]) == (2, 2)  # stops before position 2
    assert (rows[0.9]["tau"], rows[0.9]["verified_per_round"]) == (1, 1)
    # temperatures scale the logits first: t_2 = 100 brings c_2 to ~0.5 -> still below 0.6
    assert threshold_sweep(log, [1.0, 100.0, 1.0], [0.45])[0]["tau"] == 4
    with pytest.raises(InvalidArgument):
        threshold_sweep(RoundLog(accepted=[0], proposed=[1], committed=[1]))


@pytest.fixture(scope="module")
def fixture_stack(shared_fixtures):
    from dspark_core.drafters import load_drafter
    from dspark_core.target import TargetConfig, TargetRuntime

    torch.set_num_threads(1)
    drafter = load_drafter(shared_fixtures / "dspark")
    target = TargetRuntime(TargetConfig(str(shared_fixtures / "target"), device="cpu", dtype="float32",
                                        tap_layer_ids=drafter.target_layer_ids))
    return target, drafter


PROMPTS = [[5, 9, 12, 30, 41, 77, 3, 8], [7, 7, 8, 100, 200, 300, 11, 12, 13], [400, 3, 19, 22, 23, 24, 60, 61, 90]]


def test_run_rounds_logs_every_round_with_confidence_logits(fixture_stack):
    target, drafter = fixture_stack
    log = run_rounds(target, drafter, PROMPTS, temperature=1.0, max_new_tokens=12, concurrency=2, progress=False)
    assert log.rounds == len(log.proposed) == len(log.committed) == len(log.confidence_logits) > 0
    assert all(0 <= a <= p <= 4 for a, p in zip(log.accepted, log.proposed))
    assert all(len(c) == p for c, p in zip(log.confidence_logits, log.proposed))
    assert sorted(set(log.prompt_index)) == [0, 1, 2]
    assert log.tokens == 3 * 12
    # prefill gives each request its first token; the last round may commit past max_new_tokens
    assert sum(log.committed) + len(PROMPTS) >= log.tokens
    again = run_rounds(target, drafter, PROMPTS, temperature=1.0, max_new_tokens=12, concurrency=3, progress=False)
    assert again.accepted == log.accepted  # per-request seeds: batching does not change the outcome


def test_resize_block_flags_extrapolation(shared_fixtures):
    from dspark_core.drafters import load_drafter

    drafter = load_drafter(shared_fixtures / "dspark")
    drafter.set_calibration([1.0, 2.0, 3.0, 4.0], [0.0, 0.5, 0.0, -1.0])
    assert resize_block(drafter, None) == (4, False)
    assert resize_block(drafter, 2) == (2, False)
    assert resize_block(drafter, 6) == (6, True)
    assert drafter.block_size == 6 and drafter.config.sts_temperatures == (1.0, 2.0, 3.0, 4.0, 4.0, 4.0)
    assert drafter.config.calibration_bias_values == (0.0, 0.5, 0.0, -1.0, -1.0, -1.0)


def test_head_cost_reports_medians_and_shares(fixture_stack):
    _, drafter = fixture_stack
    rows = measure_head_cost(drafter, batch_sizes=(1, 2), context_length=16, repeats=2, warmup=1)
    assert [r["batch_size"] for r in rows] == [1, 2]
    for r in rows:
        assert r["heads_s"] > 0 and r["no_heads_s"] > 0 and r["backbone_s"] > 0
        assert 0 <= r["share_of_propose"] < 1 and r["share_of_round"] is None
    assert drafter.markov_head is not None and drafter.confidence_head is not None  # restored
