"""Usage: python scripts/kernel_threads.py [--rows 1,8,16,32,64,128,341] [--min-work N] [--reps 9] [--target DIR]

One target forward pass of ROWS tokens (one request, after a 341-token prompt; the verify / prefill pass a serving
step runs) timed on one intra-op thread and on two, interleaved, in a worker thread as the engine runs it: the
medians per thread count and their ratio. `--min-work` sets our kernels' split threshold (multiply-adds, see
dspark_core/kernels/parallel.h; 0 splits every call, default the kernels' own). Run it on a quiet machine with
OMP_WAIT_POLICY=PASSIVE, as the pods run."""
from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_core import kernels  # noqa: E402
from dspark_core.stack import default_target, load_target_runtime  # noqa: E402


def measure(target, rows: list[int], reps: int, threads: tuple[int, ...]) -> dict:
    prompt = [1000 + i % 30000 for i in range(341)]
    seq = target.new_sequence()
    target.cache.reserve(len(target._sequences), len(prompt) + max(rows) + 8)
    target.forward([(seq, prompt)], last_logits_only=True)
    times: dict = {}
    for _ in range(2):  # two interleaved rounds of every thread count
        for th in threads:
            torch.set_num_threads(th)
            for r in rows:
                toks = (prompt * (r // len(prompt) + 1))[:r]
                for _ in range(reps if r < 100 else max(3, reps // 3)):
                    length = seq.length
                    t0 = time.perf_counter()
                    target.forward([(seq, toks)], last_logits_only=r > 64)
                    times.setdefault((th, r), []).append(time.perf_counter() - t0)
                    target.truncate(seq, length)
    return {k: statistics.median(v) for k, v in times.items()}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rows", default="1,8,16,32,64,128,341")
    p.add_argument("--min-work", type=int, default=None)
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--threads", default="1,2")
    p.add_argument("--target", default=None)
    args = p.parse_args()
    if kernels.q8dot_unavailable() is not None:
        sys.exit(f"kernel_threads: our kernels do not run here: {kernels.q8dot_unavailable()}")
    rows = [int(r) for r in args.rows.split(",")]
    threads = tuple(int(t) for t in args.threads.split(","))
    target = load_target_runtime(args.target or default_target())
    with kernels.parallel_min_work(args.min_work) if args.min_work is not None else contextlib.nullcontext():
        med = ThreadPoolExecutor(1).submit(measure, target, rows, args.reps, threads).result()
    base = threads[0]
    for r in rows:
        cells = ", ".join(f"{th} thread{'s' * (th > 1)} {med[(th, r)] * 1e3:7.1f} ms" for th in threads)
        ratios = ", ".join(f"{med[(base, r)] / med[(th, r)]:.2f}x" for th in threads[1:])
        print(f"{r:4d} rows: {cells}; speed-up over {base}: {ratios}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
