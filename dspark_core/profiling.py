"""Step functions that make the target runtime carry exactly B tokens in one forward pass, for SPS(B).

A verification step under load is many requests, each with a long context, each verifying a short
block. `VerifyStepBench` spreads B tokens as evenly as possible over `max(ceil(B / block),
min(B, max_sequences))` sequences prefilled to `context_length` tokens: up to `max_sequences` tokens it is
one token per request (what a step at concurrency R looks like before any draft is admitted), above that
`max_sequences` requests verifying a few tokens each. So the table rises smoothly from B = R to B = R x
block, the region a scheduler at concurrency R explores, instead of jumping wherever a new sequence
starts (B = 9, 17, ... with one full block per sequence). Each call appends the tokens, then rolls them
back, so every repeat sees the same context. The timing harness itself is `cost_model.profile_sps`.

`requests_grid` lists the (R, B) points of the per-request rows (`SpsTable.by_requests`): for each R, B from
R (anchors only) to R x block (every request verifying a full block).
"""

from __future__ import annotations

import math

import torch

from .errors import InvalidArgument
from .target import TargetRuntime


def requests_grid(requests: list[int], block: int, points: int = 15) -> dict[int, list[int]]:
    """{R: batch sizes R .. R x block, about `points` of them, always both ends}."""
    grid = {}
    for r in requests:
        if r < 1:
            raise InvalidArgument("requests", r, "must be >= 1")
        lo, hi = r, r * block
        step = max(1, math.ceil((hi - lo) / max(1, points - 1)))
        sizes = list(range(lo, hi + 1, step))
        if sizes[-1] != hi:
            sizes.append(hi)
        grid[r] = sizes
    return grid


class VerifyStepBench:
    def __init__(self, target: TargetRuntime, context_length: int = 256, block: int = 8, seed: int = 0,
                 max_sequences: int = 32):
        if context_length < 1 or context_length + block >= target.max_context:
            raise InvalidArgument("context_length", context_length,
                                  f"must be in [1, {target.max_context - block - 1}] for this target")
        if block < 1:
            raise InvalidArgument("block", block, "must be >= 1")
        if max_sequences < 1:
            raise InvalidArgument("max_sequences", max_sequences, "must be >= 1")
        self.max_sequences = max_sequences
        self.target, self.context_length, self.block = target, context_length, block
        self.gen = torch.Generator().manual_seed(seed)
        self.seqs = []

    def _ensure(self, n: int) -> None:
        while len(self.seqs) < n:
            seq = self.target.new_sequence()
            ids = torch.randint(0, self.target.vocab_size, (self.context_length,), generator=self.gen).tolist()
            self.target.forward([(seq, ids)], last_logits_only=True)
            self.seqs.append(seq)

    def __call__(self, b: int, requests: int | None = None) -> None:
        """One forward pass carrying `b` tokens, spread evenly over the sequences described above, or over
        exactly `requests` sequences (a step at concurrency R: every request verifies b / R tokens)."""
        if requests is not None:
            if not 1 <= requests <= b:
                raise InvalidArgument("requests", requests, f"must be in [1, b = {b}]")
            n = requests
        else:
            n = max(math.ceil(b / self.block), min(b, self.max_sequences))
        self._ensure(n)
        sizes = [b // n + (1 if i < b % n else 0) for i in range(n)]
        batch = [(s, [1] * k) for s, k in zip(self.seqs[:n], sizes)]
        self.target.forward(batch)
        if self.target.device.type == "cuda":
            torch.cuda.synchronize()
        for s, _ in batch:
            self.target.truncate(s, self.context_length)

    def close(self) -> None:
        for s in self.seqs:
            self.target.release(s)
        self.seqs = []


def kernels_in_use(target) -> str | None:
    """The build of our CPU kernels `target`'s forward runs (`dspark_core.kernels.build_id()`), None for a target
    off the CPU or where they do not run: what a cost table measured on it records (`SpsTable.kernels`)."""
    if getattr(getattr(target, "device", None), "type", "cpu") != "cpu":
        return None
    from .kernels import build_id

    return build_id()


def stale_kernels(table, now: str | None) -> str | None:
    """Why `table` no longer describes a forward that runs kernel build `now` (`kernels_in_use(target)`; None: it
    does, or the table does not say): measured with another build of our CPU kernels."""
    if table is None or table.kernels is None or table.kernels == now:
        return None
    return f"measured with kernels {table.kernels}, running {now or 'none'}"


# the request counts beyond one whose rows the quick table measures (budget permitting)
QUICK_ROWS = (8, 32)


def quick_sps_table(target: TargetRuntime, max_tokens: int = 64, budget_s: float = 30.0, repeats: int = 5,
                    block: int = 8):
    """A quick SPS(B) table (B = 1, 2, 4, ... max_tokens, `repeats` timed sweeps each), for a target that has
    no profiled one: what a verifier measures at start-up so that a cost-table policy can run at all. It also
    measures the one-request row (one sequence verifying 1 .. `block` tokens: what a batch-1 step costs, which
    B tokens spread over B sequences do not tell), after half a second of untimed passes (a cold first pass
    measured SmolLM2's B = 1 at half its speed, and the monotone fit then flattened 1 .. 4 tokens to it), and,
    budget left, the 8- and 32-request rows (R sequences verifying 1 .. `block` tokens each: a step at
    concurrency R). Without them a step of 8 requests x 2 tokens was priced as 16 sequences of one token (twice
    the attention): SmolLM2, 8 -> 16 tokens +58% in the plain table against ~+33% in the 8-request row, and the
    causal policy at concurrency 8 verified 0.1-0.2 drafts a request where gamma1 showed one paying
    (docs/results/smollm2/README.md, "The quick cost table's 8- and 32-request rows").

    Bounded: once `budget_s` seconds are spent, the sizes measured so far make the table (at least B = 1;
    `SpsTable` extrapolates beyond its last point). Returns a monotone `SpsTable`; `dspark profile` measures
    the full one."""
    import time

    from .cost_model import SpsTable, monotone, profile_sps

    if max_tokens < 1:
        raise InvalidArgument("max_tokens", max_tokens, "must be >= 1")
    if block < 1:
        raise InvalidArgument("block", block, "must be >= 1")
    sizes, b = [], 1
    while b < max_tokens:
        sizes.append(b)
        b *= 2
    sizes.append(max_tokens)
    t0 = time.perf_counter()
    bench = VerifyStepBench(target, context_length=min(256, max(1, target.max_context // 4)), block=block,
                            max_sequences=min(32, max_tokens))
    meta = dict(device=str(target.device), dtype=str(target.dtype).replace("torch.", ""),
                context_length=bench.context_length, model=target.name, weights=getattr(target, "weights", None),
                kernels=kernels_in_use(target))
    measured, speeds, rows = [], [], []
    try:
        while time.perf_counter() - t0 < min(0.5, budget_s / 10):
            bench(1)  # warm-up: one-time costs (kernels, allocations, caches) out of the timed passes
        one = list(range(1, min(block, max_tokens) + 1))
        rows.append((1, profile_sps(lambda n: bench(n, requests=1), one, repeats=repeats, warmup=1, **meta)))
        for b in sizes:
            speeds.append(profile_sps(bench, [b], repeats=repeats, warmup=1).steps_per_second[0])
            measured.append(b)
            if time.perf_counter() - t0 > budget_s:
                break
        for r, bs in requests_grid([r for r in QUICK_ROWS if r <= bench.max_sequences], block, points=5).items():
            if time.perf_counter() - t0 > budget_s:
                break
            rows.append((r, profile_sps(lambda n, r=r: bench(n, requests=r), bs, repeats=repeats, warmup=1,
                                        **meta)))
    finally:
        bench.close()
    # monotone() makes the rows monotone too
    return monotone(SpsTable(tuple(measured), tuple(speeds), by_requests=tuple(rows) or None, **meta))
