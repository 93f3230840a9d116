"""Train the bundled target model from scratch, on text that exists offline on any machine with Python.

The bundled model is the embedded default: a small `Qwen3ForCausalLM` with its own byte-level BPE
tokenizer, trained on

- Python's standard-library sources, turned into "write a function" code exchanges (docstring ->
  source) plus raw module text,
- the standard library's own documentation (`pydoc_data.topics`, module and function docstrings),
  turned into "explain" chat exchanges,
- arithmetic and algebra exercises with worked answers that this script generates.

It never reads the evaluation prompt sets. Every exchange uses one prompt/response format:

    <|user|>\n{prompt}\n<|assistant|>\n{response}<|end|>

so chat-, code- and math-style prompts all make sense as input. The run is reproducible for a given
Python version (the corpus is the standard library it runs on) and seed.

    python scripts/train_bundled_model.py --out models/target --steps 1800
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import math
import os
import random
import sys
import sysconfig
import time
from pathlib import Path

import torch
from tqdm import tqdm

SPECIAL_TOKENS = ["<|endoftext|>", "<|user|>", "<|assistant|>", "<|end|>", "<|pad|>", "<|mask|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'user' %}<|user|>\n{{ message['content'] }}\n"
    "{% elif message['role'] == 'assistant' %}<|assistant|>\n{{ message['content'] }}<|end|>\n"
    "{% elif message['role'] == 'system' %}{{ message['content'] }}\n{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


def format_exchange(prompt: str, response: str) -> str:
    return f"<|user|>\n{prompt}\n<|assistant|>\n{response}<|end|>\n"


# ----------------------------------------------------------------------------- corpus


def _stdlib_files() -> list[Path]:
    root = Path(sysconfig.get_paths()["stdlib"])
    skip = ("site-packages", "test", "tests", "idlelib", "lib2to3", "turtledemo", "__pycache__", "ensurepip")
    files = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).parts
        if any(part in skip for part in rel):
            continue
        files.append(path)
    return files


def _is_held_out(key: str) -> bool:
    return int(hashlib.sha256(key.encode()).hexdigest(), 16) % 20 == 0  # 5% held out, stable


def code_exchanges(files: list[Path]) -> list[tuple[str, str, str]]:
    """(key, prompt, response) from every documented stdlib function."""
    out = []
    for path in files:
        try:
            source = path.read_text(encoding="utf-8")
            tree = ast.parse(source)
        except (SyntaxError, UnicodeDecodeError, ValueError):
            continue
        lines = source.splitlines()
        for node in ast.walk(tree):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                continue
            doc = ast.get_docstring(node)
            if not doc or node.end_lineno is None:
                continue
            body = "\n".join(lines[node.lineno - 1 : node.end_lineno])
            body = _dedent(body)
            if not (80 <= len(body) <= 1500):
                continue
            first = doc.strip().splitlines()[0].strip().rstrip(".")
            prompt = f"Write a Python function `{node.name}` that does the following: {first}."
            out.append((f"{path.name}:{node.name}:{node.lineno}", prompt, f"```python\n{body}\n```"))
            args = ", ".join(a.arg for a in node.args.args if a.arg != "self")
            explain = f"Explain what the Python function `{node.name}({args})` in `{path.stem}` does."
            out.append((f"{path.name}:{node.name}:{node.lineno}:doc", explain, doc.strip()[:1200]))
    return out


def _dedent(text: str) -> str:
    import textwrap

    return textwrap.dedent(text)


def doc_exchanges() -> list[tuple[str, str, str]]:
    """(key, prompt, response) from the interpreter's own reference documentation."""
    from pydoc_data.topics import topics

    out = []
    for name in sorted(topics):
        text = topics[name].strip()
        for i, chunk in enumerate(_paragraph_chunks(text, 1400)):
            prompt = f"Explain the Python topic '{name}'." if i == 0 else f"Tell me more about '{name}' in Python."
            out.append((f"topic:{name}:{i}", prompt, chunk))
    return out


def _paragraph_chunks(text: str, size: int) -> list[str]:
    chunks, cur = [], ""
    for para in text.split("\n\n"):
        if cur and len(cur) + len(para) > size:
            chunks.append(cur.strip())
            cur = ""
        cur += para + "\n\n"
    if cur.strip():
        chunks.append(cur.strip())
    return chunks


def math_exchanges(rng: random.Random, n: int) -> list[tuple[str, str, str]]:
    """Generated exercises with worked answers: arithmetic, linear equations, percentages, sums."""
    out = []
    for i in range(n):
        kind = rng.randrange(5)
        if kind == 0:
            a, b = rng.randint(2, 999), rng.randint(2, 999)
            op = rng.choice(["+", "-", "*"])
            val = {"+": a + b, "-": a - b, "*": a * b}[op]
            prompt = f"What is {a} {op} {b}?"
            resp = f"We compute {a} {op} {b} = {val}.\nThe answer is $\\boxed{{{val}}}$."
        elif kind == 1:
            x, a, b = rng.randint(-20, 20), rng.randint(2, 12), rng.randint(-50, 50)
            c = a * x + b
            sb = f"+ {b}" if b >= 0 else f"- {-b}"
            prompt = f"Solve for $x$: ${a}x {sb} = {c}$."
            step = f"Subtract {b} from both sides" if b >= 0 else f"Add {-b} to both sides"
            resp = (f"{step}: ${a}x = {c - b}$.\n"
                    f"Divide both sides by {a}: $x = {x}$.\nThe answer is $\\boxed{{{x}}}$.")
        elif kind == 2:
            p, base = rng.choice([5, 10, 15, 20, 25, 40, 50, 75]), rng.randint(1, 40) * 20
            val = p * base // 100
            prompt = f"What is {p}% of {base}?"
            resp = f"{p}% of {base} is $\\frac{{{p}}}{{100}} \\times {base} = {val}$.\nThe answer is $\\boxed{{{val}}}$."
        elif kind == 3:
            n_ = rng.randint(3, 60)
            val = n_ * (n_ + 1) // 2
            prompt = f"Find the sum of the integers from 1 to {n_}."
            resp = (f"The sum of the first $n$ positive integers is $\\frac{{n(n+1)}}{{2}}$.\n"
                    f"With $n = {n_}$: $\\frac{{{n_} \\cdot {n_ + 1}}}{{2}} = {val}$.\nThe answer is $\\boxed{{{val}}}$.")
        else:
            w, h = rng.randint(2, 50), rng.randint(2, 50)
            prompt = f"A rectangle has width {w} and height {h}. What are its area and perimeter?"
            resp = (f"The area is ${w} \\times {h} = {w * h}$.\n"
                    f"The perimeter is $2({w} + {h}) = {2 * (w + h)}$.\nThe answer is $\\boxed{{{w * h}}}$ and $\\boxed{{{2 * (w + h)}}}$.")
        out.append((f"math:{i}", prompt, resp))
    return out


def raw_module_texts(files: list[Path]) -> list[tuple[str, str]]:
    out = []
    for path in files:
        try:
            text = path.read_text(encoding="utf-8")
        except UnicodeDecodeError:
            continue
        if 200 <= len(text) <= 60_000:
            out.append((f"raw:{path.name}", text))
    return out


def build_corpus(seed: int) -> tuple[list[str], list[str], dict]:
    rng = random.Random(seed)
    files = _stdlib_files()
    exchanges = code_exchanges(files) + doc_exchanges() + math_exchanges(rng, 30_000)
    raws = raw_module_texts(files)
    train, held = [], []
    for key, prompt, resp in exchanges:
        (held if _is_held_out(key) else train).append(format_exchange(prompt, resp))
    for key, text in raws:
        (held if _is_held_out(key) else train).append(text + "<|endoftext|>")
    rng.shuffle(train)
    stats = {"exchanges": len(exchanges), "raw_modules": len(raws), "train_docs": len(train),
             "held_out_docs": len(held), "stdlib_files": len(files),
             "python_version": sys.version.split()[0]}
    return train, held, stats


# ----------------------------------------------------------------------------- tokenizer


def train_tokenizer(texts: list[str], vocab_size: int):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=True)
    tok.train_from_iterator(texts, trainer=trainer)
    return tok


def wrap_tokenizer(tok):
    from transformers import PreTrainedTokenizerFast

    hf = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=None, eos_token="<|end|>",
                                 pad_token="<|pad|>", unk_token=None,
                                 additional_special_tokens=["<|endoftext|>", "<|user|>", "<|assistant|>", "<|mask|>"])
    hf.chat_template = CHAT_TEMPLATE
    hf.model_max_length = 2048
    return hf


def pack(tok, texts: list[str], seq_len: int) -> torch.Tensor:
    ids: list[int] = []
    for enc in tok.encode_batch(texts):
        ids.extend(enc.ids)
    n = len(ids) // seq_len
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


# ----------------------------------------------------------------------------- model + training


def build_model(vocab_size: int, tok_hf, args):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size, hidden_size=args.hidden, intermediate_size=args.hidden * 3,
        num_hidden_layers=args.layers, num_attention_heads=args.hidden // 64, num_key_value_heads=max(1, args.hidden // 128),
        head_dim=64, max_position_embeddings=2048, rms_norm_eps=1e-6, tie_word_embeddings=True,
        eos_token_id=tok_hf.convert_tokens_to_ids("<|end|>"), pad_token_id=tok_hf.convert_tokens_to_ids("<|pad|>"),
        bos_token_id=None,
    )
    return Qwen3ForCausalLM(config)


@torch.no_grad()
def evaluate(model, data: torch.Tensor, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        x = data[i : i + batch]
        out = model(input_ids=x, labels=x)
        total += out.loss.item() * x.numel()
        count += x.numel()
    model.train()
    return total / max(count, 1)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default="models/target")
    p.add_argument("--seed", type=int, default=1234)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--batch", type=int, default=12)
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--threads", type=int, default=0, help="torch threads (0 = all cores)")
    p.add_argument("--eval-seqs", type=int, default=64)
    args = p.parse_args()

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    if args.threads:
        torch.set_num_threads(args.threads)
    t0 = time.time()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)

    train_texts, held_texts, stats = build_corpus(args.seed)
    print(f"corpus: {json.dumps(stats)}", flush=True)
    tok = train_tokenizer(train_texts, args.vocab_size)
    tok_hf = wrap_tokenizer(tok)
    train = pack(tok, train_texts, args.seq_len)
    held = pack(tok, held_texts, args.seq_len)[: args.eval_seqs]
    print(f"packed: train {tuple(train.shape)} ({train.numel():,} tokens), held-out {tuple(held.shape)}", flush=True)

    model = build_model(len(tok.get_vocab()), tok_hf, args)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"model: {n_params / 1e6:.2f}M parameters", flush=True)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    warm = max(1, args.steps // 25)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt, lambda s: min(1.0, (s + 1) / warm) * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, s / args.steps)))))

    gen = torch.Generator().manual_seed(args.seed)
    order = torch.randperm(len(train), generator=gen)
    cursor, tokens_seen, losses = 0, 0, []
    model.train()
    bar = tqdm(range(args.steps), desc="train", unit="step", mininterval=5)
    for step in bar:
        if cursor + args.batch > len(order):
            order, cursor = torch.randperm(len(train), generator=gen), 0
        x = train[order[cursor : cursor + args.batch]]
        cursor += args.batch
        loss = model(input_ids=x, labels=x).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        tokens_seen += x.numel()
        losses.append(loss.item())
        bar.set_postfix(loss=f"{sum(losses[-20:]) / len(losses[-20:]):.3f}", tok=f"{tokens_seen / 1e6:.2f}M")

    train_minutes = (time.time() - t0) / 60
    # Ship bf16 weights (half the bytes); the runtime computes in fp32 on CPU.
    model = model.to(torch.bfloat16)
    model.config.dtype = "bfloat16"
    model.generation_config.eos_token_id = model.config.eos_token_id
    model.generation_config.pad_token_id = model.config.pad_token_id
    model.generation_config.do_sample = False
    model.save_pretrained(out)
    tok_hf.save_pretrained(out)
    held_loss = evaluate(model.float(), held, args.batch)
    final_loss = sum(losses[-50:]) / len(losses[-50:])
    card = {
        "parameters": n_params, "steps": args.steps, "train_tokens": tokens_seen,
        "available_train_tokens": int(train.numel()), "final_train_loss": round(final_loss, 4),
        "held_out_loss": round(held_loss, 4), "held_out_perplexity": round(math.exp(held_loss), 3),
        "wall_minutes": round(train_minutes, 1), "seed": args.seed, "torch_threads": torch.get_num_threads(),
        "args": vars(args), "corpus": stats,
    }
    (out / "training_stats.json").write_text(json.dumps(card, indent=1) + "\n")
    write_model_card(out, card)
    print(json.dumps(card, indent=1))


def write_model_card(out: Path, card: dict) -> None:
    """README.md beside the weights: what the model is, what it saw, how well it fits held-out text."""
    a, c = card["args"], card["corpus"]
    text = f"""# dspark bundled target

The embedded default target of this project: a small `Qwen3ForCausalLM` with its own byte-level BPE
tokenizer, trained from scratch by `scripts/train_bundled_model.py` so that `dspark generate` works
offline on any machine. It is a demonstration model for speculative decoding, not an assistant: it
writes plausible Python, stdlib-style explanations and worked arithmetic, and is often wrong.

| | |
|---|---|
| architecture | Qwen3, {a["layers"]} layers, hidden {a["hidden"]}, intermediate {a["hidden"] * 3}, {a["hidden"] // 64} query / {max(1, a["hidden"] // 128)} KV heads of 64, tied embeddings |
| parameters | {card["parameters"]:,} |
| vocabulary | {a["vocab_size"]} byte-level BPE tokens, trained on the same corpus |
| context | trained on {a["seq_len"]}-token sequences (max_position_embeddings 2048) |
| weights | bfloat16 safetensors (the runtime computes in float32 on CPU) |
| training | {card["steps"]} steps x {a["batch"]} x {a["seq_len"]} tokens = {card["train_tokens"]:,} tokens (of {card["available_train_tokens"]:,} available), AdamW lr {a["lr"]}, warm-up then cosine, seed {card["seed"]} |
| wall time | {card["wall_minutes"]} min on {card["torch_threads"]} CPU threads |
| final training loss | {card["final_train_loss"]} (mean of the last 50 steps) |
| held-out loss / perplexity | {card["held_out_loss"]} / {card["held_out_perplexity"]} (5% of documents, split by a hash of their key) |

## Data
Built offline from the Python {c["python_version"]} standard library the script runs on, never from the
evaluation prompt sets:
- code: "Write a Python function `name` that does the following: <first docstring line>." answered with
  the function's source, from {c["stdlib_files"]} stdlib modules;
- chat: "Explain what the Python function ... does." answered with its docstring, and "Explain the
  Python topic '...'." answered with the interpreter's own reference text (`pydoc_data.topics`);
- math: generated arithmetic, linear equations, percentages, sums and geometry with worked answers;
- raw module sources, {c["raw_modules"]} files.
{c["exchanges"]:,} exchanges in all; {c["train_docs"]:,} training and {c["held_out_docs"]:,} held-out documents.

## Prompt format
One exchange is `<|user|>\n{{prompt}}\n<|assistant|>\n{{response}}<|end|>`; the tokenizer's chat template
produces it, and `<|end|>` is the end-of-sequence token. `<|mask|>` is reserved (never trained) for
block drafters' mask slots.

## Reproduce
`python scripts/train_bundled_model.py --out models/target --steps {card["steps"]}` (same Python version
for the same corpus).
"""
    (out / "README.md").write_text(text)


if __name__ == "__main__":
    main()
