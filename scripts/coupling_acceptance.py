"""Acceptance of seeded requests under position-keyed coupling against plain speculative sampling.

Serving verifies a seeded sampled request by coupling (`EngineConfig.isolate_seeded`, the default): each
position's token is the seed's exponential race over the target there, so the output never depends on
what else runs or on how many tokens were drafted. Its drafts survive when the draft's race (same noise)
picks the same token, which happens less often than speculative sampling's min(1, p / q) test. This script
measures what that costs: the same held-out prompts, seeds, drafter and fixed policy, decoded once with
coupling and once with plain speculative sampling (`isolate_seeded=False`); tokens per target pass (tau)
for both and their ratio. It also checks that each coupled output equals the same seed's autoregressive
decode (no drafter), the property coupling exists for.

    python scripts/coupling_acceptance.py --target tiny --drafter dspark --prompts 12 --max-new-tokens 64
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from dspark_cli.models import load_stack, models_dir
from dspark_core import stack
from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams
from dspark_core.text import encode_prompt
from dspark_core.training.data import load_prompts, split

DATA = Path(__file__).resolve().parents[1] / "data" / "dev"


def decode(target, drafter, prompts, params, policy: str, coupled: bool) -> tuple[list[list[int]], float]:
    """Every prompt in one engine (batched); (outputs, tokens per target pass over all requests)."""
    engine = Engine(target, drafter, EngineConfig(policy=policy, isolate_seeded=coupled,
                                                  max_waiting=len(prompts) + 1, collapse_ratio=None))
    rids = [engine.add_request(ids, p) for ids, p in zip(prompts, params)]
    engine.run()
    outs = [engine.pop(r) for r in rids]
    committed = sum(len(o.output_ids) - 1 for o in outs)  # the first token comes from the prefill
    rounds = sum(o.num_rounds for o in outs)
    return [o.output_ids for o in outs], committed / max(1, rounds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--target", default="tiny", help="target name or directory (default tiny)")
    ap.add_argument("--drafter", default="dspark", help="shipped drafter name or checkpoint directory")
    ap.add_argument("--datasets", default="mbpp,math500,arena-hard-v2")
    ap.add_argument("--prompts", type=int, default=12, help="held-out prompts in all, spread over the datasets")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--policy", default="fixed")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    target_dir = stack.resolve_target(args.target, models_dir())
    path = stack.drafter_dir(args.drafter, models_dir(), target_dir)
    target, drafter = load_stack(target_dir, path)
    names = args.datasets.split(",")
    texts = []
    for name in names:
        texts += [p.text for p in split(load_prompts(DATA / f"{name}.jsonl"), 0.2)[1][: -(-args.prompts // len(names))]]
    prompts = [encode_prompt(target.tokenizer, t) for t in texts[: args.prompts]]
    params = [SamplingParams(temperature=args.temperature, max_new_tokens=args.max_new_tokens, seed=1000 + i)
              for i in range(len(prompts))]
    coupled, tau_coupled = decode(target, drafter, prompts, params, args.policy, True)
    _, tau_plain = decode(target, drafter, prompts, params, args.policy, False)
    ar, _ = decode(target, None, prompts, params, "ar", True)
    out = {"target": Path(target_dir).name, "drafter": args.drafter, "policy": args.policy,
           "temperature": args.temperature, "prompts": len(prompts), "max_new_tokens": args.max_new_tokens,
           "tau_coupled": tau_coupled, "tau_speculative_sampling": tau_plain,
           "coupled_vs_speculative_sampling": tau_coupled / tau_plain,
           "coupled_equals_autoregressive": sum(a == b for a, b in zip(coupled, ar)), "of": len(ar)}
    if args.json:
        print(json.dumps(out, indent=2))
    else:
        for k, v in out.items():
            print(f"{k:>32}: {v:.3f}" if isinstance(v, float) else f"{k:>32}: {v}")


if __name__ == "__main__":
    main()
