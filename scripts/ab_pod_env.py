"""Usage: python scripts/ab_pod_env.py VARIANT[,VARIANT...] CONCURRENCY REPEATS

A/B of the service processes' environment (OpenMP wait policy, threads) and verifier flags, issue 21:
one embedded deployment with this environment (`dspark serve all`) plus one deployment per VARIANT (a
distributed one: redis + verifier + drafter + scheduler; an embedded one for names starting "e-"), all up
at once and loaded in turn (closed loop, CONCURRENCY in flight, greedy, 64 new tokens, the issue's 12-prompt
mix: 4 held-out each of mbpp, math500, arena-hard-v2, first 400 characters), REPEATS times. Prints tokens/s
per load, then per deployment the median and the median of its per-repeat ratios to the plain embedded one.
The variants are in VARIANTS below (per role: environment, and ARGS appended to that role's command)."""
import os
import statistics as st
import sys
import tempfile
from pathlib import Path

from dspark_cli.bench_distributed import Cluster, Client, wait_ready
from dspark_core.stack import default_target, resolve_drafter_path
from dspark_core.target import load_tokenizer
from dspark_core.text import encode_prompt
from dspark_core.training.data import load_prompts, split

VARIANTS = {
    # "": libgomp's own default (spin a while after a parallel region, then sleep); the bench sets PASSIVE
    "default": {"verifier": {"OMP_WAIT_POLICY": ""}, "drafter": {"OMP_WAIT_POLICY": ""},
                "scheduler": {"OMP_WAIT_POLICY": ""}},
    "e-default": {"all": {"OMP_WAIT_POLICY": ""}},
    "passive": {"verifier": {"OMP_WAIT_POLICY": "PASSIVE"}, "drafter": {"OMP_WAIT_POLICY": "PASSIVE"},
                "scheduler": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}},
    "spin": {"verifier": {"GOMP_SPINCOUNT": "20000"}, "drafter": {"GOMP_SPINCOUNT": "20000"},
             "scheduler": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}},
    "e-passive": {"all": {"OMP_WAIT_POLICY": "PASSIVE"}},
    "e-spin": {"all": {"GOMP_SPINCOUNT": "20000"}},
    # one intra-op thread: what every deployment ran before our kernels were built with OpenMP (kernels/parallel.h)
    "e-1thread": {"all": {"OMP_NUM_THREADS": "1"}},
    "1thread": {"verifier": {"OMP_NUM_THREADS": "1"}, "drafter": {"OMP_NUM_THREADS": "1"},
                "scheduler": {"OMP_NUM_THREADS": "1"}},
    "passive-bf16": {"verifier": {"OMP_WAIT_POLICY": "PASSIVE", "ARGS": ["--feature-dtype", "bfloat16"]},
                     "drafter": {"OMP_WAIT_POLICY": "PASSIVE"},
                     "scheduler": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}},
    "drafter1": {"verifier": {"OMP_WAIT_POLICY": "PASSIVE"}, "drafter": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"},
                 "scheduler": {"OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1"}},
}
names = sys.argv[1].split(",")
c = int(sys.argv[2]); reps = int(sys.argv[3])

class VCluster(Cluster):
    variant = {}
    def _spawn(self, dep, argv):
        env = dict(os.environ)
        for role, extra in self.variant.items():
            if role in argv[argv.index("serve") + 1]:
                extra = dict(extra)
                argv = argv + extra.pop("ARGS", [])
                env.update(extra)
        self.env = env
        super()._spawn(dep, argv)

target = default_target()
tok = load_tokenizer(target)
prompts = []
for ds in ("mbpp", "math500", "arena-hard-v2"):
    _, held = split(load_prompts(Path(__file__).resolve().parents[1] / "data" / "dev" / f"{ds}.jsonl"))
    prompts += [encode_prompt(tok, p.text[:400]) for p in held[:4]]
cl = VCluster(target, resolve_drafter_path("auto", None, target_dir=target), "fixed", None, Path(tempfile.mkdtemp()))
deps = {"embedded": cl.start_embedded()}  # this environment (PASSIVE unless set)
for n in names:
    cl.variant = VARIANTS[n]
    deps[n] = (cl.start_embedded() if n.startswith("e-") else cl.start_distributed()); deps[n].name = n
try:
    for d in deps.values(): wait_ready(d)
    clients = {k: Client(d) for k, d in deps.items()}
    for k in deps: clients[k].call(prompts[0], 4, 0.0, None)
    rates = {k: [] for k in deps}
    for r in range(reps):
        for k in deps:
            rate, outs, _ = clients[k].load(prompts, c, 64, 0.0, 0)
            rates[k].append(rate); print(k, r, round(rate, 1), flush=True)
    e = rates["embedded"]
    for k, xs in rates.items():
        print(k, "median", round(st.median(xs), 1), "paired vs embedded", round(st.median(b / a for a, b in zip(e, xs)), 3))
finally:
    cl.stop()
