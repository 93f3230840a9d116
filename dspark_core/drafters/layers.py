"""Qwen3 building blocks shared by every drafter: RMSNorm, RoPE, attention, SwiGLU MLP, decoder layer.

A pure-PyTorch reference written from algorithms.md sections 1-2 and the fixture README 4.1/4.2:
- RMSNorm in float32 with a weight: `weight * x / sqrt(mean(x^2) + eps)` (no `1 + weight`).
- Default RoPE, non-interleaved "rotate half": `inv_freq = theta^(-2i/d)`, cos/sin of `cat(freqs, freqs)`.
- Attention: q/k/v projections, per-head q_norm / k_norm *before* RoPE, grouped-query attention by
  repeating KV heads, scale `head_dim^-0.5`, torch SDPA with an optional boolean mask (True = attend).
- Decoder layer: pre-norm attention + SwiGLU MLP with residuals. Keys/values of the layer's own rows are
  appended after any `past` keys/values the caller passes (DFlash-style context injection, KV caches).

Module and parameter names match DeepSpec / Hugging Face Qwen3 so that state dicts load by name.
Nothing here knows about drafting rounds, requests or checkpoints.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from dspark_core.drafters.config import DrafterConfig


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float):
        super().__init__()
        # [size]
        self.weight = nn.Parameter(torch.ones(size))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            if _glue_rms_norm(x):
                # inference on the CPU: our kernel, one call (F.rms_norm is ~20 us of small ops on a drafter
                # block's 7 x 576; a batch-1 round makes ~8 of them); a row's result independent of the batch
                rows = x.reshape(-1, x.shape[-1]).contiguous()
                return torch.ops.dspark_cpu.rms_norm.default(rows, self.weight, self.eps).view(x.shape)
            # one fused op, bitwise the reference below for float32 (tests/drafters/test_fast_paths.py)
            return F.rms_norm(x, self.weight.shape, self.weight, self.eps)
        return self.reference(x)

    def reference(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def _glue_rms_norm(x: torch.Tensor) -> bool:
    """Whether an inference RMSNorm of `x` (float32) runs in our CPU kernel (dspark_core.kernels.glue)."""
    if torch.is_grad_enabled() or x.device.type != "cpu" or x.shape[-1] % 16 or not x.numel():
        return False
    from ..kernels import q8dot_unavailable

    return q8dot_unavailable() is None


def _row_attention_kernel(attn: nn.Module, q: torch.Tensor) -> bool:
    """Whether an inference attention over all keys runs in our CPU kernel."""
    if not _inference(attn) or q.device.type != "cpu" or q.dtype != torch.float32 or attn.head_dim % 16 \
            or attn.head_dim > 256 or not q.numel():
        return False
    from ..kernels import q8dot_unavailable

    return q8dot_unavailable() is None


def _fused_weight(module: nn.Module, parts: tuple[nn.Linear, ...], dtype: torch.dtype | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The row-concatenation of several Linear layers' weights (and biases), cached on `module` and rebuilt
    whenever any of them changes (storage or in-place version), for one matmul instead of several at
    inference. With `dtype` the weight copy is cast to it (the bias keeps its own dtype). Training never uses
    it: gradients must flow to the separate parameters."""
    slot = (dtype, tuple(id(l) for l in parts))
    key = tuple((l.weight.data_ptr(), l.weight._version) for l in parts)
    caches = module.__dict__.setdefault("_fused_cache", {})
    cache = caches.get(slot)
    if cache is None or cache[0] != key:
        weight = torch.cat([l.weight for l in parts]).detach()
        biases = [l.bias for l in parts]
        bias = torch.cat(biases).detach() if all(b is not None for b in biases) else None
        if dtype == torch.int8:
            weight = quantize_int8(weight)
        elif dtype == "q8dot":
            from ..kernels import pack_q8

            weight = pack_q8(*quantize_q8_blocks(weight))
        elif dtype is not None:
            weight = weight.to(dtype)
        cache = caches[slot] = (key, weight, bias)
    return cache[1], cache[2]


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-output-channel int8: (int8 [N, K], bf16 scales [N]) with weight ~ q * scale."""
    w = weight.float()
    scales = (w.abs().amax(dim=1) / 127.0).clamp(min=1e-12)
    q = torch.round(w / scales[:, None]).clamp_(-127, 127).to(torch.int8)
    return q.contiguous(), scales.to(torch.bfloat16)


def quantize_q8_blocks(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per block of 32 inputs (GGUF's Q8_0): (int8 codes [N, K], scales [N, K / 32]), the scales
    rounded to fp16 first and the codes chosen against them, weight ~ q * scale."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // 32, 32)
    scales = (w.abs().amax(-1) / 127.0).clamp(min=1e-7).half().float()
    q = torch.round(w / scales[..., None]).clamp_(-127, 127).to(torch.int8)
    return q.reshape(n, k), scales


def q8dot_fits(n: int, k: int) -> bool:
    """Whether an [N, K] weight can run in our integer kernels (dspark_core.kernels) here."""
    from ..kernels import q8dot_unavailable

    return n % 16 == 0 and k % 32 == 0 and q8dot_unavailable() is None


# At most this many rows go through the int8 kernel; more rows take the fallback (the kernel is built for
# decode-sized batches: on AVX512-BF16, 224 rows of the LM head cost 4.3 ms in int8, 1.2 ms in bf16).
INT8_MAX_ROWS = 32


def _q8dot_max_rows() -> int:
    """Rows up to which our integer kernel beats the fallback, by CPU. With AMX (Intel Sapphire Rapids and
    later) the bf16 matmul's tiles win past ~32 rows (224 rows of the LM head: int8 4.3 ms, bf16 1.2 ms).
    Without AMX (AVX512-VNNI / BF16 only, e.g. AMD Zen 4) ours stays ahead of bf16 to 256 rows and even at
    1,024 (the SmolLM2 drafter's shapes, one thread: fused gate/up 3072 x 576 at 64 rows 0.54 vs 0.84 ms,
    at 256 rows 2.15 vs 2.76 ms, at 1,024 8.9 vs 10.8 ms; the float32 fallback of the smaller layers is
    ~4-6x slower still), which is what the drafter's catch-up over skipped positions and batched drafting
    at high concurrency run (`scripts/measure_q8_rows.py`)."""
    from ..kernels import _cpu_flags

    return INT8_MAX_ROWS if "amx_bf16" in _cpu_flags() else 4096


Q8DOT_MAX_ROWS = _q8dot_max_rows()


def int8_matmul_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int8pack_mm")


def fused_linear(owner: nn.Module, parts: tuple[nn.Linear, ...], x: torch.Tensor) -> torch.Tensor:
    """Inference only: x @ [W_1; ..; W_n]^T (+ biases) as one matmul. When `set_matmul_dtype` gave `owner` a
    matmul dtype, the product runs on a cached copy of the weights in that dtype (activations cast in and the
    result cast back, the bias added in x's dtype); int8 means int8 weights with per-channel scales and bf16
    activations for up to INT8_MAX_ROWS rows, and the owner's `matmul_fallback` dtype beyond. Where our integer
    kernels run (AVX512-VNNI, N % 16 == 0, K % 32 == 0; up to Q8DOT_MAX_ROWS rows) int8 is theirs instead:
    weights in blocks of 32 with an fp16 scale each, activations quantized per row and block of 32, exact
    integer dot products (measured on
    the SmolLM2 DSpark drafter's 7-row matmuls: ~4x faster than `_weight_int8pack_mm`, which dequantizes
    every weight for every few rows)."""
    dtype = owner.__dict__.get("matmul_dtype")
    if dtype == torch.int8:
        k = x.shape[-1]
        rows = x.numel() // k
        if rows <= Q8DOT_MAX_ROWS and owner.__dict__.get("matmul_q8dot") \
                and sum(p.out_features for p in parts) % 16 == 0 and k % 32 == 0:
            packed, bias = _fused_weight(owner, parts, "q8dot")
            n = packed.shape[0] * 16
            out = torch.ops.dspark_cpu.q8_mm.default(x.reshape(rows, k).float().contiguous(), packed, n)
            out = out.to(x.dtype).reshape(*x.shape[:-1], n)
            return out if bias is None else out + bias
        if rows <= INT8_MAX_ROWS and not owner.__dict__.get("matmul_q8dot_only"):
            (q, scales), bias = _fused_weight(owner, parts, torch.int8)
            out = torch.ops.aten._weight_int8pack_mm(x.reshape(rows, k).to(torch.bfloat16), q, scales)
            out = out.to(x.dtype).reshape(*x.shape[:-1], q.shape[0])
            return out if bias is None else out + bias
        dtype = owner.__dict__.get("matmul_fallback")
    if dtype == x.dtype:
        dtype = None
    if dtype is None and len(parts) == 1:
        return F.linear(x, parts[0].weight, parts[0].bias)  # nothing to fuse or cast: no copy
    weight, bias = _fused_weight(owner, parts, dtype)
    if dtype is None:
        return F.linear(x, weight, bias)
    out = F.linear(x.to(dtype), weight).to(x.dtype)
    return out if bias is None else out + bias


class Linear(nn.Linear):
    """`nn.Linear` (same parameters and names) whose inference forward honours `set_matmul_dtype`."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.__dict__.get("matmul_dtype") is None or not _inference(self):
            return super().forward(x)
        return fused_linear(self, (self,), x)


# Matmuls with fewer weights, or a shorter reduction, stay in the model dtype: the cast and the bf16 kernel's
# fixed cost outweigh the halved weight traffic. Measured with bf16 on AVX512-BF16, 7 rows, weights cold (as
# they are after a target forward): the 256 x 4096 LM head 480 -> 240 us, the fused 256 x 1536 gate/up
# 190 -> 130 us, but a 256 x 512 fused q/k/v 80 -> 105 us and the rank-32 Markov W2 40 -> 110 us.
MIN_LOW_PRECISION_WEIGHTS = 262144
MIN_LOW_PRECISION_REDUCTION = 256
MIN_INT8_WEIGHTS = 65536  # smaller matmuls are call overhead, not weight traffic: int8 gains nothing there


def matmul_dtype_name(model: nn.Module) -> str:
    """What `model`'s larger inference matmuls run in, as a name: its parameters' dtype unless set; `int8` for
    int8 weights (small batches) with their fallback."""
    dtypes = {m.__dict__["matmul_dtype"] for m in model.modules() if m.__dict__.get("matmul_dtype") is not None}
    if torch.int8 in dtypes:
        return "int8"
    dtype = dtypes.pop() if len(dtypes) == 1 else next(model.parameters()).dtype
    return str(dtype).removeprefix("torch.")


def set_matmul_dtype(model: nn.Module, dtype: torch.dtype | None, native_bf16: bool = True) -> None:
    """Run the inference matmuls of `model`'s linear layers (the fused ones included) through weight copies in
    `dtype` (None: the model's own dtype). Drafts are proposals, not outputs: their precision moves acceptance,
    never what the target commits. Weights, state dicts and training are unchanged.

    bfloat16: only layers with at least MIN_LOW_PRECISION_WEIGHTS weights and a reduction of at least
    MIN_LOW_PRECISION_REDUCTION. int8: every layer with that reduction and MIN_INT8_WEIGHTS weights, for batches
    up to INT8_MAX_ROWS rows; larger batches fall back to bf16 where bf16 would apply, else the model dtype.
    `native_bf16=False` (a CPU that emulates bf16, e.g. AVX2 only): int8 means our integer kernels alone, which
    quantize activations to int8 and need no bf16; the layers they do not take, and batches past their row
    limit, stay in the model dtype (PyTorch's int8 kernel and the bf16 fallback would run bf16 in software)."""
    for module in model.modules():
        for name in ("matmul_dtype", "matmul_fallback", "matmul_q8dot", "matmul_q8dot_only", "_fused_cache"):
            module.__dict__.pop(name, None)
        linears = [module] if isinstance(module, nn.Linear) else \
            [c for c in module.children() if isinstance(c, nn.Linear)]
        if dtype is None or not linears:
            continue
        weights = sum(l.weight.numel() for l in linears)
        wide = min(l.in_features for l in linears) >= MIN_LOW_PRECISION_REDUCTION
        big = wide and weights >= MIN_LOW_PRECISION_WEIGHTS
        # our kernel: every layer (of a module: every fused group, which shares its reduction) whose shape it
        # takes, the short reductions too (a rank-64 Markov W2 of 8,192 ids, one row: 88 us in float32, 14 in
        # ours); PyTorch's int8 kernel only for the wide ones (its fixed cost dominates a short reduction)
        q8 = weights >= MIN_INT8_WEIGHTS and all(l.weight.device.type == "cpu" for l in linears) \
            and all(q8dot_fits(l.out_features, l.in_features) for l in linears)
        if dtype == torch.int8 and (q8 or (native_bf16 and wide and weights >= MIN_INT8_WEIGHTS)):
            module.matmul_dtype = torch.int8
            if q8:
                module.matmul_q8dot = True
                if not (wide and native_bf16):
                    module.matmul_q8dot_only = True
            if big and native_bf16:
                module.matmul_fallback = torch.bfloat16
        elif big:
            module.matmul_dtype = torch.bfloat16 if dtype == torch.int8 else dtype


def _inference(module: nn.Module) -> bool:
    return not module.training and not torch.is_grad_enabled()


def rope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, dtype: torch.dtype):
    """cos, sin of shape [*positions.shape, head_dim] for integer positions (computed in float32)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device=positions.device).float() / head_dim
    inv_freq = 1.0 / (theta ** exponents)  # [head_dim / 2]
    freqs = positions[..., None].float() * inv_freq  # [..., head_dim / 2]
    emb = torch.cat((freqs, freqs), dim=-1)  # [..., head_dim]
    return emb.cos().to(dtype), emb.sin().to(dtype)


class RopeTable:
    """cos/sin of every position 0..capacity-1, computed once with `rope_cos_sin` and indexed per call (two
    gathers instead of ~10 small ops a round). Values are bitwise those of `rope_cos_sin` (the same elementwise
    ops per position); the table doubles when a larger position shows up."""

    def __init__(self, head_dim: int, theta: float):
        self.head_dim, self.theta = head_dim, theta
        self._key, self._cos, self._sin = None, None, None

    def __call__(self, positions: torch.Tensor, dtype: torch.dtype):
        """positions (any shape, long) -> cos, sin [*positions.shape, head_dim] in `dtype`."""
        need = int(positions.max()) + 1 if positions.numel() else 1
        key = (dtype, positions.device)
        if self._key != key or self._cos.shape[0] < need:
            size = max(need, 2 * (self._cos.shape[0] if self._key == key else 0), 256)
            self._cos, self._sin = rope_cos_sin(torch.arange(size, device=positions.device), self.head_dim,
                                                self.theta, dtype)
            self._key = key
        return self._cos[positions], self._sin[positions]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, heads, n, d]; cos/sin [B, n, d]."""
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    return x * cos + rotate_half(x) * sin


class Attention(nn.Module):
    """Qwen3 attention split into query / key-value / attend steps so callers can inject extra K/V."""

    def __init__(self, config: DrafterConfig, in_features: int):
        super().__init__()
        d, nh, nkv = config.head_dim, config.num_attention_heads, config.num_key_value_heads
        self.head_dim, self.num_heads, self.num_kv_heads = d, nh, nkv
        self.scale = d ** -0.5
        bias = config.attention_bias
        self.q_proj = Linear(in_features, nh * d, bias=bias)
        self.k_proj = Linear(in_features, nkv * d, bias=bias)
        self.v_proj = Linear(in_features, nkv * d, bias=bias)
        self.o_proj = Linear(nh * d, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(d, config.rms_norm_eps)
        self.k_norm = RMSNorm(d, config.rms_norm_eps)

    def query(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [B, n, in] -> q [B, heads, n, d] (q_norm, then RoPE)."""
        b, n, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(b, n, self.num_heads, self.head_dim)).transpose(1, 2)
        return apply_rope(q, cos, sin)

    def key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """x [B, n, in] -> k, v [B, kv_heads, n, d] (k_norm, then RoPE on k)."""
        b, n, _ = x.shape
        if _inference(self):
            k, v = fused_linear(self.k_proj, (self.k_proj, self.v_proj), x).chunk(2, dim=-1)
        else:
            k, v = self.k_proj(x), self.v_proj(x)
        k = self.k_norm(k.view(b, n, self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = v.view(b, n, self.num_kv_heads, self.head_dim).transpose(1, 2)
        return apply_rope(k, cos, sin), v

    def query_key_value(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """`query` and `key_value` of the same rows; at inference one fused matmul."""
        if not _inference(self):
            return (self.query(x, cos, sin), *self.key_value(x, cos, sin))
        b, n, _ = x.shape
        d, nh, nkv = self.head_dim, self.num_heads, self.num_kv_heads
        qkv = fused_linear(self, (self.q_proj, self.k_proj, self.v_proj), x)
        q, k, v = qkv.split((nh * d, nkv * d, nkv * d), dim=-1)
        q = apply_rope(self.q_norm(q.view(b, n, nh, d)).transpose(1, 2), cos, sin)
        k = apply_rope(self.k_norm(k.view(b, n, nkv, d)).transpose(1, 2), cos, sin)
        return q, k, v.view(b, n, nkv, d).transpose(1, 2)

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
        """q [B, heads, nq, d], k/v [B, kv_heads, nk, d], mask [B, 1, nq, nk] bool or None -> [B, nq, H]."""
        groups = self.num_heads // self.num_kv_heads
        if mask is None and _row_attention_kernel(self, q):
            # every query row sees every key (one request's block, or one anchor): our kernel, one call (the
            # target's row-by-row attention, dspark_core.kernels.attention), ~2x SDPA's cost at 7 rows here
            lengths = torch.full(q.shape[:1] + q.shape[2:3], k.shape[2], dtype=torch.long)
            out = torch.ops.dspark_cpu.row_attention.default(q, k, v, lengths, self.scale)
            b, _, nq, _ = out.shape
            return self.o_proj(out.transpose(1, 2).reshape(b, nq, self.num_heads * self.head_dim))
        if groups > 1 and _inference(self):  # SDPA maps kv head i to query heads i*groups .. (i+1)*groups-1
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=True)
            b, _, nq, _ = out.shape
            return self.o_proj(out.transpose(1, 2).reshape(b, nq, self.num_heads * self.head_dim))
        if groups > 1:  # kv head i serves query heads i*groups .. (i+1)*groups-1
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale)  # [B, heads, nq, d]
        b, _, nq, _ = out.shape
        return self.o_proj(out.transpose(1, 2).reshape(b, nq, self.num_heads * self.head_dim))


class MLP(nn.Module):
    def __init__(self, config: DrafterConfig):
        super().__init__()
        h, i = config.hidden_size, config.intermediate_size
        self.gate_proj = Linear(h, i, bias=False)
        self.up_proj = Linear(h, i, bias=False)
        self.down_proj = Linear(i, h, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if _inference(self):
            gate, up = fused_linear(self, (self.gate_proj, self.up_proj), x).chunk(2, dim=-1)
            return self.down_proj(F.silu(gate) * up)
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm Qwen3 decoder layer whose attention also sees caller-supplied past K/V."""

    def __init__(self, config: DrafterConfig):
        super().__init__()
        self.self_attn = Attention(config, config.hidden_size)
        self.mlp = MLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, x, cos, sin, past_k=None, past_v=None, mask=None):
        """x [B, n, H]; cos/sin [B, n, d]; past_k/v [B, kv, L, d]; mask [B, 1, n, L + n] -> (x, k, v)."""
        if past_k is None:
            return self.forward_joined(x, cos, sin, lambda k, v: (k, v), mask)
        return self.forward_joined(
            x, cos, sin, lambda k, v: (torch.cat((past_k, k), dim=2), torch.cat((past_v, v), dim=2)), mask)

    def forward_joined(self, x, cos, sin, join, mask=None):
        """`forward` with the caller deciding how the rows' own k, v [B, kv, n, d] join the keys/values they
        attend to: `join(k, v) -> (keys, values)` [B, kv, L + n, d] (e.g. written into preallocated room)."""
        normed = self.input_layernorm(x)
        q, k, v = self.self_attn.query_key_value(normed, cos, sin)  # k, v [B, kv, n, d]
        keys, values = join(k, v)
        x = x + self.self_attn.attend(q, keys, values, mask)
        x = x + self.mlp(self.post_attention_layernorm(x))
        return x, k, v
