"""The verifier unit: retries are idempotent, resume rebuilds the same state, release frees the slot."""

from __future__ import annotations

import pytest
import torch

from dspark_core.errors import InvalidArgument, NotFound
from dspark_core.sampling import SamplingParams
from dspark_core.target import TargetConfig, TargetRuntime
from dspark_core.verification import DraftBlock
from dspark_core.verifier import PrefillItem, Verifier, VerifyItem

GREEDY = SamplingParams(temperature=0, max_new_tokens=64)


@pytest.fixture()
def verifier(tiny_target_dir):
    return Verifier(TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32", tap_layer_ids=(0, 1))))


def greedy_chain(v: Verifier, rid: str, prompt: list[int], rounds: int) -> list[int]:
    """Run `rounds` verify steps with empty drafts (autoregressive) and return all committed tokens."""
    out = v.prefill([PrefillItem(rid, tuple(prompt), GREEDY)])[0].tokens
    for _ in range(rounds):
        res = v.verify([VerifyItem(rid, out[-1], len(prompt) + len(out) - 1, DraftBlock(()))])[0]
        out += res.tokens
    return out


def test_prefill_returns_prompt_features_and_first_token(verifier):
    res = verifier.prefill([PrefillItem("a", (3, 4, 5), GREEDY), PrefillItem("b", (6, 7), GREEDY)])
    assert [r.features.shape for r in res] == [torch.Size([3, 128]), torch.Size([2, 128])]
    assert res[0].context_tokens == [3, 4, 5] and res[0].features_start == 0
    assert len(res[0].tokens) == 1 and res[0].num_accepted == 0


def test_verify_with_correct_drafts_accepts_them_all(verifier, tiny_target_dir):
    truth = greedy_chain(Verifier(TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu"))), "x", [9, 8, 7], 5)
    verifier.prefill([PrefillItem("a", (9, 8, 7), GREEDY)])
    res = verifier.verify([VerifyItem("a", truth[0], 3, DraftBlock(tuple(truth[1:4])))])[0]
    assert res.num_accepted == 3 and res.tokens == truth[1:5]
    assert res.features.shape[0] == 4 and res.features_start == 3
    assert res.context_tokens == truth[:4]


def test_retried_verify_is_idempotent(verifier):
    verifier.prefill([PrefillItem("a", (9, 8, 7), GREEDY)])
    item = VerifyItem("a", 1, 3, DraftBlock((5, 6)))
    once = verifier.verify([item])[0]
    again = verifier.verify([item])[0]  # the reply was "lost": the scheduler sends the same round again
    assert (once.tokens, once.num_accepted) == (again.tokens, again.num_accepted)
    torch.testing.assert_close(once.features, again.features)


def test_resume_on_another_verifier_continues_identically(verifier, tiny_target_dir):
    prompt = [11, 12, 13, 14]
    full = greedy_chain(verifier, "a", prompt, 8)
    # replica 2 learns the committed tokens after 3 rounds from a checkpoint, and carries on
    other = Verifier(TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", tap_layer_ids=(0, 1))))
    done = full[:4]
    res = other.resume("a", prompt, done, GREEDY)
    assert res.features.shape[0] == len(prompt) + len(done) - 1
    out = list(done)
    for _ in range(5):
        step = other.verify([VerifyItem("a", out[-1], len(prompt) + len(out) - 1, DraftBlock(()))])[0]
        out += step.tokens
    assert out == full


def test_unknown_request_and_bad_positions_are_refused(verifier):
    with pytest.raises(NotFound):
        verifier.verify([VerifyItem("ghost", 1, 0, DraftBlock(()))])
    verifier.prefill([PrefillItem("a", (1, 2), GREEDY)])
    with pytest.raises(InvalidArgument, match="anchor_pos"):
        verifier.verify([VerifyItem("a", 1, 7, DraftBlock(()))])
    with pytest.raises(InvalidArgument, match="request_id"):
        verifier.prefill([PrefillItem("a", (1, 2), GREEDY)])
    assert verifier.release("a") and not verifier.release("a")
    assert verifier.target.num_active == 0


def test_a_prefill_that_fails_leaves_nothing_behind(verifier):
    """All or nothing: an item whose first token cannot be sampled (a temperature that overflows the scaled
    logits) fails the call, no item of it stays active or holds KV, and the same ids prefill cleanly after."""
    bad = SamplingParams(temperature=1e-45, max_new_tokens=8)
    with pytest.raises(Exception):
        verifier.prefill([PrefillItem("good", (3, 4, 5), GREEDY), PrefillItem("bad", (6, 7), bad)])
    assert verifier.num_active == 0 and verifier.target.num_active == 0  # no slot, no sequence's KV
    res = verifier.prefill([PrefillItem("good", (3, 4, 5), GREEDY)])  # not "already active"
    assert len(res[0].tokens) == 1


def test_one_id_twice_in_one_prefill_is_refused_by_name(verifier):
    with pytest.raises(InvalidArgument, match="request_id"):
        verifier.prefill([PrefillItem("a", (3, 4, 5), GREEDY), PrefillItem("a", (6, 7), GREEDY)])
    assert verifier.num_active == 0 and verifier.target.num_active == 0
