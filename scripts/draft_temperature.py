"""Would a sharper or flatter draft distribution be accepted more often? Acceptance by slot against a scale of q.

Speculative sampling is lossless for any draft distribution q, as long as verification uses the q the draft was
drawn from; what q changes is how often a draft survives, alpha = sum_x min(p(x), q(x)). The drafters sample at
the request's temperature, q = softmax(z / T) (top-`support` truncated). This script asks whether another q,
q_s = softmax(z / (s T)), would be accepted more often against the target's p = softmax(l / T): s < 1 sharpens
the drafter, s > 1 flattens it. A drafter trained with a total-variation term (ours: `tv` in the loss) should sit
near its optimum at s = 1; a drafter whose q is systematically broader or narrower than p would not.

Teacher forcing on held-out text, as scripts/auc_ceiling.py: the target answers eval-split prompts at T, every
response position is an anchor, slot k compares q_k (Markov head included) with p_k given the true previous
tokens. tau_est = 1 + sum_k prod_{i<=k} mean alpha_i (the chain's expected accepted length if slots were
independent; a ranking of s, not a measured tau).

    .venv/bin/python scripts/draft_temperature.py [--drafter dspark] [--limit 12] [--scales 0.7,0.85,1,1.15,1.3]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np

from auc_ceiling import teacher_forced  # scripts/ is on the path when run as a script
from dspark_cli.models import default_target, drafter_dir, load_stack
from dspark_core.training.data import distill, load_prompts, split
from dspark_core.training.losses import acceptance_probability

DATA = Path(__file__).resolve().parents[1] / "data" / "dev"
DATASETS = ("mbpp", "livecodebench", "math500", "arena-hard-v2")


def slot_alphas(target, drafter, sample, temperature: float, scales: list[float]) -> np.ndarray:
    """alpha [S, A, gamma] for every scale and anchor of one sample's response."""
    gamma = drafter.block_size
    forced = teacher_forced(target, drafter, sample, temperature)
    if forced is None:
        return np.zeros((len(scales), 0, gamma))
    draft_logits, target_logits, p, _ = forced
    return np.stack([acceptance_probability(draft_logits / s, target_logits, temperature, drafter.support_size,
                                            p_target=p).reshape(-1, gamma).numpy() for s in scales])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="dspark", help="shipped drafter name (models/<name>) or a checkpoint directory")
    ap.add_argument("--limit", type=int, default=12, help="eval-split prompts per dataset (default 12)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--scales", default="0.7,0.85,1.0,1.15,1.3",
                    help="comma-separated factors s of the draft temperature (q = softmax(z / (s T)))")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0: at T = 0 the draft is the argmax whatever its scale")
    try:
        scales = [float(s) for s in args.scales.split(",")]
    except ValueError:
        raise SystemExit(f"--scales must be comma-separated numbers, got {args.scales!r}") from None
    if not scales or any(not np.isfinite(s) or s <= 0 for s in scales):
        raise SystemExit(f"--scales must be positive and finite, got {args.scales!r}")
    target, drafter = load_stack(default_target(), drafter_dir(args.drafter))
    prompts = []
    for name in DATASETS:
        prompts += split(load_prompts(DATA / f"{name}.jsonl"), 0.2)[1][: args.limit]
    samples = distill(target, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      seed=args.seed)
    alpha = np.concatenate([slot_alphas(target, drafter, s, args.temperature, scales) for s in samples], axis=1)
    rows = []
    for i, s in enumerate(scales):
        mean = alpha[i].mean(axis=0)
        rows.append({"scale": s, "mean_alpha": [round(float(a), 4) for a in mean],
                     "tau_est": round(float(1.0 + np.cumprod(mean).sum()), 4)})
    base = next((r["tau_est"] for r in rows if r["scale"] == 1.0), None)
    for r in rows:
        r["tau_est_vs_scale_1"] = round(r["tau_est"] / base, 4) if base else None
    out = {"drafter": args.drafter, "temperature": args.temperature, "prompts": len(samples),
           "anchors": int(alpha.shape[1]), "max_new_tokens": args.max_new_tokens, "rows": rows}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.drafter} on {len(samples)} held-out responses (T = {args.temperature}), {alpha.shape[1]} anchors")
    print(" scale  tau_est  vs s=1  mean alpha by slot")
    for r in rows:
        print(f"{r['scale']:6.2f} {r['tau_est']:8.3f} {r['tau_est_vs_scale_1'] or float('nan'):7.3f}  "
              + " ".join(f"{a:.3f}" for a in r["mean_alpha"]))


if __name__ == "__main__":
    main()
