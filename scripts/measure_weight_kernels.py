"""Time PyTorch's CPU matmul kernels for packed weights on a target's layer shapes (what `--weights` chose from).

    OMP_NUM_THREADS=1 .venv/bin/python scripts/measure_weight_kernels.py --hidden 576 --intermediate 1536 \
        --q-heads 9 --kv-heads 3 --head-dim 64 --layers 30 --vocab 49152

For each kernel and row count: the time of one forward's worth of projections (q/k/v, o, gate/up, down) over
`--layers` separate weight copies, so the weights stream from memory as they do in the model, and of the LM
head alone. Medians of `--repeats`. Kernels: fp32 and bf16 `F.linear`, `_weight_int8pack_mm` (per-channel int8)
and `_weight_int4pack_mm_for_cpu` (int4, groups of 32) with fp32 or bf16 activations.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.nn.functional as F

KINDS = ("f32", "bf16", "int8-f32", "int8-bf16", "int4-f32", "int4-bf16")


def make(kind: str, n: int, k: int):
    """(matmul x -> x @ W^T for a random W [n, k] in `kind`, the activation dtype it takes)."""
    w = torch.randn(n, k) * 0.05
    act = torch.float32 if kind.endswith("f32") else torch.bfloat16
    if kind == "f32":
        return (lambda x: F.linear(x, w)), act
    if kind == "bf16":
        wb = w.bfloat16()
        return (lambda x: F.linear(x, wb)), act
    if kind.startswith("int8"):
        s = w.abs().amax(1) / 127
        q = torch.round(w / s[:, None]).to(torch.int8)
        s = s.to(act)
        return (lambda x: torch.ops.aten._weight_int8pack_mm(x, q, s)), act
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(torch.randint(0, 16, (n, k), dtype=torch.int32), 1)
    sz = (torch.rand(k // 32, n, 2) * 0.01).to(act)
    return (lambda x: torch.ops.aten._weight_int4pack_mm_for_cpu(x, packed, 32, sz)), act


def median_ms(fn, repeats: int) -> float:
    fn()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t)
    return statistics.median(ts) * 1e3


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--q-heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--layers", type=int, default=30)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--rows", default="1,2,3,4,8,16")
    ap.add_argument("--kinds", default=",".join(KINDS))
    ap.add_argument("--repeats", type=int, default=7)
    args = ap.parse_args()
    torch.set_num_threads(1)
    h, d = args.hidden, args.head_dim
    shapes = [((args.q_heads + 2 * args.kv_heads) * d, h), (h, args.q_heads * d), (2 * args.intermediate, h),
              (h, args.intermediate)]
    rows = [int(r) for r in args.rows.split(",")]
    for kind in args.kinds.split(","):
        layers = [[make(kind, n, k) for _ in range(args.layers)] for n, k in shapes]
        head, act = make(kind, args.vocab, h)
        line, head_line = [], []
        for r in rows:
            total = 0.0
            for (n, k), copies in zip(shapes, layers):
                x = torch.randn(r, k).to(copies[0][1])
                total += median_ms(lambda: [f(x) for f, _ in copies], args.repeats)
            line.append(f"{r}: {total:.2f}")
            x = torch.randn(r, h).to(act)
            head_line.append(f"{r}: {median_ms(lambda: head(x), args.repeats):.2f}")
        print(f"{kind:<10} {args.layers} layers, ms by rows  {'  '.join(line)}")
        print(f"{kind:<10} LM head, ms by rows     {'  '.join(head_line)}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
