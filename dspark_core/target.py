"""Target runtime: any Hugging Face causal LM behind a small API for speculative decoding.

It offers what the engine needs from the target and nothing more:
- `new_sequence()` / `release()`: a per-request KV cache (a *slot* in a shared store),
- `forward()`: one forward pass over a *ragged* batch — each sequence appends its own number of tokens
  (a whole prompt for prefill, `[anchor, d_1..d_n]` for verification) — returning logits and the taps
  of the configured layers for every appended position,
- `truncate()`: roll a sequence's KV cache back to its accepted prefix (O(1): only its length moves).

How the ragged batch runs in one pass: every layer's K/V live in one tensor
`[slots, kv_heads, capacity, head_dim]`; a sequence owns one slot and positions `[0, length)` in it.
A step writes each sequence's new K/V at its own offset and hands the model a view of the active slots,
with a 4-D additive mask that lets query `i` of sequence `r` see keys `[0, length_r + i]`. Stale entries
past a sequence's length (rolled-back drafts) are masked, never copied. The model is the stock HF module:
this file plugs into its `Cache` interface, so any architecture whose attention calls `cache.update()`
works (Qwen3, Qwen2, Llama, Mistral...).

Knows nothing about drafters, sampling or tokenization beyond loading the tokenizer that ships with the
model. Taps follow algorithms.md section 1: layer id `l` is HF `hidden_states[l + 1]`, `-1` is the
embedding output, and the last layer is refused (HF returns it after the final norm).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
from transformers.cache_utils import Cache

from .errors import InvalidArgument, KVCacheFull, ModelLoadError, ResourceExhausted
from .fast_decoder import LeanDecoder
from .packed_weights import WEIGHT_FORMATS, DenseLinear, PackedLinear, row_invariant

_log = logging.getLogger(__name__)
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(device: str) -> torch.device:
    """`auto` picks CUDA when present, else CPU."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        dev = torch.device(device)
    except RuntimeError as exc:
        raise InvalidArgument("device", device, "must be auto, cpu, cuda or cuda:N") from exc
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidArgument("device", device, "needs a CUDA GPU, and none is available")
    return dev


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    """`auto` is bf16 on CUDA, fp32 elsewhere (CPU bf16 matmuls are slow and lossy)."""
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise InvalidArgument("dtype", dtype, f"must be one of auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


@dataclass(frozen=True)
class TargetConfig:
    model_dir: str
    device: str = "auto"
    dtype: str = "auto"
    # Decoder layers whose outputs are tapped for drafters, strictly increasing; -1 = embeddings.
    tap_layer_ids: tuple[int, ...] = ()
    # run supported architectures (Llama, Mistral, Qwen2, Qwen3) through dspark_core.fast_decoder, the same
    # computation without the stock module's per-call overhead; False = always the stock HF module
    lean: bool = True
    # the matmul weights served (dspark_core.packed_weights): auto = the GGUF file's own blocks when the directory
    # was imported from one (gguf_source.json), else the loaded weights; float32 = the loaded (for an imported
    # GGUF: dequantized) weights; bfloat16 / int8 / int4 = packed copies of them; gguf = the GGUF's blocks
    weights: str = "auto"
    # bytes the KV store of all sequences may take; None = auto (DSPARK_KV_CACHE_GB, else half the memory
    # available when the target loads: host memory on a CPU, free device memory on CUDA). Admission refuses a
    # request whose whole context (prompt + max_new_tokens) would take the store past it (KVCacheFull)
    kv_cache_bytes: int | None = None

    def __post_init__(self):
        if self.kv_cache_bytes is not None and (isinstance(self.kv_cache_bytes, bool)
                                                or not isinstance(self.kv_cache_bytes, int) or self.kv_cache_bytes < 1):
            raise InvalidArgument("kv_cache_bytes", self.kv_cache_bytes, "must be a positive integer (bytes) or None (auto)")
        if self.weights not in WEIGHT_FORMATS:
            raise InvalidArgument("weights", self.weights, f"must be one of {', '.join(WEIGHT_FORMATS)}")
        ids = tuple(self.tap_layer_ids)
        if any(not isinstance(i, int) for i in ids) or any(b <= a for a, b in zip(ids, ids[1:])):
            raise InvalidArgument("tap_layer_ids", self.tap_layer_ids, "must be strictly increasing integers")
        if ids and ids[0] < -1:
            raise InvalidArgument("tap_layer_ids", self.tap_layer_ids, "must be >= -1 (-1 = embedding output)")
        object.__setattr__(self, "tap_layer_ids", ids)


@dataclass(eq=False)
class Sequence:
    """One request's KV cache: `length` positions of it are valid, held in slot `slot` of the store."""

    slot: int
    length: int = 0
    released: bool = False
    # positions its KV cache may reach (prompt + max_new_tokens + a verify block), what admission counted
    reserved: int = 0


@dataclass
class RaggedOutput:
    """Outputs of one ragged forward, flattened over sequences in the order they were given."""

    # [num_tokens, vocab] float32, rows of sequence r are cu_seqlens[r]:cu_seqlens[r+1]
    logits: torch.Tensor
    # [num_tokens, num_taps * hidden] in the model dtype ([num_tokens, 0] when no layers are tapped)
    taps: torch.Tensor
    # [num_seqs + 1] long, cumulative token offsets
    cu_seqlens: torch.Tensor
    # which rows carry logits: all appended positions, or only each sequence's last one
    last_only: bool = False
    # [num_tokens, hidden] final (post-norm) hidden states, when asked for (training caches)
    final_hidden: torch.Tensor | None = None

    def logits_of(self, r: int) -> torch.Tensor:
        if self.last_only:
            return self.logits[r : r + 1]
        return self.logits[self.cu_seqlens[r] : self.cu_seqlens[r + 1]]

    def taps_of(self, r: int) -> torch.Tensor:
        return self.taps[self.cu_seqlens[r] : self.cu_seqlens[r + 1]]


class SlotKVCache(Cache):
    """Per-sequence KV caches in one preallocated store per layer, exposed to HF as a `Cache`.

    Before each forward, `plan()` fixes which slots take part, where each one's new tokens go, and the
    view length. `update()` (called by every attention layer) scatters the new K/V into place and
    returns the view of the participating slots.
    """

    def __init__(self, num_layers: int, device: torch.device, dtype: torch.dtype, max_length: int):
        super().__init__(layers=[])
        self.num_layers, self.device, self.dtype, self.max_length = num_layers, device, dtype, max_length
        # per layer: [slot_capacity, kv_heads, length_capacity, head_dim], allocated on first use
        self.keys: list[torch.Tensor | None] = [None] * num_layers
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.slot_capacity, self.length_capacity = 0, 0
        self._plan: dict | None = None
        # the store's budget (TargetRuntime sets both): growth doubles while it stays within it, else grows exactly
        self.budget_bytes: int | None = None
        self.bytes_per_token = 0

    def nbytes(self, slots: int | None = None, length: int | None = None) -> int:
        """Bytes of a store of `slots` x `length` positions (default: the current capacity)."""
        slots = self.slot_capacity if slots is None else slots
        length = self.length_capacity if length is None else length
        return slots * length * self.bytes_per_token

    def clear(self) -> None:
        """Free the store (no sequence holds anything in it)."""
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.slot_capacity, self.length_capacity = 0, 0

    # -- capacity
    @torch.no_grad()
    def reserve(self, slots: int, length: int) -> None:
        new_slots = max(self.slot_capacity, 1)
        while new_slots < slots:
            new_slots *= 2
        new_len = max(self.length_capacity, 64)
        while new_len < length:
            new_len *= 2
        new_len = min(new_len, max(self.max_length, length))
        if self.budget_bytes is not None and self.nbytes(new_slots, new_len) > self.budget_bytes:
            # no headroom for doubling: what is needed, exactly (admission keeps that within the budget)
            new_slots, new_len = max(self.slot_capacity, slots), max(self.length_capacity, length)
        if new_slots == self.slot_capacity and new_len == self.length_capacity:
            return
        for i in range(self.num_layers):
            for store in (self.keys, self.values):
                old = store[i]
                if old is None:
                    continue
                grown = old.new_zeros((new_slots, old.shape[1], new_len, old.shape[3]))
                grown[: old.shape[0], :, : old.shape[2]] = old
                store[i] = grown
        self.slot_capacity, self.length_capacity = new_slots, new_len

    @torch.no_grad()
    def move_slot(self, src: int, dst: int, length: int) -> None:
        for store in (self.keys, self.values):
            for t in store:
                if t is not None:
                    t[dst, :, :length] = t[src, :, :length]

    # -- one forward
    def plan(self, slots: list[int], offsets: list[int], counts: list[int]) -> None:
        kv_len = max(o + c for o, c in zip(offsets, counts))
        if len(slots) == 1:
            # one sequence (batch-1 decoding): its new K/V are one slice, written without index tensors
            from . import kernels

            # our kernels' kv_append, where they are loaded: the write and both views in one call (~60 us of
            # PyTorch indexing a layer otherwise, a tenth of a SmolLM2 step)
            append = torch.ops.dspark_cpu.kv_append.default if kernels.loaded() else None
            self._plan = {"single": (slots[0], offsets[0], counts[0]), "view": slice(slots[0], slots[0] + 1),
                          "kv_len": kv_len, "append": append}
            return
        dev = self.device
        r_idx = torch.repeat_interleave(torch.arange(len(slots)), torch.tensor(counts))
        q_idx = torch.cat([torch.arange(c) for c in counts])
        slot_t = torch.tensor(slots)
        pos_idx = torch.tensor(offsets)[r_idx] + q_idx
        lo, hi = min(slots), max(slots)
        contiguous = hi - lo + 1 == len(slots) and slots == list(range(lo, hi + 1))
        self._plan = {
            "r": r_idx.to(dev), "q": q_idx.to(dev), "slot": slot_t[r_idx].to(dev), "pos": pos_idx.to(dev),
            "view": slice(lo, hi + 1) if contiguous else slot_t.to(dev),
            "kv_len": kv_len, "single": None,
        }

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        # key_states: [num_seqs, kv_heads, max_new, head_dim]
        p = self._plan
        assert p is not None, "plan() must run before the forward pass"
        if self.keys[layer_idx] is None:
            shape = (self.slot_capacity, key_states.shape[1], self.length_capacity, key_states.shape[3])
            self.keys[layer_idx] = key_states.new_zeros(shape)
            self.values[layer_idx] = value_states.new_zeros(shape)
        k_store, v_store = self.keys[layer_idx], self.values[layer_idx]
        if p["single"] is not None:
            slot, off, count = p["single"]
            if p["append"] is not None and k_store.dtype == key_states.dtype == value_states.dtype == torch.float32 \
                    and k_store.device.type == "cpu" and key_states.shape[2] == count == value_states.shape[2] \
                    and key_states.stride(3) == 1 and value_states.stride(3) == 1:
                return p["append"](k_store, v_store, key_states, value_states, slot, off, p["kv_len"])
            k_store[slot, :, off : off + count] = key_states[0, :, :count]
            v_store[slot, :, off : off + count] = value_states[0, :, :count]
        else:
            k_store[p["slot"], :, p["pos"]] = key_states[p["r"], :, p["q"]]
            v_store[p["slot"], :, p["pos"]] = value_states[p["r"], :, p["q"]]
        # [num_seqs, kv_heads, kv_len, head_dim]: a view when the slots are contiguous
        return k_store[p["view"], :, : p["kv_len"]], v_store[p["view"], :, : p["kv_len"]]

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0 if self._plan is None else self._plan["kv_len"]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return self.get_seq_length(), 0

    @property
    def is_compileable(self) -> bool:
        return False


# positions past a request's last token that a verify pass may write (the anchor and up to 32 drafts)
VERIFY_BLOCK_MARGIN = 33


def gib_to_bytes(value, field: str) -> int:
    """A positive number of GiB (a flag's or an environment variable's text too) in bytes, checked."""
    try:
        gb = float(value)
    except (TypeError, ValueError):
        gb = math.nan
    if not (math.isfinite(gb) and 0 < gb < 2**30):
        raise InvalidArgument(field, value, "must be a positive number of GiB")
    return max(1, int(gb * 2**30))


def _kv_budget(configured: int | None, device: torch.device) -> int:
    """The KV store's budget in bytes: as configured, else DSPARK_KV_CACHE_GB, else half the memory available
    now (host memory; free device memory on CUDA)."""
    import os

    if configured is not None:
        return int(configured)
    env = os.environ.get("DSPARK_KV_CACHE_GB")
    if env:
        return gib_to_bytes(env, "DSPARK_KV_CACHE_GB")
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free // 2)
    try:
        import psutil

        available = psutil.virtual_memory().available
    except Exception:  # noqa: BLE001 - no way to read it: a bound that does not bind
        return 2**62
    room = _cgroup_room()  # in a container the host's free memory is not the pod's
    return int(min(available, room if room is not None else available) // 2)


def _cgroup_room() -> int | None:
    """Memory this process's cgroup may still take (its limit less its usage), None without a limit."""
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        try:
            raw = Path(limit_file).read_text().strip()
            if raw == "max":
                return None
            limit, usage = int(raw), int(Path(usage_file).read_text().strip())
        except (OSError, ValueError):
            continue
        if limit >= 2**60:  # cgroup v1's "no limit"
            return None
        return max(limit - usage, 0)
    return None


def _check_model_dir(path: str) -> Path:
    p = Path(path)
    if not p.exists():
        raise ModelLoadError(f"model directory not found: {path}")
    if not p.is_dir():
        raise ModelLoadError(f"model path is not a directory: {path}")
    if not (p / "config.json").is_file():
        raise ModelLoadError(f"not a Hugging Face model directory (no config.json): {path}")
    return p


def load_tokenizer(path: str | Path):
    """The tokenizer shipped in a model directory, or None when it has none (token ids only)."""
    p = Path(path)
    if not any((p / f).exists() for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")):
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(p), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - any tokenizer failure is a load failure of this directory
        raise ModelLoadError(f"cannot load the tokenizer in {path}: {exc}") from exc


class TargetRuntime:
    """A loaded target model plus the slot store of its sequences' KV caches."""

    def __init__(self, config: TargetConfig):
        from transformers import AutoConfig, AutoModelForCausalLM

        self.config = config
        path = _check_model_dir(config.model_dir)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device)
        try:
            hf_config = AutoConfig.from_pretrained(str(path), local_files_only=True)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"invalid config.json in {path}: {exc}") from exc
        try:
            model = AutoModelForCausalLM.from_pretrained(
                str(path), dtype=self.dtype, attn_implementation="sdpa", local_files_only=True)
        except Exception as exc:  # noqa: BLE001
            raise ModelLoadError(f"cannot load a causal LM from {path}: {exc}") from exc
        self.model = model.to(self.device).eval()
        self.hf_config = hf_config
        text_config = hf_config.get_text_config() if hasattr(hf_config, "get_text_config") else hf_config
        self.num_layers: int = text_config.num_hidden_layers
        self.hidden_size: int = text_config.hidden_size
        self.vocab_size: int = self.model.get_output_embeddings().weight.shape[0]
        self.max_context: int = int(getattr(text_config, "max_position_embeddings", 2048) or 2048)
        for l in config.tap_layer_ids:
            if l > self.num_layers - 2:
                raise InvalidArgument(
                    "tap_layer_ids", config.tap_layer_ids,
                    f"must be <= {self.num_layers - 2} for a {self.num_layers}-layer target "
                    "(the last layer's HF output is after the final norm)")
        self.tokenizer = load_tokenizer(path)
        self.eos_token_ids: tuple[int, ...] = self._eos_ids()
        self.name = path.name
        self._decoder = self.model.get_decoder() if hasattr(self.model, "get_decoder") else self.model.model
        self._lm_head = self.model.get_output_embeddings()
        self.cache = SlotKVCache(self.num_layers, self.device, self.dtype, self.max_context)
        heads = int(getattr(text_config, "num_attention_heads", 1) or 1)
        kv_heads = int(getattr(text_config, "num_key_value_heads", None) or heads)
        head_dim = int(getattr(text_config, "head_dim", None) or self.hidden_size // heads)
        self.kv_bytes_per_token = self.num_layers * 2 * kv_heads * head_dim * torch.finfo(self.dtype).bits // 8
        self.cache.bytes_per_token = self.kv_bytes_per_token
        self.cache.budget_bytes = self.kv_budget_bytes = _kv_budget(config.kv_cache_bytes, self.device)
        self._lean = None
        self.weights = self._resolve_weights(config, text_config, path)
        self._lm_mm: PackedLinear = DenseLinear(self._lm_head.weight.detach(), self._lm_head.bias)
        if self.weights != "float32":
            try:
                self._lean, self._lm_mm = _packed_decoder(self.weights, self._decoder, text_config, self._lm_head,
                                                          path)
            except ModelLoadError as exc:
                if config.weights != "auto":
                    raise
                _log.warning("serving the dequantized float32 weights: %s", exc)
                self.weights = "float32"
        if self._lean is None and config.lean and LeanDecoder.supports(text_config) is None:
            self._lean = LeanDecoder(self._decoder, text_config)
        # bytes of matmul weights one decode step reads (embedding rows and norms are noise beside them)
        if self._lean is not None:
            self.weight_bytes: int = sum(m.nbytes for m in self._lean.linears()) + self._lm_mm.nbytes
        else:
            self.weight_bytes = sum(m.weight.numel() * m.weight.element_size() for m in self._decoder.modules()
                                    if isinstance(m, torch.nn.Linear)) + self._lm_mm.nbytes
        self._sequences: list[Sequence] = []  # index == slot

    def _resolve_weights(self, config: TargetConfig, text_config, path: Path) -> str:
        """The weight format to serve: `auto` is `gguf` for a directory imported from a GGUF file when the packed
        kernels can run it (CPU, float32, Llama/Qwen family), else `float32`. Explicit formats that cannot run
        are refused with the reason."""
        from .gguf_import import GGUF_SOURCE, gguf_source
        from .packed_weights import packed_kernels_available

        fmt = config.weights
        imported = (path / GGUF_SOURCE).is_file()
        if fmt == "auto":
            packable = (self.device.type == "cpu" and self.dtype == torch.float32 and config.lean
                        and LeanDecoder.supports(text_config) is None and packed_kernels_available())
            return "gguf" if imported and packable else "float32"
        if fmt == "float32":
            return fmt
        if fmt == "gguf":
            if not imported:
                raise InvalidArgument("weights", fmt, f"needs a target imported from a GGUF file ({path} has no "
                                      f"{GGUF_SOURCE}; see `dspark models import-gguf`)")
            gguf_source(path)  # raises when the recorded file is gone or changed
        if self.device.type != "cpu":
            raise InvalidArgument("weights", fmt, "packed weights run on the CPU only (use --weights float32)")
        if self.dtype != torch.float32:
            raise InvalidArgument("weights", fmt, "packed weights take float32 activations (use --dtype float32)")
        if not config.lean:
            raise InvalidArgument("weights", fmt, "packed weights run in the lean decoder (lean=True)")
        reason = LeanDecoder.supports(text_config)
        if reason is not None:
            raise InvalidArgument("weights", fmt, f"packed weights need a Llama/Qwen-family target ({reason})")
        if not packed_kernels_available():
            raise InvalidArgument("weights", fmt, "this PyTorch build lacks the int8/int4 CPU weight kernels")
        return fmt

    def _eos_ids(self) -> tuple[int, ...]:
        ids: list[int] = []
        gen = getattr(self.model, "generation_config", None)
        for src in (getattr(gen, "eos_token_id", None), getattr(self.hf_config, "eos_token_id", None)):
            if src is None:
                continue
            for i in src if isinstance(src, (list, tuple)) else [src]:
                if i not in ids:
                    ids.append(int(i))
        return tuple(ids)

    @property
    def input_embeddings(self) -> torch.nn.Module:
        return self._decoder.embed_tokens

    @property
    def output_embeddings(self) -> torch.nn.Module:
        return self._lm_head

    @property
    def tap_layer_ids(self) -> tuple[int, ...]:
        """The layers whose outputs the forward pass taps for the drafter (what the engine checks)."""
        return tuple(self.config.tap_layer_ids)

    @property
    def tap_width(self) -> int:
        return len(self.config.tap_layer_ids) * self.hidden_size

    @property
    def num_active(self) -> int:
        return len(self._sequences)

    def batch_invariant(self, q: int) -> bool:
        """Whether a pass of up to `q` new tokens a sequence computes every sequence's logits and taps bitwise as a
        pass of that sequence alone, whatever else shares it: packed (row-invariant) matmuls, the LM head's too,
        and attention row by row over each row's own keys, on the CPU."""
        return (self._lean is not None and self._lean.attends_by_row(q) and row_invariant(self._lm_mm)
                and self.device.type == "cpu")

    @property
    def prefills_alone(self) -> bool:
        """Whether prompts prefill faster one per pass than batched, with the same result either way: on the CPU
        with batch-invariant weights every position is computed as alone whatever shares the pass, and a batch
        of prompts only adds padding to the longest (SmolLM2, 32 held-out prompts of 42-1,264 tokens, one
        thread: 1,586 tokens/s one per pass, 1,365 four, 930 sixteen, 737 all 32)."""
        return self._lean is not None and self._lean.row_invariant and self.device.type == "cpu"

    # -- KV budget
    def kv_reservation(self, prompt_tokens: int, max_new_tokens: int) -> int:
        """Positions a request's KV cache may reach: its prompt, every token it may generate and one verify
        block past them, at most the context window."""
        return min(self.max_context, int(prompt_tokens) + max(int(max_new_tokens), 0) + VERIFY_BLOCK_MARGIN)

    def _kv_store_after(self, new_sequences: int, lengths) -> tuple[int, int]:
        """(slots, positions) of the store once `new_sequences` more sequences hold it and some reach `lengths`:
        one rectangle, every sequence x the longest reservation, never smaller than its current shape."""
        slots = max(self.cache.slot_capacity, len(self._sequences) + new_sequences)
        return slots, max([self.cache.length_capacity, *lengths, *(s.reserved for s in self._sequences)])

    def _check_kv_budget(self, new_sequences: int, lengths, what: str, fits_alone: bool) -> None:
        slots, length = self._kv_store_after(new_sequences, lengths)
        need = self.cache.nbytes(slots, length)
        if need > self.kv_budget_bytes:
            raise KVCacheFull(f"KV cache budget exceeded: {what} needs {slots} sequences x {length} positions x "
                              f"{self.kv_bytes_per_token} bytes = {need / 2**30:.2f} GiB > "
                              f"{self.kv_budget_bytes / 2**30:.2f} GiB (kv_cache_bytes / --kv-cache-gb)",
                              fits_alone=fits_alone)

    def check_kv_room(self, reservations: list[int]) -> None:
        """Raise KVCacheFull unless new sequences reserving `reservations` positions fit beside the active ones."""
        if not reservations:
            return
        if not self._sequences and self.cache.nbytes(*self._kv_store_after(len(reservations), reservations)) \
                > self.kv_budget_bytes:
            self.cache.clear()  # an idle store's past shape does not count
        self._check_kv_budget(len(reservations), reservations,
                              f"{len(reservations)} new beside {len(self._sequences)} active sequences",
                              fits_alone=max(reservations) * self.kv_bytes_per_token <= self.kv_budget_bytes)

    def extend_reservation(self, seq: Sequence, length: int) -> None:
        """Let `seq` reach `length` positions: KVCacheFull when that takes the store past the budget."""
        if length <= seq.reserved:
            return
        self._check_kv_budget(0, [length], f"a sequence reserved {seq.reserved} positions reaching {length}",
                              fits_alone=False)
        seq.reserved = length

    # -- sequence lifecycle
    def new_sequence(self) -> Sequence:
        seq = Sequence(slot=len(self._sequences))
        self._sequences.append(seq)
        return seq

    def release(self, seq: Sequence) -> None:
        """Free a sequence's slot; the last slot moves into the hole so active slots stay contiguous."""
        if seq.released:
            return
        last = self._sequences.pop()
        if last is not seq:
            self.cache.move_slot(last.slot, seq.slot, last.length)
            last.slot = seq.slot
            self._sequences[seq.slot] = last
        seq.released = True

    def fork(self, seq: Sequence) -> Sequence:
        """A new sequence whose KV cache is a copy of `seq`'s: requests with the same prompt (the n
        choices of one request) run the prompt through the model once."""
        if seq.released:
            raise InvalidArgument("seq", seq.slot, "must not be released")
        new = self.new_sequence()
        self.cache.reserve(len(self._sequences), seq.length)
        self.cache.move_slot(seq.slot, new.slot, seq.length)
        new.length, new.reserved = seq.length, seq.reserved
        return new

    def truncate(self, seq: Sequence, length: int) -> None:
        """Roll back to the first `length` positions (e.g. anchor + accepted drafts)."""
        if not 0 <= length <= seq.length:
            raise InvalidArgument("length", length, f"must be in [0, {seq.length}]")
        seq.length = length

    # -- the forward pass
    @torch.no_grad()
    def forward(self, batch: list[tuple[Sequence, list[int]]], last_logits_only: bool = False,
                return_final_hidden: bool = False, with_logits: bool = True) -> RaggedOutput:
        """Append each sequence's tokens in one batched pass. Returns logits and taps per new position.

        With `last_logits_only` (prefill), logits are computed only at each sequence's last position.
        With `return_final_hidden`, also the post-norm hidden state of every new position. Without
        `with_logits` (building a training cache: taps and final hidden only) the LM head is skipped and
        `logits` is an empty [0, vocab] tensor.
        """
        if not batch:
            raise InvalidArgument("batch", batch, "must hold at least one sequence")
        counts = [len(toks) for _, toks in batch]
        if min(counts) < 1:
            raise InvalidArgument("tokens", counts, "every sequence must append at least one token")
        for seq, toks in batch:
            if seq.released:
                raise InvalidArgument("sequence", seq.slot, "was released")
            if seq.length + len(toks) > self.max_context:
                raise ResourceExhausted(
                    f"context window exceeded: {seq.length} + {len(toks)} tokens > max_context {self.max_context}")
            bad = [t for t in toks if not 0 <= t < self.vocab_size]
            if bad:
                raise InvalidArgument("token_ids", bad[:5], f"must be in [0, {self.vocab_size})")
        if len({id(seq) for seq, _ in batch}) != len(batch):
            raise InvalidArgument("batch", "duplicate sequence", "must name each sequence once")
        # Run in slot order so the participating slots form a view whenever possible.
        order = sorted(range(len(batch)), key=lambda i: batch[i][0].slot)
        seqs = [batch[i][0] for i in order]
        toks = [batch[i][1] for i in order]
        n, q = len(seqs), max(counts)
        offsets = [s.length for s in seqs]
        self.cache.reserve(len(self._sequences), max(o + len(t) for o, t in zip(offsets, toks)))
        sorted_counts = [len(t) for t in toks]
        self.cache.plan([s.slot for s in seqs], offsets, sorted_counts)

        ids = torch.zeros((n, q), dtype=torch.long)
        for r, t in enumerate(toks):
            ids[r, : len(t)] = torch.tensor(t)
        off = torch.tensor(offsets)
        # [n, q] absolute positions of the new tokens
        pos = off[:, None] + torch.arange(q)[None, :]
        kv_len = self.cache.get_seq_length()
        if q == 1 and min(offsets) + 1 == kv_len or self._lean is not None and self._lean.attends_by_row(q):
            mask = None  # one new token per sequence, all at the same length (every key is visible), or row by row
        else:
            # [n, 1, q, kv_len] additive mask: query i of row r sees keys [0, offset_r + i]
            allowed = torch.arange(kv_len)[None, None, :] <= pos[:, :, None]
            mask = torch.zeros(allowed.shape, dtype=self.dtype).masked_fill_(~allowed, torch.finfo(self.dtype).min)
            mask = mask[:, None].to(self.device)
        taps_wanted = self.config.tap_layer_ids
        # real tokens' indices among the n * q padded positions, row-major (None: nothing is padded)
        rows = None
        if min(sorted_counts) < q:
            valid = torch.arange(q)[None, :] < torch.tensor(sorted_counts)[:, None]  # [n, q]
            rows = valid.reshape(-1).nonzero().squeeze(1).to(self.device)
        if self._lean is not None:
            # [num_tokens, hidden] each, real tokens only
            flat_hidden, kept = self._lean(ids.to(self.device), pos.to(self.device), mask, self.cache, taps_wanted,
                                           rows=rows)
            flat_taps = [kept[l] for l in taps_wanted]
        else:
            if mask is None:
                mask = torch.zeros((n, 1, 1, kv_len), dtype=self.dtype, device=self.device)
            out = self._decoder(
                input_ids=ids.to(self.device), position_ids=pos.to(self.device),
                attention_mask=mask, cache=self.cache, use_cache=True,
                output_hidden_states=bool(taps_wanted))

            def flat(t: torch.Tensor) -> torch.Tensor:
                t = t.reshape(n * q, *t.shape[2:])
                return t if rows is None else t.index_select(0, rows)

            flat_hidden = flat(out.last_hidden_state)
            flat_taps = [flat(out.hidden_states[l + 1]) for l in taps_wanted]
        self.cache._plan = None
        if last_logits_only:
            last = torch.tensor(sorted_counts).cumsum(0) - 1  # each sequence's last real token
            h = flat_hidden.index_select(0, last.to(self.device))  # [n, hidden]
        else:
            h = flat_hidden  # [num_tokens, hidden]
        logits = self._lm_mm(h).float() if with_logits else h.new_zeros((0, self.vocab_size), dtype=torch.float32)
        final_hidden = flat_hidden if return_final_hidden else None
        taps = h.new_zeros((sum(counts), 0))
        if flat_taps:
            taps = torch.cat(flat_taps, dim=-1)  # [num_tokens, num_taps * hidden]
        for s, t in zip(seqs, toks):
            s.length += len(t)
        # Back to the caller's order.
        cu_sorted = [0]
        for c in sorted_counts:
            cu_sorted.append(cu_sorted[-1] + c)
        inverse = [0] * n
        for k, i in enumerate(order):
            inverse[i] = k
        if order != list(range(n)):
            # flat rows of each sequence, in the caller's order
            caller_rows = torch.cat([torch.arange(cu_sorted[inverse[i]], cu_sorted[inverse[i] + 1])
                                     for i in range(n)]).to(self.device)
            if with_logits:
                logits = logits[torch.tensor(inverse, device=self.device) if last_logits_only else caller_rows]
            taps = taps[caller_rows]
            if final_hidden is not None:
                final_hidden = final_hidden[caller_rows]
        cu = torch.zeros(n + 1, dtype=torch.long)
        cu[1:] = torch.cumsum(torch.tensor(counts), 0)
        return RaggedOutput(logits=logits, taps=taps, cu_seqlens=cu, last_only=last_logits_only,
                            final_hidden=final_hidden)


def _packed_decoder(fmt: str, decoder, text_config, lm_head, path: Path) -> tuple[LeanDecoder, PackedLinear]:
    """The lean decoder and LM head with their matmuls in `fmt` (bfloat16, int8, int4 or gguf)."""
    from .packed_weights import gguf_linear, make_linear

    if fmt != "gguf":
        def linear(parts):
            weight = torch.cat([l.weight for _, l in parts]).detach()
            biases = [l.bias for _, l in parts]
            return make_linear(weight, torch.cat(biases).detach() if all(b is not None for b in biases) else None,
                               fmt)

        return LeanDecoder(decoder, text_config, linear), make_linear(lm_head.weight, lm_head.bias, fmt)

    from .gguf_import import gguf_raw_tensors, gguf_source
    from .packed_weights import ConcatLinear, gguf_dequantize

    src = gguf_source(path)
    raw = gguf_raw_tensors(src, text_config)
    params = dict(decoder.named_modules())

    def blocks(name: str, module_weight: torch.Tensor):
        if name not in raw:
            raise ModelLoadError(f"{src.name} has no tensor for {name}")
        r, qtype, shape = raw[name]
        if r is None:
            raise ModelLoadError(f"{src.name}: {name} is of GGUF {qtype}, not served packed (Q4_0, Q4_1, Q8_0, "
                                 "F32, F16, BF16 are; use --weights float32 for the dequantized model)")
        if tuple(shape) != tuple(module_weight.shape):
            raise ModelLoadError(f"{src.name}: {name} is {shape}, the model's is {tuple(module_weight.shape)}")
        # the directory's float32 weights are this file's values (dspark models import-gguf): check it, so
        # `--weights gguf` and `--weights float32` serve the same model
        if not torch.equal(gguf_dequantize(r, qtype, shape), module_weight.detach().float()):
            raise ModelLoadError(f"{src.name}: tensor {name} does not match the weights in {path} "
                                 "(re-run `dspark models import-gguf`)")
        return r, qtype, shape

    def linear(parts):
        got = [(blocks(n, l.weight), l) for n, l in parts]
        biases = [l.bias for _, l in parts]
        bias = torch.cat(biases).detach() if all(b is not None for b in biases) else None
        types = {g[0][1] for g in got}
        if len(types) == 1:  # one kernel over the row-concatenated blocks
            (r0, qtype, (_, k)) = got[0][0]
            cat = torch.cat([g[0][0] for g in got])
            try:
                out = gguf_linear(cat, qtype, (cat.shape[0], k))
            except ValueError as exc:
                raise ModelLoadError(f"{src.name}: {exc}") from exc
            out.bias = bias
            return out
        out = ConcatLinear([gguf_linear(*g[0]) for g in got], bias)
        return out

    lean = LeanDecoder(decoder, text_config, linear)
    head_name = "lm_head" if "lm_head" in raw else "embed_tokens"
    r, qtype, shape = blocks(head_name, lm_head.weight)
    if head_name != "embed_tokens":
        blocks("embed_tokens", params["embed_tokens"].weight)  # the lookup uses the (equal) float32 table
    head = gguf_linear(r, qtype, shape)
    head.bias = lm_head.bias
    return lean, head
