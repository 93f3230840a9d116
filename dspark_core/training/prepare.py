"""Training data end to end: prompts -> self-distillation -> target cache, shared across ranks.

`prepare_target_cache` runs on every rank of a job:
1. if `cache_dir` already holds a complete cache built from the same inputs (same target, tapped layers,
   prompts and distillation settings, recorded in `source.json`), it is reused as is;
2. otherwise rank r distills prompts r, r + W, ... through the target (data.distill), the samples are
   gathered on every rank in prompt order (at temperature 0 the cache is the same for any world size; at
   T > 0 data.distill seeds requests by their index within a rank, so the sampled responses depend on
   the world size), rank 0 prints the estimated cache size (cache.estimate_cache_bytes)
   and writes `samples.jsonl`, each rank caches its slice (cache.build_target_cache(rank=, world_size=)),
   and rank 0 merges the manifests after a barrier. With `responses` (sequences generated elsewhere,
   `data.load_responses`) step 2 caches those instead of distilling.
Rank 0 holds an exclusive lock on `cache_dir/.lock` from the check to the end of the build, so two jobs
pointed at one cache directory never build into it together: the second waits (saying so), then reuses
what the first built.

Knows nothing about drafters, optimisers or the command line; it prints nothing itself (`log` callback).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path

from dspark_core.errors import InvalidArgument
from dspark_core.training.cache import (TargetCache, build_target_cache, estimate_cache_bytes, human_bytes,
                                        merge_manifests)
from dspark_core.text import encode_prompt
from dspark_core.training.data import Prompt, Sample, distill

SOURCE_FILE = "source.json"
SAMPLES_FILE = "samples.jsonl"
# answers of a distillation in progress, one per line as they finish: an interrupted build resumes from it
JOURNAL = "distill-rank{rank}.partial.jsonl"


@dataclass(frozen=True)
class DistillSettings:
    max_new_tokens: int = 256
    temperature: float = 1.0
    seed: int = 0
    concurrency: int = 32
    dtype: str = "bfloat16"  # cache dtype
    # longer prompts are left out (None: whatever fits the context window with the response)
    max_prompt_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.max_new_tokens, bool) or not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        if not isinstance(self.temperature, (int, float)) or self.temperature < 0:
            raise InvalidArgument("temperature", self.temperature, "must be >= 0")
        if isinstance(self.concurrency, bool) or not isinstance(self.concurrency, int) or self.concurrency < 1:
            raise InvalidArgument("concurrency", self.concurrency, "must be an integer >= 1")
        mp = self.max_prompt_tokens
        if mp is not None and (isinstance(mp, bool) or not isinstance(mp, int) or mp < 1):
            raise InvalidArgument("max_prompt_tokens", mp, "must be an integer >= 1")
        if self.dtype not in ("bfloat16", "float16", "float32"):
            raise InvalidArgument("dtype", self.dtype, "must be bfloat16, float16 or float32")


def source_fingerprint(target, prompts: list[Prompt], settings: DistillSettings) -> dict:
    h = hashlib.sha256()
    for p in prompts:
        h.update(p.key.encode())
    return {"target": target.name, "tap_layer_ids": list(target.config.tap_layer_ids),
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "num_prompts": len(prompts), "prompts_sha256": h.hexdigest(), "distill": _settings_record(settings)}


def _settings_record(settings: DistillSettings) -> dict:
    """The settings as recorded in source.json; an unset prompt limit is left out, so caches recorded before
    the field existed are still recognised."""
    record = asdict(settings)
    if record["max_prompt_tokens"] is None:
        del record["max_prompt_tokens"]
    return record


_MISMATCH = ("holds a target cache built from other inputs (target, tapped layers, prompts or distillation "
             "settings differ); pass a fresh --cache-dir or --rebuild-cache")


def _cache_status(cache_dir: Path, fingerprint: dict) -> str:
    """'reuse', 'build' or 'mismatch'."""
    if not (cache_dir / "manifest.json").is_file():
        return "build"
    try:
        recorded = json.loads((cache_dir / SOURCE_FILE).read_text())
    except (OSError, json.JSONDecodeError):
        recorded = None
    return "reuse" if recorded == fingerprint else "mismatch"


def _clear(cache_dir: Path) -> None:
    """Remove a previous cache's files (only the ones a cache consists of)."""
    for pattern in ("shard-rank*.safetensors", "manifest*.json", SOURCE_FILE, SAMPLES_FILE,
                    JOURNAL.format(rank="*")):
        for f in cache_dir.glob(pattern):
            f.unlink()


LOCK_FILE = ".lock"


@contextlib.contextmanager
def cache_lock(cache_dir: Path, log: Callable[[str], None]) -> Iterator[None]:
    """Exclusive lock on `cache_dir` for as long as the block runs; waits (and says so) while another process
    holds it. Without fcntl (not POSIX) it is a no-op."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows
        yield
        return
    cache_dir.mkdir(parents=True, exist_ok=True)
    with (cache_dir / LOCK_FILE).open("a") as fh:
        try:
            fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            log(f"waiting for another process that is building the target cache in {cache_dir}")
            fcntl.flock(fh, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(fh, fcntl.LOCK_UN)


def prepare_target_cache(target, prompts: list[Prompt], cache_dir: str | Path, ctx, settings: DistillSettings,
                         *, rebuild: bool = False, progress: bool = True,
                         log: Callable[[str], None] | None = None, responses: list[Sample] | None = None
                         ) -> TargetCache:
    """Collective over the ranks in `ctx` (a DistContext); returns the opened cache on every rank.

    `responses`: training sequences generated elsewhere (`data.load_responses`), cached as given instead of
    distilling `prompts` (which are then ignored)."""
    log = log if (log is not None and ctx.is_main) else (lambda _msg: None)
    cache_dir = Path(cache_dir)
    with cache_lock(cache_dir, log) if ctx.is_main else contextlib.nullcontext():
        return _prepare(target, prompts, cache_dir, ctx, settings, rebuild, progress, log, responses)


def _responses_fingerprint(target, responses: list[Sample], settings: DistillSettings) -> dict:
    h = hashlib.sha256()
    for s in responses:
        h.update(json.dumps([s.prompt_ids, s.response_ids]).encode())
    return {"target": target.name, "tap_layer_ids": list(target.config.tap_layer_ids),
            "hidden_size": target.hidden_size, "vocab_size": target.vocab_size,
            "responses": len(responses), "responses_sha256": h.hexdigest(), "cache_dtype": settings.dtype}


def _prepare(target, prompts, cache_dir: Path, ctx, settings, rebuild, progress, log, responses=None) -> TargetCache:
    fingerprint = (source_fingerprint(target, prompts, settings) if responses is None
                   else _responses_fingerprint(target, responses, settings))
    status = None
    if ctx.is_main:
        cache_dir.mkdir(parents=True, exist_ok=True)
        if rebuild:
            _clear(cache_dir)
        status = _cache_status(cache_dir, fingerprint)
    status = ctx.broadcast_object(status)
    if status == "mismatch":
        raise InvalidArgument("cache_dir", str(cache_dir), _MISMATCH)
    if status == "reuse":
        cache = TargetCache(cache_dir)
        log(f"reusing target cache {cache_dir} ({cache.manifest.num_samples} sequences, "
            f"{cache.manifest.num_tokens} tokens)")
        return cache
    if responses is not None:
        samples = list(responses)
    else:
        samples = _distill_all(target, prompts, cache_dir, ctx, settings, progress)
    if not samples:
        raise InvalidArgument("prompts", len(prompts), "produced no training sequence (all too long for the target?)")
    num_tokens = sum(len(s.input_ids) for s in samples)
    size = estimate_cache_bytes(num_tokens, len(target.config.tap_layer_ids), target.hidden_size, settings.dtype)
    log(f"target cache: {len(samples)} sequences, {num_tokens} tokens, about {human_bytes(size)} "
        f"({settings.dtype}) -> {cache_dir}")
    if ctx.is_main:
        with (cache_dir / SAMPLES_FILE).open("w") as fh:
            for s in samples:
                fh.write(json.dumps({"prompt_ids": s.prompt_ids, "response_ids": s.response_ids,
                                     "domain": s.domain}) + "\n")
    build_target_cache(target, samples, cache_dir, dtype=settings.dtype, rank=ctx.rank, world_size=ctx.world_size,
                       progress=progress and ctx.is_main)
    ctx.barrier()
    if ctx.is_main:
        if ctx.world_size > 1:
            merge_manifests(cache_dir, ctx.world_size)
        (cache_dir / SOURCE_FILE).write_text(json.dumps(fingerprint, indent=1) + "\n")
    ctx.barrier()
    (cache_dir / JOURNAL.format(rank=ctx.rank)).unlink(missing_ok=True)  # the cache is complete
    return TargetCache(cache_dir)


def _distill_all(target, prompts, cache_dir: Path, ctx, settings, progress) -> list[Sample]:
    """The target's answers to every prompt that fits, distilled over the ranks, in prompt order (resumable:
    each rank journals what it distilled in `cache_dir`)."""
    if not prompts:
        raise InvalidArgument("prompts", 0, "must hold at least one training prompt")
    # Keep only prompts that fit (as distill would), so that sample i of rank r is prompt r + W * i and the
    # gathered samples come back in prompt order whatever the world size.
    limit = target.max_context - settings.max_new_tokens - 1
    if settings.max_prompt_tokens is not None:
        limit = min(limit, settings.max_prompt_tokens)
    fitting = [p for p in prompts if len(encode_prompt(target.tokenizer, p.text)) <= limit]
    mine = fitting[ctx.rank::ctx.world_size]
    local = distill(target, mine, max_new_tokens=settings.max_new_tokens, temperature=settings.temperature,
                    seed=settings.seed, concurrency=settings.concurrency, max_prompt_tokens=limit,
                    progress=progress and ctx.is_main, index_base=ctx.rank, index_stride=ctx.world_size,
                    journal=cache_dir / JOURNAL.format(rank=ctx.rank))
    assert len(local) == len(mine), "distill skipped a prompt that fits"
    gathered = ctx.all_gather_object([(s.prompt_ids, s.response_ids, s.domain) for s in local])
    order = [(i * ctx.world_size + r, item) for r, part in enumerate(gathered) for i, item in enumerate(part)]
    return [Sample(list(p), list(resp), d) for _, (p, resp, d) in sorted(order, key=lambda x: x[0])]
