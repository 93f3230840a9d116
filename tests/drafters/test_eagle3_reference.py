"""Eagle3 reproduces DeepSpec's prefill row, teacher-forced chain and greedy chain."""

import torch

from dspark_core.drafters import Drafter, ProposeItem
from dspark_core.drafters.eagle3 import Eagle3Drafter

# Eagle3 pre-norm hidden states reach magnitudes ~77: fixture README 6.5 compares with rtol=atol=1e-5.
HIDDEN = dict(atol=1e-4, rtol=1e-5)
LOGITS = dict(atol=1e-4, rtol=0.0)


def prefill(d, p, feats):
    state = d.new_state()
    (rows,) = d.extend([state], [feats], [p["prompt_ids"][1:] + [p["anchor_token"]]], [0])
    return state, rows


def test_loaded_eagle3_kind_and_protocol(drafter):
    d = drafter("eagle3")
    assert type(d) is Eagle3Drafter and d.kind == "eagle3" and isinstance(d, Drafter)
    assert d.block_size == 4 and d.target_layer_ids == (0, 1, 2, 3, 4)


def test_prefill_rows_match_reference(drafter, reference):
    d, ref = drafter("eagle3"), reference("eagle3")
    for i, p in enumerate(ref.prompts):
        assert p["prefill_draft_input_ids"] == p["prompt_ids"][1:] + [p["anchor_token"]]
        state, rows = prefill(d, p, ref.t(i, "context_features"))
        expected = ref.t(i, "prefill_draft_hidden")
        torch.testing.assert_close(rows[-1], expected[-1], **HIDDEN)
        torch.testing.assert_close(rows, expected, **HIDDEN)  # causal prefill: every row matches too
        assert state.length == p["num_prompt_tokens"]


def test_teacher_and_greedy_chains_match_reference(drafter, reference):
    d, ref = drafter("eagle3"), reference("eagle3")
    for i, p in enumerate(ref.prompts):
        state, _ = prefill(d, p, ref.t(i, "context_features"))
        pos = torch.tensor([p["num_prompt_tokens"]])
        assert p["chain_position_ids"] == list(range(p["num_prompt_tokens"], p["num_prompt_tokens"] + 3))
        tf = d.chain([state], pos, teacher_tokens=torch.tensor([p["teacher_chain_tokens"]]))
        torch.testing.assert_close(tf.hidden[0], ref.t(i, "tf_chain_hidden"), **HIDDEN)
        torch.testing.assert_close(tf.logits[0], ref.t(i, "tf_chain_logits"), **LOGITS)
        greedy = d.chain([state], pos)
        torch.testing.assert_close(greedy.hidden[0], ref.t(i, "greedy_chain_hidden"), **HIDDEN)
        torch.testing.assert_close(greedy.logits[0], ref.t(i, "greedy_chain_logits"), **LOGITS)
        assert greedy.tokens[0].tolist() == p["greedy_draft_tokens"]
        assert state.length == p["num_prompt_tokens"]  # the chain never touches the committed cache


def test_propose_after_prefill_returns_greedy_drafts(drafter, reference):
    d, ref = drafter("eagle3"), reference("eagle3")
    for i, p in enumerate(ref.prompts):
        item = ProposeItem(state=d.new_state(), new_features=ref.t(i, "context_features"), new_positions_start=0,
                           new_tokens=p["prompt_ids"], anchor=p["anchor_token"], anchor_pos=p["num_prompt_tokens"])
        (prop,) = d.propose([item])
        assert prop.tokens == p["greedy_draft_tokens"]
        assert prop.confidences is None and prop.confidence_logits is None and prop.support_ids is None
