"""Usage: python scripts/prepared_block_hit_rate.py [--prompts 8] [--max-new-tokens 64] [--policy fixed]

How predictable is the outcome of a verify pass? (issue 21, the overlap part). A drafter that prepares
block t+1 while the verifier checks block t must guess the outcome: how many drafts are accepted (a) and
the next anchor x (the recovered or bonus token). This runs the bundled target + DSpark drafter embedded
(greedy; the issue's prompt mix: held-out mbpp, math500, arena-hard-v2, first 400 characters) and, for
every verified round, records the drafter's top-2 tokens at each slot, then counts:
- all_accepted: a == l (every verified draft accepted; the bonus token is then the only unknown);
- recovered_is_second_choice: after a rejection at slot a+1, the target's token equals the drafter's
  second choice there (the "reject at j, next anchor = runner-up" hypothesis);
- hits_topK (K = 1, 2, 3, 5, 8): the outcome (a, x) is among the K most likely hypotheses as the
  drafter ranks them, counting the all-accepted hypothesis as a hit only when its bonus guess is right
  (guessed here by the drafter's own next-slot token when l < gamma; when l == gamma it is not known,
  so those rounds count as misses: a lower bound).
Greedy only (the ranking uses the drafter's probabilities and confidences); prints one JSON object.

It also measures what a prepared block is worth when its hypothesis does come true: while block t is being
verified, the drafter's context lacks the features of the positions under verification (they come out of
that very pass), so a block prepared then is drafted from an older context. For every round, the block that
a pre-drafter would have prepared for the true outcome (the drafter's cache as it stood during the verify
pass, anchored at the true next anchor) is compared with the block drafted afresh next round:
prepared_accepted vs fresh_accepted (mean accepted drafts, greedy, against the target's own output).
"""
import argparse
import json
from pathlib import Path

import torch

from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams
from dspark_core.stack import default_target, load_stack
from dspark_core.text import encode_prompt
from dspark_core.training.data import load_prompts, split
from dspark_cli.models import load_sps, resolve_drafter_path

REPO = Path(__file__).resolve().parents[1]
ap = argparse.ArgumentParser()
ap.add_argument("--prompts", type=int, default=8, help="per dataset (default 8)")
ap.add_argument("--max-new-tokens", type=int, default=64)
ap.add_argument("--policy", default="fixed")
args = ap.parse_args()

target_dir = default_target()
target, drafter = load_stack(target_dir, resolve_drafter_path("auto", None, target_dir=target_dir), "cpu", "float32")
top2: dict[int, list] = {}  # id(ProposeItem.state) -> [gamma, 2] top-2 token ids, [gamma, 2] probs
inner = drafter.draft


def draft(items):
    out = inner(items)
    probs = torch.softmax(out.logits.float(), -1)
    p, ids = probs.topk(2, dim=-1)
    if getattr(drafter, "draft_vocab_ids", None) is not None:  # columns of a draft vocabulary -> target ids
        ids = drafter.draft_vocab_ids[ids]
    for i, it in enumerate(items):
        top2[id(it.state)] = (ids[i].tolist(), p[i].tolist())
    return out


drafter.draft = draft
rounds = []
prepared: dict[tuple, tuple] = {}  # (request id, anchor position) -> (output index of the anchor, block tokens)
paired: list[tuple] = []  # (request id, output index, prepared tokens, fresh accepted)


def prepare(req):
    """The block a pre-drafter would have drafted during the verify pass that just ended, for its outcome."""
    st = req.draft_state
    dev = drafter._device
    anchors = torch.tensor([req.anchor], device=dev)
    hidden = drafter.forward_block([st.cache], anchors, torch.tensor([req.anchor_pos], device=dev))
    return drafter.run_heads(hidden, drafter.lm_head(hidden), anchors).tokens[0].tolist()


def observe(rec):
    for rid, prop, l in zip(rec.request_ids, rec.proposals, rec.lengths):
        req = engine.requests.get(rid)
        ev = next((e for e in rec.events if e.request_id == rid), None)
        if req is None or ev is None or not req.accepted_per_round or l == 0:
            continue
        a = req.accepted_per_round[-1]
        key = (rid, req.anchor_pos - len(ev.new_token_ids))  # this round's anchor position
        if key in prepared:
            paired.append((rid, *prepared.pop(key), a))
        if not req.finished:
            with torch.no_grad():
                prepared[(rid, req.anchor_pos)] = (len(req.output_ids), prepare(req))
        if len(ev.new_token_ids) <= a:
            continue  # cut by max_new_tokens / a stop: no next anchor
        ids, p = top2[id(req.draft_state)] if req.draft_state is not None else (None, None)
        if ids is None:
            continue
        conf = [float(c) for c in prop.confidences[:l]] if prop.confidences is not None else [p[k][0] for k in range(l)]
        rounds.append({"a": a, "l": l, "x": ev.new_token_ids[a], "ids": ids, "p": p, "conf": conf})


# the cost-table policies (causal, async) read the target's installed SPS table, as `dspark generate` does
engine = Engine(target, drafter, EngineConfig(policy=args.policy), observer=observe, sps=load_sps(target_dir)[0])
tok = target.tokenizer
for ds in ("mbpp", "math500", "arena-hard-v2"):
    _, held = split(load_prompts(REPO / "data" / "dev" / f"{ds}.jsonl"))
    for pr in held[:args.prompts]:
        engine.add_request(encode_prompt(tok, pr.text[:400]), SamplingParams(temperature=0, max_new_tokens=args.max_new_tokens))
outputs = {}
while engine.has_work:
    for ev in engine.step():
        if ev.finished:
            outputs[ev.request_id] = engine.requests[ev.request_id].output_ids


def matched(block, truth):
    k = 0
    while k < len(block) and k < len(truth) and block[k] == truth[k]:
        k += 1
    return k


quality = [(matched(toks, outputs[rid][idx:]), fresh) for rid, idx, toks, fresh in paired if rid in outputs
           and len(outputs[rid]) - idx >= len(toks)]

n = len(rounds)
all_acc = sum(r["a"] == r["l"] for r in rounds)
rej = [r for r in rounds if r["a"] < r["l"]]
second = sum(r["x"] == r["ids"][r["a"]][1] for r in rej)
hits = {1: 0, 2: 0, 3: 0, 5: 0, 8: 0}
for r in rounds:
    l, conf, ids, p = r["l"], r["conf"], r["ids"], r["p"]
    hyps = []  # (probability estimate, a, x)
    surv = 1.0
    for j in range(l):  # reject at slot j (a = j), next anchor = the runner-up there
        runner_up = p[j][1] / max(1e-9, 1 - p[j][0])
        hyps.append((surv * (1 - conf[j]) * runner_up, j, ids[j][1]))
        surv *= conf[j]
    bonus = ids[l][0] if l < len(ids) else None  # the drafter's own guess of the bonus token
    hyps.append((surv, l, bonus))
    hyps.sort(key=lambda h: -h[0])
    for k in hits:
        if any(a == r["a"] and x is not None and x == r["x"] for _, a, x in hyps[:k]):
            hits[k] += 1
print(json.dumps({"rounds": n, "policy": args.policy, "gamma": drafter.block_size,
                  "all_accepted": round(all_acc / n, 3),
                  "recovered_is_second_choice": round(second / max(1, len(rej)), 3),
                  **{f"hits_top{k}": round(v / n, 3) for k, v in hits.items()},
                  "mean_accepted": round(sum(r["a"] for r in rounds) / n, 3),
                  "paired_rounds": len(quality),
                  "prepared_accepted": round(sum(q for q, _ in quality) / max(1, len(quality)), 3),
                  "fresh_accepted": round(sum(f for _, f in quality) / max(1, len(quality)), 3)}))
