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
    """How many tensors of each quantization type (Q4_1, Q8_0, F32...) the file holds."""
    from gguf import GGUFReader

    return dict(Counter(t.tensor_type.name for t in GGUFReader(str(path)).tensors))


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
                overwrite: bool = False, progress: bool = True) -> Path:
    """Convert `gguf_path` into a Hugging Face directory at `out_dir`; returns `out_dir`.

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
        (tmp / "gguf_source.json").write_text(json.dumps({
            "file": src.name, "path": str(src.resolve()), "bytes": src.stat().st_size,
            "sha256": _sha256(src), "tensor_types": types}, indent=2) + "\n")
        (tmp / "README.md").write_text(_model_card(name or src.stem, src, config, types))
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
