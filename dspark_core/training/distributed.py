"""Data-parallel plumbing for drafter training: process group, model wrapping, the sample order, reductions.

- `DistConfig` -> `init_distributed` -> `DistContext`: one process per device. The caller passes rank,
  world size, local rank and an explicit init method (`tcp://host:port`); this package reads no
  environment variables (the CLI turns torchrun's into a DistConfig). Backend: NCCL on CUDA, gloo on CPU.
  A world of one needs no process group at all.
- `wrap_model`: DistributedDataParallel by default, FSDP2 (`fully_shard`, one unit per decoder layer plus
  the root) as an option; `grad_sync(model, enabled)` turns gradient synchronisation off for all but the
  last micro-batch of a step (gradient accumulation); `full_state` / `load_full_state` move complete
  (unsharded) model and optimizer state dicts in and out, whatever the wrapping.
- `EpochSampler`: a deterministic stream of sample ids, a fresh seeded permutation per epoch. Global batch
  g is stream positions [g * G, (g + 1) * G); rank r takes every W-th of them. The position in the stream
  is the whole sampler state, so a run resumes mid-epoch exactly, with any world size.

Knows nothing about drafters, losses or files.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dspark_core.errors import InvalidArgument


@dataclass(frozen=True)
class DistConfig:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    # e.g. "tcp://127.0.0.1:29500"; required when world_size > 1
    init_method: str | None = None
    # auto (cuda when available), cpu, cuda (GPU LOCAL_RANK), cuda:N (one process on GPU N)
    device: str = "auto"
    timeout_s: float = 1800.0

    def __post_init__(self) -> None:
        for name in ("rank", "world_size", "local_rank"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "world_size" else 0):
                raise InvalidArgument(name, v, "must be an integer >= " + ("1" if name == "world_size" else "0"))
        if self.rank >= self.world_size:
            raise InvalidArgument("rank", self.rank, f"must be < world_size ({self.world_size})")
        if self.world_size > 1 and not self.init_method:
            raise InvalidArgument("init_method", self.init_method, "is required when world_size > 1")
        if self.device not in ("auto", "cpu", "cuda") and _cuda_index(self.device) is None:
            raise InvalidArgument("device", self.device, "must be auto, cpu, cuda or cuda:N")
        if _cuda_index(self.device) is not None and self.world_size > 1:
            raise InvalidArgument("device", self.device, "must be auto or cuda under torchrun (each rank takes GPU "
                                                         "LOCAL_RANK); cuda:N is for one process")


def _cuda_index(device: str) -> int | None:
    """N of "cuda:N", else None."""
    kind, _, index = device.partition(":")
    return int(index) if kind == "cuda" and index.isdigit() else None


class DistContext:
    """This process's place in the job, and the few collectives the trainer needs."""

    def __init__(self, config: DistConfig, device: torch.device, owns_group: bool):
        self.config = config
        self.rank, self.world_size, self.local_rank = config.rank, config.world_size, config.local_rank
        self.device = device
        self._owns_group = owns_group

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def distributed(self) -> bool:
        return self.world_size > 1

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()

    def all_reduce_sum(self, t: torch.Tensor) -> torch.Tensor:
        """In-place sum over ranks (a no-op alone); returns t."""
        if self.distributed:
            dist.all_reduce(t, op=dist.ReduceOp.SUM)
        return t

    def all_gather_object(self, obj) -> list:
        if not self.distributed:
            return [obj]
        out = [None] * self.world_size
        dist.all_gather_object(out, obj)
        return out

    def broadcast_object(self, obj):
        """rank 0's obj on every rank."""
        if not self.distributed:
            return obj
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def close(self) -> None:
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()


def init_distributed(config: DistConfig) -> DistContext:
    """Pick the device and, for world_size > 1, join the process group (NCCL on CUDA, gloo on CPU)."""
    import datetime

    index = _cuda_index(config.device)
    use_cuda = config.device == "cuda" or index is not None or (config.device == "auto" and torch.cuda.is_available())
    if use_cuda:
        if not torch.cuda.is_available():
            raise InvalidArgument("device", config.device, "needs a CUDA GPU, and none is available")
        if index is not None and index >= torch.cuda.device_count():
            raise InvalidArgument("device", config.device, f"must name one of the {torch.cuda.device_count()} GPUs")
        device = torch.device("cuda", index if index is not None else config.local_rank % torch.cuda.device_count())
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")
    owns = False
    if config.world_size > 1 and not dist.is_initialized():
        kwargs = {"device_id": device} if use_cuda else {}
        dist.init_process_group("nccl" if use_cuda else "gloo", init_method=config.init_method,
                                rank=config.rank, world_size=config.world_size,
                                timeout=datetime.timedelta(seconds=config.timeout_s), **kwargs)
        owns = True
    return DistContext(config, device, owns)


# ---- model wrapping ----------------------------------------------------------------------------------

WRAP_NONE, WRAP_DDP, WRAP_FSDP = "none", "ddp", "fsdp"


def wrap_model(module: nn.Module, ctx: DistContext, fsdp: bool = False, shard_units: list[nn.Module] | None = None):
    """Returns (model, mode). Alone: the module itself. Else DDP, or FSDP2 over `shard_units` + root."""
    if not ctx.distributed:
        return module, WRAP_NONE
    if fsdp:
        from torch.distributed.fsdp import fully_shard

        for unit in shard_units or []:
            fully_shard(unit)
        fully_shard(module)
        return module, WRAP_FSDP
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [ctx.device.index] if ctx.device.type == "cuda" else None
    return DDP(module, device_ids=ids), WRAP_DDP


def unwrap(model: nn.Module, mode: str) -> nn.Module:
    return model.module if mode == WRAP_DDP else model


@contextlib.contextmanager
def grad_sync(model: nn.Module, mode: str, enabled: bool):
    """Skip the gradient all-reduce of a micro-batch that is not the last of its step."""
    if mode == WRAP_DDP and not enabled:
        with model.no_sync():
            yield
    elif mode == WRAP_FSDP:
        model.set_requires_gradient_sync(enabled)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
    else:
        yield


def full_state(model: nn.Module, optimizer: torch.optim.Optimizer | None = None):
    """(model state dict, optimizer state dict or None): complete, on the CPU, keyed by parameter names
    (the same keys whatever the wrapping, so a run may resume under another one). Collective under FSDP,
    where only rank 0 receives the tensors."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict,
                                                         get_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True, cpu_offload=True)
    msd = get_model_state_dict(model, options=opts)
    osd = get_optimizer_state_dict(model, optimizer, options=opts) if optimizer is not None else None
    return msd, osd


def load_full_state(model: nn.Module, model_state: dict, optimizer=None, optimizer_state=None) -> None:
    """Inverse of `full_state`: every rank passes the same complete state dicts."""
    from torch.distributed.checkpoint.state_dict import (StateDictOptions, set_model_state_dict,
                                                         set_optimizer_state_dict)

    opts = StateDictOptions(full_state_dict=True)
    set_model_state_dict(model, model_state, options=opts)
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=opts)


def clip_grad_norm(params: list[torch.Tensor], max_norm: float) -> float:
    """Global gradient norm clipping (works on DTensor shards too); returns the pre-clip norm."""
    norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
    if hasattr(norm, "full_tensor"):
        norm = norm.full_tensor()
    return float(norm)


# ---- the sample order --------------------------------------------------------------------------------


class EpochSampler:
    """Deterministic stream of (epoch, sample id); a seeded permutation per epoch."""

    def __init__(self, num_samples: int, seed: int = 0, shuffle: bool = True):
        if num_samples < 1:
            raise InvalidArgument("num_samples", num_samples, "must be >= 1 (the training cache is empty)")
        self.num_samples, self.seed, self.shuffle = num_samples, seed, shuffle
        self._perm: tuple[int, list[int]] | None = None

    def order(self, epoch: int) -> list[int]:
        if self._perm is None or self._perm[0] != epoch:
            if self.shuffle:
                g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
                perm = torch.randperm(self.num_samples, generator=g).tolist()
            else:
                perm = list(range(self.num_samples))
            self._perm = (epoch, perm)
        return self._perm[1]

    def take(self, position: int, count: int) -> list[tuple[int, int]]:
        """Stream entries position .. position + count - 1 as (epoch, sample id)."""
        out = []
        for q in range(position, position + count):
            epoch, i = divmod(q, self.num_samples)
            out.append((epoch, self.order(epoch)[i]))
        return out

    @staticmethod
    def shard(entries: list, rank: int, world_size: int) -> list:
        """This rank's share of a global batch: every world_size-th entry, starting at rank."""
        return entries[rank::world_size]
