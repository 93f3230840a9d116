"""Train a DSpark / DSpark-RNN / DFlash / Eagle3 drafter from a target cache.

- `TrainConfig`: what to train and how (AdamW without weight decay, lr 6e-4, 4% linear warm-up then
  cosine to 0, grad clip 1.0; algorithms.md section 5).
- `drafter_config_for_target` / `fresh_drafter`: a new drafter shaped for a target: hidden size, heads
  and vocabulary are the target's; embedding and LM head are copied from the target and frozen; the MASK
  token is `<|mask|>` when the tokenizer has it, else the first unused embedding row (DeepSpec's choice,
  an id past the tokenizer's last token), else the last vocabulary id.
- `Trainer`: deterministic data parallel training (see distributed.py) with gradient accumulation to the
  global batch; every loss term is normalised over the whole global batch (denominators are summed over
  micro-batches and ranks before any backward). Rank 0 logs (tqdm + `metrics.jsonl`) and writes
  checkpoints `checkpoints/step-NNNNNN/` (DeepSpec format, via save_drafter, plus `trainer_state.pt`:
  optimizer, scheduler, step, sampler position, RNG states), the final drafter in `final/`, and a
  training card (`training_card.json`, `README.md`). `resume=True` continues from the latest checkpoint
  and reproduces an uninterrupted run exactly.
- `init_from_checkpoint`: start a run from a saved drafter's weights (fine-tuning a shipped drafter with
  another loss, more steps or another block size) instead of a seeded initialisation.

Knows nothing about prompts, distillation or the command line.
"""

from __future__ import annotations

import dataclasses
import json
import math
import random
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from tqdm import tqdm

from dspark_core.drafters.base import DEFAULT_SUPPORT_SIZE
from dspark_core.drafters.checkpoint import WEIGHTS_FILE, build_drafter, load_drafter, save_drafter
from dspark_core.drafters.config import ARCH_DSPARK, ARCH_EAGLE3, DrafterConfig, load_config
from dspark_core.drafters.target_record import RECORD_KEY, target_record
from dspark_core.errors import InvalidArgument
from dspark_core.training import losses as L
from dspark_core.training.distributed import (WRAP_FSDP, DistContext, EpochSampler, clip_grad_norm, full_state,
                                              grad_sync, load_full_state, wrap_model)

FROZEN = ("embed_tokens.weight", "lm_head.weight")
# what a run trains: everything but the frozen embedding / LM head, or only the confidence head (refit the
# confidence of an already trained drafter without moving its drafts: tau stays exactly the same)
# what a run trains: everything but the frozen copies, or one part of the confidence head
LAYER_INITS = ("random", "target")
TRAINABLE = {"all": None, "confidence": "confidence_head.", "confidence-sampled": "confidence_head.proj.",
             "confidence-greedy": "confidence_head.greedy."}
STATE_FILE = "trainer_state.pt"


def _int(name, v, low):
    if isinstance(v, bool) or not isinstance(v, int) or v < low:
        raise InvalidArgument(name, v, f"must be an integer >= {low}")


def _num(name, v, low, high=math.inf, low_open=False):
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v < low or v > high \
            or (low_open and v == low):
        raise InvalidArgument(name, v, f"must be a number in {'(' if low_open else '['}{low}, {high}]")


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "dspark"  # dspark | dspark-rnn | dflash | eagle3
    out_dir: str = "runs/drafter"
    steps: int = 1000
    global_batch: int = 32  # sequences per optimizer step, all ranks together
    micro_batch: int = 1  # sequences per forward on one rank
    lr: float = 6e-4
    warmup_ratio: float = 0.04
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    num_anchors: int = 512  # DSpark / DFlash blocks per sequence, at most
    seed: int = 0
    checkpoint_every: int = 0  # 0 = only at the end
    keep_checkpoints: int = 2
    max_length: int = 4096  # tokens per sequence (longer ones are cut)
    # drafter shape (None = derived from the target)
    block_size: int = 7  # gamma (Eagle3: ttt_length)
    draft_layers: int | None = None
    markov_rank: int | None = None
    target_layer_ids: tuple[int, ...] | None = None
    # loss (None = the kind's defaults: DSpark CE 0.1, TV 0.9, conf 1.0; DFlash CE 1.0)
    ce_weight: float | None = None
    tv_weight: float | None = None
    confidence_weight: float | None = None
    position_decay: float | None = 4.0  # w_j = exp(-j / decay); None = block size (the paper)
    step_decay: float = 0.8  # Eagle3 TTT step weights
    # confidence soft label: acceptance of the top-k truncated draft inference samples from (the drafters'
    # default support, 32; None = full vocabulary) at this sampling temperature (1.0 = the eval protocol)
    confidence_support: int | None = DEFAULT_SUPPORT_SIZE
    confidence_temperature: float = 1.0
    # start from this drafter checkpoint's weights (None = seeded initialisation); recorded in the card
    init_from: str | None = None
    trainable: str = "all"  # a TRAINABLE key: all, or (part of) the confidence head (needs a DSpark kind)
    # DSpark: add the greedy confidence output (label 1[argmax draft == argmax target]) beside the T-label head
    greedy_confidence: bool = False
    # the drafter predicts only the N most frequent label tokens of the training data (0 = the whole
    # vocabulary): its LM head / Markov output shrink to N rows, training and drafting get that much cheaper
    draft_vocab_size: int = 0
    # draft layers' initial weights: "random" (seeded) or "target" (copies of the target's last decoder layers,
    # the context projection starting as the deepest tapped layer's features; see `init_layers_from_target`)
    layer_init: str = "random"
    fsdp: bool = False
    bf16: bool = False  # bfloat16 autocast (CUDA, or a CPU with native bf16 matmuls)

    def __post_init__(self) -> None:
        if self.kind not in L.KINDS:
            raise InvalidArgument("kind", self.kind, f"must be one of {list(L.KINDS)}")
        _int("steps", self.steps, 1)
        _int("global_batch", self.global_batch, 1)
        _int("micro_batch", self.micro_batch, 1)
        _num("lr", self.lr, 0, low_open=True)
        _num("warmup_ratio", self.warmup_ratio, 0, 1)
        _num("weight_decay", self.weight_decay, 0)
        _num("grad_clip", self.grad_clip, 0, low_open=True)
        _int("num_anchors", self.num_anchors, 1)
        _int("seed", self.seed, 0)
        _int("checkpoint_every", self.checkpoint_every, 0)
        _int("keep_checkpoints", self.keep_checkpoints, 1)
        _int("max_length", self.max_length, 2)
        _int("draft_vocab_size", self.draft_vocab_size, 0)
        _int("block_size", self.block_size, 1)
        if self.layer_init not in LAYER_INITS:
            raise InvalidArgument("layer_init", self.layer_init, f"must be one of {list(LAYER_INITS)}")
        if self.trainable not in TRAINABLE:
            raise InvalidArgument("trainable", self.trainable, f"must be one of {list(TRAINABLE)}")
        if self.trainable.startswith("confidence") and self.kind not in ("dspark", "dspark-rnn"):
            raise InvalidArgument("trainable", self.trainable, f"needs a drafter with a confidence head, not {self.kind}")
        if self.greedy_confidence and self.kind not in ("dspark", "dspark-rnn"):
            raise InvalidArgument("greedy_confidence", True, f"needs a drafter with a confidence head, not {self.kind}")
        if self.draft_layers is not None:
            _int("draft_layers", self.draft_layers, 1)
            if self.kind == "eagle3" and self.draft_layers != 1:
                raise InvalidArgument("draft_layers", self.draft_layers, "must be 1 for eagle3")
        if self.markov_rank is not None:
            _int("markov_rank", self.markov_rank, 1)
        if self.target_layer_ids is not None:
            ids = tuple(self.target_layer_ids)
            if not ids or any(isinstance(i, bool) or not isinstance(i, int) or i < -1 for i in ids) \
                    or any(b <= a for a, b in zip(ids, ids[1:])):
                raise InvalidArgument("target_layer_ids", self.target_layer_ids,
                                      "must be strictly increasing layer ids >= -1")
            object.__setattr__(self, "target_layer_ids", ids)
        self.loss_config()  # validates the loss fields

    def loss_config(self) -> L.LossConfig:
        return L.LossConfig(kind=self.kind, ce_weight=self.ce_weight, tv_weight=self.tv_weight,
                            confidence_weight=self.confidence_weight, position_decay=self.position_decay,
                            step_decay=self.step_decay, confidence_support=self.confidence_support,
                            confidence_temperature=self.confidence_temperature)

    def to_json(self) -> dict:
        d = asdict(self)
        d["target_layer_ids"] = None if self.target_layer_ids is None else list(self.target_layer_ids)
        return d


def lr_factor(step: int, steps: int, warmup_ratio: float) -> float:
    """Multiplier of the base lr for update `step` (0-based): linear warm-up, then cosine to 0."""
    warmup = max(1, round(warmup_ratio * steps)) if warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    span = max(1, steps - warmup)
    return 0.5 * (1.0 + math.cos(math.pi * min(1.0, (step - warmup) / span)))


# ---- a drafter shaped for a target ------------------------------------------------------------------


def default_target_layers(num_layers: int, count: int = 5) -> tuple[int, ...]:
    """Evenly spaced taps. Deep targets: from layer 1 to L-3, like DeepSpec's [1, 9, 17, 25, 33] for
    36 layers; shallow ones from 0 to L-2 (the last layer is never tapped)."""
    if num_layers < 2:
        raise InvalidArgument("num_hidden_layers", num_layers, "the target needs >= 2 layers to tap one")
    first, last = (1, num_layers - 3) if num_layers >= 8 else (0, num_layers - 2)
    n = max(1, min(count, last - first + 1))
    if n == 1:
        return (last,)
    return tuple(sorted({round(first + i * (last - first) / (n - 1)) for i in range(n)}))


def mask_token_for(tokenizer, vocab_size: int) -> int:
    if tokenizer is not None:
        vocab = tokenizer.get_vocab()
        if "<|mask|>" in vocab and vocab["<|mask|>"] < vocab_size:
            return int(vocab["<|mask|>"])
        if len(tokenizer) < vocab_size:
            return len(tokenizer)  # first embedding row no token uses
    return vocab_size - 1


def choose_draft_vocab(label_counts: torch.Tensor, size: int, always: tuple[int, ...] = ()) -> torch.Tensor:
    """The draft vocabulary: `always` (e.g. the EOS ids) plus the most frequent labels (ties: lower id) up to
    `size` ids, ascending. label_counts [V]."""
    v = label_counts.numel()
    if isinstance(size, bool) or not isinstance(size, int) or not 1 <= size <= v:
        raise InvalidArgument("draft_vocab_size", size, f"must be an integer in [1, {v}]")
    keep = sorted({int(i) for i in always if 0 <= int(i) < v})[:size]
    score = label_counts.double().clone()
    score[keep] = float("inf")
    order = torch.argsort(-score, stable=True)  # by count descending, ties by id ascending
    return order[:size].sort().values


def drafter_config_for_target(target, config: TrainConfig) -> DrafterConfig:
    """A DrafterConfig for `config.kind` on this target (TargetRuntime)."""
    hf = target.hf_config.get_text_config() if hasattr(target.hf_config, "get_text_config") else target.hf_config
    h, heads = target.hidden_size, hf.num_attention_heads
    rope = getattr(hf, "rope_parameters", None) or {}
    theta = rope.get("rope_theta", getattr(hf, "rope_theta", 10000.0)) if isinstance(rope, dict) else 10000.0
    taps = config.target_layer_ids or default_target_layers(target.num_layers)
    common = dict(
        vocab_size=target.vocab_size, hidden_size=h, intermediate_size=hf.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=getattr(hf, "num_key_value_heads", None) or heads,
        head_dim=getattr(hf, "head_dim", None) or h // heads, target_layer_ids=tuple(taps),
        num_target_layers=target.num_layers, rms_norm_eps=float(getattr(hf, "rms_norm_eps", 1e-6)),
        rope_theta=float(theta), max_position_embeddings=target.max_context,
        draft_vocab_size=config.draft_vocab_size,
        extra={"model_type": "qwen3", "target_model_name_or_path": str(target.config.model_dir),
               RECORD_KEY: target_record(target, taps)},
    )
    if config.kind == "eagle3":
        return DrafterConfig(architecture=ARCH_EAGLE3, num_hidden_layers=1, ttt_length=config.block_size,
                             step_loss_decay=config.step_decay, draft_num_hidden_layers=1, **common)
    depth = config.draft_layers or max(1, min(5, target.num_layers // 6))
    rank = 0 if config.kind == "dflash" else (config.markov_rank or min(256, max(16, h // 8)))
    return DrafterConfig(
        architecture=ARCH_DSPARK, num_hidden_layers=depth, block_size=config.block_size,
        mask_token_id=mask_token_for(target.tokenizer, target.vocab_size), num_anchors=config.num_anchors,
        markov_rank=rank, markov_head_type="rnn" if config.kind == "dspark-rnn" else "vanilla",
        enable_confidence_head=config.kind != "dflash", confidence_head_with_markov=True,
        greedy_confidence_head=config.greedy_confidence, **common)


def set_trainable(drafter: nn.Module, which: str = "all") -> nn.Module:
    """`all`: everything trains except the embedding and LM head copied from the target; `confidence`: only
    the confidence head's parameters; `confidence-sampled` / `confidence-greedy`: only that output of it."""
    if which not in TRAINABLE:
        raise InvalidArgument("trainable", which, f"must be one of {list(TRAINABLE)}")
    for name, p in drafter.named_parameters():
        p.requires_grad_(name not in FROZEN if which == "all" else name.startswith(TRAINABLE[which]))
    if not any(p.requires_grad for p in drafter.parameters()):
        raise InvalidArgument("trainable", which, "leaves nothing to train in this drafter")
    return drafter.train()


def fresh_drafter(target, config: TrainConfig, draft_vocab: torch.Tensor | None = None) -> nn.Module:
    """Seeded initialisation; embedding / LM head copied from the target (frozen; with a draft vocabulary,
    `draft_vocab` [V_d] ascending target ids, the LM head is those rows); Markov W2 = 0 so training starts from
    the plain backbone logits U."""
    if bool(config.draft_vocab_size) != (draft_vocab is not None) or \
            (draft_vocab is not None and draft_vocab.numel() != config.draft_vocab_size):
        raise InvalidArgument("draft_vocab", None if draft_vocab is None else draft_vocab.numel(),
                              f"must hold draft_vocab_size ({config.draft_vocab_size}) ids")
    dcfg = drafter_config_for_target(target, config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(config.seed)
        drafter = build_drafter(dcfg)
    with torch.no_grad():
        drafter.embed_tokens.weight.copy_(target.model.get_input_embeddings().weight.float().cpu())
        head = target.model.get_output_embeddings().weight.float().cpu()
        if draft_vocab is not None:
            drafter.draft_vocab_ids.copy_(draft_vocab)
            head = head[draft_vocab]
        drafter.lm_head.weight.copy_(head)
        head = getattr(drafter, "markov_head", None)
        if head is not None:
            head.markov_w2.weight.zero_()
    if config.layer_init == "target":
        init_layers_from_target(drafter, target)
    return set_trainable(drafter)


def init_layers_from_target(drafter: nn.Module, target) -> nn.Module:
    """Start the draft layers as the target's own last decoder layers (draft layer i of n = target layer
    num_layers - n + i), in place.

    Attention projections, MLP and both norms are copied (the Qwen3 q/k norms the target may lack stay ones);
    `fc` starts as the identity on the deepest tapped layer's slice of the features (zero on the others, which
    still receive gradients) and `hidden_norm` as that target layer's input norm, so the context keys / values
    start close to what the target's own attention computes there. Eagle3's attention reads
    [embedding, hidden] (2H wide): the hidden half gets the target's projection, the embedding half keeps its
    seeded values. The shapes must match the target's (they do for a drafter built by `fresh_drafter`).
    """
    layers = list(target.model.model.layers)
    mine = list(drafter.layers)
    if len(mine) > len(layers):
        raise InvalidArgument("draft_layers", len(mine), f"must be at most the target's {len(layers)} layers")
    h = drafter.fc.weight.shape[0]
    with torch.no_grad():
        fc = torch.zeros_like(drafter.fc.weight)
        fc[:, -h:] = torch.eye(h, dtype=fc.dtype)
        drafter.fc.weight.copy_(fc)
        for layer, src in zip(mine, layers[len(layers) - len(mine):]):
            for name in ("q_proj", "k_proj", "v_proj"):
                w = getattr(src.self_attn, name).weight.float().cpu()
                dst = getattr(layer.self_attn, name).weight
                dst[:, -w.shape[1]:].copy_(w)  # Eagle3: the hidden half of [embedding, hidden]
            layer.self_attn.o_proj.weight.copy_(src.self_attn.o_proj.weight.float().cpu())
            for name in ("gate_proj", "up_proj", "down_proj"):
                getattr(layer.mlp, name).weight.copy_(getattr(src.mlp, name).weight.float().cpu())
            layer.post_attention_layernorm.weight.copy_(src.post_attention_layernorm.weight.float().cpu())
            norm = src.input_layernorm.weight.float().cpu()
            # Eagle3 normalises the hidden input with its own hidden_norm; DSpark's context has the backbone's
            (getattr(layer, "hidden_norm", None) or drafter.hidden_norm).weight.copy_(norm)
            layer.input_layernorm.weight.copy_(norm)
    return drafter


def init_from_checkpoint(drafter: nn.Module, path: str | Path) -> nn.Module:
    """Copy a saved drafter's weights (DeepSpec format, any stored dtype) into `drafter`, in place.

    The checkpoint must be the same architecture and kind with the same tensor names and shapes, tapped
    layers, Markov head type and MASK token; the block size may differ (no weight depends on it), so a
    block-7 drafter can seed a block-16 run, and a DSpark / DFlash run may have more draft layers than the
    checkpoint: the extra layers start as copies of its last layer with their output projections (attention
    `o_proj`, MLP `down_proj`) zeroed, so the deeper drafter starts out computing exactly what the checkpoint
    does and training grows the new layers from there. The embedding and LM head keep the target's values (frozen
    copies; a bf16-shipped checkpoint holds rounded ones). Raises InvalidArgument naming what differs.
    """
    reference = None
    if load_config(Path(path)).target_tensors:  # a shipped drafter: take the target's tensors from this run's
        emb = drafter.embed_tokens.weight.detach().float()
        head = torch.zeros_like(emb)
        ids = getattr(drafter, "draft_vocab_ids", None)
        head[ids if ids is not None else slice(None)] = drafter.lm_head.weight.detach().float()
        reference = (emb, head)
    src = load_drafter(path, device="cpu", dtype=torch.float32, target=reference)
    a, b = src.config, drafter.config
    if a.draft_vocab_size != b.draft_vocab_size or (a.draft_vocab_size and not torch.equal(
            src.draft_vocab_ids, drafter.draft_vocab_ids)):
        raise InvalidArgument("init_from", str(path), "has another draft vocabulary than this run")
    for name in ("architecture", "kind", "target_layer_ids", "mask_token_id", "markov_head_type",
                 "enable_confidence_head"):
        if getattr(a, name, None) != getattr(b, name, None):
            raise InvalidArgument("init_from", str(path), f"has {name} {getattr(a, name, None)!r}, this run "
                                                          f"needs {getattr(b, name, None)!r}")
    theirs, ours = src.state_dict(), drafter.state_dict()
    if b.greedy_confidence_head and not a.greedy_confidence_head:
        # a greedy confidence output this run adds to a checkpoint without one starts as a copy of the head
        theirs = {**theirs, **{k: theirs[k.replace(".greedy.", ".proj.")] for k in ours
                               if k.startswith("confidence_head.greedy.")}}
    theirs = _deepen(theirs, a, b, path)
    if set(theirs) != set(ours):
        diff = sorted(set(theirs) ^ set(ours))
        raise InvalidArgument("init_from", str(path), f"holds other tensors than this drafter ({', '.join(diff[:4])})")
    for k, v in ours.items():
        if theirs[k].shape != v.shape:
            raise InvalidArgument("init_from", str(path), f"has {k} of shape {list(theirs[k].shape)}, this run "
                                                          f"needs {list(v.shape)}")
    with torch.no_grad():
        for k, v in ours.items():
            if k not in FROZEN:
                v.copy_(theirs[k].to(v.dtype))
    return drafter


def _deepen(theirs: dict, a: DrafterConfig, b: DrafterConfig, path) -> dict:
    """`theirs` with draft layers a.num_hidden_layers.. b.num_hidden_layers - 1 added (see init_from_checkpoint)."""
    have, want = a.num_hidden_layers, b.num_hidden_layers
    if have == want:
        return theirs
    if b.architecture != ARCH_DSPARK or want < have:
        raise InvalidArgument("init_from", str(path), f"has {have} draft layers, this run needs {want} (a "
                                                      "DSpark / DFlash checkpoint can only seed a deeper run)")
    last = f"layers.{have - 1}."
    grown = dict(theirs)
    for i in range(have, want):
        for k, v in theirs.items():
            if k.startswith(last):
                name = f"layers.{i}." + k[len(last):]
                zero = name.endswith(("self_attn.o_proj.weight", "mlp.down_proj.weight"))
                grown[name] = torch.zeros_like(v) if zero else v.clone()
    return grown


# ---- batches ----------------------------------------------------------------------------------------


@dataclass
class MicroBatch:
    """Padded sequences of one forward, with their supervision."""

    # [B, S] long / bool (False on padding)
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    # [B, S, L * H], [B, S, H] as cached
    features: torch.Tensor
    final_hidden: torch.Tensor
    num_tokens: int
    # DSpark / DFlash: [B, A] anchors and their validity, and block labels / weights
    anchors: torch.Tensor | None = None
    anchor_valid: torch.Tensor | None = None
    block: L.BlockTargets | None = None
    # Eagle3
    ttt: L.TTTTargets | None = None
    # [B, S] float32: the target's full-vocabulary log-partition at label positions (a draft vocabulary)
    target_lse: torch.Tensor | None = None

    def to(self, device: torch.device) -> MicroBatch:
        def mv(x):
            if isinstance(x, torch.Tensor):
                return x.to(device, non_blocking=True)
            if dataclasses.is_dataclass(x):
                return type(x)(**{f.name: mv(getattr(x, f.name)) for f in dataclasses.fields(x)})
            return x
        return MicroBatch(**{f.name: mv(getattr(self, f.name)) for f in dataclasses.fields(self)})


def anchor_generator(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    """The anchors of a sample depend only on (seed, epoch, sample): not on rank, batch or resume."""
    return torch.Generator().manual_seed(((seed * 1_000_003 + epoch) * 1_000_000_007 + sample_id) % (1 << 62))


def collate(rows: list[dict], keys: list[tuple[int, int]], config: TrainConfig, gamma: int) -> MicroBatch:
    """rows: TargetCache items; keys: their (epoch, sample id) in the stream."""
    rows = [{k: v[: config.max_length] for k, v in r.items()} for r in rows]
    lengths = [len(r["input_ids"]) for r in rows]
    eagle = config.kind == "eagle3"
    s = max(max(lengths), 2) if eagle else max(lengths) + gamma - 1  # a block never runs off the tensor
    b = len(rows)
    ids = torch.zeros(b, s, dtype=torch.long)
    mask = torch.zeros(b, s, dtype=torch.bool)
    feats = rows[0]["features"].new_zeros(b, s, rows[0]["features"].shape[1])
    fin = rows[0]["final_hidden"].new_zeros(b, s, rows[0]["final_hidden"].shape[1])
    lse = torch.zeros(b, s, dtype=torch.float32) if all("target_lse" in r for r in rows) else None
    for i, (r, n) in enumerate(zip(rows, lengths)):
        ids[i, :n], mask[i, :n] = r["input_ids"], r["loss_mask"]
        feats[i, :n], fin[i, :n] = r["features"], r["final_hidden"]
        if lse is not None:
            lse[i, :n] = r["target_lse"]
    mb = MicroBatch(ids, mask, feats, fin, num_tokens=sum(lengths), target_lse=lse)
    if eagle:
        mb.ttt = L.ttt_targets(mask, gamma)
        return mb
    picked = [L.sample_anchors(mask[i, :n], config.num_anchors, anchor_generator(config.seed, e, sid))
              for i, (n, (e, sid)) in enumerate(zip(lengths, keys))]
    a = max(1, max(len(p) for p in picked))
    anchors = torch.zeros(b, a, dtype=torch.long)
    valid = torch.zeros(b, a, dtype=torch.bool)
    for i, p in enumerate(picked):
        anchors[i, : len(p)], valid[i, : len(p)] = p, True
    mb.anchors, mb.anchor_valid = anchors, valid
    mb.block = L.block_targets(ids, mask, anchors, valid, gamma, config.position_decay)
    return mb


# ---- the module DDP / FSDP wrap ---------------------------------------------------------------------


class TrainStep(nn.Module):
    """forward(micro-batch) -> loss numerators; wraps the drafter so DDP / FSDP hooks see one forward."""

    def __init__(self, drafter: nn.Module, loss_config: L.LossConfig):
        super().__init__()
        self.drafter = drafter
        self.loss_config = loss_config
        self.eagle = drafter.config.architecture == ARCH_EAGLE3

    def term_names(self) -> tuple[str, ...]:
        if self.eagle:
            return ("soft_ce", "accept")
        head = self.drafter.confidence_head
        return L.dspark_term_names(self.loss_config, head is not None, head is not None and head.greedy is not None)

    def coefficients(self) -> dict[str, torch.Tensor]:
        lc, g = self.loss_config, self.drafter.config.gamma
        if self.eagle:
            c = lc.step_decay ** torch.arange(g, dtype=torch.float32)
            return {"soft_ce": c, "accept": torch.zeros(g)}
        w = {"ce": lc.ce_weight, "tv": lc.tv_weight, "conf": lc.confidence_weight, "gconf": lc.confidence_weight,
             "accept": 0.0}
        return {k: torch.tensor([float(w[k])]) for k in self.term_names()}

    def denominators(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        if self.eagle:
            den = L.ttt_denominators(mb.ttt)["soft_ce"]
            return {"soft_ce": den, "accept": den}
        return L.block_denominators(mb.block, self.term_names())

    def forward(self, mb: MicroBatch) -> dict[str, torch.Tensor]:
        d = self.drafter
        if self.eagle:
            logits = [d.logits(h) for h in d.ttt_forward(mb.input_ids, mb.features)]
            sums = L.eagle3_loss_sums(logits, mb.ttt, mb.final_hidden, d.lm_head.weight, self.loss_config,
                                      mb.target_lse if d.draft_vocab_ids is not None else None)
        else:
            out = d.training_forward(mb.input_ids, mb.features, mb.anchors)
            sums = L.dspark_loss_sums(out.logits, out.confidence_logits, mb.block, mb.final_hidden, mb.anchors,
                                      d.lm_head.weight, self.loss_config, out.greedy_confidence_logits,
                                      d.draft_vocab_ids, mb.target_lse if d.draft_vocab_ids is not None else None)
        return {k: v.clone() for k, v in sums.num.items()}  # not views: FSDP hooks the outputs


# ---- the trainer ------------------------------------------------------------------------------------


def latest_checkpoint(out_dir: str | Path) -> Path | None:
    root = Path(out_dir) / "checkpoints"
    done = sorted(p for p in root.glob("step-*") if (p / STATE_FILE).is_file()) if root.is_dir() else []
    return done[-1] if done else None


@dataclass
class TrainResult:
    steps: int
    final_losses: dict[str, float]
    tokens: int
    seconds: float
    checkpoint: Path | None

    @property
    def tokens_per_second(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


class Trainer:
    def __init__(self, config: TrainConfig, cache, drafter: nn.Module, ctx: DistContext, *, resume: bool = False,
                 data_info: dict | None = None, progress: bool = True):
        if config.global_batch % ctx.world_size:
            raise InvalidArgument("global_batch", config.global_batch,
                                  f"must be a multiple of the number of ranks ({ctx.world_size})")
        dc = drafter.config
        cache.check_compatible(dc.target_layer_ids, dc.hidden_size, dc.vocab_size)
        if dc.draft_vocab_size and len(cache) and "target_lse" not in cache[0]:
            raise InvalidArgument("cache", str(getattr(cache, "path", "")), "holds no target log-partition, which a "
                                  "draft vocabulary needs: run cache.ensure_target_lse(the target's LM head) first")
        self.config, self.cache, self.ctx, self.progress = config, cache, ctx, progress
        self.data_info = data_info or {}
        self.out = Path(config.out_dir)
        self.gamma = dc.gamma
        self.step_module = TrainStep(set_trainable(drafter, config.trainable).to(ctx.device), config.loss_config())
        self.model, self.mode = wrap_model(self.step_module, ctx, fsdp=config.fsdp)
        # parameter objects after wrapping (FSDP swaps them for sharded DTensors)
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(self.params, lr=config.lr, weight_decay=config.weight_decay)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda s: lr_factor(s, config.steps, config.warmup_ratio))
        self.sampler = EpochSampler(len(cache), seed=config.seed)
        self.coef = {k: v.to(ctx.device) for k, v in self.step_module.coefficients().items()}
        self.step, self.position, self.tokens_done, self.elapsed = 0, 0, 0, 0.0
        self.last: dict[str, float] = {}
        if resume:
            self._resume()
        elif latest_checkpoint(self.out) is not None:
            raise InvalidArgument("out_dir", str(self.out), "already holds checkpoints of a run; resume it "
                                  "(--resume) or choose another output directory")
        elif ctx.is_main and (self.out / "metrics.jsonl").is_file():
            (self.out / "metrics.jsonl").unlink()  # a fresh run starts a fresh log

    # -- one optimizer step
    def _micro_batches(self) -> list[MicroBatch]:
        cfg, ctx = self.config, self.ctx
        entries = self.sampler.take(self.position, cfg.global_batch)
        mine = EpochSampler.shard(entries, ctx.rank, ctx.world_size)
        out = []
        for i in range(0, len(mine), cfg.micro_batch):
            keys = mine[i: i + cfg.micro_batch]
            out.append(collate([self.cache[sid] for _, sid in keys], keys, cfg, self.gamma))
        return out

    @staticmethod
    def _flat(d: dict[str, torch.Tensor], names) -> torch.Tensor:
        return torch.cat([d[k].detach().float().reshape(-1) for k in names])

    @staticmethod
    def _unflat(v: torch.Tensor, like: dict[str, torch.Tensor], names) -> dict[str, torch.Tensor]:
        out, i = {}, 0
        for k in names:
            n = like[k].numel()
            out[k] = v[i: i + n]
            i += n
        return out

    def train_step(self) -> dict[str, float]:
        cfg, ctx, dev = self.config, self.ctx, self.ctx.device
        names = self.step_module.term_names()
        batches = [mb.to(dev) for mb in self._micro_batches()]
        dens = [self.step_module.denominators(mb) for mb in batches]
        den_vec = torch.stack([self._flat(d, names) for d in dens]).sum(0)
        tokens = torch.tensor([float(sum(mb.num_tokens for mb in batches))], device=dev)
        packed = ctx.all_reduce_sum(torch.cat((den_vec, tokens)))
        den = self._unflat(packed[:-1], dens[0], names)
        num_sum = None
        autocast = torch.autocast(dev.type, dtype=torch.bfloat16, enabled=cfg.bf16)
        for i, mb in enumerate(batches):
            with grad_sync(self.model, self.mode, enabled=i == len(batches) - 1):
                with autocast:
                    num = self.model(mb)
                # DDP / FSDP average gradients over ranks: scale by W to get the global-batch sum
                loss = sum((self.coef[k] * num[k] / den[k].clamp_min(1e-6)).sum() for k in names) * ctx.world_size
                loss.backward()
            flat = self._flat(num, names)
            num_sum = flat if num_sum is None else num_sum + flat
        num_all = self._unflat(ctx.all_reduce_sum(num_sum), dens[0], names)
        grad_norm = clip_grad_norm(self.params, cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.optimizer.step()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1
        self.position += cfg.global_batch
        self.tokens_done += int(packed[-1])
        sums = L.LossSums(num=num_all, den=den, coef={k: self.coef[k] for k in names})
        metrics = {"step": self.step, "loss": float(sums.total())}
        metrics.update(sums.values())
        metrics.update(grad_norm=grad_norm, lr=lr, tokens=int(packed[-1]),
                       supervised=float(den[names[0]].sum()))
        return metrics

    # -- the loop
    def train(self) -> TrainResult:
        cfg, ctx = self.config, self.ctx
        if ctx.is_main:
            self.out.mkdir(parents=True, exist_ok=True)
        ctx.barrier()
        bar = tqdm(total=cfg.steps, initial=self.step, desc=f"train {cfg.kind}", unit="step",
                   disable=not (self.progress and ctx.is_main))
        ckpt = None
        while self.step < cfg.steps:
            t0 = time.perf_counter()
            m = self.train_step()
            self.elapsed += time.perf_counter() - t0
            m["elapsed_s"] = round(self.elapsed, 3)
            self.last = m
            if ctx.is_main:
                with (self.out / "metrics.jsonl").open("a") as fh:
                    fh.write(json.dumps(m) + "\n")
                bar.set_postfix({k: f"{m[k]:.3f}" for k in ("loss", "ce", "tv", "conf", "soft_ce", "accept") if k in m})
                bar.update(1)
            if self.step == cfg.steps or (cfg.checkpoint_every and self.step % cfg.checkpoint_every == 0):
                ckpt = self.save_checkpoint()
        bar.close()
        if ctx.is_main and ckpt is not None:
            final = self.out / "final"
            shutil.rmtree(final, ignore_errors=True)
            shutil.copytree(ckpt, final, ignore=shutil.ignore_patterns(STATE_FILE))
            self.write_card()
        ctx.barrier()
        losses = {k: v for k, v in self.last.items() if k in ("loss", *self.step_module.term_names())}
        return TrainResult(self.step, losses,
                           self.tokens_done, self.elapsed, self.out / "final" if ckpt else None)

    # -- checkpoints
    def save_checkpoint(self) -> Path | None:
        """Collective; rank 0 writes `checkpoints/step-NNNNNN/` atomically and keeps the newest few."""
        msd, osd = full_state(self.model, self.optimizer)
        path = self.out / "checkpoints" / f"step-{self.step:06d}"
        if self.ctx.is_main:
            drafter = self.step_module.drafter
            if self.mode == WRAP_FSDP:  # a plain copy holding the gathered weights
                drafter = build_drafter(drafter.config)
                drafter.load_state_dict({k.removeprefix("drafter."): v for k, v in msd.items()}, strict=True)
            tmp = path.with_name(path.name + ".tmp")
            shutil.rmtree(tmp, ignore_errors=True)
            save_drafter(drafter, tmp)
            torch.save({
                "step": self.step, "sampler_position": self.position, "tokens": self.tokens_done,
                "elapsed_s": self.elapsed, "optimizer": osd, "scheduler": self.scheduler.state_dict(),
                "rng": {"torch": torch.get_rng_state(), "python": random.getstate(),
                        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                "config": self.config.to_json(), "world_size": self.ctx.world_size,
            }, tmp / STATE_FILE)
            shutil.rmtree(path, ignore_errors=True)
            tmp.rename(path)
            kept = sorted(p for p in path.parent.glob("step-*") if not p.name.endswith(".tmp"))
            for old in kept[: -self.config.keep_checkpoints]:
                shutil.rmtree(old, ignore_errors=True)
        self.ctx.barrier()
        return path

    def _resume(self) -> None:
        path = latest_checkpoint(self.out)
        if path is None:
            return  # nothing to resume: a fresh run
        state = torch.load(path / STATE_FILE, map_location="cpu", weights_only=False)
        saved = state["config"]
        for key in ("kind", "global_batch", "block_size", "seed", "num_anchors"):
            ours = self.config.to_json()[key]
            if saved.get(key) != ours:
                raise InvalidArgument(key, ours, f"must equal the resumed run's {saved.get(key)!r} ({path})")
        if load_config(path) != self.step_module.drafter.config:
            raise InvalidArgument("checkpoint", str(path), "holds a drafter of another shape than this run's")
        weights = {f"drafter.{k}": v for k, v in load_file(str(path / WEIGHTS_FILE)).items()}
        load_full_state(self.model, weights, self.optimizer, state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.step, self.position = int(state["step"]), int(state["sampler_position"])
        self.tokens_done, self.elapsed = int(state.get("tokens", 0)), float(state.get("elapsed_s", 0.0))
        torch.set_rng_state(state["rng"]["torch"])
        random.setstate(state["rng"]["python"])
        if state["rng"].get("cuda") is not None and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["rng"]["cuda"])
        if self.ctx.is_main:  # the log continues where the checkpoint was taken
            log = self.out / "metrics.jsonl"
            if log.is_file():
                keep = [ln for ln in log.read_text().splitlines() if ln and json.loads(ln)["step"] <= self.step]
                log.write_text("".join(ln + "\n" for ln in keep))
        self.ctx.barrier()

    # -- the training card
    def write_card(self) -> None:
        cfg, dc = self.config, self.step_module.drafter.config
        m = self.cache.manifest
        card = {
            "kind": cfg.kind, "steps": self.step, "global_batch": cfg.global_batch, "world_size": self.ctx.world_size,
            "wrap": self.mode, "device": str(self.ctx.device),
            "tokens_processed": self.tokens_done, "train_seconds": round(self.elapsed, 2),
            "tokens_per_second": round(self.tokens_done / self.elapsed, 1) if self.elapsed else None,
            "final_losses": {k: v for k, v in self.last.items() if k not in ("step", "tokens", "elapsed_s")},
            "data": {"cache": str(self.cache.path), "target": m.target, "num_samples": m.num_samples,
                     "num_tokens": m.num_tokens, **self.data_info},
            "drafter": {"architecture": dc.architecture, "kind": dc.kind, "gamma": dc.gamma,
                        "draft_layers": dc.num_hidden_layers, "target_layer_ids": list(dc.target_layer_ids),
                        "markov_rank": dc.markov_rank, "mask_token_id": dc.mask_token_id},
            "config": cfg.to_json(),
        }
        (self.out / "training_card.json").write_text(json.dumps(card, indent=2) + "\n")
        losses = ", ".join(f"{k} {v:.4f}" for k, v in card["final_losses"].items() if isinstance(v, float))
        readme = f"""# {cfg.kind} drafter for `{m.target}`

Trained with `dspark train` ({self.ctx.world_size} rank(s), {self.mode}, {self.ctx.device}).

| | |
|---|---|
| data | {m.num_samples} sequences, {m.num_tokens} tokens (cache `{self.cache.path}`) |
| steps | {self.step} x {cfg.global_batch} sequences |
| tokens processed | {self.tokens_done} |
| time | {self.elapsed:.1f} s ({card['tokens_per_second']} tokens/s) |
| drafter | {dc.architecture}, gamma {dc.gamma}, {dc.num_hidden_layers} layer(s), taps {list(dc.target_layer_ids)} |
| final losses | {losses} |

`final/` is a DeepSpec-format checkpoint (`config.json` + `model.safetensors`): pass it to
`dspark generate --drafter-path`, `dspark calibrate`, `dspark eval`, or the serving chart's `models.drafter`.
Full details: `training_card.json`; per-step metrics: `metrics.jsonl`.
"""
        (self.out / "README.md").write_text(readme)
