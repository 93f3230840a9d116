"""A GGUF file (Llama / Qwen families) -> a Hugging Face model directory our runtime loads.

`transformers` reads GGUF with `gguf_file=` and dequantizes every tensor to float; the model it returns is
flagged as quantized and refuses `save_pretrained`. So the state dict is copied into a fresh model of the same
class built from the same config (without `quantization_config`) and saved as safetensors, beside the tokenizer
and chat template the GGUF carries, a model card that says where the weights came from, and `gguf_source.json`
(file name, size, SHA-256, quantization types), so a runtime that serves the GGUF's own quantization can find
and check the original file.

Offline by construction: nothing here touches a model hub.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import tempfile
from collections import Counter
from pathlib import Path

from .errors import InvalidArgument, ModelLoadError

SUPPORTED_ARCHITECTURES = ("llama", "mistral", "qwen2", "qwen3")


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def gguf_tensor_types(path: Path) -> dict[str, int]:
    """How many tensors of each quantization type (Q4_1, Q8_0, F32...) the file holds (from its header)."""
    from gguf import GGMLQuantizationType

    return dict(Counter(GGMLQuantizationType(ttype).name for _, _, ttype, _ in _gguf_index(path)[1]))


def load_gguf_reference(gguf_path: str | Path, dtype=None):
    """transformers' own load of a GGUF file, dequantized (the reference the import must equal)."""
    import torch
    from transformers import AutoModelForCausalLM

    path = Path(gguf_path)
    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype or torch.float32)


def _model_card(name: str, src: Path, config, types: dict[str, int]) -> str:
    kinds = ", ".join(f"{k} x {v}" for k, v in sorted(types.items()))
    return f"""# {name}

Converted by `dspark models import-gguf` from `{src.name}`.

**The weights are the GGUF file's tensors dequantized to float32** by `transformers`' GGUF loader (tensor types in
the file: {kinds}). They are therefore exactly the quantized model's values, not the original full-precision
checkpoint's. Served as float32 this directory is the dequantized model; a runtime serving the GGUF's own packed
weights (see `gguf_source.json`) serves the same values.

| | |
|---|---|
| architecture | {config.model_type} ({type(config).__name__}) |
| layers / hidden / vocabulary | {config.num_hidden_layers} / {config.hidden_size} / {config.vocab_size} |
| tied embeddings | {bool(getattr(config, "tie_word_embeddings", False))} |
| tokenizer and chat template | from the GGUF metadata |

The licence is the source model's (see the package that shipped the GGUF file).
"""


def import_gguf(gguf_path: str | Path, out_dir: str | Path, name: str | None = None,
                overwrite: bool = False, progress: bool = True, keep_copy: bool = False) -> Path:
    """Convert `gguf_path` into a Hugging Face directory at `out_dir`; returns `out_dir`.

    With `keep_copy` the GGUF file is copied in beside the conversion and recorded there, so the directory
    (whose `gguf` weights are read from that file at load time) does not depend on where the file came from
    (e.g. a virtual environment's package, which another environment's install must not redirect).

    Written into a temporary sibling and renamed at the end, so an interrupted import leaves nothing that
    looks complete."""
    import torch
    from transformers import AutoTokenizer
    from transformers.utils import logging as hf_logging

    src, out = Path(gguf_path), Path(out_dir)
    if not src.is_file():
        raise InvalidArgument("FILE", str(src), "must be an existing .gguf file")
    if src.suffix.lower() != ".gguf":
        raise InvalidArgument("FILE", str(src), "must be a .gguf file")
    if out.exists() and any(out.iterdir()) and not overwrite:
        raise InvalidArgument("--out", str(out), "already exists and is not empty (pass --overwrite to replace it)")
    try:
        import gguf  # noqa: F401 - transformers needs it, so say so here in one line
    except ImportError:
        raise ModelLoadError("importing a GGUF file needs the `gguf` package (pip install gguf accelerate)") from None
    if not progress:
        hf_logging.disable_progress_bar()
    try:
        ref = load_gguf_reference(src)
    except Exception as exc:  # a corrupt or foreign file: one line naming it
        raise ModelLoadError(f"could not load {src} as a GGUF causal LM: {exc}") from exc
    config = ref.config
    if config.model_type not in SUPPORTED_ARCHITECTURES:
        raise ModelLoadError(f"{src.name}: architecture {config.model_type!r} is not supported "
                             f"(supported: {', '.join(SUPPORTED_ARCHITECTURES)})")
    tok = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)

    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = "float32"
    with torch.device("meta"):
        fresh = type(ref)(config)
    fresh.load_state_dict(ref.state_dict(), assign=True)
    fresh.tie_weights()
    del ref

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        tmp.chmod(0o755)
        fresh.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        types = gguf_tensor_types(src)
        recorded = src.resolve()
        if keep_copy:
            shutil.copyfile(src, tmp / src.name)
            recorded = out.resolve() / src.name
        (tmp / "gguf_source.json").write_text(json.dumps({
            "file": src.name, "path": str(recorded), "bytes": src.stat().st_size,
            "sha256": _sha256(src), "tensor_types": types}, indent=2) + "\n")
        (tmp / "README.md").write_text(_model_card(name or src.stem, src, config, types))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out


# -- serving a GGUF's own blocks (`--weights gguf`)

GGUF_SOURCE = "gguf_source.json"
# GGUF tensor name (ggml's llama-family convention) -> the HF module it holds
_GGUF_LAYER_NAMES = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}


def gguf_source(model_dir: str | Path) -> Path | None:
    """The GGUF file a directory was imported from (its `gguf_source.json`), or None when it records none.

    Raises ModelLoadError when the record names a file that is gone or whose size changed."""
    rec_path = Path(model_dir) / GGUF_SOURCE
    if not rec_path.is_file():
        return None
    try:
        rec = json.loads(rec_path.read_text())
        src = Path(rec["path"])
    except (ValueError, KeyError, TypeError) as exc:
        raise ModelLoadError(f"unreadable {rec_path}: {exc}") from exc
    if not src.is_file():
        raise ModelLoadError(f"{rec_path} names {src}, which does not exist")
    if src.stat().st_size != rec.get("bytes"):
        raise ModelLoadError(f"{src} is {src.stat().st_size} bytes, {rec_path} recorded {rec.get('bytes')}")
    return src


def _reverse_permute_rows(n_rows: int, n_head: int) -> "torch.Tensor":
    """Row order that undoes llama.cpp's q/k permutation for RoPE (the inverse transformers applies at import):
    HF row r is GGUF row perm[r]."""
    import torch

    dim = n_rows // n_head // 2
    return torch.arange(n_rows).reshape(n_head, dim, 2).transpose(1, 2).reshape(n_rows)


# GGUF metadata value types (gguf spec): fixed sizes; 8 = string, 9 = array
_GGUF_SCALAR_BYTES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
# tensor types served packed -> (values per block, bytes per block)
_GGUF_BLOCKS = {0: ("F32", 1, 4), 1: ("F16", 1, 2), 30: ("BF16", 1, 2), 2: ("Q4_0", 32, 18), 3: ("Q4_1", 32, 20),
                8: ("Q8_0", 32, 34)}


def _gguf_index(path: Path) -> tuple[str, list[tuple[str, tuple[int, ...], int, int]], int]:
    """(general.architecture, [(tensor name, ggml dims, type id, offset)], data start) from a GGUF header.

    A small reader of the format (version 2/3, little-endian) that skips metadata it does not need; the gguf
    package's GGUFReader decodes every vocabulary string into numpy objects first (~5-15 s for a 49k vocabulary
    here, against well under a second)."""
    import struct

    with path.open("rb") as f:
        head = f.read(24)
        magic, version, n_tensors, n_kv = struct.unpack("<4sIQQ", head)
        if magic != b"GGUF" or version not in (2, 3):
            raise ModelLoadError(f"{path.name} is not a GGUF v2/v3 file")

        def u64() -> int:
            return struct.unpack("<Q", f.read(8))[0]

        def string() -> bytes:
            return f.read(u64())

        def skip(vtype: int) -> None:
            if vtype == 8:
                f.seek(u64(), 1)
            elif vtype == 9:
                etype, count = struct.unpack("<IQ", f.read(12))
                if etype == 8:
                    for _ in range(count):
                        f.seek(u64(), 1)
                elif etype == 9:
                    for _ in range(count):
                        skip(9)
                else:
                    f.seek(_GGUF_SCALAR_BYTES[etype] * count, 1)
            else:
                f.seek(_GGUF_SCALAR_BYTES[vtype], 1)

        arch, alignment = "", 32
        for _ in range(n_kv):
            key = string()
            vtype = struct.unpack("<I", f.read(4))[0]
            if key == b"general.architecture" and vtype == 8:
                arch = string().decode()
            elif key == b"general.alignment" and vtype == 4:
                alignment = struct.unpack("<I", f.read(4))[0]
            else:
                skip(vtype)
        tensors = []
        for _ in range(n_tensors):
            name = string().decode()
            n_dims = struct.unpack("<I", f.read(4))[0]
            dims = struct.unpack(f"<{n_dims}Q", f.read(8 * n_dims))
            ttype, offset = struct.unpack("<IQ", f.read(12))
            tensors.append((name, dims, ttype, offset))
        start = f.tell()
    return arch, tensors, (start + alignment - 1) // alignment * alignment


def gguf_raw_tensors(gguf_path: str | Path, hf_config) -> dict[str, tuple]:
    """The matmul weights of a llama-family GGUF file as raw blocks in HF row order:
    {HF module name (`layers.3.mlp.up_proj`, `embed_tokens`, `lm_head`): (uint8 [N, bytes per row], type, (N, K))}.
    `lm_head` is absent when the file ties it to the token embedding. Tensors of other types are listed with
    their type and no data (None), so the caller can say which one it cannot serve."""
    import numpy as np
    import torch

    path = Path(gguf_path)
    arch, tensors, data_start = _gguf_index(path)
    data = np.memmap(path, dtype=np.uint8, mode="r")
    heads = hf_config.num_attention_heads
    kv_heads = getattr(hf_config, "num_key_value_heads", None) or heads
    out: dict[str, tuple] = {}
    for tname, dims, ttype, offset in tensors:
        parts = tname.split(".")
        if tname == "token_embd.weight":
            name = "embed_tokens"
        elif tname == "output.weight":
            name = "lm_head"
        elif len(parts) == 4 and parts[0] == "blk" and parts[2] in _GGUF_LAYER_NAMES and parts[3] == "weight":
            name = f"layers.{parts[1]}.{_GGUF_LAYER_NAMES[parts[2]]}"
        else:
            continue
        if len(dims) != 2:
            raise ModelLoadError(f"{path.name}: tensor {tname} has {len(dims)} dimensions, expected 2")
        shape = (int(dims[1]), int(dims[0]))  # ggml lists the row length first
        if ttype not in _GGUF_BLOCKS:
            out[name] = (None, f"type {ttype}", shape)
            continue
        qtype, per_block, block_bytes = _GGUF_BLOCKS[ttype]
        row_bytes = shape[1] // per_block * block_bytes
        start = data_start + offset
        raw = torch.from_numpy(np.array(data[start : start + shape[0] * row_bytes]).reshape(shape[0], row_bytes))
        if arch == "llama" and parts[2:3] in (["attn_q"], ["attn_k"]):
            raw = raw[_reverse_permute_rows(shape[0], heads if parts[2] == "attn_q" else kv_heads)]
        out[name] = (raw, qtype, shape)
    return out
