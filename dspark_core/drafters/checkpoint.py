"""Load and save drafters in DeepSpec's on-disk format (`config.json` + `model.safetensors`).

`load_drafter` reads exactly `<dir>/config.json` (plus an optional `calibration.json` sidecar) and
`<dir>/model.safetensors`, never any other `*.safetensors` in the folder (the fixtures keep
`reference.safetensors` beside the weights). Tensor names are DeepSpec's, which are also this package's
module names, so the mapping is the identity; it is checked strictly: a missing, unexpected or
mis-shaped tensor is a `ModelLoadError` naming the tensor (and both shapes). The model is built on the
meta device and the file's tensors are assigned, so no memory is spent on a throw-away initialisation.

Knows nothing about targets, requests or serving.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dspark_core.drafters.base import DEFAULT_SUPPORT_SIZE
from dspark_core.drafters.config import DrafterConfig, load_config, save_config
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
    so its round is weight traffic, and drafts only move acceptance, never what the target commits. Otherwise
    the drafter's dtype. `float32` keeps every matmul exact (DeepSpec's numbers to the last bit); `bfloat16`
    and `int8` force those paths."""
    if name not in MATMUL_DTYPES:
        raise InvalidArgument("drafter_matmul_dtype", name, f"must be one of {', '.join(MATMUL_DTYPES)}")
    if name == "auto":
        fast = torch.device(device).type == "cpu" and dtype == torch.float32 and cpu_has_native_bf16()
        return (torch.int8 if int8_matmul_available() else torch.bfloat16) if fast else None
    if name == "int8":
        if not int8_matmul_available():
            raise InvalidArgument("drafter_matmul_dtype", name, "needs torch.ops.aten._weight_int8pack_mm")
        return torch.int8
    want = torch.bfloat16 if name == "bfloat16" else torch.float32
    return None if want == dtype else want


def build_drafter(config: DrafterConfig, support_size: int = DEFAULT_SUPPORT_SIZE, name: str | None = None):
    """A freshly initialised drafter of the config's kind (DSparkDrafter, DFlashDrafter or Eagle3Drafter)."""
    cls = {"dspark": DSparkDrafter, "dflash": DFlashDrafter, "eagle3": Eagle3Drafter}[config.kind]
    return cls(config, support_size=support_size, name=name)


def _shape(t) -> list[int]:
    return list(t.shape)


def load_drafter(path: str | Path, device: str | torch.device = "cpu", dtype: torch.dtype = torch.float32,
                 support_size: int = DEFAULT_SUPPORT_SIZE, matmul_dtype: str = "auto",
                 calibration_file: str | Path | None = None):
    """Load a DeepSpec-format drafter folder (frozen, eval mode); raises ModelLoadError naming the path and the problem.

    `matmul_dtype` (one of MATMUL_DTYPES): see `resolve_matmul_dtype`; the weights themselves stay in `dtype`.
    `calibration_file`: STS temperatures from there instead of `<path>/calibration.json` (see `load_config`)."""
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
        if not tensors[name].is_floating_point():
            raise ModelLoadError(f"{weights_path}: tensor '{name}' has dtype {tensors[name].dtype}, expected floating")
    state = {k: v.to(device=device, dtype=dtype) for k, v in tensors.items()}
    model.load_state_dict(state, strict=True, assign=True)
    set_matmul_dtype(model, low)
    return model.requires_grad_(False).eval()  # serving: frozen; a trainer re-enables what it trains


def save_drafter(drafter, path: str | Path) -> None:
    """Write `<path>/config.json` and `<path>/model.safetensors` with DeepSpec tensor names."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    state = {}
    seen: set[int] = set()
    for name, t in drafter.state_dict().items():
        t = t.detach().to("cpu").contiguous()
        if t.data_ptr() in seen:  # tied / shared storage: safetensors wants distinct buffers
            t = t.clone()
        seen.add(t.data_ptr())
        state[name] = t
    dtype_name = str(drafter.fc.weight.dtype).removeprefix("torch.")
    save_config(drafter.config, path, dtype_name=dtype_name)
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
