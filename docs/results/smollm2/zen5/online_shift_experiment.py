"""The online per-slot logit shift tried in session 22 (not kept in the engine): `dspark bench` with the engine patched
so that every slot's confidence gets a workload-wide logit shift, learned from earlier rounds by one SGD step on
the bias per verified slot (y - c).

    python docs/results/smollm2/zen5/online_shift_experiment.py LR bench ARGS...     (LR 0: no shift)
    GATE=0 ...: the draft gate off
"""
import sys
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[4]))
from dspark_core import engine as E
LR = float(sys.argv[1])
orig_lengths, orig_observe = E.Engine._lengths, E.Engine._observe
def shifts(self, greedy):
    d = self.__dict__.setdefault("_recal", {})
    return d.setdefault(greedy, [0.0] * 32)
def _lengths(self, confs, ids):
    if LR > 0:
        reqs = {r.request_id: r for r in self.active}
        for c, rid in zip(confs, ids):
            s = shifts(self, reqs[rid].params.greedy)
            for k in range(len(c)):
                c[k] = E._shift_logit(c[k], s[k])
    return orig_lengths(self, confs, ids)
def _observe(self, reqs, drafts, confs, results):
    if LR > 0:
        for r, d, c, res in zip(reqs, drafts, confs, results):
            if isinstance(res, BaseException) or not d.tokens:
                continue
            s = shifts(self, r.params.greedy)
            for k in range(min(len(d.tokens), res.num_accepted + 1)):  # slots reached and verified
                y = 1.0 if res.num_accepted > k else 0.0
                s[k] += LR * (y - c[k])
    return orig_observe(self, reqs, drafts, confs, results)
E.Engine._lengths, E.Engine._observe = _lengths, _observe
import os, dataclasses
from dspark_core import benchmark as BM
_mk = BM.make_engine
def make_engine(*a, **k):
    eng = _mk(*a, **k)
    if os.environ.get("GATE") == "0":
        eng.config = dataclasses.replace(eng.config, gate_drafts=False)
    return eng
BM.make_engine = make_engine
from dspark_cli.main import main
sys.exit(main(sys.argv[2:]))
