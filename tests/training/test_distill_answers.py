"""scripts/distill_answers.py on the tiny target: train-split prompts only, the excluded ones skipped, the shortest
first under --limit, one {prompt_ids, response_ids, domain} line per answer, and a rerun resumes from the journal."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from dspark_core.training.data import is_eval, load_prompts

REPO = Path(__file__).resolve().parents[2]


def _run(tmp_path, *extra):
    out = tmp_path / "answers.jsonl"
    subprocess.run([sys.executable, str(REPO / "scripts" / "distill_answers.py"), "--target", "tiny",
                    "--data", str(REPO / "data" / "dev" / "mbpp.jsonl"), "--temperature", "0",
                    "--max-new-tokens", "4", "--limit", "3", "--out", str(out), *extra],
                   check=True, capture_output=True, text=True, timeout=300)
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_distills_unanswered_train_split_prompts_and_resumes(tmp_path):
    from dspark_core.stack import load_target_runtime, resolve_target
    from dspark_core.text import encode_prompt

    target = load_target_runtime(resolve_target("tiny"), device="cpu", dtype="float32")
    prompts = load_prompts(REPO / "data" / "dev" / "mbpp.jsonl")
    train = {tuple(encode_prompt(target.tokenizer, p.text)): p for p in prompts if not is_eval(p)}
    held = {tuple(encode_prompt(target.tokenizer, p.text)) for p in prompts if is_eval(p)}
    rows = _run(tmp_path)
    assert len(rows) == 3 and all(len(r["response_ids"]) <= 4 and r["domain"] == "code" for r in rows)
    assert all(tuple(r["prompt_ids"]) in train and tuple(r["prompt_ids"]) not in held for r in rows)
    # excluding the answered prompts gives other ones
    excl = tmp_path / "answered.jsonl"
    excl.write_text("".join(json.dumps({"turns": [train[tuple(r["prompt_ids"])].text]}) + "\n" for r in rows))
    (tmp_path / "b").mkdir()
    others = _run(tmp_path / "b", "--exclude", str(excl))
    assert not {tuple(r["prompt_ids"]) for r in rows} & {tuple(r["prompt_ids"]) for r in others}
    # a rerun of the first command finds every answer in its journal
    assert _run(tmp_path) == rows


def test_split_all_answers_every_prompt_of_a_training_only_file(tmp_path):
    """`--split all` reads a file of training prompts as given: held-out-hashed prompts too (the default drops them)."""
    prompts = load_prompts(REPO / "data" / "dev" / "mbpp.jsonl")
    held = [p.text for p in prompts if is_eval(p)][:2]
    train = [p.text for p in prompts if not is_eval(p)][:1]
    own = tmp_path / "own.jsonl"
    own.write_text("".join(json.dumps({"turns": [t]}) + "\n" for t in held + train))

    def run(sub, *extra):
        (tmp_path / sub).mkdir()
        out = tmp_path / sub / "a.jsonl"
        subprocess.run([sys.executable, str(REPO / "scripts" / "distill_answers.py"), "--target", "tiny", "--data",
                        str(own), "--temperature", "0", "--max-new-tokens", "2", "--out", str(out), *extra],
                       check=True, capture_output=True, text=True, timeout=300)
        return out.read_text().splitlines()

    assert len(run("default")) == 1
    assert len(run("all", "--split", "all")) == 3


def test_stdlib_prompts_name_real_documented_callables(tmp_path):
    """scripts/stdlib_prompts.py: distinct prompts, each naming a standard-library callable that exists, and the same
    file for the same seed."""
    import importlib
    import re

    def make(name, seed):
        out = tmp_path / name
        subprocess.run([sys.executable, str(REPO / "scripts" / "stdlib_prompts.py"), "--out", str(out), "--count",
                        "200", "--seed", str(seed)], check=True, capture_output=True, text=True, timeout=300)
        return [json.loads(line)["turns"][0] for line in out.read_text().splitlines()]

    a = make("a.jsonl", 0)
    assert len(a) == len(set(a)) >= 190  # at most --count, distinct
    assert make("b.jsonl", 0) == a and make("c.jsonl", 1) != a
    checked = 0
    for text in a[:60]:
        for qual in re.findall(r"`([a-z_]\w*\.[\w.]+)`", text):
            module, _, attr = qual.partition(".")
            assert hasattr(importlib.import_module(module), attr.split(".")[0]), text
            checked += 1
    assert checked >= 20
