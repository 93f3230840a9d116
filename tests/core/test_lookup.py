"""N-gram lookup drafts (EngineConfig.lookup_ngram): the index, the choice against the drafter's block, greedy
outputs unchanged through the engine on a real (tiny) target, sampled ones distributed as the target's."""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark_core.cost_model import SpsTable
from dspark_core.drafters.base import LocalStates, Proposal
from dspark_core.engine import Engine, EngineConfig
from dspark_core.errors import InvalidArgument
from dspark_core.lookup import LOOKUP_ACCEPTANCE, MAX_NGRAM, NgramIndex, acceptance, check_ngram
from dspark_core.sampling import SamplingParams
from dspark_core.target import TargetConfig, TargetRuntime

from conftest import UNIFORM_V

# prompts that repeat themselves (what lookup drafts feed on) and one that does not
PROMPTS = [[5, 9, 12, 30, 41, 5, 9, 12, 30, 41, 5, 9, 12], [7, 8, 9, 10] * 4, [100, 3, 19, 22, 23, 24, 60, 61, 90]]


def test_index_proposes_what_followed_the_latest_earlier_occurrence():
    idx = NgramIndex(3)
    idx.extend([1, 2, 3, 4, 5])
    assert idx.propose(4) == ([], 0)  # (3, 4, 5) never occurred before
    idx.extend([1, 2, 3])
    assert idx.propose(4) == ([4, 5, 1, 2], 3)  # what followed (1, 2, 3)
    assert idx.propose(1) == ([4], 3)
    assert idx.propose(0) == ([], 0)
    assert idx.propose(7) == ([4, 5, 1, 2, 3, 4, 5], 3)  # past the end, the loop (1 2 3 4 5) repeats
    idx.extend([9, 1, 2, 3])
    assert idx.propose(2) == ([9, 1], 3)  # the latest occurrence wins
    # a short loop continues itself
    loop = NgramIndex(3)
    loop.extend([7, 8] * 3)
    assert loop.propose(5) == ([7, 8, 7, 8, 7], 4)  # (7 8 7 8) occurred before: the longest match, 4 tokens


def test_index_prefers_the_longest_match():
    idx = NgramIndex(3)
    # (2, 3, 4) was followed by 9 after a 3-token match and by 7 after a 5-token one (0, 1, 2, 3, 4)
    idx.extend([0, 1, 2, 3, 4, 7, 5, 2, 3, 4, 9, 0, 1, 2, 3, 4])
    assert idx.propose(1) == ([7], 5)
    short = NgramIndex(3)
    short.extend([5, 2, 3, 4, 9, 6, 2, 3, 4])
    assert short.propose(1) == ([9], 3)
    assert NgramIndex(4).propose(1) == ([], 0)
    idx4 = NgramIndex(4)
    idx4.extend([5, 2, 3, 4, 9, 6, 2, 3, 4])
    assert idx4.propose(1) == ([], 0)  # a 3-token match is shorter than this index's shortest


def test_index_built_token_by_token_equals_built_at_once():
    seq = [int(x) for x in torch.randint(0, 5, (300,), generator=torch.Generator().manual_seed(0))]
    a, b = NgramIndex(4), NgramIndex(4)
    a.extend(seq)
    for i, t in enumerate(seq):
        b.extend([t])
        if i % 17 == 0:
            assert b.propose(7) == _brute_force(seq[:i + 1], 4, 7)
    assert a.propose(7) == b.propose(7) == _brute_force(seq, 4, 7)


def _brute_force(seq, n, k):
    for m in range(MAX_NGRAM, n - 1, -1):  # the longest suffix that occurred before, its latest occurrence
        for s in range(len(seq) - m - 1, -1, -1):
            if len(seq) > m and seq[s:s + m] == seq[-m:]:
                ext = list(seq)
                while len(ext) < s + m + k:  # a loop repeats: extend the sequence by what it predicts
                    ext.append(ext[len(ext) - (len(seq) - m - s)])
                return ext[s + m:s + m + k], m
    return [], 0


@pytest.mark.parametrize("bad", [1, 2, 9, -3, True, 3.0, "3"])
def test_match_length_is_checked_by_name(bad):
    with pytest.raises(InvalidArgument, match="lookup_ngram"):
        EngineConfig(lookup_ngram=bad)
    with pytest.raises(InvalidArgument, match="--lookup-ngram"):
        check_ngram(bad, "--lookup-ngram")
    assert check_ngram(0) == 0 and check_ngram(5) == 5


def test_acceptance_table_reads_the_nearest_measured_match_length():
    assert acceptance(3, 2) == list(LOOKUP_ACCEPTANCE[3][:2])
    assert acceptance(12, 9) == list(LOOKUP_ACCEPTANCE[8]) + [LOOKUP_ACCEPTANCE[8][-1]] * 2
    assert all(0.0 < c < 1.0 for table in LOOKUP_ACCEPTANCE.values() for c in table)


class WrongDrafter(LocalStates):
    """Drafts tokens the target never picks (the largest ids), with a stated confidence per position."""

    name, kind = "wrong", "test"
    target_layer_ids: tuple[int, ...] = ()
    has_confidence = True

    def __init__(self, vocab_size, block_size=4, confidence=0.05):
        self.vocab_size, self.block_size, self.support_size = vocab_size, block_size, 1
        self.confidence = confidence

    def new_state(self):
        return None

    def propose(self, items):
        out = []
        for it in items:
            toks = [self.vocab_size - 1 - i for i in range(self.block_size)]
            out.append(Proposal(tokens=toks, support_ids=torch.tensor([[t] for t in toks]),
                                support_probs=torch.ones(self.block_size, 1),
                                confidences=torch.full((self.block_size,), self.confidence)))
        return out


@pytest.fixture(scope="module")
def target(tiny_target_dir):
    return TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def expected(tiny_target_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_target_dir, dtype=torch.float32).eval()
    out = []
    with torch.no_grad():
        for p in PROMPTS:
            ids = list(p)
            for _ in range(24):
                ids.append(int(model(torch.tensor([ids])).logits[0, -1].argmax()))
            out.append(ids[len(p):])
    return out


def _run(target, drafter, config, sps=None, temperature=0.0):
    engine = Engine(target, drafter, config, sps=sps)
    rids = [engine.add_request(p, SamplingParams(temperature=temperature, seed=3, max_new_tokens=24))
            for p in PROMPTS]
    engine.run()
    return engine, [engine.pop(r) for r in rids]


@pytest.mark.parametrize("policy,gate", [("fixed", False), ("causal", False), ("causal", True)])
def test_greedy_output_unchanged_and_lookup_drafts_accepted(target, expected, policy, gate):
    sps = SpsTable(batch_sizes=tuple(range(1, 40)), steps_per_second=tuple(100.0 / (1 + 0.02 * b)
                                                                          for b in range(1, 40)))
    drafter = WrongDrafter(target.vocab_size)
    # with the draft gate, this drafter's passes stop after a few rounds: lookup drafts go on without them
    off, outs_off = _run(target, drafter, EngineConfig(policy=policy, lookup_ngram=0, gate_drafts=gate), sps)
    on, outs_on = _run(target, drafter, EngineConfig(policy=policy, lookup_ngram=3, gate_drafts=gate), sps)
    assert [o.output_ids for o in outs_off] == [o.output_ids for o in outs_on] == expected
    # the wrong drafter accepts nothing; the lookup drafts did accept, on fewer rounds
    assert sum(sum(o.accepted_per_round) for o in outs_off) == 0 and off.num_lookup_rounds == 0
    assert on.num_lookup_rounds > 0 and on.num_lookup_accepted > 0
    assert on.num_lookup_accepted == sum(sum(o.accepted_per_round) for o in outs_on)
    assert sum(o.num_rounds for o in outs_on) < sum(o.num_rounds for o in outs_off)
    # lookup rounds feed no drafter statistic (its request history saw only its own rounds: none accepted)
    assert all(o.history_accepted == 0 for o in outs_on)
    if gate:
        assert on.num_gated_drafts > 0


def test_a_drafter_expected_to_accept_more_keeps_its_block(target, expected):
    # a drafter whose confidences promise more than any lookup table: its (wrong) drafts are verified
    sure = WrongDrafter(target.vocab_size, confidence=0.99)
    engine, outs = _run(target, sure, EngineConfig(policy="fixed", lookup_ngram=3))
    assert [o.output_ids for o in outs] == expected
    assert engine.num_lookup_rounds == 0


V = UNIFORM_V
DRAWS = 1500
# every (2, 3, v) occurred before, followed by 5: whatever the first sampled token v, the next round's lookup draft
# starts with 5
LOOP_PROMPT = [t for v in range(V) for t in (2, 3, v, 5)] + [1, 2, 3]


@pytest.mark.parametrize("coupled", [False, True])
def test_sampled_lookup_drafts_keep_the_target_distribution(uniform_target, coupled):
    """The first drafted position's token stays uniform although its lookup draft is always token 5 (a residual
    that did not take the draft out would give 5 with 1/6 + 5/6 x 1/6 = 0.31)."""
    engine = Engine(uniform_target, WrongDrafter(V, confidence=0.01),
                    EngineConfig(policy="fixed", lookup_ngram=3, max_active=64, max_waiting=DRAWS,
                                 isolate_seeded=coupled))
    rids = [engine.add_request(LOOP_PROMPT, SamplingParams(temperature=1.0, seed=i, max_new_tokens=2))
            for i in range(DRAWS)]
    engine.run()
    second = [engine.pop(r).output_ids[1] for r in rids]
    assert engine.num_lookup_rounds == DRAWS  # every request's one drafted round verified the lookup draft
    sigma = math.sqrt((1 / V) * (1 - 1 / V) / DRAWS)
    for v in range(V):
        rate = second.count(v) / DRAWS
        assert abs(rate - 1 / V) < 4 * sigma, (v, rate)
    # the draft was accepted about as often as the target draws 5
    assert abs(engine.num_lookup_accepted / DRAWS - 1 / V) < 4 * sigma


def test_sampled_requests_with_their_own_processing_verify_the_drafters_block(uniform_target):
    engine = Engine(uniform_target, WrongDrafter(V, confidence=0.01), EngineConfig(policy="fixed", lookup_ngram=3))
    rid = engine.add_request(LOOP_PROMPT, SamplingParams(temperature=1.0, seed=1, max_new_tokens=6,
                                                         repetition_penalty=1.3))
    engine.run()
    assert len(engine.pop(rid).output_ids) == 6
    assert engine.num_lookup_rounds == 0


def test_pricing_follows_the_rounds_verified():
    from dspark_core.lookup import LookupPricing

    pricing = LookupPricing(strength=50.0)
    assert pricing.acceptance(3, 3) == pytest.approx(acceptance(3, 3))  # no round yet: the table
    for _ in range(500):  # a target whose lookup drafts never survive position 1
        pricing.observe(3, verified=4, accepted=0)
    low = pricing.acceptance(3, 3)
    assert low[0] < 0.1 * acceptance(3, 1)[0]
    assert low[1:] == pytest.approx(acceptance(3, 3)[1:])  # positions never reached keep the table
    assert pricing.acceptance(3, 1, greedy=False) == pytest.approx(acceptance(3, 1, greedy=False))  # sampled: apart
    assert pricing.acceptance(5, 1) == pytest.approx(acceptance(5, 1))  # other match lengths: their own
    for _ in range(500):
        pricing.observe(8, verified=7, accepted=7)
    assert all(x > 0.99 for x in pricing.acceptance(8, 7))
    with pytest.raises(InvalidArgument, match="strength"):
        LookupPricing(strength=0)
