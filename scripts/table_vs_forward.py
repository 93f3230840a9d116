#!/usr/bin/env python3
"""How true the cost table is while the engine serves: every verify pass's measured forward time against what the
live table the engine plans on predicts for it, and the verification overhead the engine measures on top.

    OMP_NUM_THREADS=1 python scripts/table_vs_forward.py --target smollm2 --concurrency 1 --num-prompts 8
    python scripts/table_vs_forward.py --concurrency 8 --temperature 1 --json

Runs the causal policy with the online table (as `dspark bench` does) over held-out prompts of the dev sets and
prints medians over the verify passes: the table's step time for each pass (for its request count and tokens),
the measured forward, their ratio, the verify call's wall time, and the engine's `_step_overhead` at the end.
A ratio far from 1 is a table the policy and the draft gate misjudge (docs/results/smollm2/README.md, "Cost tables
by pass shape").
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--drafter", default="auto")
    p.add_argument("--concurrency", type=int, default=1)
    p.add_argument("--num-prompts", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--dataset", default=str(Path(__file__).resolve().parents[1] / "data" / "dev" / "mbpp.jsonl"))
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    if args.concurrency < 1 or args.num_prompts < 1 or args.max_new_tokens < 1:
        p.error("--concurrency, --num-prompts and --max-new-tokens must be >= 1")

    from dspark_cli.models import load_sps, load_stack, resolve_drafter_path, resolve_target
    from dspark_core.cost_model import sps_callable
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.text import encode_prompt
    from dspark_core.training.data import load_prompts, split

    target_dir = resolve_target(args.target)
    target, drafter = load_stack(target_dir, resolve_drafter_path(args.drafter, None, target_dir), "cpu", "float32",
                                 "auto", auto=args.drafter == "auto")
    sps, sps_path = load_sps(target_dir)
    if sps is None:
        p.error(f"the target has no cost table ({target_dir}): `dspark profile --target {args.target}`")
    held = split(load_prompts(args.dataset), 0.2)[1][:args.num_prompts]
    prompts = [encode_prompt(target.tokenizer, pr.text) for pr in held]
    engine = Engine(target, drafter, EngineConfig(policy="causal", max_active=args.concurrency, online_sps=True,
                                                  isolate_seeded=False), sps=sps)
    forwards: list[float] = []
    observe = engine.verifier.on_forward

    def on_forward(tokens, seconds, context, requests):
        forwards.append(seconds)
        observe(tokens, seconds, context, requests)

    engine.verifier.on_forward = on_forward
    passes = []  # (table's step time, verify call's wall) per step
    note = engine._note_step_overhead

    def noted(requests, tokens, seconds):
        passes.append((1.0 / sps_callable(engine._table_for(requests))(tokens), seconds, len(forwards) - 1))
        note(requests, tokens, seconds)

    engine._note_step_overhead = noted
    for i, ids in enumerate(prompts):
        engine.add_request(ids, SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                                               seed=i))
    t0 = time.perf_counter()
    engine.run()
    wall = time.perf_counter() - t0
    pairs = [(t, w, forwards[k]) for t, w, k in passes if 0 <= k < len(forwards)]
    out = {
        "target": target_dir, "sps": str(sps_path), "concurrency": args.concurrency, "temperature": args.temperature,
        "steps": len(pairs), "wall_s": round(wall, 3),
        "table_ms_median": round(statistics.median(t for t, _, _ in pairs) * 1e3, 3),
        "forward_ms_median": round(statistics.median(f for _, _, f in pairs) * 1e3, 3),
        "forward_over_table_median": round(statistics.median(f / t for t, _, f in pairs), 4),
        "verify_call_ms_median": round(statistics.median(w for _, w, _ in pairs) * 1e3, 3),
        "step_overhead_ms": round(engine._step_overhead * 1e3, 3),
        "draft_ms": round(engine._draft_seconds * 1e3, 3),
        "gated_request_rounds": engine.num_gated_drafts,
    }
    if args.json:
        print(json.dumps(out))
    else:
        for k, v in out.items():
            print(f"{k:28s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
