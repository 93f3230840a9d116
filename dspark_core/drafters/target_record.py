"""Which target a drafter was trained for, and whether a given target is that one.

A drafter reads one target's hidden states (its tapped layers) and shares its vocabulary, so it works
beside that target only. `dspark train` writes a record of the target into the drafter's `config.json`
under `dspark_target` (an extra key: DeepSpec's loader ignores it, ours keeps it in `DrafterConfig.extra`):

    "dspark_target": {"name": "target", "architecture": "Qwen3ForCausalLM", "vocab_size": 4096,
                      "hidden_size": 256, "num_hidden_layers": 8, "tap_layer_ids": [1, 3, 5],
                      "embedding_fingerprint": [0.0123, ...]}

The fingerprint is 16 numbers: a fixed +-1 projection of 16 evenly spaced rows of the target's input
embedding, divided by sqrt(hidden). It is compared with a tolerance (2% of its RMS), so the dtype a target
is loaded in (float32, bfloat16, float16) does not matter, while another model's embedding (random or
trained) gives unrelated numbers.

Two checks, each raising `ModelLoadError` in one line naming the drafter and the target:
- `check_shapes(config, target_dir)` before the target's weights are loaded: architecture (when recorded),
  vocabulary, hidden size, number of layers and tapped layers. A DeepSpec checkpoint without a record gets
  these from its own keys (`vocab_size`, `hidden_size`, `target_layer_ids`, `num_target_layers`).
- `check_fingerprint(config, embedding)` once the target is loaded, when a fingerprint is recorded.

Knows nothing about the CLI or services; reads a target's `config.json` through transformers' AutoConfig.
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from dspark_core.errors import ModelLoadError

RECORD_KEY = "dspark_target"
FINGERPRINT_ROWS = 16
FINGERPRINT_TOLERANCE = 0.02  # of the fingerprint's RMS


def embedding_fingerprint(embedding: torch.Tensor) -> list[float]:
    """16 numbers that identify an embedding matrix [vocab, hidden] whatever dtype it is held in."""
    if embedding.dim() != 2 or embedding.shape[0] < 1:
        raise ModelLoadError(f"embedding must be a [vocab, hidden] matrix; got {list(embedding.shape)}")
    vocab, hidden = embedding.shape
    rows = torch.linspace(0, vocab - 1, FINGERPRINT_ROWS).round().long().to(embedding.device)
    gen = torch.Generator().manual_seed(0x5EED)
    signs = (torch.randint(0, 2, (hidden,), generator=gen) * 2 - 1).to(torch.float64)
    picked = embedding.detach().index_select(0, rows).to(device="cpu", dtype=torch.float64)
    return [round(float(v), 6) for v in (picked @ signs) / math.sqrt(hidden)]


def fingerprints_match(a, b) -> bool:
    if len(a) != len(b) or not a:
        return False
    rms = math.sqrt(sum(x * x for x in a) / len(a)) or 1e-12
    return all(abs(x - y) <= FINGERPRINT_TOLERANCE * rms + 1e-9 for x, y in zip(a, b))


def target_record(target, tap_layer_ids) -> dict:
    """The record of a loaded target (TargetRuntime) for a drafter that taps `tap_layer_ids`."""
    archs = getattr(target.hf_config, "architectures", None) or [type(target.model).__name__]
    return {"name": target.name, "architecture": archs[0], "vocab_size": int(target.vocab_size),
            "hidden_size": int(target.hidden_size), "num_hidden_layers": int(target.num_layers),
            "tap_layer_ids": [int(i) for i in tap_layer_ids],
            "embedding_fingerprint": embedding_fingerprint(target.input_embeddings.weight)}


def recorded_target(config) -> dict | None:
    """The `dspark_target` record of a DrafterConfig, or None (DeepSpec checkpoints and older ones)."""
    rec = config.extra.get(RECORD_KEY)
    return rec if isinstance(rec, dict) else None


def expected_shape(config) -> dict:
    """What the drafter needs of its target: the record where there is one, else its own config keys."""
    rec = recorded_target(config) or {}
    return {"name": rec.get("name") or config.extra.get("target_model_name_or_path"),
            "architecture": rec.get("architecture"), "vocab_size": rec.get("vocab_size", config.vocab_size),
            "hidden_size": rec.get("hidden_size", config.hidden_size),
            "num_hidden_layers": rec.get("num_hidden_layers", config.num_target_layers),
            "tap_layer_ids": list(config.target_layer_ids)}


def _describe(d: dict) -> str:
    parts = [d["architecture"]] if d.get("architecture") else []
    parts.append(f"vocab {d['vocab_size']}")
    parts.append(f"hidden {d['hidden_size']}")
    if d.get("num_hidden_layers"):
        parts.append(f"{d['num_hidden_layers']} layers")
    return ", ".join(parts)


def read_target_shape(target_dir: str | Path) -> dict:
    """architecture, vocab_size, hidden_size, num_hidden_layers of a Hugging Face model directory."""
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(str(target_dir), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any failure means the directory is not a usable model
        raise ModelLoadError(f"invalid config.json in {target_dir}: {exc}") from exc
    text = hf.get_text_config() if hasattr(hf, "get_text_config") else hf
    archs = getattr(hf, "architectures", None) or [None]
    return {"name": Path(target_dir).name, "architecture": archs[0], "vocab_size": text.vocab_size,
            "hidden_size": text.hidden_size, "num_hidden_layers": text.num_hidden_layers}


def shape_mismatch(config, target: dict) -> str | None:
    """Why a drafter (DrafterConfig) cannot run beside a target of this shape, or None when it can."""
    want = expected_shape(config)
    if want["architecture"] and target.get("architecture") and want["architecture"] != target["architecture"]:
        return "architecture"
    if want["vocab_size"] != target["vocab_size"]:
        return "vocabulary"
    if want["hidden_size"] != target["hidden_size"]:
        return "hidden size"
    if want["num_hidden_layers"] and want["num_hidden_layers"] != target["num_hidden_layers"]:
        return "number of layers"
    if max(want["tap_layer_ids"]) > target["num_hidden_layers"] - 2:
        return f"tapped layers {want['tap_layer_ids']}"
    return None


def _refusal(drafter_label: str, config, target: dict, target_label: str, what: str) -> ModelLoadError:
    want = expected_shape(config)
    trained = f" '{want['name']}'" if want.get("name") else ""
    return ModelLoadError(
        f"drafter {drafter_label} was trained for target{trained} ({_describe(want)}), not for {target_label} "
        f"({_describe(target)}): the {what} differs; use --drafter none or a drafter trained for this target "
        "(docs/training.md)")


def check_shapes(config, drafter_label: str, target_dir: str | Path, target_label: str | None = None) -> None:
    """Refuse (ModelLoadError, one line) a drafter whose target is not shaped like `target_dir`'s model."""
    target = read_target_shape(target_dir)
    what = shape_mismatch(config, target)
    if what:
        raise _refusal(drafter_label, config, target, target_label or str(target_dir), what)


def fingerprint_mismatch(config, embedding: torch.Tensor) -> bool:
    rec = recorded_target(config)
    if not rec or not isinstance(rec.get("embedding_fingerprint"), list):
        return False
    return not fingerprints_match(rec["embedding_fingerprint"], embedding_fingerprint(embedding))


def check_fingerprint(config, drafter_label: str, target, target_label: str | None = None) -> None:
    """Refuse a drafter whose recorded embedding fingerprint is not the loaded target's (TargetRuntime)."""
    if fingerprint_mismatch(config, target.input_embeddings.weight):
        shape = {"architecture": (getattr(target.hf_config, "architectures", None) or [None])[0],
                 "vocab_size": target.vocab_size, "hidden_size": target.hidden_size,
                 "num_hidden_layers": target.num_layers}
        raise _refusal(drafter_label, config, shape, target_label or target.name, "embedding (weights)")
