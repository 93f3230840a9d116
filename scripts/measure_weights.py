"""Measure the target's weight formats (`--weights`) against each other in one process: bytes per step, the
one-request step cost for 1..16 tokens (interleaved repeats, medians), tokens/s against the memory-bandwidth
limit, and how far each format's logits are from float32's.

    OMP_NUM_THREADS=1 .venv/bin/python scripts/measure_weights.py --target smollm2 \
        --out docs/results/weights/formats_smollm2.json

The bandwidth is measured here too (one thread: summing a float32 tensor far larger than the caches), so the
limit `bandwidth / bytes of weights per step` is of the same moment as the step times. Logit differences are
over greedy float32 trajectories of the prompts (teacher-forced, every position), relative to the float32
logits' largest magnitude per row; top-1 agreement is the share of positions whose argmax is float32's.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_cli.models import resolve_target  # noqa: E402
from dspark_core.target import TargetConfig, TargetRuntime  # noqa: E402
from dspark_core.text import encode_prompt  # noqa: E402

PROMPTS = ["Write a Python function that reverses a string.", "What is 12 * 7? Explain step by step.",
           "Give three tips for writing clear documentation.", "def fibonacci(n):"]


def bandwidth_gbs(repeats: int = 7) -> float:
    x = torch.ones(128 * 1024 * 1024 // 4 * 4)  # 512 MB of float32
    x.sum()
    ts = []
    for _ in range(repeats):
        t = time.perf_counter()
        x.sum()
        ts.append(time.perf_counter() - t)
    return x.numel() * 4 / statistics.median(ts) / 1e9


def greedy_trajectory(target: TargetRuntime, prompt: list[int], n: int) -> list[int]:
    seq = target.new_sequence()
    tok = int(target.forward([(seq, prompt)], last_logits_only=True).logits[-1].argmax())
    out = [tok]
    for _ in range(n - 1):
        out.append(int(target.forward([(seq, [out[-1]])]).logits[-1].argmax()))
    target.release(seq)
    return out


def logits_along(target: TargetRuntime, ids: list[int]) -> torch.Tensor:
    seq = target.new_sequence()
    out = target.forward([(seq, ids)]).logits
    target.release(seq)
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--target", default="smollm2")
    ap.add_argument("--formats", default="float32,bfloat16,int8,int4,gguf",
                    help="comma-separated --weights values; gguf-torch / gguf-q8dot pin gguf's kernel")
    ap.add_argument("--rows", default="1,2,3,4,5,6,8,12,16")
    ap.add_argument("--context-length", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--new-tokens", type=int, default=48, help="greedy tokens per prompt for the logit comparison")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    import transformers

    transformers.utils.logging.disable_progress_bar()
    target_dir = resolve_target(args.target)
    formats = args.formats.split(",")
    rows = [int(r) for r in args.rows.split(",")]
    def load(f: str) -> TargetRuntime:  # gguf-torch / gguf-q8dot: --weights gguf through that kernel
        from dspark_core import packed_weights

        weights, _, kernel = f.partition("-")
        packed_weights.GGUF_KERNEL = kernel or None
        try:
            return TargetRuntime(TargetConfig(target_dir, device="cpu", dtype="float32", weights=weights))
        finally:
            packed_weights.GGUF_KERNEL = None

    targets = {f: load(f) for f in formats}
    prompts = [encode_prompt(targets[formats[0]].tokenizer, p) for p in PROMPTS]

    # -- logits against float32, along float32's own greedy trajectories
    quality: dict[str, dict] = {}
    if "float32" in targets:
        ref_t = targets["float32"]
        trajectories = [p + greedy_trajectory(ref_t, p, args.new_tokens) for p in prompts]
        refs = [logits_along(ref_t, ids) for ids in trajectories]
        for f, t in targets.items():
            rel, top1, n = [], 0, 0
            for ids, ref in zip(trajectories, refs):
                got = logits_along(t, ids)
                rel.append(((got - ref).abs().amax(-1) / ref.abs().amax(-1)).max().item())
                top1 += int((got.argmax(-1) == ref.argmax(-1)).sum())
                n += ref.shape[0]
            quality[f] = {"max_rel_logit_diff": round(max(rel), 5), "top1_agreement": round(top1 / n, 5),
                          "positions": n, "own_greedy_equals_float32_greedy": None}
            for p, ids in zip(prompts, trajectories):
                same = greedy_trajectory(t, p, args.new_tokens) == ids[len(p):]
                quality[f]["own_greedy_equals_float32_greedy"] = bool(
                    same and quality[f]["own_greedy_equals_float32_greedy"] in (None, True))

    # -- step cost, one request at context_length, 1..16 tokens; formats and row counts interleaved
    seqs = {}
    for f, t in targets.items():
        s = t.new_sequence()
        t.forward([(s, [1 + i % 1000 for i in range(args.context_length)])], last_logits_only=True)
        seqs[f] = s
    times: dict[tuple[str, int], list[float]] = {(f, r): [] for f in formats for r in rows}
    for rep in range(args.repeats + 1):
        for f in formats[rep % len(formats):] + formats[:rep % len(formats)]:
            t, s = targets[f], seqs[f]
            for r in rows:
                start = time.perf_counter()
                t.forward([(s, [5] * r)])
                el = time.perf_counter() - start
                t.truncate(s, args.context_length)
                if rep:  # the first sweep warms up
                    times[(f, r)].append(el)
    bw = bandwidth_gbs()
    result = {"target": target_dir, "threads": torch.get_num_threads(), "context_length": args.context_length,
              "repeats": args.repeats, "bandwidth_gb_s": round(bw, 2), "formats": {}}
    for f, t in targets.items():
        ms = {r: statistics.median(times[(f, r)]) * 1e3 for r in rows}
        limit = bw * 1e9 / t.weight_bytes
        result["formats"][f] = {
            "served": t.weights, "weight_mb_per_step": round(t.weight_bytes / 1e6, 2),
            "step_ms": {str(r): round(v, 2) for r, v in ms.items()},
            "step_cost_vs_one_token": {str(r): round(v / ms[rows[0]], 3) for r, v in ms.items()},
            "ar_tokens_per_s": round(1e3 / ms[1], 2) if 1 in ms else None,
            "bandwidth_limit_tokens_per_s": round(limit, 2),
            "share_of_bandwidth_limit": round(1e3 / ms[1] / limit, 3) if 1 in ms else None,
            **quality.get(f, {}),
        }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
