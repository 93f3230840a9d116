"""The target's matmul weights in packed formats (`--weights`), and the CPU kernels that read them.

Decoding one token at batch 1 is memory-bound: a step reads every weight once, so its cost is the bytes of the
weights. This module holds each (fused) projection of the lean decoder and the LM head as a `PackedLinear`:
`y = x @ W^T (+ b)` computed from W in one of these formats (all with float32 activations outside the matmul):

- `float32`: the weights as loaded (no copy).
- `bfloat16`: a bf16 copy, bf16 activations into the matmul (oneDNN, fp32 accumulation).
- `int8`: symmetric per-output-channel int8 (the drafter's `quantize_int8`), `aten._weight_int8pack_mm`.
- `int4`: asymmetric int4 with one scale and zero per group of 32 inputs (`aten._weight_int4pack_mm_for_cpu`).
- `gguf`: a GGUF file's own blocks. Where the CPU has AVX512-VNNI (and our kernels build: dspark_core.kernels)
  they are served by our integer kernels (`Q8DotLinear`): Q4_0 / Q4_1 as 4-bit codes with the file's fp16 scale
  and offset per block of 32, Q8_0 as 8-bit codes with its fp16 scale, every weight exactly the file's value;
  activations are quantized per row and block of 32 to int8 (symmetric, as llama.cpp does for these formats),
  each block's dot product is exact in int32 and the output float32. Elsewhere they are re-packed into PyTorch's
  int4 kernel's layout. Q4_0 / Q4_1 keep their 4-bit codes; the block scale d and min m become the kernel's
  scale and zero (the kernel computes `(q - 8) s + z`: Q4_1 `d q + m` is `s = d, z = m + 8 d`; Q4_0 `d (q - 8)`
  is `s = d, z = 0`). Q8_0 (8-bit codes) is split exactly into a high and a low nibble, two int4 products
  summed: `d q = 16 d (hi + 8 - 8) + d (lo - 8) + 8 d`.

What is exact in `gguf` through PyTorch's int4 kernel: the codes (every 4-bit / 8-bit value of the file). What is
not: the kernel takes its scales, zeros and activations in bf16 and returns bf16, so the fp16 block scales /
mins are rounded to bf16 (relative error <= 2^-9) and each product is rounded to bf16. There is no fast
fp32-activation path: measured on this CPU the same int4 kernel with fp32 activations is ~40x slower than with
bf16. Through our kernels the weights are exact and the rounding is the activations' int8 (a relative error
of ~0.5% per product on random data, against ~1-2% for bf16 in and out).

Row counts: every product of a packed format runs in its packed kernel, whatever the number of rows. Both
kernels are batch-invariant (a row's result is bitwise the same however many rows come with it, checked in
tests/core/test_packed_weights.py), so a verify pass of k + 1 rows computes each row's projections exactly as
the one-row autoregressive step does, and a request's rows do not depend on what shares its batch. Attention
is made so too: with packed projections the lean decoder runs decode / verify attention row by row over
exactly the keys each row sees (`fast_decoder.LeanDecoder._row_attention`), since one batched attention over a
masked, padded softmax reduces in another order, and the bf16 activations magnify that last-bit difference
into logit changes of ~0.2 (on SmolLM2 Q4_1 it moved 3 of 6 greedy decodes off the target's own). The price
is prefill: above ~16 rows a dense bf16 matmul would be ~2x faster (measured 3072 x 576, 200 rows: int4 28.7
ms, int8 39.3, bf16 dense 13.4), but a dense copy would compute other roundings, so it is not used.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .drafters.layers import quantize_int8

WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4", "gguf")
GROUP_SIZE = 32
# the overload itself: a decode step makes ~120 of these calls, and the packet's overload lookup is per call
_INT4_MM = getattr(getattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu", None), "default", None)


def packed_kernels_available() -> bool:
    ops = torch.ops.aten
    return all(hasattr(ops, n) for n in ("_weight_int8pack_mm", "_weight_int4pack_mm_for_cpu",
                                          "_convert_weight_to_int4pack_for_cpu"))


class PackedLinear:
    """One matmul `y = x @ W^T + b`, W [N, K] held in `fmt`. `nbytes`: bytes of W one product reads."""

    fmt = "float32"

    def __init__(self, bias: torch.Tensor | None):
        self.bias = bias

    def _product(self, x2: torch.Tensor) -> torch.Tensor:  # [rows, K] -> [rows, N]
        raise NotImplementedError

    def dequantized(self) -> torch.Tensor:
        """The served weight W [N, K] in float32 (what every row count computes with, up to rounding)."""
        raise NotImplementedError

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        k = x.shape[-1]
        out = self._product(x.reshape(-1, k)).to(x.dtype)
        out = out.reshape(*x.shape[:-1], out.shape[-1])
        return out if self.bias is None else out + self.bias


class DenseLinear(PackedLinear):
    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None, dtype: torch.dtype | None = None):
        super().__init__(bias)
        self.weight = weight if dtype is None or dtype == weight.dtype else weight.to(dtype).contiguous()
        self.fmt = str(self.weight.dtype).removeprefix("torch.")
        self.nbytes = self.weight.numel() * self.weight.element_size()

    def _product(self, x2):
        return F.linear(x2.to(self.weight.dtype), self.weight)

    def __call__(self, x):
        if x.dtype == self.weight.dtype:  # no cast: one fused call, bias included
            return F.linear(x, self.weight, self.bias)
        return super().__call__(x)

    def dequantized(self):
        return self.weight.float()


class _Packed(PackedLinear):
    """A packed kernel with bf16 activations in and out, for every row count (see the module docstring)."""

    def _packed(self, x2: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def _product(self, x2):
        return self._packed(x2.to(torch.bfloat16))


class Int8Linear(_Packed):
    fmt = "int8"

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        super().__init__(bias)
        self.q, self.scales = quantize_int8(weight)  # int8 [N, K], bf16 [N]
        self.nbytes = self.q.numel() + self.scales.numel() * 2

    def _packed(self, x2):
        return torch.ops.aten._weight_int8pack_mm(x2, self.q, self.scales)

    def dequantized(self):
        return self.q.float() * self.scales.float()[:, None]


class Int4Linear(_Packed):
    """4-bit codes [N, K] in 0..15 with a (scale, zero) per group of GROUP_SIZE inputs: w = (q - 8) s + z."""

    fmt = "int4"

    def __init__(self, codes: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor,
                 bias: torch.Tensor | None = None):
        super().__init__(bias)
        n, k = codes.shape
        if not supports_int4(n, k):
            raise ValueError(f"int4 kernel needs N % 16 == 0 and K % {GROUP_SIZE} == 0, got {n} x {k}")
        self.shape = (n, k)
        self.packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
        # [K / group, N, 2] bf16, the kernel's layout
        self.scale_zeros = torch.stack([scales.t(), zeros.t()], dim=-1).to(torch.bfloat16).contiguous()
        self.nbytes = self.packed.numel() + self.scale_zeros.numel() * 2

    @staticmethod
    def _dequantize(codes: torch.Tensor, sz: torch.Tensor) -> torch.Tensor:
        n, k = codes.shape
        g = codes.reshape(n, k // GROUP_SIZE, GROUP_SIZE).float()
        s, z = sz[..., 0].t()[..., None], sz[..., 1].t()[..., None]  # [N, K / group, 1]
        return g.sub_(8.0).mul_(s).add_(z).reshape(n, k)

    def _packed(self, x2):
        return _INT4_MM(x2, self.packed, GROUP_SIZE, self.scale_zeros)

    def __call__(self, x):
        if x.dim() == 2 and self.bias is None:  # the decoder's case: one call, no reshapes (what the base computes)
            return _INT4_MM(x.to(torch.bfloat16), self.packed, GROUP_SIZE, self.scale_zeros).to(x.dtype)
        return super().__call__(x)

    def codes(self) -> torch.Tensor:
        """The 4-bit codes [N, K] back out of the kernel layout (identity products: checks and tests only)."""
        n, k = self.shape
        eye = torch.eye(k, dtype=torch.bfloat16)
        ones = torch.zeros(k // GROUP_SIZE, n, 2, dtype=torch.bfloat16)
        ones[..., 0] = 1.0
        ones[..., 1] = 8.0
        out = torch.cat([torch.ops.aten._weight_int4pack_mm_for_cpu(eye[i : i + 16], self.packed, GROUP_SIZE, ones)
                         for i in range(0, k, 16)])
        return out.t().round().to(torch.int32)  # [N, K]

    def dequantized(self):
        return self._dequantize(self.codes(), self.scale_zeros.float())


class Q8DotLinear(PackedLinear):
    """GGUF blocks served by our integer kernels (dspark_core.kernels, AVX512-VNNI): Q4_0 / Q4_1 as 4-bit codes
    with an fp16 scale d and offset o per block of 32 (w = d q + o), Q8_0 as signed 8-bit codes with an fp16 scale
    (w = d q): the file's values exactly. Activations are quantized per row and block of 32 to int8 (llama.cpp's
    way for these formats), each block's dot product is exact in int32, and the output is float32. Batch-
    invariant by construction (q8dot.cpp)."""

    fmt = "gguf"
    kernel = "q8dot"

    def __init__(self, kind: str, codes: torch.Tensor, d: torch.Tensor, o: torch.Tensor | None = None,
                 bias: torch.Tensor | None = None):
        from . import kernels

        super().__init__(bias)
        n, k = codes.shape
        if not supports_int4(n, k):
            raise ValueError(f"the q8dot kernels need N % 16 == 0 and K % {GROUP_SIZE} == 0, got {n} x {k}")
        self.kind, self.shape = kind, (n, k)
        if kind == "q4":
            self.packed = kernels.pack_q4(codes, d, o)
            self._mm = torch.ops.dspark_cpu.q4_mm.default
        elif kind == "q8":
            self.packed = kernels.pack_q8(codes, d)
            self._mm = torch.ops.dspark_cpu.q8_mm.default
        else:
            raise ValueError(f"unknown q8dot kind {kind!r}")
        self.nbytes = self.packed.numel()

    def _product(self, x2):
        return self._mm(x2.float().contiguous(), self.packed, self.shape[0])

    def __call__(self, x):
        if x.dim() == 2 and self.bias is None and x.dtype == torch.float32 and x.is_contiguous():
            return self._mm(x, self.packed, self.shape[0])  # the decoder's case: one call
        return super().__call__(x)

    def dequantized(self):
        n, k = self.shape
        g = k // GROUP_SIZE
        p = self.packed
        if self.kind == "q4":
            nib = p[..., :256].reshape(n // 16, g, 4, 16, 4)
            codes = torch.stack([nib & 0x0F, nib >> 4], dim=3)  # T, G, v, lo/hi, col, j
            codes = codes.permute(0, 4, 1, 2, 3, 5).reshape(n, k).float()
            consts = p[..., 256:].contiguous().view(torch.float16).float().reshape(n // 16, g, 2, 16)
            d, o = (consts[:, :, i].permute(0, 2, 1).reshape(n, g, 1) for i in (0, 1))
            return (codes.reshape(n, g, GROUP_SIZE) * d + o).reshape(n, k)
        codes = p[..., :512].contiguous().view(torch.int8).reshape(n // 16, g, 8, 16, 4)
        codes = codes.permute(0, 3, 1, 2, 4).reshape(n, k).float()
        d = p[..., 512:544].contiguous().view(torch.float16).float().permute(0, 2, 1).reshape(n, g, 1)
        return (codes.reshape(n, g, GROUP_SIZE) * d).reshape(n, k)


class SumLinear(PackedLinear):
    """W = sum of parts (the two nibbles of an 8-bit code), one product per part, summed in float32."""

    def __init__(self, parts: list[PackedLinear], fmt: str, bias: torch.Tensor | None = None):
        super().__init__(bias)
        self.parts, self.fmt = parts, fmt
        self.nbytes = sum(p.nbytes for p in parts)

    def _product(self, x2):
        out = self.parts[0]._product(x2).float()
        for p in self.parts[1:]:
            out += p._product(x2).float()
        return out

    def dequantized(self):
        return sum(p.dequantized() for p in self.parts)


class ConcatLinear(PackedLinear):
    """W = row-concatenation of parts in different formats (a fused projection whose parts differ)."""

    def __init__(self, parts: list[PackedLinear], bias: torch.Tensor | None = None):
        super().__init__(bias)
        self.parts = parts
        self.fmt = "+".join(sorted({p.fmt for p in parts}))
        self.nbytes = sum(p.nbytes for p in parts)

    def _product(self, x2):
        return torch.cat([p._product(x2).float() for p in self.parts], dim=-1)

    def dequantized(self):
        return torch.cat([p.dequantized() for p in self.parts])


def row_invariant(linear: PackedLinear) -> bool:
    """Whether a row's product is bitwise the same however many rows come with it: the packed kernels are;
    a dense float32 / bf16 matmul picks other kernels (gemv, gemm blockings) for other row counts."""
    if isinstance(linear, (SumLinear, ConcatLinear)):
        return all(row_invariant(p) for p in linear.parts)
    return isinstance(linear, (_Packed, Q8DotLinear))


def supports_int4(n: int, k: int) -> bool:
    return n % 16 == 0 and k % GROUP_SIZE == 0


def quantize_int4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Asymmetric min/max int4 per group of GROUP_SIZE inputs: (codes [N, K] 0..15, scales, zeros [N, K / g]),
    w ~ (q - 8) s + z, the codes chosen against the bf16-rounded scale and zero the kernel will use."""
    n, k = weight.shape
    w = weight.float().reshape(n, k // GROUP_SIZE, GROUP_SIZE)
    lo, hi = w.amin(-1), w.amax(-1)
    scales = ((hi - lo) / 15.0).clamp(min=1e-8).to(torch.bfloat16).float()
    zeros = (lo + 8.0 * scales).to(torch.bfloat16).float()
    codes = torch.round((w - zeros[..., None]) / scales[..., None] + 8.0).clamp_(0, 15)
    return codes.reshape(n, k).to(torch.int32), scales, zeros


def make_linear(weight: torch.Tensor, bias: torch.Tensor | None, fmt: str) -> PackedLinear:
    """`weight` [N, K] (float) in format `fmt` (float32, bfloat16, int8, int4). Shapes the int4 kernel cannot
    take (N not a multiple of 16, K not of 32) stay int8; the format of the result says what was chosen."""
    weight = weight.detach()
    if fmt == "float32":
        return DenseLinear(weight, bias)
    if fmt == "bfloat16":
        return DenseLinear(weight, bias, torch.bfloat16)
    if fmt == "int4" and supports_int4(*weight.shape):
        return Int4Linear(*quantize_int4(weight), bias=bias)
    if fmt in ("int4", "int8"):
        return Int8Linear(weight, bias)
    raise ValueError(f"unknown weight format {fmt!r}")


# -- GGUF blocks -> kernel layout

def _half(raw, start: int) -> torch.Tensor:
    """fp16 values at byte offset `start` of every block of `raw` [N, blocks, block_bytes] -> float32 [N, blocks]."""
    return raw[..., start : start + 2].contiguous().view(torch.float16).squeeze(-1).float()


def _nibbles(qs: torch.Tensor) -> torch.Tensor:
    """ggml's 4-bit layout: byte j of a 32-value block holds value j (low nibble) and value j + 16 (high)."""
    return torch.cat([qs & 0x0F, qs >> 4], dim=-1).to(torch.int32)


# the kernel `gguf` blocks go to when a caller names none (tests and comparisons pin each in turn): None = ours
# (q8dot) where it runs; "torch" = PyTorch's kernels only (the lean decoder then also attends through SDPA)
GGUF_KERNEL: str | None = None


def q8dot_kernels(kernel: str | None = None) -> bool:
    """Whether `gguf` blocks go to our q8dot kernels: `kernel` "q8dot" (required: refused where they cannot run),
    "torch" (PyTorch's int4 kernel, bf16 activations), None = q8dot where the CPU and build allow."""
    from .kernels import q8dot_unavailable

    kernel = kernel or GGUF_KERNEL
    if kernel == "torch":
        return False
    why = q8dot_unavailable()
    if kernel == "q8dot" and why is not None:
        raise ValueError(f"the q8dot kernels cannot run here: {why}")
    if kernel not in (None, "q8dot"):
        raise ValueError(f"unknown kernel {kernel!r} (q8dot, torch)")
    return why is None


def gguf_linear(raw: torch.Tensor, qtype: str, shape: tuple[int, int], kernel: str | None = None) -> PackedLinear:
    """A GGUF tensor's raw blocks (uint8 [N, bytes per row]) of type Q4_0 / Q4_1 / Q8_0 / F32 / F16 as a
    PackedLinear serving the same codes: through our q8dot kernels where they run (`q8dot_kernels`), else
    PyTorch's int4 kernel."""
    n, k = shape
    if qtype in ("F32", "F16", "BF16"):
        dtype = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[qtype]
        return DenseLinear(raw.contiguous().view(dtype).reshape(n, k).float())
    if not supports_int4(n, k):
        raise ValueError(f"{qtype} tensor {n} x {k}: the int4 kernel needs N % 16 == 0 and K % 32 == 0")
    blocks = k // GROUP_SIZE
    if q8dot_kernels(kernel) and qtype in ("Q4_0", "Q4_1", "Q8_0"):
        if qtype == "Q4_0":  # w = d (q - 8) = d q - 8 d (fp16-exact)
            b = raw.reshape(n, blocks, 18)
            d = _half(b, 0)
            return Q8DotLinear("q4", _nibbles(b[..., 2:]).reshape(n, k), d, -8.0 * d)
        if qtype == "Q4_1":  # w = d q + m
            b = raw.reshape(n, blocks, 20)
            return Q8DotLinear("q4", _nibbles(b[..., 4:]).reshape(n, k), _half(b, 0), _half(b, 2))
        b = raw.reshape(n, blocks, 34)
        return Q8DotLinear("q8", b[..., 2:].contiguous().view(torch.int8).reshape(n, k), _half(b, 0))
    if qtype == "Q4_0":  # [d fp16][16 bytes]: w = d (q - 8)
        b = raw.reshape(n, blocks, 18)
        d = _half(b, 0)
        codes = _nibbles(b[..., 2:]).reshape(n, k)
        return Int4Linear(codes, d, torch.zeros_like(d))
    if qtype == "Q4_1":  # [d fp16][m fp16][16 bytes]: w = d q + m = d (q - 8) + (m + 8 d)
        b = raw.reshape(n, blocks, 20)
        d, m = _half(b, 0), _half(b, 2)
        codes = _nibbles(b[..., 4:]).reshape(n, k)
        return Int4Linear(codes, d, m + 8.0 * d)
    if qtype == "Q8_0":  # [d fp16][32 int8]: w = d q, q = 16 hi + lo, hi in -8..7, lo in 0..15
        b = raw.reshape(n, blocks, 34)
        d = _half(b, 0)
        q = b[..., 2:].contiguous().view(torch.int8).to(torch.int32).reshape(n, k)
        hi, lo = q >> 4, q & 0x0F
        return SumLinear([Int4Linear(hi + 8, 16.0 * d, torch.zeros_like(d)), Int4Linear(lo, d, 8.0 * d)], "gguf")
    raise ValueError(f"GGUF tensor type {qtype} is not served packed (supported: Q4_0, Q4_1, Q8_0, F32, F16, BF16)")


def gguf_dequantize(raw: torch.Tensor, qtype: str, shape: tuple[int, int]) -> torch.Tensor:
    """The GGUF file's own dequantized values of a tensor in float32 (ggml's formulas, what transformers'
    importer computes): the reference `gguf` serving is checked against."""
    n, k = shape
    if qtype in ("F32", "F16", "BF16"):
        return gguf_linear(raw, qtype, shape).dequantized()
    blocks = k // GROUP_SIZE
    if qtype == "Q4_0":
        b = raw.reshape(n, blocks, 18)
        return (_half(b, 0)[..., None] * (_nibbles(b[..., 2:]) - 8).float()).reshape(n, k)
    if qtype == "Q4_1":
        b = raw.reshape(n, blocks, 20)
        return (_half(b, 0)[..., None] * _nibbles(b[..., 4:]).float() + _half(b, 2)[..., None]).reshape(n, k)
    if qtype == "Q8_0":
        b = raw.reshape(n, blocks, 34)
        return (_half(b, 0)[..., None] * b[..., 2:].contiguous().view(torch.int8).float()).reshape(n, k)
    raise ValueError(f"GGUF tensor type {qtype} is not supported")
