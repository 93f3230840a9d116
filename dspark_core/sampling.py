"""Sampling parameters and the one categorical draw everything else is built on.

`target_probs` turns target logits into the distribution plain sampling draws from (temperature, then
top-k, then top-p, in Hugging Face's order and with its tie and boundary rules), `sample_from_probs` makes
one inverse-CDF draw that consumes exactly one uniform number, and `sample_token` is plain autoregressive
sampling built from the two. Verification (`dspark_core.verification`) uses the same primitives, so a
request's output depends only on its seed, never on batching or on how many tokens were drafted.

This module knows nothing about drafters, models, tokenizers or batches of requests: it sees logits,
probabilities and a `torch.Generator`.
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass

import torch

from dspark_core.errors import InvalidArgument

_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64) without wrapping


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 means greedy (argmax); top_k 0 and top_p 1 mean off."""

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        if not _is_real(self.temperature) or not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidArgument("temperature", self.temperature, "must be a finite number >= 0")
        if not _is_int(self.top_k) or self.top_k < 0:
            raise InvalidArgument("top_k", self.top_k, "must be an integer >= 0 (0 turns top-k off)")
        if not _is_real(self.top_p) or not 0.0 < self.top_p <= 1.0:  # NaN fails the comparison too
            raise InvalidArgument("top_p", self.top_p, "must be a number in (0, 1]")
        if self.seed is not None and (not _is_int(self.seed) or not 0 <= self.seed < _MAX_SEED):
            raise InvalidArgument("seed", self.seed, "must be None or an integer in [0, 2**64)")
        if not _is_int(self.max_new_tokens) or self.max_new_tokens < 1:
            raise InvalidArgument("max_new_tokens", self.max_new_tokens, "must be an integer >= 1")
        try:
            stop = tuple(self.stop_token_ids)
        except TypeError:
            raise InvalidArgument("stop_token_ids", self.stop_token_ids, "must be a sequence of token ids") from None
        if not all(_is_int(t) and t >= 0 for t in stop):
            raise InvalidArgument("stop_token_ids", self.stop_token_ids, "must contain only integers >= 0")
        # Normalise to plain Python types so the params hash, compare and print the same whatever came in.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        if self.seed is not None:
            object.__setattr__(self, "seed", int(self.seed))

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax and consumes no random numbers."""
        return self.temperature == 0.0


def target_probs(
    # [..., vocab_size] raw logits, any float dtype
    logits: torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """The distribution plain sampling draws from, as float32 probabilities of the same shape.

    Greedy params give a one-hot at the argmax (ties go to the lowest id, as `torch.argmax`). Otherwise:
    divide by the temperature; top-k keeps every token whose score is >= the k-th largest (ties at the
    k-th value survive); top-p then keeps the smallest set of highest-probability tokens whose mass reaches
    top_p, computed as Hugging Face does (ascending sort, drop while the cumulative mass <= 1 - top_p,
    never drop the most likely token); finally softmax over what is left.
    """
    if params.greedy:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    scores = logits.float()  # [..., vocab_size] float32; never modified in place below
    if params.temperature != 1.0:
        scores = scores / params.temperature
    vocab_size = scores.shape[-1]
    if 0 < params.top_k < vocab_size:
        kth = torch.topk(scores, params.top_k, dim=-1).values[..., -1:]  # [..., 1]
        scores = scores.masked_fill(scores < kth, -math.inf)
    if params.top_p < 1.0:
        ascending, order = torch.sort(scores, dim=-1, descending=False)  # [..., vocab_size] each
        drop_sorted = ascending.softmax(dim=-1).cumsum(dim=-1) <= 1.0 - params.top_p
        drop_sorted[..., -1:] = False  # always keep the most likely token
        drop = drop_sorted.scatter(-1, order, drop_sorted)  # back to vocabulary order
        scores = scores.masked_fill(drop, -math.inf)
    return scores.softmax(dim=-1)


def derive_seed(seed: int | None, position: int) -> int | None:
    """The one seed derivation: a request's seed keyed by a position (a verifier resuming a request at
    `position`, a drafter drafting from anchor `position`), so that a stream restarted there is reproducible
    and independent of where else it ran. None stays None (unseeded)."""
    if seed is None:
        return None
    return (seed * 1_000_003 + position) % (2**63)


def make_generator(seed: int | None, device: torch.device | str = "cpu") -> torch.Generator:
    """A generator for one request on `device`; a None seed gets a fresh nondeterministic seed."""
    if seed is not None and (not _is_int(seed) or not 0 <= seed < _MAX_SEED):
        raise InvalidArgument("seed", seed, "must be None or an integer in [0, 2**64)")
    generator = torch.Generator(device=device)
    if seed is None:
        generator.seed()
    else:
        generator.manual_seed(int(seed))
    return generator


def _uniform(generator: torch.Generator, device: torch.device) -> torch.Tensor:
    """One uniform number in [0, 1) as a float64 tensor [1] on `device`: the only way this package draws.

    It is drawn on the generator's own device, so a CPU generator can drive sampling on any device and the
    numbers a request sees do not depend on where its logits live.
    """
    return torch.rand(1, generator=generator, dtype=torch.float64, device=generator.device).to(device)


def _inverse_cdf(
    # [vocab_size] non-negative weights, not necessarily normalised
    probs: torch.Tensor,
    # [1] float64 in [0, 1)
    u: torch.Tensor,
) -> int:
    """The token whose cumulative-mass interval [cdf[i-1], cdf[i]) holds u * total mass."""
    cdf = probs.cumsum(dim=0, dtype=torch.float64)  # [vocab_size]
    index = int(torch.searchsorted(cdf, u * cdf[-1:], right=True))
    if index < cdf.shape[0]:
        return index
    # u * total rounded up to the total itself: the draw belongs to the last token with mass.
    nonzero = torch.nonzero(probs > 0)
    if nonzero.numel() == 0:
        raise InvalidArgument("probs", "all zero", "must have a positive total mass")
    return int(nonzero[-1, 0])


def sample_from_probs(
    # [vocab_size] non-negative weights (normalised or not)
    probs: torch.Tensor,
    generator: torch.Generator,
) -> int:
    """One categorical draw by inverse CDF, consuming exactly one uniform number from `generator`.

    Zero-probability tokens are never returned; rounding that would fall past the end of the CDF lands on
    the last token with nonzero probability.
    """
    if probs.dim() != 1:
        raise InvalidArgument("probs", tuple(probs.shape), "must be 1-D [vocab_size]")
    return _inverse_cdf(probs, _uniform(generator, probs.device))


def sample_token(
    # [vocab_size] raw logits
    logits: torch.Tensor,
    params: SamplingParams,
    generator: torch.Generator,
) -> int:
    """Plain autoregressive sampling of one token. Greedy takes the argmax and draws nothing."""
    if logits.dim() != 1:
        raise InvalidArgument("logits", tuple(logits.shape), "must be 1-D [vocab_size]")
    if params.greedy:
        return int(logits.argmax())
    return sample_from_probs(target_probs(logits, params), generator)
