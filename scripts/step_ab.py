"""Usage: python scripts/step_ab.py CHECKOUT LOGITS.pt

The SmolLM2 target step of one request (the served GGUF weights, one thread) at contexts 256 and 768, for 1 and 8
new tokens: medians of 22 timed steps each, printed as ms; the last step's logits are saved to LOGITS.pt. Run it
alternately from two checkouts (e.g. a `git worktree` of an older commit and this one) for an interleaved A/B,
and compare the saved logits (`torch.equal`) to check that a kernel change kept every bit.
"""
import sys, time, statistics, torch
sys.path.insert(0, sys.argv[1])
from dspark_cli.models import resolve_target, load_stack
from dspark_core.text import encode_prompt
torch.set_num_threads(1)
td = resolve_target("smollm2")
target, _ = load_stack(td, None, "cpu", "float32")
prompt = encode_prompt(target.tokenizer, "Write a Python function that reverses a string and explain it well.")
res = {}
for ctx in (256, 768):
    seq = target.new_sequence()
    target.forward([(seq, prompt + [100] * (ctx - len(prompt)))], last_logits_only=True)
    for k in (1, 8):
        ts = []
        for _ in range(25):
            t = time.perf_counter(); out = target.forward([(seq, [200 + j for j in range(k)])]); ts.append(time.perf_counter() - t)
            target.truncate(seq, ctx)
        res[f"ctx{ctx}-k{k}"] = statistics.median(ts[3:]) * 1e3
        res[f"logits{ctx}-{k}"] = out.logits.clone()
    target.release(seq)
print(sys.argv[1], {k: round(v, 2) for k, v in res.items() if not k.startswith("logits")})
torch.save({k: v for k, v in res.items() if k.startswith("logits")}, sys.argv[2])
