"""Copy a trained drafter run into models/NAME: bf16 weights (the loader computes in fp32), config,
calibration (if any), and the run's training card as the model card.

    python scripts/ship_drafter.py runs/b-dspark dspark
    python scripts/ship_drafter.py runs/smol-dspark smollm2/dspark --reference-target --target-name smollm2

`--reference-target` leaves out the frozen copies of the target's embedding and LM head (`"target_tensors":
"referenced"` in config.json): the loader takes them from the target it runs beside. Integer tensors (a draft
vocabulary's ids) stay as they are.
"""

from __future__ import annotations

import argparse
import json
import shutil
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("run", help="run directory written by `dspark train` (uses RUN/final)")
    p.add_argument("name", help="models/NAME to (re)write")
    p.add_argument("--models-dir", default=str(Path(__file__).resolve().parents[1] / "models"))
    p.add_argument("--reference-target", action="store_true",
                   help="store only the drafter's own tensors; embedding / LM head come from the target at load time")
    p.add_argument("--not-default", default=None, metavar="WHY",
                   help="`--drafter auto` passes this drafter over and says WHY (e.g. it is still slower than "
                        "decoding without a drafter); `--drafter NAME` still uses it")
    p.add_argument("--target-name", default=None,
                   help="record the target by this name (e.g. smollm2) instead of the run's path")
    args = p.parse_args()
    run, out = Path(args.run), Path(args.models_dir) / args.name
    final = run / "final"
    if not (final / "model.safetensors").is_file():
        raise SystemExit(f"ship_drafter: error: no trained drafter at {final}")
    out.mkdir(parents=True, exist_ok=True)
    weights = load_file(str(final / "model.safetensors"))
    if args.reference_target:
        weights = {k: v for k, v in weights.items() if k not in ("embed_tokens.weight", "lm_head.weight")}
    save_file({k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous() for k, v in weights.items()},
              str(out / "model.safetensors"))
    for name in ("config.json", "calibration.json"):
        if (final / name).exists():
            shutil.copy(final / name, out / name)
    # a run records the target by the absolute path it was given; a shipped drafter names it relative to the
    # repository root (models/target), so the checkout can live anywhere
    config = json.loads((out / "config.json").read_text())
    target = config.get("target_model_name_or_path")
    root = Path(args.models_dir).resolve().parent
    if args.target_name:
        config["target_model_name_or_path"] = args.target_name
    elif isinstance(target, str) and Path(target).is_absolute() and Path(target).resolve().is_relative_to(root):
        config["target_model_name_or_path"] = str(Path(target).resolve().relative_to(root))
    if args.reference_target:
        config["target_tensors"] = "referenced"
    if args.not_default:
        config["dspark_not_default"] = args.not_default
    (out / "config.json").write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    for name in ("training_card.json",):
        if (run / name).exists():
            shutil.copy(run / name, out / name)
    card = (run / "README.md").read_text() if (run / "README.md").exists() else ""
    (out / "README.md").write_text(card + "\nShipped with bf16 weights by `scripts/ship_drafter.py`; the loader computes in fp32.\n")
    print(f"shipped {final} -> {out}")


if __name__ == "__main__":
    main()
