"""Train a small autoregressive *assistant* model for a target: the peer drafter that Hugging Face
transformers' assisted generation (`model.generate(..., assistant_model=...)`) uses in `dspark bench`.

The assistant is a 2-layer model of the target's own architecture (Qwen3 for the bundled target, Llama for
SmolLM2) with the target's tokenizer, distilled from the target:

1. initialisation ("shrink"): the target's embeddings / tied LM head and final norm, and two of its
   layers (`--layers`, e.g. the first and the last), with each MLP cut to the `--intermediate` neurons of
   largest weight norm. Width stays the target's, so the embeddings carry over as they are
   (`--freeze-embeddings` keeps them and saves the assistant without them).
2. data: the target's own greedy answers to the *train* split of the dev prompt sets
   (`dspark_core.training.data.load_prompts` / `split` / `distill`; the held-out 20% split that `dspark
   eval` and `dspark bench` use is never read), code prompts first, until `--distill-minutes` are spent;
   or `--responses FILE ...`, answers distilled before (the drafters' `data/distill/*.jsonl`); plus, with
   `--corpus-fraction > 0`, windows of the bundled target's own training corpus
   (`scripts/train_bundled_model.py::build_corpus`, imported, not copied).
3. training: KL(target || assistant) on the target's full next-token distribution plus cross-entropy to
   the target's argmax (what greedy acceptance needs), for `--train-minutes` of wall time; the learning
   rate follows warm-up then cosine over the *time* budget. `--kl-weight 0` runs no target pass at all:
   cross-entropy on the answers' tokens (sequence-level distillation; for SmolLM2, whose forward pass would
   cost more than the assistant's step).

Run it niced on one thread, in the background (the numbers in the model cards come from such runs):

    setsid nohup nice -n 5 env OMP_NUM_THREADS=1 .venv/bin/python scripts/train_assistant.py \
        --out models/assistant > runs/assistant.log 2>&1 &

    # SmolLM2: the drafters' answers and CPU budget (~35 min of one core each)
    .venv/bin/python scripts/train_assistant.py --target smollm2 --layers 0,29 --intermediate 1536 \
        --responses data/distill/smollm2-t0.jsonl data/distill/smollm2-t1.jsonl --kl-weight 0 --prompt-weight 0 \
        --corpus-fraction 0 --freeze-embeddings --batch 4 --seq-len 256 --train-minutes 35 \
        --out models/smollm2/assistant
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
    """A model of the target's own architecture (Qwen3, Llama, ...) and width, with `layer_ids` of its layers and
    MLPs pruned to `intermediate` neurons; the embeddings, final norm and (tied) LM head are the target's."""
    import copy

    cfg = copy.deepcopy(target.config)
    cfg.num_hidden_layers = len(layer_ids)
    cfg.intermediate_size = intermediate
    if getattr(cfg, "layer_types", None) is not None:
        cfg.layer_types = [cfg.layer_types[i] for i in layer_ids]
    if getattr(cfg, "max_window_layers", None) is not None:
        cfg.max_window_layers = min(cfg.max_window_layers, len(layer_ids))
    model = type(target)(cfg)
    src, dst = target.model, model.model
    with torch.no_grad():
        dst.embed_tokens.weight.copy_(src.embed_tokens.weight)
        if not getattr(cfg, "tie_word_embeddings", False):
            model.lm_head.weight.copy_(target.lm_head.weight)
        dst.norm.weight.copy_(src.norm.weight)
        for new, old in enumerate(layer_ids):
            a, b = src.layers[old], dst.layers[new]
            b.self_attn.load_state_dict(a.self_attn.state_dict())
            b.input_layernorm.load_state_dict(a.input_layernorm.state_dict())
            b.post_attention_layernorm.load_state_dict(a.post_attention_layernorm.state_dict())
            # keep the neurons whose in- and out-weights are largest
            score = (a.mlp.gate_proj.weight.norm(dim=1) * a.mlp.up_proj.weight.norm(dim=1)
                     * a.mlp.down_proj.weight.norm(dim=0))
            keep = score.topk(min(intermediate, score.shape[0])).indices.sort().values
            b.mlp.gate_proj.weight.copy_(a.mlp.gate_proj.weight[keep])
            b.mlp.up_proj.weight.copy_(a.mlp.up_proj.weight[keep])
            b.mlp.down_proj.weight.copy_(a.mlp.down_proj.weight[:, keep])
    model.tie_weights()
    return model


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


def distill_loss(student_logits, teacher_logits, weights, ce_weight: float, kl_weight: float = 1.0):
    """Weighted mean over positions of kl_weight * KL(teacher || student) + ce_weight * CE(student, argmax
    teacher); returns (loss, KL, top-1 agreement)."""
    s = F.log_softmax(student_logits.float(), dim=-1)
    t = F.log_softmax(teacher_logits.float(), dim=-1)
    kl = (t.exp() * (t - s)).sum(-1)
    ce = -s.gather(-1, t.argmax(-1, keepdim=True)).squeeze(-1)
    agree = (s.argmax(-1) == t.argmax(-1)).float()
    norm = weights.sum().clamp_min(1e-9)
    loss = ((kl_weight * kl + ce_weight * ce) * weights).sum() / norm
    return loss, (kl * weights).sum() / norm, (agree * weights).sum() / norm


def answer_loss(student, x, att, w):
    """Cross-entropy of the student on the weighted next tokens (sequence-level distillation: the answers are
    the target's own), the LM head run only where a weight is set. Returns (loss, top-1 agreement)."""
    h = student.model(input_ids=x, attention_mask=att).last_hidden_state  # [B, T, H]
    sel = w > 0
    nxt = torch.roll(x, -1, dims=1)[sel]  # position t predicts token t + 1 (the last position has weight 0)
    logits = student.lm_head(h[sel]).float()  # [n, V]
    weights = w[sel]
    ce = F.cross_entropy(logits, nxt, reduction="none")
    norm = weights.sum().clamp_min(1e-9)
    return (ce * weights).sum() / norm, ((logits.argmax(-1) == nxt).float() * weights).sum() / norm


@torch.no_grad()
def evaluate(student, teacher, samples, idx, args, pad_id) -> dict:
    """KL to the teacher and top-1 agreement with its argmax; without a teacher (--kl-weight 0), the answer
    tokens' cross-entropy and top-1 agreement with them (the target's argmax for greedy answers)."""
    student.eval()
    tot = {"kl": 0.0, "top1_agreement": 0.0} if teacher is not None else {"answer_ce": 0.0, "top1_agreement": 0.0}
    n = 0
    for i in range(0, len(idx), args.batch):
        x, att, w = make_batch(samples, idx[i:i + args.batch], args.seq_len, pad_id, 0.0)
        if teacher is not None:
            t = teacher(input_ids=x, attention_mask=att).logits
            s = student(input_ids=x, attention_mask=att).logits
            _, first, agree = distill_loss(s, t, w, 0.0)
        else:
            first, agree = answer_loss(student, x, att, w)
        k = float(w.sum())
        tot[next(iter(tot))] += float(first) * k
        tot["top1_agreement"] += float(agree) * k
        n += k
    student.train()
    return {k: round(v / max(n, 1), 4) for k, v in tot.items()}


# ----------------------------------------------------------------------------- main

def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--target", default=str(REPO / "models" / "target"),
                   help="target model directory, or a name `dspark` resolves (e.g. smollm2)")
    p.add_argument("--out", default=str(REPO / "models" / "assistant"))
    p.add_argument("--data", nargs="*", default=[str(f) for f in DEFAULT_DATA])
    p.add_argument("--responses", nargs="*", default=None,
                   help="train on these distilled answers ({prompt_ids, response_ids} per line, e.g. the drafters' "
                        "data/distill/*.jsonl) instead of distilling --data")
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
    p.add_argument("--kl-weight", type=float, default=1.0,
                   help="weight of KL(target || assistant) (default 1); 0: no target pass at all, cross-entropy "
                        "on the answers' tokens only (sequence-level distillation, for a target too slow to run "
                        "beside training)")
    p.add_argument("--ce-weight", type=float, default=0.5)
    p.add_argument("--prompt-weight", type=float, default=0.1, help="loss weight of prompt positions")
    p.add_argument("--corpus-fraction", type=float, default=0.25,
                   help="share of batches drawn from the target's own training corpus (bundled target only)")
    p.add_argument("--freeze-embeddings", action="store_true",
                   help="keep the target's embeddings / tied LM head as they are, and save the assistant without "
                        "them: `dspark_core.benchmark.load_assistant` takes them from the target")
    p.add_argument("--eval-samples", type=int, default=48, help="distilled samples kept out for the card")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging

    from dspark_core.stack import resolve_target

    hf_logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    rng = random.Random(args.seed)
    t_start = time.time()
    args.target = resolve_target(args.target) if not Path(args.target).is_dir() else args.target
    tok = AutoTokenizer.from_pretrained(args.target)
    source = AutoModelForCausalLM.from_pretrained(args.target, dtype=torch.float32).eval()
    for q in source.parameters():
        q.requires_grad_(False)
    teacher = source if args.kl_weight > 0 else None
    pad_id = tok.pad_token_id if tok.pad_token_id is not None else 0
    layer_ids = [int(v) for v in args.layers.split(",")]
    student = shrink_target(source, layer_ids, args.intermediate).float().train()
    if teacher is None:
        del source  # only its weights were needed
    if args.freeze_embeddings:
        student.get_input_embeddings().weight.requires_grad_(False)
        student.get_output_embeddings().weight.requires_grad_(False)
    n_params = sum(q.numel() for q in student.parameters())
    n_own = sum(q.numel() for n, q in student.named_parameters() if "embed_tokens" not in n and "lm_head" not in n)
    print(f"assistant: {n_params / 1e6:.2f}M parameters ({n_own / 1e6:.2f}M besides the embeddings) from target "
          f"layers {layer_ids}", flush=True)

    if args.responses:
        from dspark_core.training.data import load_responses

        samples, t0 = [], time.time()
        for f in args.responses:
            got, held, long_ = load_responses(f, tok, max_length=None)
            samples += got
        dstats = {"responses": [str(Path(f).resolve().relative_to(REPO)) if Path(f).resolve().is_relative_to(REPO)
                                else str(f) for f in args.responses],
                  "prompts_answered": len(samples), "samples": len(samples),
                  "answer_tokens": sum(len(s.response_ids) for s in samples), "seconds": 0.0,
                  "max_new_tokens": max(len(s.response_ids) for s in samples), "temperature": "as distilled"}
    else:
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

    opt = torch.optim.AdamW([q for q in student.parameters() if q.requires_grad], lr=args.lr, betas=(0.9, 0.95),
                            weight_decay=0.0)
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
        if teacher is not None:
            with torch.no_grad():
                t_logits = teacher(input_ids=x, attention_mask=att).logits
            s_logits = student(input_ids=x, attention_mask=att).logits
            loss, kl, agree = distill_loss(s_logits, t_logits, w, args.ce_weight, args.kl_weight)
        else:
            loss, agree = answer_loss(student, x, att, w)
            kl = loss  # reported as the answer cross-entropy
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_([q for q in student.parameters() if q.requires_grad], 1.0)
        opt.step()
        step += 1
        tokens += int(att.sum())
        losses.append(float(kl.detach()))
        agrees.append(float(agree.detach()))
        if step % 10 == 0:
            print(f"step {step} {time.time() - t0:.0f}s lr {lr:.2e} {'kl' if teacher is not None else 'ce'} "
                  f"{sum(losses[-10:]) / 10:.3f} top1 {sum(agrees[-10:]) / 10:.3f}", flush=True)
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
    if args.freeze_embeddings:
        from safetensors.torch import save_file

        from dspark_core.benchmark import ASSISTANT_LAYERS_FILE

        own = {n: q.detach().contiguous() for n, q in student.state_dict().items()
               if "embed_tokens" not in n and "lm_head" not in n}
        save_file(own, str(out / ASSISTANT_LAYERS_FILE), metadata={"embeddings": "the target's (frozen)"})
        student.config.save_pretrained(out)
        student.generation_config.save_pretrained(out)
    else:
        student.save_pretrained(out)
    for name in () if args.freeze_embeddings else TOKENIZER_FILES:  # frozen: the target's tokenizer too
        if (Path(args.target) / name).exists():
            shutil.copy(Path(args.target) / name, out / name)
    card = {
        "parameters": n_params, "own_parameters": n_own,
        "init": {"target_layers": layer_ids, "intermediate": args.intermediate},
        "architecture": type(student).__name__, "hidden_size": student.config.hidden_size,
        "vocab_size": student.config.vocab_size,
        "distill": dstats, "train_steps": step, "train_tokens": tokens,
        "train_minutes": round(train_seconds / 60, 2), "total_minutes": round((time.time() - t_start) / 60, 2),
        "final_train_kl": round(sum(losses[-20:]) / max(len(losses[-20:]), 1), 4),
        "final_train_top1": round(sum(agrees[-20:]) / max(len(agrees[-20:]), 1), 4),
        "eval_at_init": init_eval, "eval_at_end": final_eval, "eval_samples": len(eval_idx),
        "torch_threads": torch.get_num_threads(), "args": vars(args), "command": " ".join(sys.argv[1:]),
    }
    (out / "training_stats.json").write_text(json.dumps(card, indent=1) + "\n")
    write_model_card(out, card)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(json.dumps(card, indent=1))
    print(f"saved {out} ({size / 1e6:.2f} MB)")


def write_model_card(out: Path, card: dict) -> None:
    a, d = card["args"], card["distill"]
    teacher = a["kl_weight"] > 0
    data = (f"the target's greedy answers (max {d['max_new_tokens']} tokens) to {d['prompts_answered']} train-split "
            f"dev prompts ({d['samples']} answers, {d['answer_tokens']:,} answer tokens; code first)"
            if "responses" not in d else
            f"the drafters' distilled answers {', '.join(f'`{f}`' for f in d['responses'])} ({d['samples']} answers, "
            f"{d['answer_tokens']:,} answer tokens; train-split prompts only)")
    if a["corpus_fraction"] > 0:
        data += f", plus {a['corpus_fraction']:.0%} of batches from the target's own training corpus"
    loss = (f"KL(target || assistant) on the full next-token distribution + {a['ce_weight']} x CE to the target's "
            f"argmax; answer positions weight 1, prompt positions {a['prompt_weight']}" if teacher else
            "cross-entropy on the answers' tokens (sequence-level distillation: no target pass), answer positions "
            f"weight 1, prompt positions {a['prompt_weight']}")
    kl_or_ce = "KL" if teacher else "answer cross-entropy"
    first = "kl" if teacher else "answer_ce"
    emb = ("frozen: the target's, not stored here (`dspark_core.benchmark.load_assistant` builds the model from "
           "the target and `assistant_layers.safetensors`)" if a["freeze_embeddings"] else "trained, stored")
    text = f"""# dspark assistant (Hugging Face assisted-generation peer)

A small autoregressive `{card["architecture"]}` distilled from the target (`{a["target"]}`), with the target's
tokenizer (vocabulary {card["vocab_size"]}). It exists to be the `assistant_model` of Hugging Face
transformers' own assisted generation, the peer that `dspark bench` compares DSpark against at batch 1.
It is not a drafter for the DSpark engine. Trained by `scripts/train_assistant.py`.

| | |
|---|---|
| architecture | {card["architecture"]}, {len(card["init"]["target_layers"])} layers, hidden {card["hidden_size"]}, intermediate {card["init"]["intermediate"]}, tied embeddings |
| parameters | {card["parameters"]:,} ({card["own_parameters"]:,} besides the embeddings) |
| embeddings / LM head | {emb} |
| initialisation | the target's embeddings, final norm and layers {card["init"]["target_layers"]}, MLPs pruned to the {card["init"]["intermediate"]} neurons of largest weight norm |
| data | {data} |
| held-out prompts | never used: the 20% eval split of `dspark_core.training.data.split` is left out |
| loss | {loss} |
| training | {card["train_steps"]} steps x {a["batch"]} sequences (<= {a["seq_len"]} tokens), {card["train_tokens"]:,} tokens, AdamW lr {a["lr"]}, warm-up then cosine over a {a["train_minutes"]}-minute budget |
| wall time | distillation {d["seconds"] / 60:.1f} min + training {card["train_minutes"]} min ({card["total_minutes"]} min in all) on {card["torch_threads"]} CPU thread(s) |
| final training {kl_or_ce} | {card["final_train_kl"]} (top-1 agreement {card["final_train_top1"]}) |
| {card["eval_samples"]} held-back answers | {kl_or_ce} {card["eval_at_init"][first]} -> {card["eval_at_end"][first]}, top-1 agreement {card["eval_at_init"]["top1_agreement"]} -> {card["eval_at_end"]["top1_agreement"]} (init -> trained) |
| weights | bfloat16 safetensors |

## Reproduce
`nice -n 5 env OMP_NUM_THREADS=1 .venv/bin/python scripts/train_assistant.py {card.get("command", "--out " + str(a["out"]))}`
(`training_stats.json` holds every argument and number above).
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
