"""Measure the conditional acceptance of n-gram lookup drafts by their match length (dspark_core.lookup's table).

Replays a target's own greedy answers (distillation files: prompt_ids + response_ids, temperature 0) as a
speculative decoder that drafts only by lookup would: at each round, the longest suffix of prompt + output so
far (MIN_NGRAM..MAX_NGRAM tokens) that occurred before proposes the `--block` tokens that followed it (a loop
continued past the end, as `NgramIndex.propose` does); the draft is accepted up to its first token that differs
from the answer, and the round commits one token more. Rounds without a match commit one token. Prints, per
match length, the conditional acceptance at each draft position and the number of rounds, as the literal of
`LOOKUP_ACCEPTANCE`, and the lookup-only tau.

    python scripts/lookup_acceptance.py data/distill/smollm2-t0*.jsonl
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dspark_core.lookup import MAX_NGRAM, MIN_NGRAM, NgramIndex  # noqa: E402


def replay(prompt: list[int], answer: list[int], block: int, tried: dict, accepted: dict) -> int:
    """Rounds to decode `answer` after `prompt` with lookup drafts alone; counts into tried / accepted[n][pos]."""
    idx = NgramIndex(MIN_NGRAM)
    idx.extend(prompt)
    i = rounds = 0
    while i < len(answer):
        draft, n = idx.propose(block)
        ok = 0
        for j, t in enumerate(draft):
            tried[n][j] += 1
            if i + j < len(answer) and answer[i + j] == t:
                accepted[n][j] += 1
                ok += 1
            else:
                break
        step = min(ok + 1, len(answer) - i)
        idx.extend(answer[i:i + step])
        i += step
        rounds += 1
    return rounds


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="distillation JSONL files of greedy answers (prompt_ids, response_ids)")
    p.add_argument("--block", type=int, default=7, help="draft positions measured (default 7, the drafters' block)")
    args = p.parse_args(argv)
    tried = {n: [0] * args.block for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
    accepted = {n: [0] * args.block for n in range(MIN_NGRAM, MAX_NGRAM + 1)}
    tokens = rounds = answers = 0
    for f in args.files:
        with open(f) as fh:
            for line in fh:
                row = json.loads(line)
                tokens += len(row["response_ids"])
                rounds += replay(row["prompt_ids"], row["response_ids"], args.block, tried, accepted)
                answers += 1
    print(f"# {answers} answers, {tokens} tokens, {rounds} rounds: lookup-only tau {tokens / max(rounds, 1):.3f}; "
          f"{sum(t[0] for t in tried.values())} lookup rounds")
    print("LOOKUP_ACCEPTANCE = {")
    for n in range(MIN_NGRAM, MAX_NGRAM + 1):
        rates = ", ".join(f"{a / t:.3f}" if t else "nan" for a, t in zip(accepted[n], tried[n]))
        print(f"    {n}: ({rates}),  # {tried[n][0]} rounds")
    print("}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
