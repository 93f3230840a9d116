"""The best ROC-AUC any confidence head can reach on a target, next to the shipped head's, slot by slot.

Whether speculative sampling accepts slot k is a coin: with the draft token drawn from q_k it lands 1 with
probability alpha_k = sum_x min(p_k(x), q_k(x)) (p_k the target's distribution). A confidence c_k may depend
on everything before slot k but never on that coin (algorithms.md section 4), so the most it can know is
alpha_k itself, and the best AUC it can reach (in expectation over the coins) is the expected AUC of alpha
against labels drawn with probability alpha (`calibration.expected_auc(alpha, alpha)`). On a small,
high-entropy target alpha has little spread, and that ceiling sits low whatever the head.

Measured under teacher forcing on held-out text: the target answers eval-split prompts (T = --temperature),
then every response position is an anchor; slot k's alpha compares the drafter's q_k (its sampling
distribution, Markov head included) with the target's p_k given the true previous tokens, which is what
"slots < k were accepted" means. Prints per slot: mean alpha, the ceiling, the head's expected AUC under
the same coins, and the head's AUC against one set of drawn coins; and the survival view (the first k all
accepted, ~ prod alpha_i along the path) with the calibrated a_k = prod c_i, the view `dspark calibrate`
reports first.

    .venv/bin/python scripts/auc_ceiling.py [--drafter dspark] [--limit 25] [--max-new-tokens 128] [--json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import torch

from dspark_cli.models import default_target, drafter_dir, load_stack
from dspark_core import calibration as cal
from dspark_core.training.data import distill, load_prompts, split
from dspark_core.training.losses import acceptance_probability

DATA = Path(__file__).resolve().parents[1] / "data" / "dev"
DATASETS = ("mbpp", "livecodebench", "math500", "arena-hard-v2")


def teacher_forced(target, drafter, sample, temperature: float):
    """One sample's response under teacher forcing: (draft logits [A * gamma, V_d], target logits [A * gamma, V]
    at the same positions, the target's T probabilities on the draft vocabulary's columns or None, raw confidence
    logits [A, gamma]), every response position an anchor; None when the response is shorter than a block."""
    gamma, ids = drafter.block_size, sample.input_ids
    seq = target.new_sequence()
    try:
        res = target.forward([(seq, ids)])
    finally:
        target.release(seq)
    first = len(sample.prompt_ids) - 1  # anchor = last committed token; slot 0 predicts ids[anchor + 1]
    anchors = torch.arange(first, len(ids) - gamma)
    if anchors.numel() == 0:
        return None
    with torch.no_grad():
        out = drafter.training_forward(torch.tensor([ids]), res.taps[None].float(), anchors[None])
        draft_logits = out.logits[0].reshape(-1, out.logits.shape[-1])  # [A * gamma, V]
        # the target's distribution for slot k of anchor a sits at position a + k
        rows = (anchors[:, None] + torch.arange(gamma)).reshape(-1)
        target_logits = res.logits[rows].float()
        vocab_ids = getattr(drafter, "draft_vocab_ids", None)
        # a draft vocabulary: q lives on its columns; target mass outside them is never accepted
        p = None if vocab_ids is None else torch.softmax(target_logits / temperature, dim=-1)[:, vocab_ids]
    return draft_logits, target_logits, p, out.confidence_logits[0].float().numpy()


def slot_values(target, drafter, sample, temperature: float) -> tuple[np.ndarray, np.ndarray]:
    """alpha [A, gamma] and raw confidence logits [A, gamma] for every anchor of one sample's response."""
    gamma = drafter.block_size
    forced = teacher_forced(target, drafter, sample, temperature)
    if forced is None:
        return np.zeros((0, gamma)), np.zeros((0, gamma))
    draft_logits, target_logits, p, conf = forced
    alpha = acceptance_probability(draft_logits, target_logits, temperature, drafter.support_size, p_target=p)
    return alpha.reshape(-1, gamma).numpy(), conf


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--drafter", default="dspark",
                    help="shipped drafter name (models/<name>) or a checkpoint directory")
    ap.add_argument("--limit", type=int, default=25, help="eval-split prompts per dataset (default 25)")
    ap.add_argument("--max-new-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.temperature <= 0:
        raise SystemExit("--temperature must be > 0: at T = 0 acceptance is not a coin")
    target, drafter = load_stack(default_target(), drafter_dir(args.drafter))
    if not drafter.has_confidence:
        raise SystemExit(f"{args.drafter} has no confidence head")
    prompts = []
    for name in DATASETS:
        prompts += split(load_prompts(DATA / f"{name}.jsonl"), 0.2)[1][: args.limit]
    samples = distill(target, prompts, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      seed=args.seed)
    alphas, logits = zip(*(slot_values(target, drafter, s, args.temperature) for s in samples))
    alpha, conf = np.concatenate(alphas), np.concatenate(logits)
    rng = np.random.default_rng(args.seed)
    # survival view: P(first k accepted) ~ prod_{i<=k} alpha_i along the teacher-forced path, against the head's
    # calibrated a_k = prod sigmoid(c_i / t_i + b_i)
    temps = np.asarray(drafter.config.sts_temperatures, dtype=np.float64)
    biases = np.asarray(drafter.config.calibration_bias_values, dtype=np.float64)
    surv_alpha = np.cumprod(alpha, axis=1)
    surv_head = np.cumprod(1.0 / (1.0 + np.exp(-(conf / temps + biases))), axis=1)
    rows = []
    for k in range(drafter.block_size):
        a, c = alpha[:, k], conf[:, k]
        coins = rng.uniform(size=a.size) < a
        rows.append({"slot": k + 1, "positions": int(a.size), "mean_alpha": float(a.mean()),
                     "alpha_std": float(a.std()), "auc_ceiling": cal.expected_auc(a, a),
                     "head_expected_auc": cal.expected_auc(c, a), "head_auc_one_draw": cal.roc_auc(c, coins),
                     "auc_ceiling_survival": cal.expected_auc(surv_alpha[:, k], surv_alpha[:, k]),
                     "head_expected_auc_survival": cal.expected_auc(surv_head[:, k], surv_alpha[:, k])})
    out = {"drafter": args.drafter, "temperature": args.temperature, "prompts": len(samples),
           "max_new_tokens": args.max_new_tokens, "datasets": list(DATASETS), "limit": args.limit, "slots": rows}
    if args.json:
        print(json.dumps(out, indent=2))
        return
    print(f"{args.drafter} on {len(samples)} held-out responses (T = {args.temperature}), teacher forcing")
    print("            conditional (slot k given slots < k accepted)                  | survival (first k accepted)")
    print(" slot  positions  mean alpha  std   AUC ceiling  head (expected)  head (one draw) | ceiling  head")
    for r in rows:
        print(f"{r['slot']:5d} {r['positions']:10d} {r['mean_alpha']:10.3f} {r['alpha_std']:6.3f} "
              f"{r['auc_ceiling']:11.3f} {r['head_expected_auc']:16.3f} {r['head_auc_one_draw']:16.3f} | "
              f"{r['auc_ceiling_survival']:7.3f} {r['head_expected_auc_survival']:5.3f}")


if __name__ == "__main__":
    main()
