"""The lean decoder path: which models take it, and that sharing frozen weights with a drafter is exact."""

from __future__ import annotations

import pytest
import torch
from transformers import GPT2Config, LlamaConfig, Qwen2Config, Qwen3Config

from dspark_core.drafters.checkpoint import share_target_weights
from dspark_core.fast_decoder import LeanDecoder
from dspark_core.target import TargetConfig, TargetRuntime

pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.mark.parametrize("config", [Qwen3Config(), LlamaConfig(), Qwen2Config()], ids=["qwen3", "llama", "qwen2"])
def test_llama_family_is_supported(config):
    assert LeanDecoder.supports(config) is None


@pytest.mark.parametrize("config, reason", [
    (GPT2Config(), "model_type 'gpt2'"),
    (LlamaConfig(hidden_act="gelu"), "hidden_act 'gelu'"),
    (LlamaConfig(mlp_bias=True), "MLP biases"),
    (Qwen2Config(use_sliding_window=True, sliding_window=64), "sliding-window"),
], ids=["gpt2", "gelu", "mlp-bias", "sliding-window"])
def test_other_models_keep_the_stock_module_and_say_why(config, reason):
    assert reason in LeanDecoder.supports(config)


def test_greedy_decode_is_identical_on_both_paths(tiny_target_dir):
    """A 40-token greedy decode, one token per forward as AR decoding does it, matches token for token."""
    outs = []
    for lean in (True, False):
        rt = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32", lean=lean))
        seq = rt.new_sequence()
        out = rt.forward([(seq, [5, 9, 17, 3])], last_logits_only=True)
        toks = [int(out.logits[0].argmax())]
        for _ in range(40):
            toks.append(int(rt.forward([(seq, toks[-1:])]).logits[0].argmax()))
        outs.append(toks)
    assert outs[0] == outs[1]


def test_share_target_weights_only_shares_identical_tensors():
    class Drafter(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = torch.nn.Embedding(10, 4)
            self.lm_head = torch.nn.Linear(4, 10, bias=False)

    d = Drafter()
    embed = d.embed_tokens.weight.detach().clone()
    lm_head = torch.randn(10, 4)  # different values: must stay the drafter's own
    assert share_target_weights(d, embed, lm_head) == ["embed_tokens"]
    assert d.embed_tokens.weight.data_ptr() == embed.data_ptr()
    assert not torch.equal(d.lm_head.weight, lm_head)
    assert share_target_weights(d, embed, lm_head) == []  # idempotent


def test_the_lean_norm_and_rope_are_bitwise_the_formulas_they_replace():
    """The batch-1 decode step's elementwise work in fewer calls (fast_decoder._rms_norm / _rope) computes
    exactly what HF's RMSNorm / `x cos + rotate_half(x) sin` compute, bit for bit, at every scale."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb

    from dspark_core.fast_decoder import _rms_norm, _rope

    torch.manual_seed(0)
    for size, scale in ((64, 1e-3), (576, 1.0), (576, 40.0), (960, 7.0)):
        ref = LlamaRMSNorm(size, eps=1e-5)
        ref.weight.data = torch.randn(size)
        for shape in ((1, size), (5, size), (2, 3, size)):
            x = torch.randn(*shape) * scale
            assert torch.equal(_rms_norm(x, ref.weight.data, 1e-5), ref(x))
            assert torch.equal(_rms_norm(x, ref.weight.data, 1e-5),
                               torch.nn.functional.rms_norm(x, (size,), ref.weight.data, 1e-5))
    d = 64
    q, k = torch.randn(2, 9, 5, d) * 3, torch.randn(2, 3, 5, d)
    angles = torch.randn(2, 5, d // 2) * 20
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)  # unsqueezes dim 1
    signed = torch.cat((-sin[..., : d // 2], sin[..., d // 2:]), -1)[:, None]
    assert torch.equal(_rope(q, cos[:, None], signed), ref_q)
    assert torch.equal(_rope(k.transpose(1, 2).contiguous().transpose(1, 2), cos[:, None], signed), ref_k)
