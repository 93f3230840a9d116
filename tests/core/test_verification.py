"""Tests of dspark_core.verification: exact greedy cases, validation, seeding, and losslessness by statistics.

The statistical tests run the real `verify_block` once per round on a toy order-1 Markov target and a
sparse draft, and compare the empirical joint distribution of the first two emitted tokens with the exact
target joint. The default run uses 100,000 draws across all cases; `-m slow` runs 100,000+ per case.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import random
from dataclasses import dataclass

import pytest
import torch

from dspark_core.errors import InvalidArgument
from dspark_core.sampling import (SamplingParams, TokenHistory, make_generator, process_logits, sample_token,
                                  target_probs)
from dspark_core.verification import (DraftBlock, VerifyOutcome, couple_draft, process_draft, verify_batch,
                                      verify_block)

pytestmark = pytest.mark.usefixtures("one_torch_thread")

GREEDY = SamplingParams(temperature=0)


def _peaked(argmaxes: list[int], vocab_size: int = 8) -> torch.Tensor:
    """Target logits [len(argmaxes), vocab_size] whose row i has its argmax at argmaxes[i]."""
    logits = torch.randn(len(argmaxes), vocab_size, generator=torch.Generator().manual_seed(len(argmaxes)))
    logits[torch.arange(len(argmaxes)), torch.tensor(argmaxes)] = 10.0
    return logits


def _full_support(probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A dense draft distribution [n, V] written as a support over the whole vocabulary."""
    ids = torch.arange(probs.shape[1]).expand(probs.shape[0], -1).contiguous()
    return ids, probs


# -------------------------------------------------------------------------------------------- greedy


def test_greedy_accepts_all_matching_drafts_and_appends_the_bonus():
    outcome = verify_block(_peaked([3, 1, 4, 6]), DraftBlock((3, 1, 4)), GREEDY, make_generator(0))
    assert outcome == VerifyOutcome(num_accepted=3, tokens=(3, 1, 4, 6), stopped=False)


def test_greedy_rejects_the_first_draft_and_emits_the_target_argmax():
    outcome = verify_block(_peaked([2, 1, 4, 6]), DraftBlock((3, 1, 4)), GREEDY, make_generator(0))
    assert outcome == VerifyOutcome(num_accepted=0, tokens=(2,), stopped=False)


def test_greedy_rejects_in_the_middle_and_ignores_later_drafts():
    outcome = verify_block(_peaked([3, 1, 5, 6]), DraftBlock((3, 1, 4)), GREEDY, make_generator(0))
    assert outcome == VerifyOutcome(num_accepted=2, tokens=(3, 1, 5), stopped=False)


def test_greedy_stop_token_among_accepted_drafts_ends_the_round_without_bonus():
    params = SamplingParams(temperature=0, stop_token_ids=(7, 1))
    outcome = verify_block(_peaked([3, 1, 4, 6]), DraftBlock((3, 1, 4)), params, make_generator(0))
    assert outcome == VerifyOutcome(num_accepted=2, tokens=(3, 1), stopped=True)


def test_greedy_stop_token_as_the_recovered_or_bonus_token_sets_stopped():
    params = SamplingParams(temperature=0, stop_token_ids=(6,))
    rejected = verify_block(_peaked([3, 6, 4, 0]), DraftBlock((3, 1, 4)), params, make_generator(0))
    assert rejected == VerifyOutcome(num_accepted=1, tokens=(3, 6), stopped=True)
    bonus = verify_block(_peaked([3, 1, 4, 6]), DraftBlock((3, 1, 4)), params, make_generator(0))
    assert bonus == VerifyOutcome(num_accepted=3, tokens=(3, 1, 4, 6), stopped=True)


def test_greedy_without_drafts_emits_the_argmax():
    assert verify_block(_peaked([5]), DraftBlock(()), GREEDY, make_generator(0)) == VerifyOutcome(0, (5,), False)


def test_greedy_ties_go_to_the_lowest_id():
    logits = torch.tensor([[1.0, 4.0, 4.0, 0.0], [2.0, 2.0, 0.0, 0.0]])
    assert verify_block(logits, DraftBlock((2,)), GREEDY, make_generator(0)).tokens == (1,)
    assert verify_block(logits, DraftBlock((1,)), GREEDY, make_generator(0)).tokens == (1, 0)


def test_greedy_ignores_the_draft_support_and_draws_no_random_numbers():
    generator = make_generator(3)
    state = generator.get_state()
    ids, probs = _full_support(torch.full((3, 8), 1 / 8))
    outcome = verify_block(_peaked([3, 1, 5, 6]), DraftBlock((3, 1, 4), ids, probs), GREEDY, generator)
    assert outcome.tokens == (3, 1, 5)
    assert torch.equal(generator.get_state(), state)


# ------------------------------------------------------------------------------- sampled, exact cases


def test_sampled_draft_equal_to_target_is_always_accepted():
    params = SamplingParams(temperature=0.9, top_k=6)
    logits = torch.randn(4, 10, generator=torch.Generator().manual_seed(0))  # [4, 10]
    probs = target_probs(logits, params)
    tokens = tuple(int(t) for t in probs[:3].argmax(dim=-1))
    generator = make_generator(1)
    for _ in range(50):
        outcome = verify_block(logits, DraftBlock(tokens, *_full_support(probs[:3])), params, generator)
        assert outcome.num_accepted == 3 and outcome.tokens[:3] == tokens and len(outcome.tokens) == 4


def test_sampled_draft_with_zero_target_probability_is_rejected_for_the_residual():
    # Target row 0 is a point mass on token 1; the draft proposed token 0 with certainty.
    logits = torch.tensor([[-math.inf, 0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0, 0.0]])
    draft = DraftBlock((0,), torch.tensor([[0, 2]]), torch.tensor([[1.0, 0.0]]))
    generator = make_generator(2)
    for _ in range(20):
        assert verify_block(logits, draft, SamplingParams(), generator) == VerifyOutcome(0, (1,), False)


def test_sampled_recovered_token_comes_from_the_positive_part_of_p_minus_q():
    # p = [0.5, 0.5, 0, 0]; q = [0.9, 0.1] on tokens [0, 1]. Rejecting token 0 leaves max(0, p - q) = [0, 0.4, 0,
    # 0]: the recovered token is always 1, never 0 again and never a token outside the target's support.
    logits = torch.tensor([[0.0, 0.0, -math.inf, -math.inf], [0.0, 0.0, 0.0, 0.0]])
    draft = DraftBlock((0,), torch.tensor([[0, 1]]), torch.tensor([[0.9, 0.1]]))
    generator = make_generator(3)
    outcomes = {verify_block(logits, draft, SamplingParams(), generator).tokens[:1] for _ in range(300)}
    assert outcomes == {(0,), (1,)}
    rejected = [o for o in (verify_block(logits, draft, SamplingParams(), generator) for _ in range(300))
                if o.num_accepted == 0]
    assert rejected and all(o.tokens == (1,) for o in rejected)


def test_sampled_residual_without_mass_falls_back_to_the_target_row():
    # p = [0, 1]; the draft row [0.0009, 1.0] sums to 1 within tolerance and covers p everywhere, so
    # max(0, p - q) is all zero after the certain rejection of token 0: the next token comes from p itself.
    logits = torch.tensor([[-math.inf, 0.0], [0.0, 0.0]])
    draft = DraftBlock((0,), torch.tensor([[0, 1]]), torch.tensor([[0.0009, 1.0]]))
    generator = make_generator(4)
    for _ in range(20):
        assert verify_block(logits, draft, SamplingParams(), generator) == VerifyOutcome(0, (1,), False)


def test_sampled_stop_token_among_accepted_drafts_ends_the_round_without_bonus():
    params = SamplingParams(stop_token_ids=(4,))
    logits = torch.randn(4, 8, generator=torch.Generator().manual_seed(5))
    probs = target_probs(logits, params)
    outcome = verify_block(logits, DraftBlock((2, 4, 1), *_full_support(probs[:3])), params, make_generator(0))
    assert outcome == VerifyOutcome(num_accepted=2, tokens=(2, 4), stopped=True)


def test_sampled_round_draws_one_uniform_per_tested_draft_plus_one():
    params = SamplingParams()
    logits = torch.randn(3, 8, generator=torch.Generator().manual_seed(6))
    probs = target_probs(logits, params)
    accept_all = DraftBlock((1, 2), *_full_support(probs[:2]))  # q = p: both accepted, then a bonus
    reject_first = DraftBlock((5, 2), torch.tensor([[5], [2]]), torch.tensor([[1.0], [1.0]]))
    logits_reject = logits.clone()
    logits_reject[0, 5] = -math.inf  # p(5) = 0: the first draft is rejected
    for logits_used, draft, uniforms in ((logits, accept_all, 3), (logits_reject, reject_first, 2)):
        generator, twin = make_generator(8), make_generator(8)
        verify_block(logits_used, draft, params, generator)
        torch.rand(uniforms, generator=twin, dtype=torch.float64)
        assert torch.equal(generator.get_state(), twin.get_state())


# --------------------------------------------------------------------------------------- validation


def test_draft_token_outside_its_support_is_rejected_naming_it():
    with pytest.raises(InvalidArgument) as info:
        DraftBlock((2, 9), torch.tensor([[2, 3], [4, 5]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]))
    assert info.value.field == "tokens[1]" and "9" in str(info.value)


def test_draft_token_with_zero_draft_probability_is_rejected():
    with pytest.raises(InvalidArgument, match=r"tokens\[0\]"):
        DraftBlock((3,), torch.tensor([[2, 3]]), torch.tensor([[1.0, 0.0]]))


@pytest.mark.parametrize(
    ("ids", "probs", "field"),
    [
        (torch.tensor([[1, 2]]), None, "support_probs"),
        (torch.tensor([[1.0, 2.0]]), torch.tensor([[0.5, 0.5]]), "support_ids"),
        (torch.tensor([[1, 2, 3]]), torch.tensor([[0.5, 0.5]]), "support_probs"),
        (torch.tensor([[1, 2], [1, 2]]), torch.tensor([[0.5, 0.5], [0.5, 0.5]]), "support_ids"),
        (torch.tensor([[1, 2]]), torch.tensor([[0.7, 0.7]]), "support_probs"),
        (torch.tensor([[1, 2]]), torch.tensor([[1.5, -0.5]]), "support_probs"),
        (torch.tensor([[1, 2]]), torch.tensor([[float("nan"), 0.5]]), "support_probs"),
        (torch.tensor([[1, -2]]), torch.tensor([[0.5, 0.5]]), "support_ids"),
    ],
)
def test_malformed_draft_support_is_rejected_naming_the_field(ids, probs, field):
    with pytest.raises(InvalidArgument) as info:
        DraftBlock((1,), ids, probs)
    assert info.value.field == field


def test_negative_draft_token_is_rejected():
    with pytest.raises(InvalidArgument, match="tokens"):
        DraftBlock((1, -4))


def test_verify_block_rejects_mismatched_rows_vocab_and_missing_support():
    with pytest.raises(InvalidArgument) as info:
        verify_block(torch.zeros(2, 8), DraftBlock((1, 2)), GREEDY, make_generator(0))
    assert info.value.field == "target_logits" and info.value.value == (2, 8)
    with pytest.raises(InvalidArgument, match="vocab_size 8"):
        verify_block(torch.zeros(2, 8), DraftBlock((8,)), GREEDY, make_generator(0))
    with pytest.raises(InvalidArgument, match="support_probs"):
        verify_block(torch.zeros(2, 8), DraftBlock((1,)), SamplingParams(), make_generator(0))
    wide = DraftBlock((1,), torch.tensor([[1, 9]]), torch.tensor([[0.5, 0.5]]))
    with pytest.raises(InvalidArgument, match="support_ids"):
        verify_block(torch.zeros(2, 8), wide, SamplingParams(), make_generator(0))


# ---------------------------------------------------------------------------------------- seeding


def _random_rounds(seed: int, rounds: int = 40) -> list[tuple[int, ...]]:
    """A run of sampled rounds with random targets and drafts; only the verifier's generator varies."""
    data = torch.Generator().manual_seed(99)
    params = SamplingParams(temperature=1.1, top_k=8, top_p=0.95)
    generator = make_generator(seed)
    out = []
    for r in range(rounds):
        n = r % 4
        logits = torch.randn(n + 1, 12, generator=data) * 2  # [n + 1, 12]
        q = torch.rand(n, 12, generator=data).softmax(dim=-1)  # [n, 12]
        tokens = tuple(int(t) for t in q.argmax(dim=-1)) if n else ()
        out.append(verify_block(logits, DraftBlock(tokens, *_full_support(q)), params, generator).tokens)
    return out


def test_same_seed_gives_the_same_rounds_and_different_seeds_differ():
    assert _random_rounds(17) == _random_rounds(17)
    assert _random_rounds(17) != _random_rounds(18)


@pytest.mark.parametrize(
    "params",
    [SamplingParams(), SamplingParams(temperature=0.5, top_k=4), SamplingParams(top_p=0.6), GREEDY],
    ids=["plain", "top_k", "top_p", "greedy"],
)
def test_no_drafts_equals_plain_sampling_for_the_same_seed(params):
    logits = torch.randn(200, 16, generator=torch.Generator().manual_seed(4))  # [200, 16]
    speculative, plain = make_generator(21), make_generator(21)
    for row in logits:
        outcome = verify_block(row[None], DraftBlock(()), params, speculative)
        assert outcome.num_accepted == 0
        assert outcome.tokens == (sample_token(row, params, plain),)
    assert torch.equal(speculative.get_state(), plain.get_state())


# ------------------------------------------------------------------------------------------ batch


def test_verify_batch_equals_verify_block_per_request():
    data = torch.Generator().manual_seed(12)
    vocab_size = 10
    lengths = [3, 0, 2, 1, 0]
    params = [SamplingParams(top_k=5), GREEDY, SamplingParams(temperature=0.7, top_p=0.9),
              SamplingParams(temperature=0, stop_token_ids=(3,)), SamplingParams(seed=4)]
    drafts, rows = [], []
    for n in lengths:
        q = torch.rand(n, vocab_size, generator=data).softmax(dim=-1)  # [n, V]
        tokens = tuple(int(t) for t in torch.multinomial(q, 1, generator=data).flatten()) if n else ()
        drafts.append(DraftBlock(tokens, *_full_support(q)))
        rows.append(torch.randn(n + 1, vocab_size, generator=data))
    logits = torch.cat(rows)  # [total_tokens, V]
    cu_seqlens = torch.tensor([0] + [sum(n + 1 for n in lengths[: r + 1]) for r in range(len(lengths))])
    batched = verify_batch(logits, cu_seqlens, drafts, params, [make_generator(s) for s in range(5)])
    single = [verify_block(rows[r], drafts[r], params[r], make_generator(r)) for r in range(5)]
    assert batched == single


def test_verify_batch_rejects_bad_offsets_and_counts():
    logits = torch.zeros(3, 4)
    drafts, params, gens = [DraftBlock((1,)), DraftBlock(())], [GREEDY, GREEDY], [make_generator(0)] * 2
    with pytest.raises(InvalidArgument, match="cu_seqlens"):
        verify_batch(logits, torch.tensor([0, 2, 4]), drafts, params, gens)
    with pytest.raises(InvalidArgument, match=r"cu_seqlens\[0:2\]"):
        verify_batch(logits, torch.tensor([0, 1, 3]), drafts, params, gens)
    with pytest.raises(InvalidArgument, match="generators"):
        verify_batch(logits, torch.tensor([0, 2, 3]), drafts, params, gens[:1])


# ------------------------------------------------------------------------------------- statistics


@dataclass(frozen=True)
class ToyCase:
    name: str
    vocab_size: int
    params: SamplingParams
    draft_k: int  # draft support size per row (k < V is a sparse draft)
    draft_lengths: tuple[int, ...]  # a draw's block length is chosen uniformly from these
    seed: int


CASES = [
    ToyCase("dense-draft-T1", 6, SamplingParams(), 6, (1, 2, 3), 0),
    ToyCase("sparse-draft-top-k", 8, SamplingParams(temperature=0.8, top_k=5), 3, (1, 2, 3), 1),
    ToyCase("sparse-draft-top-p", 8, SamplingParams(temperature=1.3, top_p=0.8), 2, (1, 2, 3), 2),
    ToyCase("all-three-with-empty-blocks", 12, SamplingParams(temperature=0.6, top_k=6, top_p=0.9), 4,
            (0, 1, 2, 3), 3),
    ToyCase("draft-mass-outside-target", 16, SamplingParams(top_k=4), 5, (1, 2, 3), 4),
]


class ToyPair:
    """An order-1 Markov target and draft over a tiny vocabulary.

    Table row 0 is the first position; row 1 + t is the position after token t. The target gives raw logits
    (verify_block applies the sampling params); the draft gives a top-k-truncated distribution per row.
    """

    def __init__(self, case: ToyCase):
        gen = torch.Generator().manual_seed(1000 + case.seed)
        size = case.vocab_size
        self.case = case
        self.logits = torch.randn(size + 1, size, generator=gen) * 1.5  # [V + 1, V]
        self.target = target_probs(self.logits, case.params).double()  # [V + 1, V]
        # The draft is a noisy copy of the raw target (before the sampling params), truncated to its top k.
        draft_logits = self.logits + torch.randn(size + 1, size, generator=gen)  # [V + 1, V]
        self.draft_ids = draft_logits.topk(case.draft_k, dim=-1).indices  # [V + 1, k]
        self.draft_probs = draft_logits.gather(1, self.draft_ids).softmax(dim=-1)  # [V + 1, k]
        self.draft = torch.zeros(size + 1, size, dtype=torch.float64).scatter_(
            1, self.draft_ids, self.draft_probs.double())  # [V + 1, V] dense q
        self._ids = self.draft_ids.tolist()
        self._cdf = [list(torch.cumsum(row, 0).tolist()) for row in self.draft_probs.double()]
        self._blocks: dict[tuple[int, tuple[int, ...]], tuple[DraftBlock, torch.Tensor]] = {}

    def joint(self, table: torch.Tensor) -> torch.Tensor:
        """Exact joint of the first two tokens under `table` (target or draft), [V * V] float64."""
        return (table[0][:, None] * table[1:]).flatten()

    def draft_token(self, row: int, rng: random.Random) -> int:
        cdf = self._cdf[row]
        return self._ids[row][min(bisect.bisect_right(cdf, rng.random() * cdf[-1]), len(cdf) - 1)]

    def block(self, row: int, tokens: tuple[int, ...]) -> tuple[DraftBlock, torch.Tensor]:
        """The DraftBlock and target logits [n + 1, V] of one round; cached, since both are pure."""
        key = (row, tokens)
        if key not in self._blocks:
            rows = torch.tensor([row] + [1 + t for t in tokens])  # [n + 1]
            block = DraftBlock(tokens, self.draft_ids[rows[:-1]], self.draft_probs[rows[:-1]])
            self._blocks[key] = (block, self.logits[rows])
        return self._blocks[key]

    def first_two_counts(self, draws: int) -> torch.Tensor:
        """Counts [V * V] of the first two emitted tokens over `draws` independent generations."""
        size, params = self.case.vocab_size, self.case.params
        rng = random.Random(self.case.seed)
        generator = make_generator(self.case.seed)
        counts = [0] * (size * size)
        for _ in range(draws):
            emitted: list[int] = []
            row = 0
            while len(emitted) < 2:  # one round, or two when the first round emits a single token
                tokens, r = [], row
                for _ in range(rng.choice(self.case.draft_lengths)):
                    t = self.draft_token(r, rng)
                    tokens.append(t)
                    r = 1 + t
                block, logits = self.block(row, tuple(tokens))
                emitted += verify_block(logits, block, params, generator).tokens
                row = 1 + emitted[-1]
            counts[emitted[0] * size + emitted[1]] += 1
        return torch.tensor(counts, dtype=torch.float64)


def _total_variation(a: torch.Tensor, b: torch.Tensor) -> float:
    return 0.5 * float((a - b).abs().sum())


def _expected_noise(dist: torch.Tensor, draws: int) -> float:
    """The total variation that `draws` samples of `dist` are expected to show by chance alone."""
    return float((0.5 * (2 * dist * (1 - dist) / (math.pi * draws)).sqrt()).sum())


def _check_lossless(case: ToyCase, draws: int, tolerance: float) -> None:
    pair = ToyPair(case)
    target, draft = pair.joint(pair.target), pair.joint(pair.draft)
    # The case must be worth testing: a draft far from the target, and sampling noise well under tolerance.
    assert _total_variation(target, draft) > 0.2
    expected_noise = _expected_noise(target, draws)
    assert expected_noise < 0.7 * tolerance
    empirical = pair.first_two_counts(draws) / draws
    to_target, to_draft = _total_variation(empirical, target), _total_variation(empirical, draft)
    assert to_target <= tolerance, (case.name, to_target, expected_noise)
    assert to_target < to_draft / 10, (case.name, to_target, to_draft)
    # The first token alone, too (its marginal is the row sums of the joint).
    first = empirical.view(case.vocab_size, -1).sum(dim=1)
    assert _total_variation(first, pair.target[0]) <= tolerance


@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_first_two_tokens_follow_the_target_not_the_draft(case):
    # 20,000 draws per case, 100,000 across the cases; the tolerance scales as 1 / sqrt(draws).
    _check_lossless(case, draws=20_000, tolerance=0.01 * math.sqrt(100_000 / 20_000))


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.name)
def test_first_two_tokens_follow_the_target_not_the_draft_full_size(case):
    _check_lossless(case, draws=120_000, tolerance=0.01)


# ------------------------------------------------------------- seeded requests: position-keyed coupling

def _coupled_rounds(pair: ToyPair, draws: int, position: int = 5):
    """Counts [V * V] of the first two tokens when draw s is a request seeded with s: each round's block is
    drafted by the toy drafter (its own random stream, Markov rows conditioned on its own tokens, as a real
    drafter's are), re-drawn by `couple_draft`, verified with the round's position. Also returns the
    first-slot acceptance rate over rounds that tested a draft at the first position."""
    size, params = pair.case.vocab_size, pair.case.params
    rng = random.Random(pair.case.seed)
    counts = [0] * (size * size)
    tested = accepted = 0
    for s in range(draws):
        seeded = dataclasses.replace(params, seed=s)
        emitted: list[int] = []
        row = 0
        while len(emitted) < 2:
            drafted, r = [], row
            for _ in range(rng.choice(pair.case.draft_lengths)):
                t = pair.draft_token(r, rng)
                drafted.append(t)
                r = 1 + t
            rows = torch.tensor([row] + [1 + t for t in drafted[:-1]], dtype=torch.long)[:len(drafted)]
            block = DraftBlock(tuple(drafted), pair.draft_ids[rows], pair.draft_probs[rows])
            block = couple_draft(block, s, position + len(emitted), size)
            logits = pair.logits[torch.tensor([row] + [1 + t for t in block.tokens])]
            out = verify_block(logits, block, seeded, make_generator(0), position=position + len(emitted))
            if not emitted and block.tokens:
                tested += 1
                accepted += out.num_accepted > 0
            emitted += out.tokens
            row = 1 + emitted[-1]
        counts[emitted[0] * size + emitted[1]] += 1
    return torch.tensor(counts, dtype=torch.float64), accepted / max(1, tested)


@pytest.mark.parametrize("case", CASES[:3], ids=lambda c: c.name)
def test_seeded_coupled_verification_follows_the_target_and_keeps_most_of_the_acceptance(case):
    draws = 12_000
    tolerance = 0.01 * math.sqrt(120_000 / draws)
    pair = ToyPair(case)
    target, draft = pair.joint(pair.target), pair.joint(pair.draft)
    assert _expected_noise(target, draws) < 0.7 * tolerance
    counts, first_slot = _coupled_rounds(pair, draws)
    empirical = counts / draws
    to_target, to_draft = _total_variation(empirical, target), _total_variation(empirical, draft)
    assert to_target <= tolerance, (case.name, to_target)
    assert to_target < to_draft / 10, (case.name, to_target, to_draft)
    # the exponential-race coupling keeps at least (1 - TV) / (1 + TV) of the first slot's drafts
    tv = _total_variation(pair.target[0], pair.draft[0])
    assert first_slot >= (1 - tv) / (1 + tv) - 0.03, (case.name, first_slot, tv)


def test_seeded_coupled_tokens_are_the_seeds_draw_whatever_was_drafted():
    """The committed token at a position is the seed's race over the target there: no drafts, a rejected
    draft and an accepted one give the same token, and different seeds spread over the distribution."""
    torch.manual_seed(3)
    logits = torch.randn(3, 10)
    params = SamplingParams(temperature=0.9, seed=41)
    gen = make_generator(0)
    alone = verify_block(logits[:1], DraftBlock(()), params, gen, position=12).tokens[0]
    ids = torch.arange(10)[None].expand(2, 10)
    for d in range(10):
        q = torch.full((2, 10), 0.1)
        out = verify_block(torch.cat([logits[:1], logits[:2]]), DraftBlock((d, 0), ids, q), params, gen,
                           position=12)
        assert out.tokens[0] == alone
        assert out.num_accepted == (1 + (out.tokens[1] == 0) if d == alone else 0)
    seen = {verify_block(logits[:1], DraftBlock(()), dataclasses.replace(params, seed=s), gen,
                         position=12).tokens[0] for s in range(200)}
    assert len(seen) >= 5
    with pytest.raises(InvalidArgument, match="position"):
        verify_block(logits[:1], DraftBlock(()), params, gen, position=-1)


# ------------------------------------------------------------- statistics with the request's own processing

@dataclass(frozen=True)
class ProcessedCase:
    name: str
    vocab_size: int
    params: SamplingParams
    draft_k: int
    draft_lengths: tuple[int, ...]
    seed: int
    prompt: tuple[int, ...] = (2, 3)
    anchor: int = 1


PROCESSED_CASES = [
    ProcessedCase("penalties-dense-draft", 8, SamplingParams(repetition_penalty=1.6, frequency_penalty=0.9,
                                                             presence_penalty=0.6), 8, (1, 2, 3), 10),
    ProcessedCase("min-p-top-k-presence", 10, SamplingParams(temperature=0.8, top_k=7, min_p=0.15,
                                                             presence_penalty=1.2), 6, (1, 2), 11),
    ProcessedCase("min-tokens-frequency-empty-blocks", 8, SamplingParams(
        temperature=1.2, frequency_penalty=1.5, min_tokens=3, stop_token_ids=(0, 4)), 5, (0, 1, 2, 3), 12),
]


def _unprocessed(params: SamplingParams) -> SamplingParams:
    return dataclasses.replace(params, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
                               min_p=0.0, min_tokens=0)


class ProcessedPair(ToyPair):
    """ToyPair whose target is processed with the request's penalties / min-p / min_tokens given the history
    (prompt, anchor, then what the round emitted), and whose drafts go through `process_draft` first."""

    def __init__(self, case: ProcessedCase):
        super().__init__(ToyCase(case.name, case.vocab_size, _unprocessed(case.params), case.draft_k,
                                 case.draft_lengths, case.seed))
        self.pcase = case

    def history(self, emitted: tuple[int, ...]) -> TokenHistory:
        return TokenHistory(self.pcase.prompt, (self.pcase.anchor, *emitted))

    def processed_joint(self, params: SamplingParams) -> torch.Tensor:
        """Exact joint [V * V] of the first two tokens after the anchor under the processed target."""
        def dist(row: int, emitted: tuple[int, ...]) -> torch.Tensor:
            logits = process_logits(self.logits[row][None, :], params, self.history(emitted))
            return target_probs(logits, params)[0].double()

        first = dist(1 + self.pcase.anchor, ())
        second = torch.stack([dist(1 + t, (t,)) for t in range(self.pcase.vocab_size)])
        return (first[:, None] * second).flatten()

    def processed_counts(self, draws: int) -> torch.Tensor:
        case, params = self.pcase, self.pcase.params
        rng = random.Random(case.seed)
        verify_gen, draft_gen = make_generator(case.seed), make_generator(case.seed + 1)
        counts = [0] * (case.vocab_size * case.vocab_size)
        for _ in range(draws):
            emitted: list[int] = []
            while len(emitted) < 2:
                row = 1 + (emitted[-1] if emitted else case.anchor)
                tokens, r = [], row
                for _ in range(rng.choice(case.draft_lengths)):  # the raw drafter, conditioned on its own drafts
                    t = self.draft_token(r, rng)
                    tokens.append(t)
                    r = 1 + t
                rows = torch.tensor([row] + [1 + t for t in tokens[:-1]] if tokens else [row])
                raw = DraftBlock(tuple(tokens), self.draft_ids[rows[: len(tokens)]],
                                 self.draft_probs[rows[: len(tokens)]])
                history = self.history(tuple(emitted))
                block = process_draft(raw, params, history, draft_gen)
                logits = self.logits[torch.tensor([row] + [1 + t for t in block.tokens])]
                emitted += verify_block(logits, block, params, verify_gen, history).tokens
            counts[emitted[0] * case.vocab_size + emitted[1]] += 1
        return torch.tensor(counts, dtype=torch.float64)


def _check_processed_lossless(case: ProcessedCase, draws: int, tolerance: float) -> None:
    pair = ProcessedPair(case)
    processed = pair.processed_joint(case.params)
    plain = pair.processed_joint(_unprocessed(case.params))
    expected_noise = _expected_noise(processed, draws)
    assert expected_noise < 0.7 * tolerance
    # worth testing: the processing moves the target far, and the raw draft is far from the processed target
    assert _total_variation(processed, plain) > 0.1
    empirical = pair.processed_counts(draws) / draws
    to_processed, to_plain = _total_variation(empirical, processed), _total_variation(empirical, plain)
    assert to_processed <= tolerance, (case.name, to_processed, expected_noise)
    assert to_processed < to_plain / 10, (case.name, to_processed, to_plain)
    if case.params.min_tokens >= 3:  # no stop token among the first two tokens after the anchor
        grid = empirical.view(case.vocab_size, -1)
        assert all(float(grid[s].sum()) == 0 and float(grid[:, s].sum()) == 0 for s in case.params.stop_token_ids)


@pytest.mark.parametrize("case", PROCESSED_CASES, ids=lambda c: c.name)
def test_processed_tokens_follow_the_processed_target_not_the_plain_one(case):
    _check_processed_lossless(case, draws=6_000, tolerance=0.01 * math.sqrt(120_000 / 6_000))


@pytest.mark.slow
@pytest.mark.parametrize("case", PROCESSED_CASES, ids=lambda c: c.name)
def test_processed_tokens_follow_the_processed_target_full_size(case):
    _check_processed_lossless(case, draws=120_000, tolerance=0.01)


def test_process_draft_keeps_the_drafts_the_processing_leaves_alone():
    # with nothing generated that the penalties touch and min-p below every token, q' = q: every draft kept
    probs = torch.tensor([[0.4, 0.3, 0.2, 0.1], [0.25, 0.25, 0.25, 0.25]])
    ids = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    block = DraftBlock((2, 3), ids, probs)
    params = SamplingParams(presence_penalty=1.0, min_p=0.01)
    out = process_draft(block, params, TokenHistory((), (0,)), make_generator(0))
    assert out.tokens[0] == 2  # slot 1 only penalises token 0 (generated): q'(2) > q(2), always kept
    assert torch.allclose(out.support_probs[0], torch.tensor([0.4 * math.exp(-1), 0.3, 0.2, 0.1]) /
                          (0.4 * math.exp(-1) + 0.6))


def test_process_draft_never_drafts_a_stop_token_before_min_tokens():
    probs = torch.tensor([[0.9, 0.1]])
    block = DraftBlock((0,), torch.tensor([[0, 1]]), probs)
    params = SamplingParams(min_tokens=5, stop_token_ids=(0,))
    for seed in range(20):
        out = process_draft(block, params, TokenHistory((), (1,)), make_generator(seed))
        assert out.tokens == (1,) and out.support_probs[0].tolist() == [0.0, 1.0]


def test_processing_without_a_history_is_refused_not_ignored():
    with pytest.raises(InvalidArgument, match="history"):
        verify_block(torch.zeros(1, 4), DraftBlock(()), SamplingParams(presence_penalty=0.5), make_generator(0))


def test_process_draft_gives_the_same_q_for_a_full_vocabulary_support_in_any_order():
    # the id-ordered full support (the drafters' default) takes a shortcut; a permuted one the general path
    gen = torch.Generator().manual_seed(5)
    q = torch.rand(3, 12, generator=gen).softmax(dim=-1)  # [3, 12]
    order = torch.randperm(12, generator=gen)
    params = SamplingParams(temperature=0.7, repetition_penalty=1.5, frequency_penalty=0.5, min_p=0.05,
                            min_tokens=3, stop_token_ids=(4, 7))
    history = TokenHistory((1, 2, 9), (2, 5))
    tokens = tuple(int(t) for t in q.argmax(dim=-1))
    ordered = DraftBlock(tokens, torch.arange(12).expand(3, 12), q)
    permuted = DraftBlock(tokens, order.expand(3, 12), q[:, order])
    a = process_draft(ordered, params, history, make_generator(1))
    b = process_draft(permuted, params, history, make_generator(1))
    # the first slot's q' (it depends on the history only, not on re-drawn tokens) is the same in any order
    assert torch.allclose(a.support_probs[0][order], b.support_probs[0], atol=1e-6)
    assert float(a.support_probs[0][4]) == 0.0 and float(a.support_probs[0][7]) == 0.0  # min_tokens
