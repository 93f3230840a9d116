"""Usage: python scripts/stdlib_prompts.py --out data/distill/stdlib-prompts.jsonl [--count 1200] [--seed 0]

Prompts for self-distillation beyond data/dev's train split (used up to 1,600 prompt tokens by the `-g` / `-h`
files): requests written from the Python standard library's own public functions and classes. Each prompt asks the
target to write, implement or explain one documented callable (its name, signature and the first sentence of its
docstring), in a handful of phrasings, so the answers are the target's code and explanations on topics no dev
prompt names. Nothing is downloaded: the interpreter running this script is the source, read with `inspect`.

The output is a DeepSpec prompt file (`{"turns": [...]}` per line, deduplicated, in a seeded random order) that
`scripts/distill_answers.py --data FILE --split all` answers. Held-out evaluation never reads it, so it adds
training prompts only; the prompts name library functions, never a benchmark's problems.
"""
from __future__ import annotations

import argparse
import importlib
import inspect
import json
import random
import re
import sys
import warnings
from pathlib import Path

# modules whose import has side effects (opens windows, prints, starts things) or that are platform-specific
SKIP = {"antigravity", "this", "idlelib", "tkinter", "turtle", "turtledemo", "test", "lib2to3", "ensurepip", "venv",
        "pydoc", "pydoc_data", "msvcrt", "winreg", "winsound", "_winapi", "nt", "__main__", "__phello__", "xxlimited"}

TEMPLATES = (
    "Write a Python function `{name}{sig}` that does what the standard library's `{qual}` does: {doc}",
    "Implement `{name}{sig}` in plain Python without importing `{module}`. {doc}",
    "Explain what `{qual}` does in Python and show a short example of using it. The documentation says: \"{doc}\"",
    "Write a Python function `{name}{sig}`. {doc} Include a docstring and a few test cases.",
    "How would I use `{qual}` in a Python program? Give an example. ({doc})",
)


def _first_sentence(doc: str) -> str:
    para = doc.strip().split("\n\n")[0]
    text = " ".join(para.split())
    m = re.search(r"(.+?[.!?])(\s|$)", text)
    return (m.group(1) if m else text).strip()


def _signature(obj) -> str:
    try:
        sig = str(inspect.signature(obj))
    except (TypeError, ValueError):
        return "(...)"
    sig = re.sub(r"=<[^<>]* at 0x[0-9a-f]+>", "=...", sig)  # a default whose repr is an address: not reproducible
    return sig if len(sig) <= 80 else "(...)"


def callables():
    """(module, qualified name, name, signature, first docstring sentence) of every public documented function and
    class of the importable pure modules, sorted."""
    for modname in sorted(getattr(sys, "stdlib_module_names", ())):
        if modname.startswith("_") or modname in SKIP:
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                mod = importlib.import_module(modname)
        except BaseException:  # noqa: BLE001 - a module this platform lacks
            continue
        for name, obj in sorted(vars(mod).items()):
            if name.startswith("_") or not (inspect.isfunction(obj) or inspect.isclass(obj) or inspect.isbuiltin(obj)):
                continue
            if (getattr(obj, "__module__", None) or modname).split(".")[0].lstrip("_") != modname.lstrip("_"):
                continue  # re-exported from elsewhere
            doc = inspect.getdoc(obj) or ""
            sentence = _first_sentence(doc)
            if len(sentence) < 20 or len(sentence) > 300 or sentence.startswith(name + "("):
                continue
            yield modname, f"{modname}.{name}", name, _signature(obj), sentence  # (module, name) is unique


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True)
    p.add_argument("--count", type=int, default=1200, help="prompts to write (at most one per callable)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    rng = random.Random(args.seed)
    items = list(callables())
    rng.shuffle(items)
    prompts = []
    for module, qual, name, sig, doc in items[: args.count]:
        prompts.append(rng.choice(TEMPLATES).format(module=module, qual=qual, name=name, sig=sig, doc=doc))
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    distinct = list(dict.fromkeys(prompts))  # two callables can read alike (same name, signature and sentence)
    with out.open("w", encoding="utf-8") as fh:
        for text in distinct:
            fh.write(json.dumps({"turns": [text]}) + "\n")
    print(f"{len(items)} documented standard-library callables, {len(distinct)} distinct prompts -> {out}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
