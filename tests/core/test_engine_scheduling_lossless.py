"""Scheduling must not bias sampling: the paper's Appendix A, end to end through the engine.

One request at a time, block of 2, SPS(1..3) = 1.0, 0.5, 0.45, slot-1 confidence 0.8 and a slot-2
confidence that depends on the *sampled* slot-1 token (0.9 if it is token 0, else 0). The causal
scheduler stops at the first throughput drop and never looks at slot 2; the async one sizes capacity
from confidences two steps old. Both leave the first drafted position's token distributed as the
target's. A retrospective global search looks at slot 2, i.e. at the sampled slot-1 token, and skews
the output — by exactly the amount the analysis predicts.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core import scheduling
from dspark_core.drafters.base import LocalStates, Proposal
from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams

from conftest import UNIFORM_V

V = UNIFORM_V
SPS = [0.0, 1.0, 0.5, 0.45]
DRAWS = 1500


class SlotDependentDrafter(LocalStates):
    """Drafts two tokens uniformly from {0, 1}; confidence of slot 2 reveals the sampled slot-1 token."""

    name, kind = "appendix-a", "test"
    block_size, support_size, vocab_size = 2, 2, V
    target_layer_ids: tuple[int, ...] = ()
    has_confidence = True

    def new_state(self):
        return None

    def propose(self, items):
        out = []
        for it in items:
            d = (torch.rand(2, generator=it.generator) < 0.5).long().tolist()  # uniform over {0, 1}
            out.append(Proposal(tokens=d, support_ids=torch.tensor([[0, 1], [0, 1]]),
                                support_probs=torch.full((2, 2), 0.5),
                                confidences=torch.tensor([0.8, 0.9 if d[0] == 0 else 0.0])))
        return out


def first_drafted_position_zero_rate(target, policy: str, coupled: bool = False) -> float:
    """Fraction of requests whose second output token (the first one a draft could cover) is token 0.
    Seeded requests are verified by plain speculative sampling (the paper's algorithm, whose losslessness
    rests on the policy), or with `coupled` by serving's position-keyed coupling."""
    # test-only: the biased search is never a registered policy, only one handed to the engine
    biased = (lambda confs, sps, request_ids: scheduling.retrospective_global_schedule(confs, SPS)
              ) if policy == "retrospective" else None
    engine = Engine(target, SlotDependentDrafter(), EngineConfig(policy="fixed" if policy == "retrospective" else policy,
                                                                  max_active=1, max_waiting=DRAWS,
                                                                  isolate_seeded=coupled), sps=SPS,
                    policy=biased)
    rids = [engine.add_request([1, 2, 3], SamplingParams(temperature=1.0, seed=i, max_new_tokens=2))
            for i in range(DRAWS)]
    engine.run()
    return sum(engine.pop(r).output_ids[1] == 0 for r in rids) / DRAWS


def test_target_is_uniform(uniform_target):
    seq = uniform_target.new_sequence()
    probs = uniform_target.forward([(seq, [1, 2, 3])]).logits.softmax(-1)
    uniform_target.release(seq)
    torch.testing.assert_close(probs, torch.full_like(probs, 1 / V))


@pytest.mark.parametrize("policy", ["causal", "async"])
def test_causal_and_async_policies_keep_the_target_distribution(uniform_target, policy):
    p0 = 1 / V
    sigma = math.sqrt(p0 * (1 - p0) / DRAWS)
    rate = first_drafted_position_zero_rate(uniform_target, policy)
    assert abs(rate - p0) < 4 * sigma, (policy, rate)


def test_retrospective_global_search_biases_the_output(uniform_target):
    # With prob 1/2 slot 1 drafts token 0, the search sees c_2 = 0.9 and verifies it: accepted with
    # prob min(1, p0 / 0.5); otherwise (slot 1 drafted token 1, c_2 = 0) nothing is verified and the
    # target samples: P(0) = 1/2 * 2 p0 + 1/2 * p0 = 1.5 p0 instead of p0.
    p0 = 1 / V
    biased = 1.5 * p0
    sigma = math.sqrt(biased * (1 - biased) / DRAWS)
    rate = first_drafted_position_zero_rate(uniform_target, "retrospective")
    assert abs(rate - biased) < 4 * sigma, rate
    assert abs(rate - p0) > 4 * sigma


def test_position_keyed_coupling_keeps_the_distribution_even_under_the_biased_search(uniform_target):
    """Coupled verification commits the seed's own draw at every position whatever is verified, so not even
    a policy that reads the drafts can bias it."""
    p0 = 1 / V
    sigma = math.sqrt(p0 * (1 - p0) / DRAWS)
    rate = first_drafted_position_zero_rate(uniform_target, "retrospective", coupled=True)
    assert abs(rate - p0) < 4 * sigma, rate
