"""Widen a trained drafter's draft vocabulary without retraining it: the question is whether the ids a drafter
can never propose (the target's tokens outside its `draft_vocab_ids`) cost acceptance that a wider vocabulary
gives back for free.

A drafter with a draft vocabulary computes logits over those rows of the *target's* frozen LM head only, so a
wider vocabulary needs no new trained weights for the base logits: the new ids' rows come from the target at load
time, as the old ones do. The one trained tensor shaped by the vocabulary is the Markov head's W2 ([V_d, r], a
bias on each draft column from the previous token); new ids get zero rows (no bias), and every old id keeps its
row. The extra ids are the most frequent answer tokens outside the vocabulary in the given distillation files
(training split only), ties broken by the smaller id.

    python scripts/expand_draft_vocab.py models/smollm2/dspark /tmp/dspark-16k --size 16384 \
        --counts data/distill/smollm2-*.jsonl
    python scripts/expand_draft_vocab.py models/smollm2/dspark - --coverage data/distill/smollm2-t1-d.jsonl

`--coverage FILE...` prints the share of answer tokens inside the vocabulary (before and, with --size, after).
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
from collections import Counter
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def answer_tokens(paths: list[str]) -> Counter:
    """Counts of the answer (response) ids in `{"prompt_ids": [...], "response_ids": [...]}` lines."""
    counts: Counter = Counter()
    for path in paths:
        with open(path, encoding="utf-8") as fh:
            for lineno, line in enumerate(fh, 1):
                if not line.strip():
                    continue
                row = json.loads(line)
                ids = row.get("response_ids") if isinstance(row, dict) else None
                if not isinstance(ids, list):
                    continue  # a journal header or a text row: nothing to count
                counts.update(int(i) for i in ids)
    return counts


def widen(ids: torch.Tensor, counts: Counter, size: int, vocab_size: int) -> torch.Tensor:
    """`ids` (ascending target ids) plus the most frequent ids of `counts` not in it, up to `size`, ascending."""
    if size < ids.numel():
        raise SystemExit(f"expand_draft_vocab: error: --size {size} is below the current {ids.numel()} ids")
    if size > vocab_size:
        raise SystemExit(f"expand_draft_vocab: error: --size {size} is above the target's vocabulary ({vocab_size})")
    have = set(ids.tolist())
    extra = [t for t, _ in sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])) if t not in have and 0 <= t < vocab_size]
    if len(extra) < size - ids.numel():  # fewer seen ids than asked for: fill with the smallest unused ids
        seen = have | set(extra)
        extra += [t for t in range(vocab_size) if t not in seen][: size - ids.numel() - len(extra)]
    new = torch.tensor(sorted(have | set(extra[: size - ids.numel()])), dtype=torch.long)
    assert new.numel() == size
    return new


def coverage(ids: set[int], counts: Counter) -> float:
    total = sum(counts.values())
    return sum(c for t, c in counts.items() if t in ids) / max(total, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("src", help="a drafter directory with a draft vocabulary (model.safetensors + config.json)")
    p.add_argument("out", help="directory to write the widened drafter to ('-' with --coverage only)")
    p.add_argument("--size", type=int, default=None, help="the new draft vocabulary size")
    p.add_argument("--counts", nargs="+", default=[], help="distillation JSONL files whose answer ids rank the new ids")
    p.add_argument("--coverage", nargs="+", default=[], help="JSONL files to report the vocabulary's coverage on")
    args = p.parse_args()
    src = Path(args.src)
    weights = load_file(str(src / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    ids = weights.get("draft_vocab_ids")
    if ids is None or not config.get("draft_vocab_size"):
        raise SystemExit(f"expand_draft_vocab: error: {src} has no draft vocabulary")
    if args.out != "-" and "lm_head.weight" in weights:
        raise SystemExit(f"expand_draft_vocab: error: {src} stores its own LM-head rows, and the new ids' rows are "
                         "the target's: widen a drafter that references the target's tensors (shipped with "
                         "scripts/ship_drafter.py --reference-target)")
    new_ids = ids
    if args.size is not None:
        if not args.counts:
            raise SystemExit("expand_draft_vocab: error: --size needs --counts FILE... to rank the new ids")
        new_ids = widen(ids, answer_tokens(args.counts), args.size, int(config["vocab_size"]))
    if args.coverage:
        cov = answer_tokens(args.coverage)
        print(f"coverage of {sum(cov.values())} answer tokens: {coverage(set(ids.tolist()), cov):.4f} "
              f"({ids.numel()} ids)" + (f" -> {coverage(set(new_ids.tolist()), cov):.4f} ({new_ids.numel()} ids)"
                                        if args.size else ""))
    if args.out == "-":
        return
    if args.size is None:
        raise SystemExit("expand_draft_vocab: error: writing a drafter needs --size")
    out = Path(args.out)
    if out.resolve() == src.resolve():
        raise SystemExit("expand_draft_vocab: error: write to a new directory, not over the source")
    out.mkdir(parents=True, exist_ok=True)
    w2 = weights["markov_head.markov_w2.weight"] if "markov_head.markov_w2.weight" in weights else None
    if w2 is not None:
        rows = torch.zeros(new_ids.numel(), w2.shape[1], dtype=w2.dtype)
        pos = torch.searchsorted(new_ids, ids)  # where each old id sits among the new ones
        rows[pos] = w2
        weights["markov_head.markov_w2.weight"] = rows
    weights["draft_vocab_ids"] = new_ids
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out / "model.safetensors"))
    config["draft_vocab_size"] = int(new_ids.numel())
    (out / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    for name in ("calibration.json", "README.md", "training_card.json"):
        if (src / name).exists():
            shutil.copy(src / name, out / name)
    print(f"wrote {out}: {ids.numel()} -> {new_ids.numel()} draft ids", file=sys.stderr)


if __name__ == "__main__":
    main()
