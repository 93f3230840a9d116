"""Usage: python scripts/kernel_ab.py REF [--reps N] [--rows 1,2,4,8] [--contexts 256,768]

A/B of our CPU kernels (dspark_core/kernels) against their sources at git revision REF, in one process: REF's
sources are built under another op namespace (`dspark_ab_ref`, in a temporary directory), this checkout's are
loaded as usual (`dspark_cpu`), and both are timed interleaved on SmolLM2's shapes:

- the projections of one forward at 1..8 rows (q/k/v, o, gate/up as Q4, down as Q4, over 30 layer copies so the
  weights stream from memory as in the model) and the Q8 LM head;
- the row attention of 30 layers (9 query heads, 3 key heads, head size 64) for 1..8 rows at each context.

Before timing it checks that both builds give bitwise equal outputs (a kernel change that moves a bit changes the
served model; say so rather than time it). Prints medians of --reps (ms) and new / ref. One thread (OMP_NUM_THREADS
is set to 1 unless given). Needs the compiler and ninja the kernels need (`make setup` has them)."""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from dspark_core import kernels as K  # noqa: E402

SOURCES = ("q8dot.cpp", "attention.cpp", "glue.cpp", "markov.cpp", "vec_math.h", "parallel.h")
PROJECTIONS = {"qkv": (960, 576, "q4"), "o": (576, 576, "q4"), "gate_up": (3072, 576, "q4"),
               "down": (576, 1536, "q4"), "lm_head": (49152, 576, "q8")}


def build_ref(ref: str, out: Path) -> None:
    """REF's kernel sources, their ops renamed to dspark_ab_ref, built and loaded into this process."""
    from torch.utils.cpp_extension import load

    src = out / "src"
    src.mkdir(parents=True, exist_ok=True)
    for name in SOURCES:
        shown = subprocess.run(["git", "-C", str(ROOT), "show", f"{ref}:dspark_core/kernels/{name}"],
                               capture_output=True, text=True)
        if shown.returncode != 0 and name.endswith(".h"):
            continue  # a header REF does not have yet (parallel.h came with the OpenMP build)
        shown.check_returncode()
        text = shown.stdout
        text = text.replace("TORCH_LIBRARY(dspark_cpu", "TORCH_LIBRARY(dspark_ab_ref")
        text = text.replace("TORCH_LIBRARY_FRAGMENT(dspark_cpu", "TORCH_LIBRARY_FRAGMENT(dspark_ab_ref")
        (src / name).write_text(text)
    chosen = K.isa()
    if isinstance(chosen, str):
        sys.exit(f"kernel_ab: our kernels cannot run here: {chosen}")
    print(f"building {ref}'s kernels ({chosen[0]}) in {out} ...", file=sys.stderr, flush=True)
    load(name="dspark_ab_ref", sources=[str(src / n) for n in SOURCES if n.endswith(".cpp")],
         build_directory=str(out), is_python_module=False, extra_cflags=[*K._COMMON_CFLAGS, *chosen[1]])


def median_ms(samples: list[float]) -> float:
    return statistics.median(samples) * 1e3


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ref", help="git revision to compare against (e.g. HEAD~1)")
    p.add_argument("--reps", type=int, default=9)
    p.add_argument("--rows", default="1,2,4,8")
    p.add_argument("--contexts", default="256,768")
    args = p.parse_args()
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    why = K.q8dot_unavailable()
    if why is not None:
        sys.exit(f"kernel_ab: our kernels cannot run here: {why}")
    rows = [int(r) for r in args.rows.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    with tempfile.TemporaryDirectory() as tmp:
        build_ref(args.ref, Path(tmp))
        builds = {"ref": torch.ops.dspark_ab_ref, "new": torch.ops.dspark_cpu}
        torch.manual_seed(0)
        weights = {}
        for name, (n, k, fmt) in PROJECTIONS.items():
            copies = 1 if name == "lm_head" else 30
            g = k // K.BLOCK
            if fmt == "q4":
                weights[name] = [K.pack_q4(torch.randint(0, 16, (n, k)), torch.rand(n, g) * 0.01,
                                           -torch.rand(n, g) * 0.01) for _ in range(copies)]
            else:
                weights[name] = [K.pack_q8(torch.randint(-127, 128, (n, k)), torch.rand(n, g) * 0.01)]
        xs = {(r, name): torch.randn(r, PROJECTIONS[name][1]) for r in rows for name in PROJECTIONS}
        attn = {}
        for ctx in contexts:
            for r in rows:
                q = torch.randn(1, 9, r, 64)
                kv = [(torch.randn(1, 3, ctx + r, 64), torch.randn(1, 3, ctx + r, 64)) for _ in range(30)]
                attn[(ctx, r)] = (q, kv, torch.tensor([[ctx + i + 1 for i in range(r)]]))
        # the same bits, or no timing
        for (r, name), x in xs.items():
            n, _, fmt = PROJECTIONS[name]
            outs = [getattr(ops, f"{fmt}_mm")(x, weights[name][0], n) for ops in builds.values()]
            if not torch.equal(*outs):
                sys.exit(f"kernel_ab: {name} at {r} rows differs between {args.ref} and this checkout")
        for key, (q, kv, lengths) in attn.items():
            outs = [ops.row_attention_rows(q, *kv[0], lengths, 0.125) for ops in builds.values()]
            if not torch.equal(*outs):
                sys.exit(f"kernel_ab: attention (context, rows) {key} differs between {args.ref} and this checkout")
        print("outputs: bitwise equal", flush=True)
        times: dict[tuple, list[float]] = {}
        for _ in range(args.reps):
            for label, ops in builds.items():
                for r in rows:
                    for name, (n, _, fmt) in PROJECTIONS.items():
                        mm, x = getattr(ops, f"{fmt}_mm"), xs[(r, name)]
                        t0 = time.perf_counter()
                        for w in weights[name]:
                            mm(x, w, n)
                        times.setdefault((label, "proj", r, name), []).append(time.perf_counter() - t0)
                for (ctx, r), (q, kv, lengths) in attn.items():
                    t0 = time.perf_counter()
                    for k_, v_ in kv:
                        ops.row_attention_rows(q, k_, v_, lengths, 0.125)
                    times.setdefault((label, "attn", ctx, r), []).append(time.perf_counter() - t0)
        print(f"medians of {args.reps} (ms), one forward's projections (30 layers) and attention (30 layers)")
        print(f"{'what':32s} {'rows':>4s} {args.ref[:12]:>12s} {'this':>8s} {'this/ref':>9s}")
        for r in rows:
            for name in PROJECTIONS:
                a, b = (median_ms(times[(lb, "proj", r, name)]) for lb in ("ref", "new"))
                print(f"{name:32s} {r:4d} {a:12.2f} {b:8.2f} {b / a:9.3f}")
            a = sum(median_ms(times[("ref", "proj", r, n)]) for n in PROJECTIONS)
            b = sum(median_ms(times[("new", "proj", r, n)]) for n in PROJECTIONS)
            print(f"{'all projections':32s} {r:4d} {a:12.2f} {b:8.2f} {b / a:9.3f}")
        for ctx in contexts:
            for r in rows:
                a, b = (median_ms(times[(lb, "attn", ctx, r)]) for lb in ("ref", "new"))
                print(f"{f'attention, context {ctx}':32s} {r:4d} {a:12.2f} {b:8.2f} {b / a:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
