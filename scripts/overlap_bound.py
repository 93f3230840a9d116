"""Usage: python scripts/overlap_bound.py [TARGET] [CONCURRENCY]

What overlapping the drafter with the verifier could give on this machine (issue 21): the engine's draft and
verify stage times per step (fixed policy, greedy, the last 8 mbpp dev prompts, 64 tokens, 3 repeats,
medians) with one thread (a pod on each core) and with two (the embedded engine, both cores). The bound is
(draft + verify on two threads) / max(draft, verify on one thread): a perfect overlap (every prepared block
used, accepted like a fresh one) with no transport. Prints the per-repeat medians, then one JSON line."""
import json
import statistics as st
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dspark_cli.models import load_stack, resolve_drafter_path
from dspark_cli.bench import resolve_target
from dspark_core.benchmark import BenchSettings, make_engine, closed_loop, default_sampling
from dspark_core.text import encode_prompt  # noqa: E402
td = resolve_target(sys.argv[1] if len(sys.argv) > 1 else "smollm2")
target, drafter = load_stack(td, resolve_drafter_path("auto", None, td), "cpu", "float32")
rows = [json.loads(l) for l in open(Path(__file__).resolve().parents[1] / "data" / "dev" / "mbpp.jsonl")][-8:]
prompts = [encode_prompt(target.tokenizer, r["turns"][0]) for r in rows]
c = int(sys.argv[2]) if len(sys.argv) > 2 else 1
settings = BenchSettings(policies=("fixed",), concurrencies=(c,), max_new_tokens=64, temperature=0.0)
stop = tuple(target.eos_token_ids or ())
res = {}
for rep in range(3):
    for n in (1, 2):
        torch.set_num_threads(n)
        eng = make_engine(target, drafter, "fixed", c, settings, None)
        d, v = [], []
        def obs(rec):
            t = rec.timings
            if "draft" in t and "prefill" not in t:
                d.append((t["draft"][1] - t["draft"][0]) / 1e6); v.append((t["verify"][1] - t["verify"][0]) / 1e6)
        eng.observer = obs
        closed_loop(eng, prompts, max(8, 2 * c), c, lambda i: default_sampling(settings, stop, i))
        res.setdefault(n, []).append((st.median(d), st.median(v)))
for n, xs in res.items():
    print(n, "thread(s): draft ms", [round(a, 2) for a, _ in xs], "verify ms", [round(b, 2) for _, b in xs])
D1 = st.median(a for a, _ in res[1]); V1 = st.median(b for _, b in res[1])
D2 = st.median(a for a, _ in res[2]); V2 = st.median(b for _, b in res[2])
print(json.dumps({"concurrency": c, "draft_ms_1thread": round(D1, 2), "verify_ms_1thread": round(V1, 2),
                  "draft_ms_2threads": round(D2, 2), "verify_ms_2threads": round(V2, 2),
                  "embedded_step_2threads": round(D2 + V2, 2), "perfect_overlap_step_1thread_each": round(max(D1, V1), 2),
                  "bound_distributed_vs_embedded": round((D2 + V2) / max(D1, V1), 3)}))
