"""Where a batch-1 round's time goes: drafting vs verification, against one autoregressive step.

Decodes held-out code prompts greedily with the shipped drafter and with none, alternating per prompt in
one process, and times every `propose` (drafter) and `verify` (target forward + acceptance) call. Prints
medians: the drafter's share of a round, the round's cost in autoregressive steps, tau, and the
end-to-end speedup. Used for issue #3's "drafter share of round latency at batch 1" figure and to see
why a batch-1 speedup is what it is (speedup ~= tau / round cost in AR steps).

    .venv/bin/python scripts/round_breakdown.py [--drafter dspark] [--prompts 8] [--max-new-tokens 128]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from dspark_cli.models import add_matmul_dtype_arg, default_target, drafter_dir, load_sps, load_stack
from dspark_core.drafters.layers import matmul_dtype_name
from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams
from dspark_core.text import encode_prompt
from dspark_core.training.data import load_prompts, split

DATA = Path(__file__).resolve().parents[1] / "data" / "dev"


class Timed:
    """Wraps a callable and records the wall time of every call."""

    def __init__(self, fn):
        self.fn, self.times = fn, []

    def __call__(self, *args, **kwargs):
        start = time.perf_counter()
        out = self.fn(*args, **kwargs)
        self.times.append(time.perf_counter() - start)
        return out


def decode(target, drafter, ids, params, policy, sps=None):
    engine = Engine(target, drafter, EngineConfig(policy=policy), sps=sps)
    verify = engine.verifier.verify = Timed(engine.verifier.verify)
    propose = None
    if drafter is not None:
        propose = drafter.propose = Timed(type(drafter).propose.__get__(drafter))
    rid = engine.add_request(ids, params)
    req = engine.requests[rid]
    engine.step()  # prefill (+ the first round), not timed below
    verify.times.clear()
    if propose is not None:
        propose.times.clear()
    start = time.perf_counter()
    n0 = len(req.output_ids)
    steps = []
    while not req.finished:
        t = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - t)
    wall = time.perf_counter() - start
    if drafter is not None:
        del drafter.propose
    tokens = len(req.output_ids) - n0
    return {"tokens_per_s": tokens / wall, "tokens": tokens, "verify": verify.times, "steps": steps,
            "propose": propose.times if propose else []}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="dspark",
                    help="shipped drafter name (models/<name>) or a checkpoint directory")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--policy", default="fixed")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--temperature", type=float, default=0.0, help="sampling temperature (default 0: greedy)")
    add_matmul_dtype_arg(ap)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    target, drafter = load_stack(default_target(), drafter_dir(args.drafter),
                                 drafter_matmul_dtype=args.drafter_matmul_dtype)
    prompts = []
    for name in ("mbpp", "livecodebench"):
        prompts += split(load_prompts(DATA / f"{name}.jsonl"), 0.2)[1][: (args.prompts + 1) // 2]
    params = SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=0)
    sps, _ = load_sps(default_target())  # the causal / async policies need it (what `dspark profile` wrote)
    ar, sd = [], []
    decode(target, drafter, encode_prompt(target.tokenizer, prompts[0].text), params, args.policy, sps)  # warm-up
    for p in prompts[: args.prompts]:
        ids = encode_prompt(target.tokenizer, p.text)
        ar.append(decode(target, None, ids, params, "ar"))
        sd.append(decode(target, drafter, ids, params, args.policy, sps))
    med = statistics.median
    step_ar = med([t for r in ar for t in r["verify"]])
    verify = med([t for r in sd for t in r["verify"]])
    propose = med([t for r in sd for t in r["propose"]])
    step = med([t for r in sd for t in r["steps"]])
    tau = sum(r["tokens"] for r in sd) / sum(len(r["verify"]) for r in sd)  # tokens per target pass
    out = {
        "drafter": args.drafter, "policy": args.policy, "temperature": args.temperature,
        "drafter_matmul_dtype": matmul_dtype_name(drafter), "prompts": len(sd), "threads": torch.get_num_threads(),
        "ar_step_ms": step_ar * 1e3, "verify_ms": verify * 1e3, "propose_ms": propose * 1e3,
        "step_ms": step * 1e3,
        "drafter_share_of_round": propose / (propose + verify),
        "drafter_share_of_step": propose / step,
        "round_cost_in_ar_steps": (propose + verify) / step_ar,
        "verify_cost_in_ar_steps": verify / step_ar,
        "tau": tau,
        "speedup_median": med([s["tokens_per_s"] / a["tokens_per_s"] for s, a in zip(sd, ar)]),
        "ar_tokens_per_s": med([a["tokens_per_s"] for a in ar]),
        "spec_tokens_per_s": med([s["tokens_per_s"] for s in sd]),
    }
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>26}: {v:.3f}" if isinstance(v, float) else f"{k:>26}: {v}")


if __name__ == "__main__":
    main()
