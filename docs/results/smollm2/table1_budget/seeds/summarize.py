"""Table 1 at T = 1 over seeds 0-2 (shipped weights): per-seed taus, per-set means, macro mean and range."""
import json, statistics as st, sys
from pathlib import Path
D = Path(__file__).resolve().parent; T1 = D.parent  # seed 0 of DSpark: Table 1's own JSONs
sets = ['mbpp', 'math500', 'arena-hard-v2']
def tau(p):
    
    try:
        return json.load(open(p))['tau']
    except (OSError, ValueError):
        return None
rows = {}
for tag in ['dspark', 'rnn5ship', 'eagle3ship', 'dflashship']:
    per_seed = {}
    for s in (0, 1, 2):
        vals = []
        for ds in sets:
            p = D / f'{tag}_s{s}_{ds}.json'
            if tag == 'dspark' and s == 0 and not p.exists():
                p = T1 / f'dspark_t1_{ds}.json'
            vals.append(tau(p))
        per_seed[s] = vals
    rows[tag] = per_seed
    for s, v in per_seed.items():
        print(tag, s, [round(x, 3) if x else None for x in v], 'macro', round(sum(v) / 3, 3) if all(v) else None)
print()
means = {}
for tag, ps in rows.items():
    ok = [s for s in ps if all(ps[s])]
    macros = [sum(ps[s]) / 3 for s in ok]
    perset = [st.mean(ps[s][i] for s in ok) for i in range(3)] if ok else None
    means[tag] = (st.mean(macros) if macros else None, macros, perset)
    print(tag, 'seeds', ok, 'per-set mean', [round(x, 3) for x in perset] if perset else None,
          'macro mean', round(means[tag][0], 3) if macros else None, 'range', [round(min(macros), 3), round(max(macros), 3)] if macros else None)
