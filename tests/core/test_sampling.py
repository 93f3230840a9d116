"""Tests of dspark_core.sampling: parameter validation, target_probs semantics, the one-uniform draw."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core.errors import InvalidArgument
from dspark_core.sampling import (
    SamplingParams,
    _inverse_cdf,
    make_generator,
    sample_from_probs,
    sample_token,
    target_probs,
)

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def _logits_of(probs: list[float]) -> torch.Tensor:
    """Logits whose softmax is `probs` (zeros become -inf)."""
    return torch.tensor([math.log(p) if p > 0 else -math.inf for p in probs], dtype=torch.float32)


def _reference_probs(row: list[float], params: SamplingParams) -> list[float]:
    """Plain-Python reference: temperature, then top-k, then top-p (smallest top set with mass >= top_p)."""
    vocab_size = len(row)
    if params.greedy:
        best = max(range(vocab_size), key=lambda i: (row[i], -i))
        return [1.0 if i == best else 0.0 for i in range(vocab_size)]

    def softmax(scores: list[float]) -> list[float]:
        top = max(scores)
        exps = [math.exp(s - top) if s != -math.inf else 0.0 for s in scores]
        total = sum(exps)
        return [e / total for e in exps]

    scores = [x / params.temperature for x in row]
    if 0 < params.top_k < vocab_size:
        kth = sorted(scores, reverse=True)[params.top_k - 1]
        scores = [s if s >= kth else -math.inf for s in scores]
    if params.top_p < 1.0:
        probs = softmax(scores)
        keep, mass = set(), 0.0
        for i in sorted(range(vocab_size), key=lambda i: -probs[i]):
            keep.add(i)
            mass += probs[i]
            if mass >= params.top_p:
                break
        scores = [s if i in keep else -math.inf for i, s in enumerate(scores)]
    return softmax(scores)


# ---------------------------------------------------------------------------------------------- params


def test_default_params_sample_at_temperature_one_without_truncation():
    params = SamplingParams()
    assert (params.temperature, params.top_k, params.top_p, params.seed) == (1.0, 0, 1.0, None)
    assert params.max_new_tokens == 128 and params.stop_token_ids == () and not params.greedy
    assert SamplingParams(temperature=0).greedy


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -1.0),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "0.7"),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", float("nan")),
        ("top_k", -3),
        ("top_k", 2.5),
        ("top_k", True),
        ("seed", -1),
        ("seed", 2**64),
        ("max_new_tokens", 0),
        ("stop_token_ids", (3, -1)),
    ],
)
def test_invalid_params_raise_naming_field_and_value(field, value):
    with pytest.raises(InvalidArgument) as info:
        SamplingParams(**{field: value})
    assert info.value.field == field
    assert str(info.value).startswith(f"{field} ")
    assert repr(value) in str(info.value)


def test_params_normalise_to_plain_python_types():
    params = SamplingParams(temperature=1, stop_token_ids=[2, 5], top_k=torch.tensor(3).item())
    assert params.temperature == 1.0 and isinstance(params.temperature, float)
    assert params.stop_token_ids == (2, 5)
    assert hash(params) == hash(SamplingParams(temperature=1.0, stop_token_ids=(2, 5), top_k=3))


# ---------------------------------------------------------------------------------------- target_probs


def test_greedy_probs_are_one_hot_at_lowest_tied_argmax():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, -1.0, 5.0, 5.0]])
    probs = target_probs(logits, SamplingParams(temperature=0))
    assert probs.dtype == torch.float32
    assert probs.tolist() == [[0.0, 1.0, 0.0, 0.0], [1.0, 0.0, 0.0, 0.0]]


def test_top_k_keeps_the_k_highest_and_renormalises():
    probs = target_probs(_logits_of([0.1, 0.4, 0.2, 0.3]), SamplingParams(top_k=2))
    assert probs.tolist() == pytest.approx([0.0, 4 / 7, 0.0, 3 / 7], abs=1e-6)


def test_top_k_keeps_ties_at_the_kth_value():
    probs = target_probs(torch.tensor([1.0, 2.0, 2.0, 0.0]), SamplingParams(top_k=2))
    assert probs.tolist() == pytest.approx([0.0, 0.5, 0.5, 0.0])
    probs = target_probs(torch.tensor([2.0, 1.0, 1.0, 0.0]), SamplingParams(top_k=2))
    assert (probs > 0).tolist() == [True, True, True, False]


@pytest.mark.parametrize(
    ("top_p", "kept"),
    [(1e-9, [0]), (0.4, [0]), (0.75, [0, 1]), (0.85, [0, 1, 2]), (0.99, [0, 1, 2, 3])],
)
def test_top_p_keeps_the_smallest_top_set_reaching_the_mass(top_p, kept):
    base = [0.5, 0.3, 0.15, 0.05]
    probs = target_probs(_logits_of(base), SamplingParams(top_p=top_p))
    mass = sum(base[i] for i in kept)
    expected = [base[i] / mass if i in kept else 0.0 for i in range(4)]
    assert probs.tolist() == pytest.approx(expected, abs=1e-6)


def test_top_p_applies_after_top_k_renormalises():
    # top-k 2 leaves [4/7, 3/7]; top-p 0.5 then keeps token 0 alone. Applied the other way round, top-p
    # would keep tokens 0 and 1 (mass 0.4 < 0.5).
    probs = target_probs(_logits_of([0.4, 0.3, 0.2, 0.1]), SamplingParams(top_k=2, top_p=0.5))
    assert probs.tolist() == [1.0, 0.0, 0.0, 0.0]


def test_temperature_applies_before_top_p():
    # At temperature 1 token 0 holds 0.5 < 0.6, so top-p 0.6 keeps two tokens; at temperature 0.5 the
    # distribution sharpens to [0.25, 0.09, 0.0225, 0.0025] / 0.365 and token 0 alone holds 0.68 >= 0.6.
    logits = _logits_of([0.5, 0.3, 0.15, 0.05])
    assert (target_probs(logits, SamplingParams(top_p=0.6)) > 0).sum() == 2
    assert (target_probs(logits, SamplingParams(temperature=0.5, top_p=0.6)) > 0).sum() == 1


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(),
        SamplingParams(temperature=0),
        SamplingParams(temperature=0.7),
        SamplingParams(temperature=1.6, top_k=3),
        SamplingParams(top_p=0.7),
        SamplingParams(temperature=0.8, top_k=5, top_p=0.9),
        SamplingParams(temperature=2.0, top_k=1),
        SamplingParams(top_k=50),  # larger than the vocabulary: off
    ],
    ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}",
)
def test_target_probs_match_plain_python_reference(params):
    logits = torch.randn(32, 11, generator=torch.Generator().manual_seed(7)) * 2.0  # [32, 11]
    probs = target_probs(logits, params)
    assert probs.shape == logits.shape and probs.dtype == torch.float32
    for row, got in zip(logits.tolist(), probs.tolist()):
        expected = _reference_probs(row, params)
        assert [g > 0 for g in got] == [e > 0 for e in expected]
        assert got == pytest.approx(expected, abs=1e-6)
    # A 1-D row gives the same values as the same row inside a batch.
    assert torch.equal(target_probs(logits[3], params), probs[3])


def test_target_probs_equal_transformers_warpers_bit_for_bit():
    logits_process = pytest.importorskip("transformers.generation.logits_process")
    gen = torch.Generator().manual_seed(3)
    smooth = torch.randn(16, 40, generator=gen) * 3.0  # [16, 40]
    tied = torch.randint(-3, 4, (16, 40), generator=gen).float()  # [16, 40] many ties
    for logits in (smooth, tied):
        for temperature, top_k, top_p in [(0.7, 0, 1.0), (1.0, 7, 1.0), (1.0, 0, 0.8), (1.3, 12, 0.6)]:
            scores = logits
            if temperature != 1.0:
                scores = logits_process.TemperatureLogitsWarper(temperature)(None, scores)
            if top_k:
                scores = logits_process.TopKLogitsWarper(top_k)(None, scores)
            if top_p < 1.0:
                scores = logits_process.TopPLogitsWarper(top_p)(None, scores)
            params = SamplingParams(temperature=temperature, top_k=top_k, top_p=top_p)
            assert torch.equal(target_probs(logits, params), scores.softmax(dim=-1))


def test_target_probs_accept_half_precision_logits():
    logits = torch.randn(4, 9, generator=torch.Generator().manual_seed(1))
    params = SamplingParams(temperature=0.9, top_p=0.8)
    probs = target_probs(logits.to(torch.bfloat16), params)
    assert probs.dtype == torch.float32
    assert torch.allclose(probs.sum(dim=-1), torch.ones(4))


# ------------------------------------------------------------------------------------ draws and seeds


def test_make_generator_with_seed_is_reproducible():
    a, b = make_generator(123), make_generator(123)
    assert torch.equal(torch.rand(5, generator=a), torch.rand(5, generator=b))
    c, d = make_generator(None), make_generator(None)
    assert not torch.equal(torch.rand(5, generator=c), torch.rand(5, generator=d))
    with pytest.raises(InvalidArgument, match="seed"):
        make_generator(-5)


def test_sample_from_probs_consumes_exactly_one_uniform():
    probs = torch.tensor([0.2, 0.5, 0.3])
    generator = make_generator(11)
    twin = make_generator(11)
    sample_from_probs(probs, generator)
    torch.rand(1, generator=twin, dtype=torch.float64)
    assert torch.equal(generator.get_state(), twin.get_state())


def test_inverse_cdf_maps_uniform_intervals_to_tokens_and_skips_zero_mass():
    probs = torch.tensor([0.0, 0.25, 0.0, 0.75, 0.0, 0.0])
    cases = {0.0: 1, 0.2499: 1, 0.25: 3, 0.9: 3, 1.0: 3}  # u = 1.0 stands for rounding up to the total
    for u, token in cases.items():
        assert _inverse_cdf(probs, torch.tensor([u], dtype=torch.float64)) == token
    # Unnormalised weights work the same way.
    assert _inverse_cdf(probs * 8, torch.tensor([0.3], dtype=torch.float64)) == 3
    with pytest.raises(InvalidArgument, match="probs"):
        _inverse_cdf(torch.zeros(4), torch.tensor([0.5], dtype=torch.float64))


def test_sample_from_probs_frequencies_match_the_distribution():
    probs = torch.tensor([0.1, 0.0, 0.45, 0.05, 0.4])
    generator = make_generator(5)
    draws = 20_000
    counts = [0] * 5
    for _ in range(draws):
        counts[sample_from_probs(probs, generator)] += 1
    assert counts[1] == 0
    total_variation = 0.5 * sum(abs(c / draws - p) for c, p in zip(counts, probs.tolist()))
    assert total_variation < 0.015


def test_greedy_sample_token_takes_argmax_and_draws_nothing():
    generator = make_generator(9)
    state = generator.get_state()
    assert sample_token(torch.tensor([0.5, 2.0, 2.0, -1.0]), SamplingParams(temperature=0), generator) == 1
    assert torch.equal(generator.get_state(), state)


def test_sample_token_is_deterministic_per_seed():
    logits = torch.randn(40, 16, generator=torch.Generator().manual_seed(2))  # [40, 16]
    params = SamplingParams(temperature=1.2, top_k=10, top_p=0.95)

    def run(seed: int) -> list[int]:
        generator = make_generator(seed)
        return [sample_token(row, params, generator) for row in logits]

    assert run(1) == run(1)
    assert run(1) != run(2)


def test_sample_token_never_returns_a_truncated_token():
    logits = torch.tensor([3.0, 2.5, 0.0, -1.0, 2.9])
    generator = make_generator(4)
    tokens = {sample_token(logits, SamplingParams(top_k=2), generator) for _ in range(300)}
    assert tokens == {0, 4}
