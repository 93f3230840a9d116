"""Usage: python scripts/drafter_round_stages.py [TEMPERATURE] [DRAFTER_MATMUL_DTYPE] [DRAFTER_PATH]

Where a SmolLM2 DSpark drafter round goes at batch 1 (issue 18 / 14): the engine runs the fixed policy (7 drafts)
over 8 held-out mbpp prompts, 64 tokens, one thread, twice; prints the median ms per call of the drafter's
stages (extend_contexts = the new positions' context K/V, forward_block = the block's layer, forward = the LM
head, run_heads = the Markov / confidence heads and the token choice, draft = all of it). DRAFTER_MATMUL_DTYPE:
`--drafter-matmul-dtype` (auto, float32, bfloat16, int8; default auto); DRAFTER_PATH: a drafter directory (default:
the installed default drafter)."""
import collections
import statistics as st
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_cli.bench import resolve_target  # noqa: E402
from dspark_cli.models import load_stack, resolve_drafter_path  # noqa: E402
from dspark_core.benchmark import BenchSettings, closed_loop, default_sampling, make_engine  # noqa: E402
from dspark_core.text import encode_prompt  # noqa: E402
from dspark_core.training.data import load_prompts, split  # noqa: E402

torch.set_num_threads(1)
td = resolve_target("smollm2")
matmul = sys.argv[2] if len(sys.argv) > 2 else "auto"
path = sys.argv[3] if len(sys.argv) > 3 else None
target, drafter = load_stack(td, resolve_drafter_path("auto", path, td), "cpu", "float32", drafter_matmul_dtype=matmul)
rows = split(load_prompts(Path(__file__).resolve().parents[1] / "data" / "dev" / "mbpp.jsonl"), 0.2)[1][:8]
prompts = [encode_prompt(target.tokenizer, r.text) for r in rows]
stop = tuple(target.eos_token_ids or ())
T = collections.defaultdict(list)


def wrap(obj, name, label=None):
    f = getattr(obj, name)

    def g(*a, **k):
        t0 = time.perf_counter()
        r = f(*a, **k)
        T[label or name].append((time.perf_counter() - t0) * 1e3)
        return r
    setattr(obj, name, g)


for n in ("draft", "extend_contexts", "forward_block", "run_heads"):
    wrap(drafter, n)
wrap(drafter.lm_head, "forward", "lm_head")
temp = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
settings = BenchSettings(policies=("fixed",), concurrencies=(1,), max_new_tokens=64, temperature=temp)
for rep in range(2):
    T.clear()
    eng = make_engine(target, drafter, "fixed", 1, settings, None)
    closed_loop(eng, prompts, 8, 1, lambda i: default_sampling(settings, stop, i))
    print(f"T = {temp}, drafter matmuls {matmul}, repeat {rep}: ms per call (calls)",
          {k: (round(st.median(v), 3), len(v)) for k, v in T.items()}, flush=True)
