"""Usage: python scripts/distill_answers.py --target smollm2 --temperature 1 --out data/distill/smollm2-t1-c.jsonl \
        [--data data/dev/*.jsonl] [--exclude data/distill/smollm2-prompts-a.jsonl ...] [--journal PATH]

Let a target answer train-split prompts it has not answered yet, without training anything: the answers a
later `dspark train --responses ...` run (or `scripts/train_assistant.py --responses`) reads. `dspark train
--data` distills too, but then always builds its feature cache and trains; this is the distillation alone, so
it can run for hours in the background and be resumed (the journal keeps every finished answer; rerunning the
same command skips them).

Prompts: the train split (`dspark_core.training.data.split`, 80%) of every `--data` file (`--split all`: every
prompt of a file that holds training prompts only, like `scripts/stdlib_prompts.py`'s), deduplicated by text,
minus every prompt in the `--exclude` files (DeepSpec prompt files, `{"turns": [...]}` per line), at most
`--max-prompt-tokens` tokens after the chat template, shortest first (the engine answers them in batches).
Held-out prompts are never read, so `dspark eval` / `dspark calibrate` on the same files stay out of sample.
Each output line is `{"prompt_ids": [...], "response_ids": [...], "domain": ...}`.
"""
from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default="smollm2")
    p.add_argument("--data", nargs="+", default=sorted(str(f) for f in (REPO / "data" / "dev").glob("*.jsonl")))
    p.add_argument("--exclude", nargs="*", default=[], help="prompt files whose prompts are already answered")
    p.add_argument("--split", choices=("train", "all"), default="train",
                   help="train: the 80%% training split of each file (data/dev); all: every prompt (a file of training "
                        "prompts only, e.g. scripts/stdlib_prompts.py's)")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=320)
    p.add_argument("--min-prompt-tokens", type=int, default=0,
                   help="answer only prompts of more tokens than this (e.g. the ones a shorter run left out)")
    p.add_argument("--limit", type=int, default=None, help="answer at most N prompts (the shortest)")
    p.add_argument("--concurrency", type=int, default=16)
    p.add_argument("--weights", default="float32", help="target weights (distillation used float32 before)")
    p.add_argument("--journal", default=None, help="resumable journal (default OUT.partial)")
    p.add_argument("--out", required=True)
    args = p.parse_args()

    from dspark_core.stack import load_target_runtime, resolve_target
    from dspark_core.text import encode_prompt
    from dspark_core.training.data import distill, load_prompts, split

    target = load_target_runtime(resolve_target(args.target), device="cpu", dtype="float32", weights=args.weights)
    skip = set()
    for f in args.exclude:
        skip.update(pr.text for pr in load_prompts(f))
    seen, prompts = set(), []
    for f in args.data:
        train = split(load_prompts(f))[0] if args.split == "train" else load_prompts(f)
        for pr in train:
            if pr.text not in skip and pr.text not in seen:
                seen.add(pr.text)
                prompts.append(pr)
    sized = sorted(((len(encode_prompt(target.tokenizer, pr.text)), pr) for pr in prompts), key=lambda e: e[0])
    chosen = [pr for n, pr in sized if args.min_prompt_tokens < n <= args.max_prompt_tokens][: args.limit]
    kind = "train-split prompts" if args.split == "train" else "prompts"
    print(f"{len(prompts)} new {kind}, {len(chosen)} answered ({args.min_prompt_tokens} < prompt tokens <= "
          f"{args.max_prompt_tokens}), T = {args.temperature}", flush=True)
    t0 = time.time()
    out = Path(args.out)
    samples = distill(target, chosen, max_new_tokens=args.max_new_tokens, temperature=args.temperature,
                      seed=args.seed, concurrency=args.concurrency, journal=args.journal or f"{out}.partial")
    out.parent.mkdir(parents=True, exist_ok=True)
    with out.open("w", encoding="utf-8") as fh:
        for s in samples:
            fh.write(json.dumps({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                                 "domain": s.domain}) + "\n")
    print(f"{len(samples)} answers, {sum(len(s.response_ids) for s in samples)} answer tokens in "
          f"{time.time() - t0:.0f} s -> {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
