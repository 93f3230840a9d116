"""DSpark (vanilla and rnn Markov heads) and DFlash reproduce DeepSpec's first-round numbers."""

import pytest
import torch

from dspark_core.drafters import Drafter, ProposeItem
from dspark_core.drafters.dflash import DFlashDrafter
from dspark_core.drafters.dspark import DSparkDrafter

ATOL = 1e-4  # measured differences are a few 1e-6


def first_round(d, p, features):
    item = ProposeItem(state=d.new_state(), new_features=features, new_positions_start=0,
                       new_tokens=p["prompt_ids"], anchor=p["anchor_token"], anchor_pos=p["num_prompt_tokens"])
    return d.draft([item])


def close(got, want):
    assert got.shape == want.shape
    diff = float((got - want).abs().max())
    assert diff <= ATOL, f"max abs diff {diff}"


@pytest.mark.parametrize("name,kind,cls", [("dspark", "dspark", DSparkDrafter), ("dspark-rnn", "dspark", DSparkDrafter),
                                           ("dflash", "dflash", DFlashDrafter)])
def test_loaded_drafter_kind_and_protocol(name, kind, cls, drafter):
    d = drafter(name)
    assert type(d) is cls and d.kind == kind and isinstance(d, Drafter)
    assert d.block_size == 4 and d.target_layer_ids == (0, 1, 2) and d.support_size == min(4096, d.vocab_size)
    assert (d.markov_head is None) == (name == "dflash")
    assert (d.confidence_head is None) == (name == "dflash")


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn", "dflash"])
def test_block_hidden_and_base_logits_match_reference(name, drafter, reference):
    d, ref = drafter(name), reference(name)
    for i, p in enumerate(ref.prompts):
        feats = ref.t(i, "context_features")
        assert p["block_input_ids"] == [p["anchor_token"]] + [d.config.mask_token_id] * 3
        close(d.project_context(feats), ref.t(i, "context_hidden"))
        out = first_round(d, p, feats)
        close(out.hidden[0], ref.t(i, "block_hidden"))
        close(out.base_logits[0], ref.t(i, "base_logits"))
        if name == "dflash":
            close(out.logits[0], ref.t(i, "base_logits"))
            assert out.confidence_logits is None


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn"])
def test_greedy_chain_matches_reference(name, drafter, reference):
    d, ref = drafter(name), reference(name)
    for i, p in enumerate(ref.prompts):
        out = first_round(d, p, ref.t(i, "context_features"))
        assert out.tokens[0].tolist() == p["greedy_draft_tokens"]
        assert out.prev_tokens[0].tolist() == [p["anchor_token"]] + p["greedy_draft_tokens"][:-1]
        close(out.logits[0], ref.t(i, "greedy_logits"))
        close(out.confidence_logits[0], ref.t(i, "greedy_confidence_logits"))
        close(torch.sigmoid(out.confidence_logits[0]), ref.t(i, "greedy_confidence_probs"))


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn"])
def test_teacher_forced_heads_match_reference(name, drafter, reference):
    d, ref = drafter(name), reference(name)
    for i, p in enumerate(ref.prompts):
        out = first_round(d, p, ref.t(i, "context_features"))
        teacher = torch.tensor([p["teacher_prev_tokens"]])
        tf = d.run_heads(out.hidden, out.base_logits, teacher[:, 0], teacher_prev=teacher)
        close(tf.logits[0], ref.t(i, "tf_logits"))
        assert tf.logits[0].argmax(-1).tolist() == p["tf_argmax"]
        close(tf.confidence_logits[0], ref.t(i, "tf_confidence_logits"))
        close(torch.sigmoid(tf.confidence_logits[0]), ref.t(i, "tf_confidence_probs"))


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn"])
def test_propose_returns_greedy_drafts_and_confidences(name, drafter, reference):
    d, ref = drafter(name), reference(name)
    for i, p in enumerate(ref.prompts):
        item = ProposeItem(state=d.new_state(), new_features=ref.t(i, "context_features"), new_positions_start=0,
                           new_tokens=p["prompt_ids"], anchor=p["anchor_token"], anchor_pos=p["num_prompt_tokens"])
        (prop,) = d.propose([item])
        assert prop.tokens == p["greedy_draft_tokens"]
        assert prop.support_ids is None and prop.support_probs is None
        close(prop.confidence_logits, ref.t(i, "greedy_confidence_logits"))
        close(prop.confidences, ref.t(i, "greedy_confidence_probs"))  # STS temperatures default to 1.0
        assert item.state.length == p["num_prompt_tokens"]


@pytest.mark.parametrize("name", ["dspark", "dspark-rnn", "dflash"])
def test_training_forward_equals_teacher_forced_inference(name, drafter, reference, target_features):
    """Dense block mask over several anchors == one inference round per anchor with teacher tokens."""
    d, ref = drafter(name), reference(name)
    p = ref.prompts[2]
    seq = p["prompt_ids"] + p["target_greedy_tokens"][:8]  # [S]
    _, feats = target_features(seq, d.target_layer_ids)  # [S, L * H]
    anchors = [3, 11, p["num_prompt_tokens"], len(seq) - 4]
    out = d.training_forward(torch.tensor([seq]), feats[None], torch.tensor([anchors]))
    assert out.logits.shape == (1, len(anchors), 4, 512)
    for j, a in enumerate(anchors):
        single = d.draft([ProposeItem(state=d.new_state(), new_features=feats[:a], new_positions_start=0,
                                      new_tokens=seq[:a], anchor=seq[a], anchor_pos=a)])
        teacher = torch.tensor([seq[a : a + 4]])
        tf = d.run_heads(single.hidden, single.base_logits, teacher[:, 0], teacher_prev=teacher)
        close(out.hidden[0, j], single.hidden[0])
        close(out.logits[0, j], tf.logits[0])
        if tf.confidence_logits is not None:
            close(out.confidence_logits[0, j], tf.confidence_logits[0])
    # the anchor right after the prompt reproduces the fixture's teacher-forced numbers
    j = anchors.index(p["num_prompt_tokens"])
    name_tf = "base_logits" if name == "dflash" else "tf_logits"
    close(out.logits[0, j], ref.t(2, name_tf))
