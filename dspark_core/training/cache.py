"""The target cache: what the target computed for every training sequence, stored once, read every epoch.

Per sequence we keep the tapped-layer features `[T, L*H]` (the drafter's context input) and the final
post-norm hidden state `[T, H]` (target distributions are recomputed from it through the frozen LM head
at train time, only at label positions — no logits are stored). Shards are safetensors files holding
many sequences as flat token tensors plus offsets; `manifest.json` ties them together and records what
the cache is compatible with (target, tapped layers, hidden size, vocabulary).

Several ranks may build one cache together: rank r caches samples r, r + W, r + 2W... into its own
shards and writes `manifest-rank{r}.json`; `merge_manifests` (rank 0, after all ranks finished) writes
the combined `manifest.json`.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from ..errors import InvalidArgument
from .data import Sample

FORMAT = "dspark-target-cache/1"
_DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


@dataclass
class CacheManifest:
    target: str
    tap_layer_ids: list[int]
    hidden_size: int
    vocab_size: int
    dtype: str
    num_samples: int = 0
    num_tokens: int = 0
    # [{"file": name, "num_samples": n, "num_tokens": t, "sample_ids": [...]}] in sample order per shard
    shards: list[dict] = field(default_factory=list)
    format: str = FORMAT

    def save(self, path: Path) -> None:
        path.write_text(json.dumps(asdict(self), indent=1) + "\n")

    @classmethod
    def load(cls, path: Path) -> "CacheManifest":
        try:
            data = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise InvalidArgument("cache", str(path), f"must be a readable cache manifest ({exc})") from None
        if data.get("format") != FORMAT:
            raise InvalidArgument("cache", str(path), f"has format {data.get('format')!r}, expected {FORMAT!r}")
        return cls(**data)


def estimate_cache_bytes(num_tokens: int, num_taps: int, hidden_size: int, dtype: str = "bfloat16") -> int:
    """Bytes on disk for `num_tokens` positions: features + final hidden + ids and mask."""
    width = torch.tensor([], dtype=_DTYPES[dtype]).element_size()
    return num_tokens * ((num_taps + 1) * hidden_size * width + 4 + 1)


def human_bytes(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if n < 1024 or unit == "TiB":
            return f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def build_target_cache(target, samples: list[Sample], out_dir: str | Path, *, dtype: str = "bfloat16",
                       shard_tokens: int = 1 << 18, batch_tokens: int = 4096, rank: int = 0, world_size: int = 1,
                       progress: bool = True) -> CacheManifest:
    """Run the target over this rank's samples and write shards + this rank's manifest."""
    if dtype not in _DTYPES:
        raise InvalidArgument("dtype", dtype, f"must be one of {', '.join(_DTYPES)}")
    if not target.config.tap_layer_ids:
        raise InvalidArgument("tap_layer_ids", (), "the target must tap the drafter's layers to build a cache")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    empty = [j for j, smp in enumerate(samples) if not smp.prompt_ids and not smp.response_ids]
    if empty:
        raise InvalidArgument("samples", empty[:5], "must each hold at least one token")
    my_groups = _prompt_groups(samples, range(len(samples)))[rank::world_size]  # a prompt's answers stay on one rank
    mine = [j for g in my_groups for j in g]
    manifest = CacheManifest(target=target.name, tap_layer_ids=list(target.config.tap_layer_ids),
                             hidden_size=target.hidden_size, vocab_size=target.vocab_size, dtype=dtype)
    bar = tqdm(total=len(mine), desc=f"cache[rank {rank}]", unit="seq", disable=not progress)
    buf: dict[str, list] = {"ids": [], "mask": [], "feat": [], "hid": [], "sid": []}

    def flush():
        if not buf["sid"]:
            return
        lengths = [len(x) for x in buf["ids"]]
        offsets = torch.zeros(len(lengths) + 1, dtype=torch.long)
        offsets[1:] = torch.cumsum(torch.tensor(lengths), 0)
        name = f"shard-rank{rank}-{len(manifest.shards):05d}.safetensors"
        save_file({
            "input_ids": torch.cat(buf["ids"]).to(torch.int32),  # [num_tokens]
            "loss_mask": torch.cat(buf["mask"]).to(torch.uint8),  # [num_tokens]
            "features": torch.cat(buf["feat"]).contiguous(),  # [num_tokens, L * H]
            "final_hidden": torch.cat(buf["hid"]).contiguous(),  # [num_tokens, H]
            "offsets": offsets,  # [num_samples + 1]
        }, str(out / name))
        manifest.shards.append({"file": name, "num_samples": len(lengths), "num_tokens": int(offsets[-1]),
                                "sample_ids": list(buf["sid"])})
        for v in buf.values():
            v.clear()

    for batch in _batches(my_groups, samples, batch_tokens):
        for j, feat, hid in _run_batch(target, samples, batch):
            buf["ids"].append(torch.tensor(samples[j].input_ids))
            buf["mask"].append(torch.tensor(samples[j].loss_mask))
            buf["feat"].append(feat.to("cpu", _DTYPES[dtype]))
            buf["hid"].append(hid.to("cpu", _DTYPES[dtype]))
            buf["sid"].append(j)
            manifest.num_samples += 1
            manifest.num_tokens += len(samples[j].input_ids)
            bar.update(1)
        if sum(len(x) for x in buf["ids"]) >= shard_tokens:
            flush()
    flush()
    bar.close()
    manifest.save(out / (f"manifest-rank{rank}.json" if world_size > 1 else "manifest.json"))
    return manifest


def _prompt_groups(samples: list[Sample], indices) -> list[list[int]]:
    """`indices` grouped by identical prompt, groups in order of first appearance: the answers to one prompt
    (several temperatures and seeds of distillation) share its forward pass."""
    groups: dict[tuple[int, ...], list[int]] = {}
    for j in indices:
        groups.setdefault(tuple(samples[j].prompt_ids), []).append(j)
    return list(groups.values())


def _batches(groups: list[list[int]], samples: list[Sample], batch_tokens: int):
    """Consecutive groups whose computed tokens (each prompt once, every answer) fit `batch_tokens`; a group
    never splits, so a batch may exceed the budget by one group."""
    batch, tokens = [], 0
    for g in groups:
        cost = len(samples[g[0]].prompt_ids) + sum(len(samples[j].response_ids) for j in g)
        if batch and tokens + cost > batch_tokens:
            yield batch
            batch, tokens = [], 0
        batch.append(g)
        tokens += cost
    if batch:
        yield batch


def _run_batch(target, samples: list[Sample], batch: list[list[int]]):
    """(sample id, features [T, L*H], final hidden [T, H]) for every sample of `batch`: each group's prompt runs
    once, then every answer continues a fork of the prompt's KV cache (the same numbers as one pass over
    prompt + answer, up to float rounding)."""
    seqs = []
    try:
        heads = [g for g in batch if samples[g[0]].prompt_ids]
        prompt_out = {}
        if heads:
            starts = [target.new_sequence() for _ in heads]
            seqs += starts
            res = target.forward([(s, samples[g[0]].prompt_ids) for s, g in zip(starts, heads)],
                                 return_final_hidden=True, with_logits=False)
            for r, (s, g) in enumerate(zip(starts, heads)):
                lo, hi = int(res.cu_seqlens[r]), int(res.cu_seqlens[r + 1])
                prompt_out[id(g)] = (s, res.taps[lo:hi], res.final_hidden[lo:hi])
        work = []  # (sample id, sequence) for every answer to run
        for g in batch:
            start = prompt_out.get(id(g), (None,))[0]
            free = start  # the first answer continues the prompt's own sequence; the others fork it
            for j in g:
                if not samples[j].response_ids:
                    continue
                if free is not None:
                    seq, free = free, None
                else:
                    seq = target.new_sequence() if start is None else target.fork(start)
                    seqs.append(seq)
                work.append((j, seq))
        # (every fork copied the prompt's cache above, before any answer extends it)
        answers = {}
        if work:
            res = target.forward([(s, samples[j].response_ids) for j, s in work], return_final_hidden=True,
                                 with_logits=False)
            for r, (j, _) in enumerate(work):
                lo, hi = int(res.cu_seqlens[r]), int(res.cu_seqlens[r + 1])
                answers[j] = (res.taps[lo:hi], res.final_hidden[lo:hi])
        for g in batch:
            head = prompt_out.get(id(g))
            for j in g:
                parts = ([head[1:]] if head else []) + ([answers[j]] if j in answers else [])
                yield j, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])
    finally:
        for s in seqs:
            target.release(s)


def merge_manifests(out_dir: str | Path, world_size: int) -> CacheManifest:
    """Combine the per-rank manifests into `manifest.json` (call once, after every rank finished)."""
    out = Path(out_dir)
    parts = [CacheManifest.load(out / f"manifest-rank{r}.json") for r in range(world_size)]
    head = parts[0]
    for p in parts[1:]:
        if (p.tap_layer_ids, p.hidden_size, p.vocab_size, p.dtype) != (head.tap_layer_ids, head.hidden_size,
                                                                      head.vocab_size, head.dtype):
            raise InvalidArgument("cache", str(out), "ranks disagree on tapped layers, hidden size, vocab or dtype")
    merged = CacheManifest(target=head.target, tap_layer_ids=head.tap_layer_ids, hidden_size=head.hidden_size,
                           vocab_size=head.vocab_size, dtype=head.dtype,
                           num_samples=sum(p.num_samples for p in parts), num_tokens=sum(p.num_tokens for p in parts),
                           shards=[s for p in parts for s in p.shards])
    merged.save(out / "manifest.json")
    return merged


LSE_SUFFIX = ".lse.safetensors"


def _head_checksum(lm_head_weight: torch.Tensor) -> str:
    w = lm_head_weight.detach().float()
    return f"{tuple(w.shape)}:{float(w.sum()):.6e}:{float(w.abs().sum()):.6e}"


def label_positions(input_ids: torch.Tensor, loss_mask: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """Flat positions q whose final hidden state predicts a supervised token (loss_mask[q + 1], same sequence)."""
    nxt = torch.zeros_like(loss_mask, dtype=torch.bool)
    nxt[:-1] = loss_mask[1:].bool()
    nxt[(offsets[1:] - 1).clamp_min(0)] = False  # a sequence's last position predicts nothing of its own
    return nxt.nonzero().flatten()


class TargetCache:
    """Read access to a cache: `cache[i]` is one sequence's tensors, in global sample order.

    With a draft vocabulary the trainer also needs the target's log-partition `logsumexp(lm_head @ h)` over the
    whole vocabulary at every label position (the drafter's loss sees only its columns, so the target's
    probabilities there are `exp(logit - lse)`, and the mass outside them is `1 - sum`): `ensure_target_lse`
    computes it once per shard into `<shard>.lse.safetensors`, and items then carry `target_lse` [T].
"""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.manifest = CacheManifest.load(self.path / "manifest.json")
        self._index: list[tuple[int, int]] = []  # sample id -> (shard, row)
        by_id = {}
        for si, shard in enumerate(self.manifest.shards):
            for row, sid in enumerate(shard["sample_ids"]):
                by_id[sid] = (si, row)
        self._index = [by_id[k] for k in sorted(by_id)]
        self._open: dict[int, dict[str, torch.Tensor]] = {}
        self._lse_checksum: str | None = None  # set by ensure_target_lse: items then carry target_lse

    def __len__(self) -> int:
        return len(self._index)

    def check_compatible(self, tap_layer_ids, hidden_size: int, vocab_size: int | None = None) -> None:
        """Refuse a drafter whose tapped layers or sizes differ from what the cache holds."""
        m = self.manifest
        if list(tap_layer_ids) != list(m.tap_layer_ids):
            raise InvalidArgument("target_layer_ids", list(tap_layer_ids),
                                  f"must match the cache's tapped layers {m.tap_layer_ids} ({self.path})")
        if hidden_size != m.hidden_size:
            raise InvalidArgument("hidden_size", hidden_size, f"must match the cache's {m.hidden_size} ({self.path})")
        if vocab_size is not None and vocab_size != m.vocab_size:
            raise InvalidArgument("vocab_size", vocab_size, f"must match the cache's {m.vocab_size} ({self.path})")

    def _shard(self, si: int) -> dict[str, torch.Tensor]:
        if si not in self._open:
            name = self.manifest.shards[si]["file"]
            with safe_open(str(self.path / name), framework="pt") as f:
                self._open[si] = {k: f.get_tensor(k) for k in f.keys()}
            lse = self.path / (name + LSE_SUFFIX)
            if self._lse_checksum and lse.is_file():
                with safe_open(str(lse), framework="pt") as f:
                    if (f.metadata() or {}).get("lm_head") == self._lse_checksum:
                        self._open[si]["target_lse"] = f.get_tensor("lse")
            if len(self._open) > 8:  # bounded memory: keep a few shards
                self._open.pop(next(iter(self._open)))
        return self._open[si]

    def ensure_target_lse(self, lm_head_weight: torch.Tensor, progress: bool = True, chunk: int = 2048,
                          rank: int = 0, world_size: int = 1, barrier=None) -> None:
        """Compute (once; reused while the LM head is the same) the target's full-vocabulary log-partition at
        every label position of every shard; from then on items carry `target_lse`. Several ranks share the work:
        rank r computes the missing shards r, r + W, ..., `barrier()` waits for all of them, and each rank then
        computes whatever is still missing (nothing, unless a rank failed)."""
        if world_size > 1:
            self._compute_lse(lm_head_weight, progress, chunk, lambda si: si % world_size == rank)
            if barrier is not None:
                barrier()
        self._compute_lse(lm_head_weight, progress, chunk, lambda si: True)

    def _compute_lse(self, lm_head_weight: torch.Tensor, progress: bool, chunk: int, mine) -> None:
        checksum = _head_checksum(lm_head_weight)
        w = lm_head_weight.detach().float()
        todo = []
        for si, shard in enumerate(self.manifest.shards):
            if not mine(si):
                continue
            lse = self.path / (shard["file"] + LSE_SUFFIX)
            ok = False
            if lse.is_file():
                with safe_open(str(lse), framework="pt") as f:
                    ok = (f.metadata() or {}).get("lm_head") == checksum
            if not ok:
                todo.append(si)
        total = sum(self.manifest.shards[si]["num_tokens"] for si in todo)
        bar = tqdm(total=total, desc="target log-partition", unit="tok", disable=not progress or not todo)
        for si in todo:
            name = self.manifest.shards[si]["file"]
            with safe_open(str(self.path / name), framework="pt") as f:
                ids, mask, offsets = f.get_tensor("input_ids"), f.get_tensor("loss_mask"), f.get_tensor("offsets")
                hidden = f.get_tensor("final_hidden")
            out = torch.zeros(ids.shape[0], dtype=torch.float32)
            pos = label_positions(ids, mask, offsets)
            with torch.no_grad():
                for lo in range(0, pos.numel(), chunk):
                    p = pos[lo: lo + chunk]
                    out[p] = torch.logsumexp(F.linear(hidden[p].float(), w), dim=-1)
            tmp = self.path / (name + LSE_SUFFIX + f".tmp{os.getpid()}")
            save_file({"lse": out}, str(tmp), metadata={"lm_head": checksum})
            os.replace(tmp, self.path / (name + LSE_SUFFIX))
            bar.update(self.manifest.shards[si]["num_tokens"])
        bar.close()
        self._lse_checksum = checksum
        self._open.clear()

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        """[vocab_size] how often each token is a supervised label (loss_mask) in the cache."""
        counts = torch.zeros(vocab_size, dtype=torch.long)
        for shard in self.manifest.shards:
            with safe_open(str(self.path / shard["file"]), framework="pt") as f:
                ids, mask = f.get_tensor("input_ids").long(), f.get_tensor("loss_mask").bool()
            counts += torch.bincount(ids[mask], minlength=vocab_size)[:vocab_size]
        return counts

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        si, row = self._index[i]
        t = self._shard(si)
        lo, hi = int(t["offsets"][row]), int(t["offsets"][row + 1])
        item = {"input_ids": t["input_ids"][lo:hi].long(), "loss_mask": t["loss_mask"][lo:hi].bool(),
                "features": t["features"][lo:hi], "final_hidden": t["final_hidden"][lo:hi]}
        if "target_lse" in t:
            item["target_lse"] = t["target_lse"][lo:hi]
        return item


class ConcatCache:
    """Several caches read as one (e.g. the same prompts distilled at T = 0 and at T = 1): sample ids run
    through the first cache, then the second, ... Every part must hold the same target, taps and sizes."""

    def __init__(self, parts: list[TargetCache], path: str | Path):
        if not parts:
            raise InvalidArgument("caches", 0, "must hold at least one target cache")
        first = parts[0].manifest
        for p in parts[1:]:
            m = p.manifest
            for name in ("target", "tap_layer_ids", "hidden_size", "vocab_size"):
                if getattr(m, name) != getattr(first, name):
                    raise InvalidArgument("cache", str(p.path),
                                          f"has {name} {getattr(m, name)!r}, but {parts[0].path} has "
                                          f"{getattr(first, name)!r}; caches read together must match")
        self.parts, self.path = parts, Path(path)
        self._starts = [0]
        for p in parts:
            self._starts.append(self._starts[-1] + len(p))
        self.manifest = CacheManifest(target=first.target, tap_layer_ids=list(first.tap_layer_ids),
                                      hidden_size=first.hidden_size, vocab_size=first.vocab_size, dtype=first.dtype,
                                      num_samples=sum(p.manifest.num_samples for p in parts),
                                      num_tokens=sum(p.manifest.num_tokens for p in parts))

    def __len__(self) -> int:
        return self._starts[-1]

    def check_compatible(self, tap_layer_ids, hidden_size: int, vocab_size: int | None = None) -> None:
        for p in self.parts:
            p.check_compatible(tap_layer_ids, hidden_size, vocab_size)

    def ensure_target_lse(self, lm_head_weight: torch.Tensor, progress: bool = True, rank: int = 0,
                          world_size: int = 1, barrier=None) -> None:
        for p in self.parts:
            p.ensure_target_lse(lm_head_weight, progress, rank=rank, world_size=world_size, barrier=barrier)

    def label_counts(self, vocab_size: int) -> torch.Tensor:
        return sum(p.label_counts(vocab_size) for p in self.parts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if not 0 <= i < len(self):
            raise IndexError(i)
        k = next(k for k in range(len(self.parts)) if i < self._starts[k + 1])
        return self.parts[k][i - self._starts[k]]
