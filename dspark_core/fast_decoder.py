"""A lean forward pass for Llama-family decoders, over the weights of the loaded HF model.

Why: on a small target the stock HF module spends most of a decode step in Python (output capturing,
mask helpers, per-module hooks); a round of speculative decoding is then dominated by fixed per-call cost
rather than by the tokens verified. This module runs the same computation with fused projections
(one QKV matmul, one gate/up matmul) and nothing else per layer. It covers the architectures whose
layer is: pre-norm RMSNorm -> attention (optional q/k RMSNorm, RoPE, GQA) -> residual -> RMSNorm ->
SwiGLU MLP -> residual (Llama, Mistral without sliding window, Qwen2, Qwen3). `LeanDecoder.supports`
says whether a model qualifies; anything else keeps the stock module. RoPE comes from the model's own
rotary embedding, so scaled variants (linear, dynamic, YaRN, llama3) keep their exact cos/sin.

The weights are shared with the HF model (the fused matrices are concatenated copies, about one extra
copy of the attention and MLP input projections), or packed copies in another format (`linear`, see
dspark_core.packed_weights). Equality with the HF forward is tested
(tests/core/test_fast_decoder.py).

Knows nothing about slots, sequences or sampling: the caller supplies the KV cache object (anything with
`update(k, v, layer_idx)` returning the keys/values to attend to) and the attention mask.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .packed_weights import DenseLinear, PackedLinear

_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


# passes with at most this many new tokens per sequence run attention row by row when the projections are
# batch-invariant; None = every pass, prefill included (the default): then every position's logits are the
# one-row autoregressive step's bit for bit, whether the position came from a prompt prefill (beside any other
# prompts), a verify pass, a decode step or a resume that re-prefills prompt + generated tokens. On SmolLM2 a
# prefill costs ~13-16% more that way (301 tokens: 0.82 -> 0.95 s on one thread).
ROW_ATTENTION_MAX_ROWS: int | None = None


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # HF's Llama/Qwen RMSNorm: normalise in fp32, cast back, then scale
    if x.dtype == torch.float32 and weight.dtype == torch.float32:
        # in place on fresh tensors: five kernel calls; bitwise HF's (and F.rms_norm's, which on the CPU is a
        # composite of ~12 calls) for float32 (tests/core/test_fast_decoder.py)
        ms = torch.mul(x, x).mean(-1, keepdim=True)
        return torch.mul(x, ms.add_(eps).rsqrt_()).mul_(weight)
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rope(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor) -> torch.Tensor:
    """x cos + rotate_half(x) sin, as roll(x) * signed_sin (the first half of sin negated): four calls
    instead of seven, bitwise equal (negating a factor before or after a product rounds the same)."""
    return torch.mul(x, cos).add_(x.roll(x.shape[-1] // 2, -1).mul_(signed_sin))


def dense_linear(parts: list[tuple[str, torch.nn.Linear]]) -> DenseLinear:
    """The default `linear` builder: the parts' weights row-concatenated, as loaded (float32: no cast)."""
    linears = [l for _, l in parts]
    weight = linears[0].weight if len(linears) == 1 else torch.cat([l.weight for l in linears])
    biases = [l.bias for l in linears]
    bias = torch.cat(biases).detach() if all(b is not None for b in biases) else None
    return DenseLinear(weight.detach(), bias)


class _Layer:
    __slots__ = ("in_norm", "post_norm", "qkv", "q_norm", "k_norm", "o", "gate_up", "down")

    def __init__(self, layer, index: int, linear):
        attn, mlp = layer.self_attn, layer.mlp
        self.in_norm = layer.input_layernorm.weight
        self.post_norm = layer.post_attention_layernorm.weight
        pre = f"layers.{index}."
        self.qkv = linear([(pre + f"self_attn.{n}_proj", getattr(attn, f"{n}_proj")) for n in "qkv"])
        self.q_norm = attn.q_norm.weight if hasattr(attn, "q_norm") else None
        self.k_norm = attn.k_norm.weight if hasattr(attn, "k_norm") else None
        self.o = linear([(pre + "self_attn.o_proj", attn.o_proj)])
        self.gate_up = linear([(pre + "mlp.gate_proj", mlp.gate_proj), (pre + "mlp.up_proj", mlp.up_proj)])
        self.down = linear([(pre + "mlp.down_proj", mlp.down_proj)])


class LeanDecoder:
    """Forward of a supported HF decoder stack with fused projections and no per-module overhead."""

    @staticmethod
    def supports(hf_config) -> str | None:
        """None when the lean path computes exactly what the HF model does, else why not."""
        model_type = getattr(hf_config, "model_type", None)
        if model_type not in _FAMILIES:
            return f"model_type {model_type!r} is not one of {', '.join(_FAMILIES)}"
        if getattr(hf_config, "hidden_act", "silu") != "silu":
            return f"hidden_act {hf_config.hidden_act!r} is not silu"
        if getattr(hf_config, "sliding_window", None) and getattr(hf_config, "use_sliding_window", True):
            return "sliding-window attention"
        if getattr(hf_config, "mlp_bias", False):
            return "MLP biases"
        layer_types = getattr(hf_config, "layer_types", None) or ["full_attention"]
        if any(t != "full_attention" for t in layer_types):
            return f"layer types {sorted(set(layer_types))}"
        if getattr(hf_config, "pretraining_tp", 1) not in (None, 1):
            return "tensor-parallel pretraining split"
        return None

    def __init__(self, decoder, hf_config, linear=None):
        """`linear(parts) -> PackedLinear` builds each (fused) projection from its parts, a list of
        (name, nn.Linear) with names like `layers.3.self_attn.q_proj` (default: `dense_linear`, the loaded
        weights; dspark_core.target passes int8 / int4 / GGUF builders for `--weights`)."""
        reason = self.supports(hf_config)
        if reason is not None:
            raise ValueError(f"LeanDecoder does not support this model: {reason}")
        self.embed = decoder.embed_tokens
        self.rotary = decoder.rotary_emb
        self.norm_w = decoder.norm.weight
        self.eps = float(hf_config.rms_norm_eps)
        self.num_heads = hf_config.num_attention_heads
        self.num_kv_heads = getattr(hf_config, "num_key_value_heads", None) or self.num_heads
        self.head_dim = getattr(hf_config, "head_dim", None) or hf_config.hidden_size // self.num_heads
        self.scaling = self.head_dim ** -0.5
        self.layers = [_Layer(layer, i, linear or dense_linear) for i, layer in enumerate(decoder.layers)]
        self.inter = getattr(hf_config, "intermediate_size", 0)
        # every projection batch-invariant (the packed formats): then a verify pass's attention runs row by row
        # over exactly the keys each row sees, so that pass computes each row bitwise as the one-row
        # autoregressive step at that position does (`_row_attention`); with dense weights it would not pay
        from .packed_weights import row_invariant
        self.row_invariant = all(row_invariant(m) for m in self.linears())
        # our row-by-row attention kernel (dspark_core.kernels): one call a layer instead of one SDPA call a row
        # and layer, the same operations for every row however many come with it (~1 ms a verified row on
        # SmolLM2 otherwise); None: SDPA row by row
        self._attn = None
        from . import packed_weights

        if self.row_invariant and self.head_dim % 16 == 0 and self.head_dim <= 256 \
                and self.norm_w.dtype == torch.float32 and self.norm_w.device.type == "cpu" \
                and packed_weights.GGUF_KERNEL != "torch":  # "torch": PyTorch's kernels only (comparisons)
            from .kernels import q8dot_unavailable

            if q8dot_unavailable() is None:
                self._attn = torch.ops.dspark_cpu.row_attention.default
        # and the elementwise steps between the matmuls in one call each (norms, RoPE + head split, SwiGLU):
        # ~1,000 small PyTorch ops a SmolLM2 step otherwise
        hidden = self.norm_w.numel()
        self._glue = (self._attn is not None and hidden % 16 == 0 and self.inter % 16 == 0
                      and self.head_dim % 2 == 0 and all(L.q_norm is None for L in self.layers))
        if self._glue:
            ops = torch.ops.dspark_cpu
            self._norm_op, self._silu_op, self._rope_op = ops.rms_norm.default, ops.silu_mul.default, \
                ops.rope_split.default
            # the attention output in the rows-major layout the output projection reads (no transpose copy)
            self._attn_rows = ops.row_attention_rows.default

    def _row_attention(self, qs: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                       by_row: list[list[int | None]], lengths: torch.Tensor | None = None) -> torch.Tensor:
        """qs [n, h, q, d]; keys / values [n, kvh, kv, d] -> [n, h, q, d]: row i of sequence r attends to its
        first by_row[r][i] keys alone, in a call of the one-row step's own shape (no mask, no padding), so
        its softmax reduces over exactly the keys the autoregressive step at that position reduces over.
        `lengths`: by_row as our attention kernel's int64 [n, q] (0 for a padded row), built once a pass."""
        if lengths is not None and qs.dtype == torch.float32:
            return self._attn(qs, keys, values, lengths, self.scaling)
        gqa = self.num_kv_heads != self.num_heads
        if len(by_row) == 1 and len(by_row[0]) == 1 and by_row[0][0] == keys.shape[2]:
            # one row seeing every key (a batch-1 decode step): the call below as is, without the copy
            return F.scaled_dot_product_attention(qs, keys, values, scale=self.scaling, enable_gqa=gqa)
        out = qs.new_zeros(qs.shape)
        for r, lengths in enumerate(by_row):
            for i, length in enumerate(lengths):
                if length is None:
                    continue
                out[r:r + 1, :, i:i + 1] = F.scaled_dot_product_attention(
                    qs[r:r + 1, :, i:i + 1], keys[r:r + 1, :, :length], values[r:r + 1, :, :length],
                    scale=self.scaling, enable_gqa=gqa)
        return out

    def _glued(self, x, n, q, cos, sin, lengths, cache, keep_layers, kept, rows):
        """The layer loop of __call__ with our kernels for everything between the matmuls (same math: HF's
        RMSNorm, x cos + roll(x) signed_sin, silu(g) u), for the batch-invariant path."""
        h, d, kvh = self.num_heads, self.head_dim, self.num_kv_heads
        norm, rope, silu_mul, attend = self._norm_op, self._rope_op, self._silu_op, self._attn_rows
        for li, L in enumerate(self.layers):
            qkv = L.qkv(norm(x, L.in_norm, self.eps))  # [N, (h + 2 kvh) d]
            if rows is not None:
                qkv = qkv.new_zeros(n * q, qkv.shape[-1]).index_copy_(0, rows, qkv)
            qs, ks, vs = rope(qkv, cos, sin, n, h, kvh)
            keys, values = cache.update(ks, vs, li)
            attn = attend(qs, keys, values, lengths, self.scaling)  # [n * q, h * d]
            if rows is not None:
                attn = attn.index_select(0, rows)
            x = x + L.o(attn)
            x = x + L.down(silu_mul(L.gate_up(norm(x, L.post_norm, self.eps))))
            if li in keep_layers:
                kept[li] = x
        return norm(x, self.norm_w, self.eps), kept

    def attends_by_row(self, q: int) -> bool:
        """Whether a pass of `q` new tokens a sequence runs attention row by row over each row's own keys (then
        the additive mask goes unused and need not be built)."""
        return self.row_invariant and (ROW_ATTENTION_MAX_ROWS is None or q <= ROW_ATTENTION_MAX_ROWS)

    def linears(self) -> list[PackedLinear]:
        """Every matmul of one forward but the LM head, in order."""
        return [m for L in self.layers for m in (L.qkv, L.o, L.gate_up, L.down)]

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None,
                 cache, keep_layers: tuple[int, ...] = (), rows: torch.Tensor | None = None
                 ) -> tuple[torch.Tensor, dict[int, torch.Tensor]]:
        """input_ids, position_ids [n, q]; attention_mask [n, 1, q, kv] additive or None (attend to all);
        rows: indices into the n * q padded positions of the real tokens (None = no padding).

        Returns the final-norm hidden states of the real tokens, flattened row-major ([N, hidden], N = n * q
        or len(rows)), and the outputs of the layers in `keep_layers` (HF `hidden_states[l + 1]`; -1 = the
        embedding output) in the same layout. Everything but attention runs on the real tokens only, so a
        ragged batch (one request verifying 7 drafts, the others 1) costs its real token count, not
        n x the longest block.
        """
        n, q = input_ids.shape
        h, d, kvh = self.num_heads, self.head_dim, self.num_kv_heads
        # with batch-invariant projections, attention row by row (every pass, or those of at most
        # ROW_ATTENTION_MAX_ROWS rows); by_row[r][i] = keys row i of sequence r sees (its position + 1), None for
        # a padded row
        by_row = None
        if self.attends_by_row(q):
            lengths = (position_ids + 1).tolist()
            real = None if rows is None else set(rows.tolist())
            by_row = [[lengths[r][i] if real is None or r * q + i in real else None for i in range(q)]
                      for r in range(n)]
        flat_ids = input_ids.reshape(n * q)
        x = self.embed(flat_ids if rows is None else flat_ids[rows])  # [N, hidden]
        kept: dict[int, torch.Tensor] = {}
        if -1 in keep_layers:
            kept[-1] = x
        cos, sin = self.rotary(x, position_ids)  # [n, q, d]
        half = d // 2
        sin = torch.cat((sin[..., :half].neg(), sin[..., half:]), dim=-1)  # signed for _rope
        lengths = None  # by_row for our attention kernel, once a pass
        if by_row is not None and self._attn is not None:
            lengths = torch.tensor([[0 if m is None else m for m in row] for row in by_row], dtype=torch.long)
        if self._glue and lengths is not None and x.dtype == torch.float32:
            return self._glued(x, n, q, cos.contiguous(), sin.contiguous(), lengths, cache, keep_layers, kept, rows)
        cos, sin = cos[:, None], sin[:, None]  # [n, 1, q, d]
        hk = h + kvh
        for li, L in enumerate(self.layers):
            hs = _rms_norm(x, L.in_norm, self.eps)
            qkv = L.qkv(hs)  # [N, (h + 2 kvh) d]
            if rows is not None:
                qkv = qkv.new_zeros(n * q, qkv.shape[-1]).index_copy_(0, rows, qkv)
            heads = qkv.view(n, q, hk + kvh, d)
            vs = heads[:, :, hk:].transpose(1, 2)  # [n, kvh, q, d]
            if L.q_norm is None:
                # RoPE on the query and key heads at once: [n, h + kvh, q, d]
                qk = _rope(heads[:, :, :hk].transpose(1, 2), cos, sin)
                qs, ks = qk[:, :h], qk[:, h:]
            else:
                qs = _rope(_rms_norm(heads[:, :, :h], L.q_norm, self.eps).transpose(1, 2), cos, sin)
                ks = _rope(_rms_norm(heads[:, :, h:hk], L.k_norm, self.eps).transpose(1, 2), cos, sin)
            keys, values = cache.update(ks, vs, li)
            if by_row is not None:
                attn = self._row_attention(qs, keys, values, by_row, lengths)
            else:
                attn = F.scaled_dot_product_attention(qs, keys, values, attn_mask=attention_mask,
                                                      scale=self.scaling, enable_gqa=kvh != h)
            attn = attn.transpose(1, 2).reshape(n * q, h * d)
            if rows is not None:
                attn = attn.index_select(0, rows)
            x = x + L.o(attn)
            hs = _rms_norm(x, L.post_norm, self.eps)
            gate_up = L.gate_up(hs)
            x = x + L.down(F.silu(gate_up[..., : self.inter]).mul_(gate_up[..., self.inter:]))
            if li in keep_layers:
                kept[li] = x
        return _rms_norm(x, self.norm_w, self.eps), kept
