"""Load and save drafters in DeepSpec's on-disk format (`config.json` + `model.safetensors`).

`load_drafter` reads exactly `<dir>/config.json` (plus an optional `calibration.json` sidecar) and
`<dir>/model.safetensors`, never any other `*.safetensors` in the folder (the fixtures keep
`reference.safetensors` beside the weights). Tensor names are DeepSpec's, which are also this package's
module names, so the mapping is the identity; it is checked strictly: a missing, unexpected or
mis-shaped tensor is a `ModelLoadError` naming the tensor (and both shapes). The model is built on the
meta device and the file's tensors are assigned, so no memory is spent on a throw-away initialisation.

Two extensions of ours (DeepSpec's own checkpoints have neither):
- a draft vocabulary (`draft_vocab_size` in config.json, the int64 tensor `draft_vocab_ids`): the LM head and
  Markov output cover only those target ids;
- `"target_tensors": "referenced"`: the file stores only the drafter's own tensors; `embed_tokens.weight` and
  `lm_head.weight` (the rows `draft_vocab_ids` of it) are the frozen target's, read from the target's
  directory (`target=`) at load time. A shipped drafter of a 135M target is then ~12M parameters, not ~70M.

Knows nothing about requests or serving.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import load_file, save_file

from dspark_core.drafters.base import DEFAULT_SUPPORT_SIZE
import dataclasses
import json

from dspark_core.drafters.config import TARGET_TENSORS_REFERENCED, DrafterConfig, load_config, save_config
from dspark_core.drafters.dflash import DFlashDrafter
from dspark_core.drafters.dspark import DSparkDrafter
from dspark_core.drafters.eagle3 import Eagle3Drafter
from dspark_core.drafters.layers import int8_matmul_available, set_matmul_dtype
from dspark_core.errors import InvalidArgument, ModelLoadError

WEIGHTS_FILE = "model.safetensors"
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # recomputed, never stored by DeepSpec but harmless


MATMUL_DTYPES = ("auto", "float32", "bfloat16", "int8")


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bf16 in hardware (AVX512-BF16 or AMX); elsewhere bf16 matmuls are emulated
    and slower than float32."""
    probes = ("_is_avx512_bf16_supported", "_is_amx_tile_supported")
    return any(bool(getattr(torch.cpu, name, lambda: False)()) for name in probes)


def resolve_matmul_dtype(name: str, device: torch.device, dtype: torch.dtype) -> torch.dtype | None:
    """What a drafter's inference matmuls run in (None: its own dtype); see `layers.set_matmul_dtype`.

    `auto`: for a float32 drafter on a CPU with native bf16, int8 weights with bf16 activations for decode-sized
    batches (bf16 weights for the big layers beyond): the drafter's weights are cold after every target forward,
    so its round is weight traffic, and drafts only move acceptance, never what the target commits. On a CPU
    without native bf16 where our integer kernels run (AVX2), int8 in those kernels alone (`set_matmul_dtype`
    with `native_bf16=False`). Otherwise the drafter's dtype. `float32` keeps every matmul exact (DeepSpec's
    numbers to the last bit); `bfloat16` and `int8` force those paths."""
    if name not in MATMUL_DTYPES:
        raise InvalidArgument("drafter_matmul_dtype", name, f"must be one of {', '.join(MATMUL_DTYPES)}")
    if name == "auto":
        if torch.device(device).type != "cpu" or dtype != torch.float32:
            return None
        if cpu_has_native_bf16():
            return torch.int8 if int8_matmul_available() else torch.bfloat16
        from ..kernels import q8dot_unavailable

        return torch.int8 if q8dot_unavailable() is None else None
    if name == "int8":
        if not int8_matmul_available():
            raise InvalidArgument("drafter_matmul_dtype", name, "needs torch.ops.aten._weight_int8pack_mm")
        return torch.int8
    want = torch.bfloat16 if name == "bfloat16" else torch.float32
    return None if want == dtype else want


def build_drafter(config: DrafterConfig, support_size: int | None = None, name: str | None = None):
    """A freshly initialised drafter of the config's kind (DSparkDrafter, DFlashDrafter or Eagle3Drafter).
    `support_size`: the top-k support of sampled drafts; None = the config's `draft_support_size`, else
    DEFAULT_SUPPORT_SIZE."""
    cls = {"dspark": DSparkDrafter, "dflash": DFlashDrafter, "eagle3": Eagle3Drafter}[config.kind]
    if support_size is None:
        support_size = config.draft_support_size or DEFAULT_SUPPORT_SIZE
    return cls(config, support_size=support_size, name=name)


def _shape(t) -> list[int]:
    return list(t.shape)


REFERENCED = ("embed_tokens.weight", "lm_head.weight")
_INTEGER_TENSORS = ("draft_vocab_ids",)


def read_target_tensors(target_dir: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """(input embedding [V, H], output embedding [V, H]) of a Hugging Face causal-LM directory, read alone from
    its safetensors (single file or index; tied embeddings give the same tensor twice)."""
    root = Path(target_dir)
    files = [root / "model.safetensors"]
    index = root / "model.safetensors.index.json"
    if not files[0].is_file() and index.is_file():
        try:
            files = sorted({root / f for f in json.loads(index.read_text())["weight_map"].values()})
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise ModelLoadError(f"{index}: cannot read the weight map ({exc})") from exc
    found: dict[str, torch.Tensor] = {}
    want = {"model.embed_tokens.weight": "embed", "embed_tokens.weight": "embed", "lm_head.weight": "head"}
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{root}: the drafter takes its embedding and LM head from the target, but "
                                 f"{f.name} is missing there")
        try:
            with safe_open(str(f), framework="pt") as sf:
                for key in sf.keys():
                    if key in want and want[key] not in found:
                        found[want[key]] = sf.get_tensor(key)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise ModelLoadError(f"{f}: cannot read safetensors file ({exc})") from exc
    if "embed" not in found:
        raise ModelLoadError(f"{root}: no embed_tokens.weight in the target's weights")
    return found["embed"], found.get("head", found["embed"])


def _target_tensors(target) -> tuple[torch.Tensor, torch.Tensor] | None:
    if target is None or isinstance(target, tuple):
        return target
    return read_target_tensors(target)


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 support_size: int | None = None, matmul_dtype: str = "auto",
                 calibration_file: str | Path | None = None, target=None):
    """Load a DeepSpec-format drafter folder (frozen, eval mode); raises ModelLoadError naming the path and the problem.

    `support_size`: see `build_drafter`.
    `matmul_dtype` (one of MATMUL_DTYPES): see `resolve_matmul_dtype`; the weights themselves stay in `dtype`.
    `calibration_file`: STS temperatures from there instead of `<path>/calibration.json` (see `load_config`).
    `target`: the target's directory, or its (input, output) embedding tensors: needed by a checkpoint that
    references them (`target_tensors: referenced`), ignored otherwise."""
    path = Path(path)
    low = resolve_matmul_dtype(matmul_dtype, torch.device(device), dtype)
    config = load_config(path, calibration_file)
    weights_path = path / WEIGHTS_FILE
    if not weights_path.is_file():
        if (path / f"{WEIGHTS_FILE}.index.json").is_file():
            raise ModelLoadError(f"{path}: sharded checkpoints ({WEIGHTS_FILE}.index.json) are not supported; "
                                 f"expected a single {WEIGHTS_FILE}")
        raise ModelLoadError(f"{path}: missing {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(weights_path), device="cpu")
    except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
        raise ModelLoadError(f"{weights_path}: cannot read safetensors file ({exc})") from exc
    tensors = {k: v for k, v in tensors.items() if not k.endswith(_IGNORED_SUFFIXES)}
    if config.target_tensors == TARGET_TENSORS_REFERENCED:
        theirs = _target_tensors(target)
        if theirs is None:
            raise ModelLoadError(f"{path}: this drafter takes its embedding and LM head from its target; load it "
                                 "beside the target (--target / the target directory)")
        present = sorted(set(REFERENCED) & set(tensors))
        if present:
            raise ModelLoadError(f"{weights_path}: references the target's tensors but also stores {', '.join(present)}")
        embed, head = theirs
        if tuple(embed.shape) != (config.vocab_size, config.hidden_size) or embed.shape != head.shape:
            raise ModelLoadError(f"{path}: the target's embedding is {_shape(embed)}, the drafter expects "
                                 f"[{config.vocab_size}, {config.hidden_size}]")
        ids = tensors.get("draft_vocab_ids")
        tensors["embed_tokens.weight"] = embed.float()
        tensors["lm_head.weight"] = (head if ids is None or not config.draft_vocab_size else
                                     head[ids.long().clamp(0, config.vocab_size - 1)]).float()
    if config.tie_word_embeddings and "lm_head.weight" not in tensors and "embed_tokens.weight" in tensors:
        tensors["lm_head.weight"] = tensors["embed_tokens.weight"]

    with torch.device("meta"):
        model = build_drafter(config, support_size=support_size, name=path.name)
    expected = model.state_dict()
    missing = sorted(set(expected) - set(tensors))
    if missing:
        raise ModelLoadError(f"{weights_path}: missing tensor(s) for {config.architecture} ({config.kind}): "
                             f"{', '.join(missing)}")
    unexpected = sorted(set(tensors) - set(expected))
    if unexpected:
        raise ModelLoadError(f"{weights_path}: unexpected tensor(s) not used by {config.architecture} "
                             f"({config.kind}; check markov_rank / markov_head_type / enable_confidence_head): "
                             f"{', '.join(unexpected)}")
    for name, param in expected.items():
        if tensors[name].shape != param.shape:
            raise ModelLoadError(f"{weights_path}: tensor '{name}' has shape {_shape(tensors[name])} in the file, "
                                 f"expected {_shape(param)} from config.json")
        if name in _INTEGER_TENSORS:
            ids = tensors[name]
            if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
                raise ModelLoadError(f"{weights_path}: tensor '{name}' has dtype {ids.dtype}, expected integer")
            if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= config.vocab_size
                                or bool((ids[1:] <= ids[:-1]).any())):
                raise ModelLoadError(f"{weights_path}: tensor '{name}' must hold strictly increasing target ids "
                                     f"in [0, {config.vocab_size})")
            continue
        if not tensors[name].is_floating_point():
            raise ModelLoadError(f"{weights_path}: tensor '{name}' has dtype {tensors[name].dtype}, expected floating")
    state = {k: (v.to(device=device, dtype=torch.long) if k in _INTEGER_TENSORS else v.to(device=device, dtype=dtype))
             for k, v in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    set_matmul_dtype(model, low, native_bf16=torch.device(device).type != "cpu" or cpu_has_native_bf16())
    return model.requires_grad_(False).eval()  # serving: frozen; a trainer re-enables what it trains


def save_drafter(drafter, path: str | Path, reference_target: bool = False) -> None:
    """Write `<path>/config.json` and `<path>/model.safetensors` with DeepSpec tensor names.

    `reference_target`: leave out the frozen copies of the target's embedding and LM head (`target_tensors:
    referenced`; `load_drafter` then needs the target). The drafter's trainer keeps them equal to the target's."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    seen: set[int] = set()
    config = drafter.config
    if reference_target:
        config = dataclasses.replace(config, target_tensors=TARGET_TENSORS_REFERENCED)
    for name, t in drafter.state_dict().items():
        if reference_target and name in REFERENCED:
            continue
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # tied / shared storage: safetensors wants distinct buffers
            t = t.clone()
        seen.add(t.data_ptr())
        state[name] = t
    dtype_name = str(drafter.fc.weight.dtype).removeprefix("torch.")
    save_config(config, path, dtype_name=dtype_name)
    save_file(state, str(path / WEIGHTS_FILE), metadata={"format": "pt"})


@torch.no_grad()
def share_target_weights(drafter, embed: torch.Tensor, lm_head: torch.Tensor) -> list[str]:
    """Point the drafter's `embed_tokens` / `lm_head` at the target's tensors where they hold the same values.

    Drafters are trained with the target's embedding and LM head frozen, so in one process the copies are
    redundant: sharing them saves the memory and, on small models, keeps one copy hot in the CPU cache
    for both the drafting and the verification pass. Returns the names of the shared parameters.
    """
    shared = []
    for name, theirs in (("embed_tokens", embed), ("lm_head", lm_head)):
        module = getattr(drafter, name, None)
        mine = getattr(module, "weight", None)
        if mine is None or mine.data_ptr() == theirs.data_ptr():
            continue
        if mine.shape == theirs.shape and mine.dtype == theirs.dtype and mine.device == theirs.device \
                and torch.equal(mine, theirs):
            module.weight = torch.nn.Parameter(theirs, requires_grad=False)
            shared.append(name)
    return shared
