"""The target runtime: ragged batched forwards equal unbatched ones; rollback equals a fresh forward."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from dspark_core.errors import InvalidArgument, ModelLoadError, ResourceExhausted
from dspark_core.target import TargetConfig, TargetRuntime

ATOL = 1e-4


def reference(model_dir, ids, taps):
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        out = model(torch.tensor([ids]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[l + 1][0] for l in taps], dim=-1) if taps else None
    return out.logits[0], feats


@pytest.fixture(params=["qwen3", "llama"])
def model_dir(request, tiny_target_dir, tiny_llama_dir):
    return tiny_target_dir if request.param == "qwen3" else tiny_llama_dir


@pytest.mark.parametrize("lean", [True, False], ids=["lean", "stock-hf"])
def test_ragged_batched_logits_equal_unbatched(model_dir, lean):
    taps = (0, 1)
    rt = TargetRuntime(TargetConfig(str(model_dir), device="cpu", dtype="float32", tap_layer_ids=taps, lean=lean))
    assert (rt._lean is not None) == lean
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, rt.vocab_size, (n,), generator=g).tolist() for n in (7, 15, 2, 11)]
    seqs = [rt.new_sequence() for _ in prompts]
    out = rt.forward(list(zip(seqs, prompts)))
    for r, ids in enumerate(prompts):
        logits, feats = reference(model_dir, ids, taps)
        torch.testing.assert_close(out.logits_of(r), logits, atol=ATOL, rtol=0)
        torch.testing.assert_close(out.taps_of(r), feats, atol=ATOL, rtol=0)
    # A verification step: every sequence appends its own number of tokens, given out of slot order.
    blocks = {3: [5, 6, 7], 0: [9], 2: [1, 2, 3, 4, 5, 6], 1: [8, 8]}
    out = rt.forward([(seqs[i], blocks[i]) for i in blocks])
    for r, i in enumerate(blocks):
        logits, feats = reference(model_dir, prompts[i] + blocks[i], taps)
        n = len(blocks[i])
        torch.testing.assert_close(out.logits_of(r), logits[-n:], atol=ATOL, rtol=0)
        torch.testing.assert_close(out.taps_of(r), feats[-n:], atol=ATOL, rtol=0)


def test_rollback_then_reextend_equals_fresh_forward(tiny_target_dir):
    rt = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    a, b = rt.new_sequence(), rt.new_sequence()
    rt.forward([(a, [3, 4, 5, 6]), (b, [7, 8])])
    rt.forward([(a, [10, 11, 12, 13]), (b, [14, 15, 16])])  # drafts
    rt.truncate(a, 5)  # keep the anchor 10 only
    rt.truncate(b, 4)  # keep 14, 15
    out = rt.forward([(a, [20, 21]), (b, [22])])
    fresh_a, _ = reference(tiny_target_dir, [3, 4, 5, 6, 10, 20, 21], ())
    fresh_b, _ = reference(tiny_target_dir, [7, 8, 14, 15, 22], ())
    torch.testing.assert_close(out.logits_of(0), fresh_a[-2:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits_of(1), fresh_b[-1:], atol=ATOL, rtol=0)


def test_release_keeps_other_sequences_intact(tiny_target_dir):
    rt = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    seqs = [rt.new_sequence() for _ in range(3)]
    rt.forward([(s, [i + 1, i + 2, i + 3]) for i, s in enumerate(seqs)])
    rt.release(seqs[0])  # the last slot moves into the hole
    out = rt.forward([(seqs[2], [30]), (seqs[1], [20])])
    torch.testing.assert_close(out.logits_of(0), reference(tiny_target_dir, [3, 4, 5, 30], ())[0][-1:], atol=ATOL, rtol=0)
    torch.testing.assert_close(out.logits_of(1), reference(tiny_target_dir, [2, 3, 4, 20], ())[0][-1:], atol=ATOL, rtol=0)
    assert rt.num_active == 2


def test_last_logits_only_matches_full(tiny_target_dir):
    rt = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    s1, s2 = rt.new_sequence(), rt.new_sequence()
    out = rt.forward([(s1, [1, 2, 3]), (s2, [4, 5, 6, 7, 8])], last_logits_only=True)
    assert out.logits.shape[0] == 2
    torch.testing.assert_close(out.logits_of(1)[0], reference(tiny_target_dir, [4, 5, 6, 7, 8], ())[0][-1], atol=ATOL, rtol=0)


def test_missing_model_dir_names_the_path(tmp_path):
    with pytest.raises(ModelLoadError, match="not found"):
        TargetRuntime(TargetConfig(str(tmp_path / "nope")))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelLoadError, match="no config.json"):
        TargetRuntime(TargetConfig(str(tmp_path / "empty")))


def test_last_layer_cannot_be_tapped(tiny_target_dir):
    with pytest.raises(InvalidArgument, match="tap_layer_ids"):
        TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", tap_layer_ids=(0, 3)))
    with pytest.raises(InvalidArgument, match="strictly increasing"):
        TargetConfig(str(tiny_target_dir), tap_layer_ids=(1, 1))


def test_context_window_is_enforced(tiny_target_dir):
    rt = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    s = rt.new_sequence()
    with pytest.raises(ResourceExhausted, match="context window"):
        rt.forward([(s, [1] * (rt.max_context + 1))])
    with pytest.raises(InvalidArgument, match="token_ids"):
        rt.forward([(s, [rt.vocab_size + 5])])
