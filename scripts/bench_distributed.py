"""Usage: python scripts/bench_distributed.py [PROMPT_DIR] [--concurrency 8] [--repeats 3]

Aggregate tokens/s: distributed (redis + verifier + drafter + scheduler processes) vs embedded
(`dspark serve all`), same prompts, same run, greedy, 64 new tokens: 24 held-out dev prompts (8 each of mbpp,
math500, arena-hard-v2, first 400 characters), the bundled target and DSpark drafter. The orchestration and
the stage breakdown are `dspark bench --distributed`'s (dspark_cli/bench_distributed.py); this script keeps
the issue's fixed prompt set."""
import argparse
import json
import sys
from pathlib import Path

from dspark_cli.bench_distributed import human_summary, run_distributed_bench
from dspark_core.benchmark import parse_int_list
from dspark_core.stack import default_target, resolve_drafter_path
from dspark_core.target import load_tokenizer
from dspark_core.text import encode_prompt
from dspark_core.training.data import load_prompts, split

REPO = Path(__file__).resolve().parents[1]
ap = argparse.ArgumentParser()
ap.add_argument("data", nargs="?", default=str(REPO / "data" / "dev"))
ap.add_argument("--concurrency", default="8")
ap.add_argument("--repeats", type=int, default=3)
ap.add_argument("--json", action="store_true")
args = ap.parse_args()
target = default_target()
tok = load_tokenizer(target)
prompts = []
for ds in ("mbpp", "math500", "arena-hard-v2"):
    _, held = split(load_prompts(Path(args.data) / f"{ds}.jsonl"))
    prompts += [encode_prompt(tok, p.text[:400]) for p in held[:8]]
r = run_distributed_bench(target, resolve_drafter_path("auto", None, target_dir=target), prompts, "fixed",
                          parse_int_list(args.concurrency, "--concurrency"), args.repeats, 64, 0.0, 0, None,
                          progress=lambda m: print(m, file=sys.stderr))
print(json.dumps(r) if args.json else human_summary(r))
