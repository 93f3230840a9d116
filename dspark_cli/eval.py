"""`dspark eval`: the paper's acceptance protocol for one drafter on one prompt set.

Fixed block (no scheduler), T = 1.0 by default, the first turn of each prompt, the eval split only
(`dspark_core.training.data.split(prompts, 0.2)`; `--limit K` keeps the first K eval prompts). Prompts
go through the engine together (continuous batching, `--concurrency` at a time). `--prompt-ids-file`
takes token-id prompts (one JSON list, or an object with "prompt_ids", per line) for targets without a
tokenizer; those are used as given (no split) and the output says so.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from dspark_core.errors import InvalidArgument

from .models import resolve_drafter_path, resolve_target
from .options import add_device_args, add_drafter_args, add_matmul_dtype_arg, add_target_arg, add_weights_arg

TRUNCATION_NOTE = ("draft tokens are sampled from the top-{k} of softmax(logits / T), renormalised; the verifier "
                   "uses q on that support, so output stays lossless, but truncation can lower acceptance. "
                   "support_size = vocab is full-vocabulary sampling.")


def drafter_label(path) -> str:
    """A drafter's name for tables: its folder, or the run's for `RUN/final` and `RUN/checkpoints/step-N`."""
    p = Path(path).resolve()
    if p.name == "final":
        return p.parent.name
    if p.parent.name == "checkpoints":
        return f"{p.parent.parent.name}@{p.name}"
    return p.name


def add_common_args(p, max_new_tokens: int) -> None:
    p.add_argument("--dataset", action="append", default=None, metavar="F.jsonl",
                   help="DeepSpec-format prompt file ({\"turns\": [...]} per line); first turn, eval split")
    p.add_argument("--prompt-ids-file", default=None, metavar="F.jsonl",
                   help="token-id prompts instead (a JSON list or {\"prompt_ids\": [...]} per line), used as given")
    add_drafter_args(p, what="drafter to measure")
    add_target_arg(p)
    p.add_argument("--split", default="eval", choices=("eval", "all"),
                   help="eval: the fixed held-out 20%% of each --dataset (default); all: the file as given (a prompt "
                        "set kept apart from training)")
    p.add_argument("--limit", type=int, default=None, help="first K prompts of the split per dataset (default all)")
    p.add_argument("--max-new-tokens", type=int, default=max_new_tokens,
                   help=f"tokens generated per prompt at most (default {max_new_tokens})")
    p.add_argument("--temperature", type=float, default=1.0, help="sampling temperature (default 1.0, the paper's)")
    p.add_argument("--concurrency", type=int, default=32, help="requests decoded together (default 32)")
    p.add_argument("--seed", type=int, default=0, help="base seed; request i uses its own stream (default 0)")
    add_device_args(p)
    add_matmul_dtype_arg(p)
    add_weights_arg(p)
    p.add_argument("--json", action="store_true", help="print one JSON object")


def add_parser(sub) -> None:
    p = sub.add_parser("eval", help="acceptance metrics of a drafter on a prompt set (paper protocol)",
                       description="Decode the eval split of a prompt set with a fixed draft block (no scheduler) "
                                   "and report tau, conditional acceptance and survival by position.")
    add_common_args(p, max_new_tokens=256)
    p.add_argument("--block-size", type=int, default=None,
                   help="draft tokens per round (default: the drafter's; larger ones are extrapolated and flagged)")
    p.add_argument("--support-size", default=None, metavar="K|vocab",
                   help="top-k support of draft sampling (default: the drafter's, i.e. its config's draft_support_size, "
                        "else 4096; at most the vocabulary); 'vocab' = full vocabulary")
    p.add_argument("--truncation-cost", action="store_true",
                   help="also run with full-vocabulary draft sampling and report the tau lost to truncation")
    p.add_argument("--no-rollouts", action="store_true", help="leave the per-round records out of the JSON")
    p.add_argument("--out", default=None, help="also write the JSON object to this file (input of `dspark report`)")
    p.add_argument("--name", default=None,
                   help="the drafter's name in the JSON and in `dspark report` (default: its folder's name; for a "
                        "training run's final/ or checkpoints/step-N/, the run's)")
    p.set_defaults(func=run)


# ---- prompts ----------------------------------------------------------------------------------------

def load_prompt_sets(args, tokenizer) -> list[dict]:
    """[{"dataset", "domain", "split", "prompts": [[ids]]}] from --dataset files or --prompt-ids-file."""
    from dspark_core.text import encode_prompt
    from dspark_core.training.data import load_prompts, split

    if args.prompt_ids_file:
        ids = read_prompt_ids(args.prompt_ids_file)[: args.limit]
        from dspark_core.training.data import DOMAINS

        stem = Path(args.prompt_ids_file).stem
        return [{"dataset": stem, "domain": DOMAINS.get(stem, "other"), "prompts": ids,
                 "split": "none (token-id prompts used as given)"}]
    if tokenizer is None:
        raise InvalidArgument("--dataset", args.dataset, "needs a target with a tokenizer; use --prompt-ids-file")
    sets = []
    for path in args.dataset:
        prompts = load_prompts(path)
        whole = args.split == "all"
        held = (prompts if whole else split(prompts, 0.2)[1])[: args.limit]
        if not held:
            raise InvalidArgument("--dataset", path, f"has no prompt in the {'file' if whole else 'eval split'} "
                                                     f"({len(prompts)} prompts in all)")
        sets.append({"dataset": held[0].dataset, "domain": held[0].domain,
                     "split": "all (the file as given)" if whole else "eval (20%, hashed)",
                     "prompts": [encode_prompt(tokenizer, pr.text) for pr in held]})
    return sets


def read_prompt_ids(path: str) -> list[list[int]]:
    p = Path(path)
    if not p.is_file():
        raise InvalidArgument("--prompt-ids-file", path, "must be an existing file")
    out = []
    for lineno, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise InvalidArgument(f"{path}:{lineno}", line[:60], "must be JSON") from None
        ids = row.get("prompt_ids") if isinstance(row, dict) else row
        if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and t >= 0 for t in ids):
            raise InvalidArgument(f"{path}:{lineno}", line[:60], "must be a non-empty list of token ids")
        out.append(ids)
    if not out:
        raise InvalidArgument("--prompt-ids-file", path, "must hold at least one prompt")
    return out


def load_models(args):
    from .generate import _quiet_transformers
    from .models import load_stack

    target_dir = resolve_target(args.target)
    why: list[str] = []
    path = resolve_drafter_path(args.drafter, args.drafter_path, target_dir, say=why.append)
    if path is None:
        raise InvalidArgument("--drafter", args.drafter, "must name a drafter trained for the target (a shipped name "
                              f"or --drafter-path DIR): this command measures one{': ' + why[0] if why else ''}")
    _quiet_transformers()
    target, drafter = load_stack(target_dir, path, args.device, args.dtype, args.drafter_matmul_dtype,
                                 weights=args.weights)
    return target, drafter, path


def check_common(args) -> None:
    """Validate what needs no model, before anything is loaded."""
    if args.limit is not None and args.limit < 1:
        raise InvalidArgument("--limit", args.limit, "must be >= 1")
    if bool(args.dataset) == bool(args.prompt_ids_file):
        raise InvalidArgument("--dataset", args.dataset, "give --dataset (one or more) or --prompt-ids-file, not both")
    if args.drafter not in ("auto", None) and args.drafter_path:
        raise InvalidArgument("--drafter", args.drafter, "give --drafter or --drafter-path, not both")
    if args.drafter == "none" and not args.drafter_path:
        raise InvalidArgument("--drafter", args.drafter, "must name a drafter: this command measures one")
    if not args.temperature >= 0 or args.temperature != args.temperature:
        raise InvalidArgument("--temperature", args.temperature, "must be >= 0")
    if args.max_new_tokens < 1:
        raise InvalidArgument("--max-new-tokens", args.max_new_tokens, "must be >= 1")
    if args.concurrency < 1:
        raise InvalidArgument("--concurrency", args.concurrency, "must be >= 1")


def parse_support_size(value, vocab_size: int) -> int | None:
    if value is None:
        return None
    if value == "vocab":
        return vocab_size
    try:
        k = int(value)
    except ValueError:
        raise InvalidArgument("--support-size", value, "must be a positive integer or 'vocab'") from None
    if k < 1:
        raise InvalidArgument("--support-size", value, "must be a positive integer or 'vocab'")
    return min(k, vocab_size)


# ---- run --------------------------------------------------------------------------------------------

def run(args) -> int:
    import torch

    from dspark_core.drafters.layers import matmul_dtype_name
    from dspark_core.evaluation import resize_block, rollouts_json, run_rounds, summarize

    check_common(args)
    if args.block_size is not None and not 1 <= args.block_size <= 32:
        raise InvalidArgument("--block-size", args.block_size, "must be in [1, 32]")
    if args.dataset and len(args.dataset) > 1:
        raise InvalidArgument("--dataset", args.dataset, "must name one file for `dspark eval` (run once per dataset)")
    parse_support_size(args.support_size, 1 << 30)
    target, drafter, path = load_models(args)
    support = parse_support_size(args.support_size, drafter.vocab_size)
    if support is not None:
        drafter.support_size = support
    ps = load_prompt_sets(args, target.tokenizer)[0]
    trained_gamma = drafter.block_size
    gamma, extrapolated = resize_block(drafter, args.block_size)
    torch.manual_seed(args.seed)
    common = dict(block_size=gamma, temperature=args.temperature, max_new_tokens=args.max_new_tokens,
                  seed=args.seed, concurrency=args.concurrency, stop_token_ids=target.eos_token_ids,
                  progress=True)  # the bar goes to stderr, --json output to stdout
    t0 = time.perf_counter()
    log = run_rounds(target, drafter, ps["prompts"], **common)
    wall = time.perf_counter() - t0
    cfg = drafter.config
    greedy_output = args.temperature == 0 and drafter.has_confidence and cfg.greedy_confidence_head
    cfg_temps = cfg.sts_temperatures_greedy if greedy_output else cfg.sts_temperatures
    cfg_biases = cfg.calibration_bias_values_greedy if greedy_output else cfg.calibration_bias_values
    result = {
        "dataset": ps["dataset"], "domain": ps["domain"], "split": ps["split"],
        "drafter": args.name or drafter_label(path), "drafter_kind": drafter.kind, "drafter_path": str(path),
        "target": getattr(target, "name", None), "block_size": gamma, "trained_block_size": trained_gamma,
        "block_size_extrapolated": extrapolated, "temperature": args.temperature, "policy": "fixed",
        "max_new_tokens": args.max_new_tokens, "num_prompts": len(ps["prompts"]) - log.skipped_prompts,
        "skipped_prompts": log.skipped_prompts, "seed": args.seed,
        **summarize(log, gamma),
        "support_size": drafter.support_size, "vocab_size": drafter.vocab_size,
        "drafter_matmul_dtype": matmul_dtype_name(drafter),
        "support_note": TRUNCATION_NOTE.format(k=drafter.support_size),
        # the calibration of the confidence output these rollouts logged (the greedy one at T = 0, if any)
        "calibration_temperatures": list(cfg_temps) if drafter.has_confidence else None,
        "calibration_biases": list(cfg_biases) if drafter.has_confidence else None,
        "wall_s": round(wall, 3),
    }
    if args.truncation_cost:
        truncated_k = drafter.support_size
        drafter.support_size = drafter.vocab_size
        full = run_rounds(target, drafter, ps["prompts"], **common)
        drafter.support_size = truncated_k
        full = summarize(full, gamma)
        result["truncation"] = {
            "support_size": truncated_k, "tau_truncated": result["tau"], "tau_full_vocab": full["tau"],
            "tau_change_pct": 100.0 * (result["tau"] / full["tau"] - 1.0),
            "survival_full_vocab": full["survival"],
        }
    if not args.no_rollouts:
        result["rollouts"] = rollouts_json(log)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps(result) + "\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(human_summary(result))
    return 0


def human_summary(r: dict) -> str:
    def fmt(xs):
        return " ".join("-" if x is None else f"{x:.3f}" for x in xs)

    lines = [f"{r['drafter']} on {r['dataset']} ({r['domain']}, split: {r['split']}), block {r['block_size']}"
             f"{' (extrapolated)' if r['block_size_extrapolated'] else ''}, T = {r['temperature']}: "
             f"tau = {r['tau']:.3f} over {r['rounds']} rounds, {r['num_prompts']} prompts, {r['tokens']} tokens",
             f"  conditional acceptance by position: {fmt(r['conditional_acceptance'])}",
             f"  survival by position:               {fmt(r['survival'])}",
             f"  draft support: top-{r['support_size']} of {r['vocab_size']}"]
    if "truncation" in r:
        t = r["truncation"]
        lines.append(f"  truncation cost: tau {t['tau_truncated']:.3f} (top-{t['support_size']}) vs "
                     f"{t['tau_full_vocab']:.3f} (full vocabulary): {t['tau_change_pct']:+.1f}%")
    return "\n".join(lines)
