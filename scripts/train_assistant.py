"""Train a tiny autoregressive *assistant* model for the bundled target: the peer drafter that Hugging Face
transformers' assisted generation (`model.generate(..., assistant_model=...)`) uses in `dspark bench`.

The assistant is a 2-layer `Qwen3ForCausalLM` with the target's tokenizer, distilled from the target:

1. initialisation ("shrink"): the target's embeddings / tied LM head and final norm, and two of its
   layers (default: the first and the last), with each MLP cut to the `--intermediate` neurons of largest
   weight norm. Width stays the target's (256), so the embeddings carry over as they are.
2. data: the target's own greedy answers to the *train* split of the dev prompt sets
   (`dspark_core.training.data.load_prompts` / `split` / `distill`; the held-out 20% split that `dspark
   eval` and `dspark bench` use is never read), code prompts first, until `--distill-minutes` are spent;
   plus, with `--corpus-fraction > 0`, windows of the target's own training corpus
   (`scripts/train_bundled_model.py::build_corpus`, imported, not copied).
3. training: KL(target || assistant) on the target's full next-token distribution plus cross-entropy to
   the target's argmax (what greedy acceptance needs), for `--train-minutes` of wall time; the learning
   rate follows warm-up then cosine over the *time* budget.

Run it niced on one thread, in the background (the numbers in the model card come from such a run):

    setsid nohup nice -n 5 env OMP_NUM_THREADS=1 .venv/bin/python scripts/train_assistant.py \
        --out models/assistant > runs/assistant.log 2>&1 &
"""

from __future__ import annotations

import argparse
import json
import math
import random
import shutil
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
DEFAULT_DATA = [REPO / "data" / "dev" / f"{n}.jsonl"
                for n in ("mbpp", "livecodebench", "math500", "arena-hard-v2")]
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json")


# ----------------------------------------------------------------------------- model

def shrink_target(target, layer_ids: list[int], intermediate: int):
    """A Qwen3 with the target's width, `layer_ids` of its layers and MLPs pruned to `intermediate` neurons."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    tc = target.config
    cfg = Qwen3Config(
        vocab_size=tc.vocab_size, hidden_size=tc.hidden_size, intermediate_size=intermediate,
        num_hidden_layers=len(layer_ids), num_attention_heads=tc.num_attention_heads,
        num_key_value_heads=tc.num_key_value_heads, head_dim=tc.head_dim,
        max_position_embeddings=tc.max_position_embeddings, rms_norm_eps=tc.rms_norm_eps,
        tie_word_embeddings=True, eos_token_id=tc.eos_token_id, pad_token_id=tc.pad_token_id, bos_token_id=None,
        rope_parameters=getattr(tc, "rope_parameters", None),
    )
    model = Qwen3ForCausalLM(cfg)
    src, dst = target.model, model.model
    with torch.no_grad():
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
        dst.norm.weight.copy_(src.norm.weight)
        for new, old in enumerate(layer_ids):
            a, b = src.layers[old], dst.layers[new]
            b.self_attn.load_state_dict(a.self_attn.state_dict())
            b.input_layernorm.load_state_dict(a.input_layernorm.state_dict())
            b.post_attention_layernorm.load_state_dict(a.post_attention_layernorm.state_dict())
            # keep the neurons whose in- and out-weights are largest
            score = (a.mlp.gate_proj.weight.norm(dim=1) * a.mlp.up_proj.weight.norm(dim=1)
                     * a.mlp.down_proj.weight.norm(dim=0))
            keep = score.topk(intermediate).indices.sort().values
            b.mlp.gate_proj.weight.copy_(a.mlp.gate_proj.weight[keep])
            b.mlp.up_proj.weight.copy_(a.mlp.up_proj.weight[keep])
            b.mlp.down_proj.weight.copy_(a.mlp.down_proj.weight[:, keep])
    model.tie_weights()
    return model


# ----------------------------------------------------------------------------- data

def interleave(*lists):
    out = []
    for i in range(max(map(len, lists), default=0)):
        out.extend(lst[i] for lst in lists if i < len(lst))
    return out


def distill_train_split(files: list[Path], target_dir: str, minutes: float, max_new_tokens: int,
                        max_prompt_tokens: int, chunk: int, seed: int) -> tuple[list, dict]:
    """Greedy target answers to train-split prompts, code first, until the time budget is spent."""
    from dspark_core.target import TargetConfig, TargetRuntime
    from dspark_core.training.data import distill, load_prompts, split

    target = TargetRuntime(TargetConfig(target_dir, device="cpu", dtype="float32"))
    by_domain: dict[str, list] = {}
    counts = {}
    for f in files:
        train, held = split(load_prompts(f), 0.2)
        counts[Path(f).stem] = {"train": len(train), "held_out_never_used": len(held)}
        by_domain.setdefault(train[0].domain if train else "other", []).append(train)
    code = interleave(*by_domain.pop("code", []))
    rest = interleave(*[interleave(*v) for v in by_domain.values()])
    prompts = code + rest
    samples, t0, used = [], time.time(), 0
    for i in range(0, len(prompts), chunk):
        if time.time() - t0 > minutes * 60:
            break
        part = prompts[i:i + chunk]
        samples += distill(target, part, max_new_tokens=max_new_tokens, temperature=0.0, seed=seed,
                           concurrency=chunk, max_prompt_tokens=max_prompt_tokens, progress=False,
                           index_base=i)
        used += len(part)
        print(f"distill: {used}/{len(prompts)} prompts, {len(samples)} answers, "
              f"{sum(len(s.response_ids) for s in samples)} answer tokens, {time.time() - t0:.0f}s", flush=True)
    stats = {"prompt_files": counts, "prompts_offered": len(prompts), "prompts_answered": used,
             "samples": len(samples), "answer_tokens": sum(len(s.response_ids) for s in samples),
             "seconds": round(time.time() - t0, 1), "temperature": 0.0, "max_new_tokens": max_new_tokens,
             "max_prompt_tokens": max_prompt_tokens}
    return samples, stats


def corpus_windows(tokenizer, seq_len: int, seed: int, limit_docs: int) -> torch.Tensor:
    """Packed windows of the target's own training corpus (its train part only)."""
    sys.path.insert(0, str(REPO / "scripts"))
    from train_bundled_model import build_corpus

    train_texts, _held, _stats = build_corpus(seed)
    texts = train_texts[:limit_docs]
    ids: list[int] = []
    for enc in tokenizer.backend_tokenizer.encode_batch(texts):
        ids.extend(enc.ids)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def make_batch(samples, idx, seq_len: int, pad_id: int, prompt_weight: float):
    """Right-padded [B, T] ids and per-position loss weights; long sequences keep their tail."""
    rows, weights = [], []
    for i in idx:
        s = samples[i]
        ids = s.prompt_ids + s.response_ids
        # position t predicts token t+1: weight 1 where t+1 is an answer token
        w = [prompt_weight] * (len(s.prompt_ids) - 1) + [1.0] * len(s.response_ids) + [0.0]
        ids, w = ids[-seq_len:], w[-seq_len:]
        rows.append(ids)
        weights.append(w)
    T = max(map(len, rows))
    x = torch.full((len(rows), T), pad_id, dtype=torch.long)
    wt = torch.zeros(len(rows), T)
    att = torch.zeros(len(rows), T, dtype=torch.long)
    for r, (ids, w) in enumerate(zip(rows, weights)):
        x[r, :len(ids)] = torch.tensor(ids)
        wt[r, :len(w)] = torch.tensor(w)
        att[r, :len(ids)] = 1
    return x, att, wt


def distill_loss(student_logits, teacher_logits, weights, ce_weight: float):
    """Weighted mean over positions of KL(teacher || student) + ce_weight * CE(student, argmax teacher)."""
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    ce = -s.gather(-1, t.argmax(-1, keepdim=True)).squeeze(-1)
    agree = (s.argmax(-1) == t.argmax(-1)).float()
    norm = weights.sum().clamp_min(1e-9)
    loss = ((kl + ce_weight * ce) * weights).sum() / norm
    return loss, (kl * weights).sum() / norm, (agree * weights).sum() / norm


@torch.no_grad()
def evaluate(student, teacher, samples, idx, args, pad_id) -> dict:
    student.eval()
    tot = {"kl": 0.0, "top1_agreement": 0.0}
    n = 0
    for i in range(0, len(idx), args.batch):
        x, att, w = make_batch(samples, idx[i:i + args.batch], args.seq_len, pad_id, 0.0)
        t = teacher(input_ids=x, attention_mask=att).logits
        s = student(input_ids=x, attention_mask=att).logits
        _, kl, agree = distill_loss(s, t, w, 0.0)
        k = float(w.sum())
        tot["kl"] += float(kl) * k
        tot["top1_agreement"] += float(agree) * k
        n += k
    student.train()
    return {k: round(v / max(n, 1), 4) for k, v in tot.items()}


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(REPO / "models" / "target"))
    p.add_argument("--out", default=str(REPO / "models" / "assistant"))
    p.add_argument("--data", nargs="*", default=[str(f) for f in DEFAULT_DATA])
    p.add_argument("--layers", default="0,7", help="target layers the assistant starts from (default 0,7)")
    p.add_argument("--intermediate", type=int, default=512, help="MLP neurons kept per layer (default 512)")
    p.add_argument("--distill-minutes", type=float, default=5.0)
    p.add_argument("--train-minutes", type=float, default=10.0)
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--max-prompt-tokens", type=int, default=1024)
    p.add_argument("--chunk", type=int, default=32, help="prompts the target answers together")
    p.add_argument("--seq-len", type=int, default=384, help="tokens per training sequence (tail kept)")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--ce-weight", type=float, default=0.5)
    p.add_argument("--prompt-weight", type=float, default=0.1, help="loss weight of prompt positions")
    p.add_argument("--corpus-fraction", type=float, default=0.25,
                   help="share of batches drawn from the target's own training corpus (default 0.25)")
    p.add_argument("--eval-samples", type=int, default=48, help="distilled samples kept out for the card")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()
    tok = AutoTokenizer.from_pretrained(args.target)
    teacher = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for q in teacher.parameters():
        q.requires_grad_(False)
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    layer_ids = [int(v) for v in args.layers.split(",")]
    student = shrink_target(teacher, layer_ids, args.intermediate).float().train()
    n_params = sum(q.numel() for q in student.parameters())
    print(f"assistant: {n_params / 1e6:.2f}M parameters from target layers {layer_ids}", flush=True)

    samples, dstats = distill_train_split(args.data, args.target, args.distill_minutes, args.max_new_tokens,
                                          args.max_prompt_tokens, args.chunk, args.seed)
    order = list(range(len(samples)))
    rng.shuffle(order)
    eval_idx, train_idx = order[: args.eval_samples], order[args.eval_samples:]
    corpus = None
    if args.corpus_fraction > 0:
        t0 = time.time()
        corpus = corpus_windows(tok, args.seq_len, 1234, limit_docs=6000)
        print(f"corpus: {tuple(corpus.shape)} windows in {time.time() - t0:.0f}s", flush=True)
    init_eval = evaluate(student, teacher, samples, eval_idx, args, pad_id)
    print(f"eval at init: {init_eval}", flush=True)

    opt = torch.optim.AdamW(student.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.0)
    budget = args.train_minutes * 60
    t0, step, tokens, losses, agrees = time.time(), 0, 0, [], []
    cursor = len(train_idx)
    while time.time() - t0 < budget:
        frac = (time.time() - t0) / budget
        lr = args.lr * min(1.0, (frac + 1e-3) / 0.05) * (0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        if corpus is not None and rng.random() < args.corpus_fraction:
            rows = torch.randint(0, len(corpus), (args.batch,))
            x = corpus[rows]
            att = torch.ones_like(x)
            w = torch.ones(x.shape, dtype=torch.float32)
            w[:, -1] = 0
        else:
            if cursor + args.batch > len(train_idx):
                rng.shuffle(train_idx)
                cursor = 0
            x, att, w = make_batch(samples, train_idx[cursor:cursor + args.batch], args.seq_len, pad_id,
                                   args.prompt_weight)
            cursor += args.batch
        with torch.no_grad():
            t_logits = teacher(input_ids=x, attention_mask=att).logits
        s_logits = student(input_ids=x, attention_mask=att).logits
        loss, kl, agree = distill_loss(s_logits, t_logits, w, args.ce_weight)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        opt.step()
        step += 1
        tokens += int(att.sum())
        losses.append(float(kl.detach()))
        agrees.append(float(agree.detach()))
        if step % 10 == 0:
            print(f"step {step} {time.time() - t0:.0f}s lr {lr:.2e} kl {sum(losses[-10:]) / 10:.3f} "
                  f"top1 {sum(agrees[-10:]) / 10:.3f}", flush=True)
    train_seconds = time.time() - t0
    final_eval = evaluate(student, teacher, samples, eval_idx, args, pad_id)
    print(f"eval at end: {final_eval}", flush=True)

    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    student = student.to(torch.bfloat16)
    student.config.dtype = "bfloat16"
    student.generation_config.eos_token_id = student.config.eos_token_id
    student.generation_config.pad_token_id = student.config.pad_token_id
    student.generation_config.do_sample = False
    student.save_pretrained(out)
    for name in TOKENIZER_FILES:
        if (Path(args.target) / name).exists():
            shutil.copy(Path(args.target) / name, out / name)
    card = {
        "parameters": n_params, "init": {"target_layers": layer_ids, "intermediate": args.intermediate},
        "distill": dstats, "train_steps": step, "train_tokens": tokens,
        "train_minutes": round(train_seconds / 60, 2), "total_minutes": round((time.time() - t_start) / 60, 2),
        "final_train_kl": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 4),
        "final_train_top1": round(sum(agrees[-20:]) / max(len(agrees[-20:]), 1), 4),
        "eval_at_init": init_eval, "eval_at_end": final_eval, "eval_samples": len(eval_idx),
        "torch_threads": torch.get_num_threads(), "args": vars(args),
    }
    (out / "training_stats.json").write_text(json.dumps(card, indent=1) + "\n")
    write_model_card(out, card)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(json.dumps(card, indent=1))
    print(f"saved {out} ({size / 1e6:.2f} MB)")


def write_model_card(out: Path, card: dict) -> None:
    a, d = card["args"], card["distill"]
    text = f"""# dspark assistant (Hugging Face assisted-generation peer)

A tiny autoregressive `Qwen3ForCausalLM` distilled from the bundled target (`models/target`), with the
target's tokenizer (vocabulary 4096). It exists to be the `assistant_model` of Hugging Face
transformers' own assisted generation, the peer that `dspark bench` compares DSpark against at batch 1.
It is not a drafter for the DSpark engine. Trained by `scripts/train_assistant.py`.

| | |
|---|---|
| architecture | Qwen3, {len(card["init"]["target_layers"])} layers, hidden 256, intermediate {card["init"]["intermediate"]}, tied embeddings |
| parameters | {card["parameters"]:,} |
| initialisation | the target's embeddings, final norm and layers {card["init"]["target_layers"]}, MLPs pruned to the {card["init"]["intermediate"]} neurons of largest weight norm |
| data | the target's greedy answers (max {d["max_new_tokens"]} tokens) to {d["prompts_answered"]} train-split dev prompts ({d["samples"]} answers, {d["answer_tokens"]:,} answer tokens; code first), plus {a["corpus_fraction"]:.0%} of batches from the target's own training corpus |
| held-out prompts | never used: the 20% eval split of `dspark_core.training.data.split` is left out |
| loss | KL(target or assistant) on the full next-token distribution + {a["ce_weight"]} x CE to the target's argmax; answer positions weight 1, prompt positions {a["prompt_weight"]} |
| training | {card["train_steps"]} steps x {a["batch"]} sequences (<= {a["seq_len"]} tokens), {card["train_tokens"]:,} tokens, AdamW lr {a["lr"]}, warm-up then cosine over a {a["train_minutes"]}-minute budget |
| wall time | distillation {d["seconds"] / 60:.1f} min + training {card["train_minutes"]} min ({card["total_minutes"]} min in all) on {card["torch_threads"]} CPU thread(s) |
| final training KL | {card["final_train_kl"]} (top-1 agreement with the target {card["final_train_top1"]}) |
| {card["eval_samples"]} held-back distilled answers | KL {card["eval_at_init"]["kl"]} -> {card["eval_at_end"]["kl"]}, top-1 agreement {card["eval_at_init"]["top1_agreement"]} -> {card["eval_at_end"]["top1_agreement"]} (init -> trained) |
| weights | bfloat16 safetensors |

## Reproduce
`nice -n 5 env OMP_NUM_THREADS=1 .venv/bin/python scripts/train_assistant.py --out models/assistant`
(`training_stats.json` holds every argument and number above).
"""
    (out / "README.md").write_text(text.replace("KL(target or assistant)", "KL(target || assistant)"))


if __name__ == "__main__":
    main()
