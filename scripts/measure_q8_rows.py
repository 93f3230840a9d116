"""Usage: python scripts/measure_q8_rows.py [THREADS]

Our int8 kernel (q8_mm: weights in Q8_0-style blocks, activations quantized per row and block) against the
bf16 and float32 matmuls, by rows, for the SmolLM2 DSpark drafter's shapes (fc 576 x 2880, context k/v
384 x 576, fused q/k/v 960 x 576, gate/up 3072 x 576, down 576 x 1536, LM head 8192 x 576). Prints
milliseconds (median of 15). What `dspark_core.drafters.layers.Q8DOT_MAX_ROWS` was chosen from."""
import statistics as st
import sys
import time

import torch
import torch.nn.functional as F
from dspark_core import kernels
assert kernels.q8dot_unavailable() is None, kernels.q8dot_unavailable()
from dspark_core.drafters.layers import quantize_q8_blocks
torch.set_num_threads(int(sys.argv[1]) if len(sys.argv) > 1 else 1)
def t(f, reps=15):
    f(); ts = []
    for _ in range(reps):
        t0 = time.perf_counter(); f(); ts.append(time.perf_counter() - t0)
    return 1e3 * st.median(ts)
for n, k in ((576, 2880), (384, 576), (960, 576), (3072, 576), (576, 1536), (8192, 576)):
    w = torch.randn(n, k) * 0.02
    wb = w.bfloat16()
    q, d = quantize_q8_blocks(w)
    packed = kernels.pack_q8(q, d)
    line = [f"{n}x{k}"]
    for rows in (7, 32, 64, 128, 256, 1024):
        x = torch.randn(rows, k)
        a = t(lambda: torch.ops.dspark_cpu.q8_mm.default(x, packed, n))
        b = t(lambda: F.linear(x.bfloat16(), wb).float())
        c = t(lambda: F.linear(x, w))
        line.append(f"r{rows}: q8 {a:.3f} bf16 {b:.3f} f32 {c:.3f}")
    print(" | ".join(line), flush=True)
