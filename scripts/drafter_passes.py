"""Where a loaded step's drafting goes, per bench point: `dspark bench` with its engines instrumented.

    python scripts/drafter_passes.py bench --target smollm2 --policy causal,ar --draft-gate-scope both \\
        --concurrency 8 --num-prompts 64 --max-new-tokens 64 --no-hf --no-llamacpp --json --out run.json

Runs the bench as given (its JSON / text output unchanged), then prints for every point at concurrency > 1:
steps, drafter passes and their total time, the verify calls' total time, the request-rounds the draft gate held
back, the batch scope's probe passes, the pass-cost fit (fixed + per request) of the point's last engine, and the
passes by size (count, median ms). Timings include the bench's untimed warm-up engine for its warm policy.
"""

from __future__ import annotations

import atexit
import statistics
import sys
import time
from collections import defaultdict

from dspark_cli.main import main
from dspark_core import benchmark
from dspark_core import engine as engine_mod

_stats: dict = defaultdict(lambda: {"passes": defaultdict(list), "verify": 0.0, "draft": 0.0, "engines": []})
_make_engine = benchmark.make_engine
_draft = engine_mod.Engine._draft


def _instrumented_engine(target, drafter, policy, concurrency, settings, sps):
    eng = _make_engine(target, drafter, policy, concurrency, settings, sps)
    st = _stats[(policy, concurrency)]
    st["engines"].append(eng)
    eng._passes_log = st
    verify = eng.verifier.verify

    def timed_verify(items):
        t = time.perf_counter()
        try:
            return verify(items)
        finally:
            st["verify"] += time.perf_counter() - t

    eng.verifier.verify = timed_verify
    return eng


def _timed_draft(self, reqs, rec, undrafted=()):
    t = time.perf_counter()
    try:
        return _draft(self, reqs, rec, undrafted)
    finally:
        st = getattr(self, "_passes_log", None)
        if st is not None:
            dt = time.perf_counter() - t
            st["passes"][len(reqs)].append(dt)
            st["draft"] += dt


@atexit.register
def _report() -> None:
    for (policy, c), st in _stats.items():
        if c == 1:
            continue
        engines = st["engines"]
        passes = sum(len(v) for v in st["passes"].values())
        fit = engines[-1].draft_cost.cost
        print(f"{policy} c={c}: steps {sum(e.num_steps for e in engines)}, drafter passes {passes} "
              f"({st['draft']:.2f} s), verify {st['verify']:.2f} s, gated request-rounds "
              f"{sum(e.num_gated_drafts for e in engines)}, probe passes {sum(e.num_probe_passes for e in engines)}, "
              f"pass fit {1000 * fit.base:.2f} ms + {1000 * fit.per_request:.2f} ms / request", file=sys.stderr)
        sizes = {n: (len(v), round(1000 * statistics.median(v), 2)) for n, v in sorted(st["passes"].items())}
        print(f"  passes by size (count, median ms): {sizes}", file=sys.stderr)


if __name__ == "__main__":
    benchmark.make_engine = _instrumented_engine
    engine_mod.Engine._draft = _timed_draft
    sys.exit(main(sys.argv[1:]))
