"""Step functions that make the target runtime carry exactly B tokens in one forward pass, for SPS(B).

A verification step under load is many requests, each with a long context, each verifying a short
block. `VerifyStepBench` builds that shape once — `ceil(B / block)` sequences prefilled to
`context_length` tokens — and each call appends the blocks, then rolls them back, so every repeat sees
the same context. The timing harness itself is `cost_model.profile_sps`.
"""

from __future__ import annotations

import math

import torch

from .errors import InvalidArgument
from .target import TargetRuntime


class VerifyStepBench:
    def __init__(self, target: TargetRuntime, context_length: int = 256, block: int = 8, seed: int = 0):
        if context_length < 1 or context_length + block >= target.max_context:
            raise InvalidArgument("context_length", context_length,
                                  f"must be in [1, {target.max_context - block - 1}] for this target")
        if block < 1:
            raise InvalidArgument("block", block, "must be >= 1")
        self.target, self.context_length, self.block = target, context_length, block
        self.gen = torch.Generator().manual_seed(seed)
        self.seqs = []

    def _ensure(self, n: int) -> None:
        while len(self.seqs) < n:
            seq = self.target.new_sequence()
            ids = torch.randint(0, self.target.vocab_size, (self.context_length,), generator=self.gen).tolist()
            self.target.forward([(seq, ids)], last_logits_only=True)
            self.seqs.append(seq)

    def __call__(self, b: int) -> None:
        """One forward pass carrying `b` tokens, spread over ceil(b / block) sequences."""
        n = math.ceil(b / self.block)
        self._ensure(n)
        sizes = [self.block] * (n - 1) + [b - self.block * (n - 1)]
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
