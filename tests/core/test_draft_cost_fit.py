"""capacity.DraftCostFit: a drafter's pass time as fixed + per request, fitted online to the passes timed."""

from __future__ import annotations

import random

import pytest

from dspark_core.capacity import DraftCost, DraftCostFit
from dspark_core.errors import InvalidArgument


def test_passes_of_different_sizes_separate_the_fixed_part_from_the_per_request_part():
    rng = random.Random(0)
    fit = DraftCostFit(window=64)
    for _ in range(200):
        n = rng.randint(1, 8)
        fit.observe(n, 0.0045 + 0.00075 * n + rng.gauss(0.0, 0.0003))
    assert fit.observed == 64  # the window
    assert fit.cost.base == pytest.approx(0.0045, abs=0.0004)
    assert fit.cost.per_request == pytest.approx(0.00075, abs=0.0001)


def test_passes_of_one_size_split_by_the_prior_and_keep_their_total():
    fit = DraftCostFit(base_share=0.5)
    assert fit.cost == DraftCost()  # nothing timed: free
    for t in (0.010, 0.012, 0.011):
        fit.observe(8, t)
    c = fit.cost
    assert c.base == pytest.approx(0.0055) and c(8) == pytest.approx(0.011)


def test_a_fit_that_noise_makes_negative_falls_back_to_the_prior():
    fit = DraftCostFit(base_share=0.25)
    for n, t in ((1, 0.010), (2, 0.004), (3, 0.001)):  # a slope below zero: not a drafter's cost
        fit.observe(n, t)
    c = fit.cost
    assert c.base >= 0 and c.per_request >= 0
    assert c(2) == pytest.approx(0.005)  # the mean pass, at the mean size
    assert c.base == pytest.approx(0.25 * 0.005)


def test_the_newest_passes_count():
    fit = DraftCostFit(window=4)
    for n in (1, 2, 3, 4):
        fit.observe(n, 1.0 + n)  # an old, slow drafter
    for n in (1, 2, 3, 4):
        fit.observe(n, 0.1 + 0.01 * n)
    assert fit.cost.base == pytest.approx(0.1) and fit.cost.per_request == pytest.approx(0.01)


@pytest.mark.parametrize("requests,seconds", [(0, 0.01), (-3, 0.01), (2, float("nan")), (2, -1.0),
                                              (2, float("inf"))])
def test_unusable_passes_are_ignored(requests, seconds):
    fit = DraftCostFit()
    fit.observe(requests, seconds)
    assert fit.observed == 0


@pytest.mark.parametrize("kwargs,name", [({"window": 1}, "window"), ({"window": 2.5}, "window"),
                                         ({"window": True}, "window"), ({"base_share": 1.5}, "base_share"),
                                         ({"base_share": -0.1}, "base_share")])
def test_bad_settings_are_refused_by_name(kwargs, name):
    with pytest.raises(InvalidArgument, match=name):
        DraftCostFit(**kwargs)
