"""Sampling parameters and the one categorical draw everything else is built on.

`target_probs` turns target logits into the distribution plain sampling draws from (temperature, then
top-k, then top-p, then min-p, in Hugging Face's order and with its tie and boundary rules),
`sample_from_probs` makes one inverse-CDF draw that consumes exactly one uniform number, and `sample_token`
is plain autoregressive sampling built from the two. Verification (`dspark_core.verification`) uses the same
primitives. A seeded request draws instead through `coupling_noise` / `coupled_choice`: one exponential race
per absolute position, keyed by (seed, position), so its output depends only on its seed, never on batching
or on how many tokens were drafted.

A request's own processing depends on what came before the position being sampled: `process_logits`
applies the repetition, frequency and presence penalties and `min_tokens` to raw logits, one row per
position, given the request's `TokenHistory` (prompt and generated tokens) and the tokens drafted in front
of each row. `sampling_logprobs` gives the log-probabilities of the distribution a token is drawn from
(what `logprobs` reports) and `token_logprobs` reads the chosen tokens' and the top ones out of it.

This module knows nothing about drafters, models, tokenizers or batches of requests: it sees logits,
probabilities, token histories and a `torch.Generator`.
"""

from __future__ import annotations

import functools
import math
import numbers
from dataclasses import dataclass

import torch

from dspark_core.errors import InvalidArgument

_MAX_SEED = 2**64  # torch.Generator.manual_seed accepts [0, 2**64) without wrapping
MAX_LOGPROBS = 20  # top log-probabilities a request may ask for per token (OpenAI's top_logprobs limit)
MAX_PENALTY = 2.0  # |presence_penalty| and |frequency_penalty| at most (OpenAI's range)
MAX_REPETITION_PENALTY = 10.0


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SamplingParams:
    """How one request samples. temperature 0 means greedy (argmax); top_k 0, top_p 1 and min_p 0 mean off.

    The penalties act on raw logits before the temperature, as vLLM and Hugging Face apply them:
    `repetition_penalty` r divides positive and multiplies negative logits of every token seen in the prompt
    or the output so far (1 = off); `frequency_penalty` subtracts f * (times the token was generated) and
    `presence_penalty` subtracts p once the token was generated at all (0 = off). `min_tokens` forbids the
    stop tokens until that many tokens were generated. `logprobs` None returns no log-probabilities; K >= 0
    returns the chosen token's and the K most likely ones per generated token.
    """

    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    seed: int | None = None
    max_new_tokens: int = 128
    stop_token_ids: tuple[int, ...] = ()
    min_p: float = 0.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_tokens: int = 0
    logprobs: int | None = None

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
        if not _is_real(self.min_p) or not 0.0 <= self.min_p <= 1.0:
            raise InvalidArgument("min_p", self.min_p, "must be a number in [0, 1] (0 turns min-p off)")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not _is_real(value) or not -MAX_PENALTY <= value <= MAX_PENALTY:
                raise InvalidArgument(name, value, f"must be a number in [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]")
        r = self.repetition_penalty
        if not _is_real(r) or not 0.0 < r <= MAX_REPETITION_PENALTY:
            raise InvalidArgument("repetition_penalty", r,
                                  f"must be a number in (0, {MAX_REPETITION_PENALTY:g}] (1 turns it off)")
        if not _is_int(self.min_tokens) or not 0 <= self.min_tokens <= self.max_new_tokens:
            raise InvalidArgument("min_tokens", self.min_tokens,
                                  f"must be an integer in [0, max_new_tokens = {self.max_new_tokens}]")
        if self.logprobs is not None and (not _is_int(self.logprobs) or not 0 <= self.logprobs <= MAX_LOGPROBS):
            raise InvalidArgument("logprobs", self.logprobs, f"must be None or an integer in [0, {MAX_LOGPROBS}]")
        # Normalise to plain Python types so the params hash, compare and print the same whatever came in.
        object.__setattr__(self, "temperature", float(self.temperature))
        object.__setattr__(self, "top_k", int(self.top_k))
        object.__setattr__(self, "top_p", float(self.top_p))
        object.__setattr__(self, "max_new_tokens", int(self.max_new_tokens))
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in stop))
        for name in ("min_p", "presence_penalty", "frequency_penalty", "repetition_penalty"):
            object.__setattr__(self, name, float(getattr(self, name)))
        object.__setattr__(self, "min_tokens", int(self.min_tokens))
        for name in ("seed", "logprobs"):
            if getattr(self, name) is not None:
                object.__setattr__(self, name, int(getattr(self, name)))

    @property
    def greedy(self) -> bool:
        """True when the request takes the argmax and consumes no random numbers."""
        return self.temperature == 0.0

    @property
    def history_dependent(self) -> bool:
        """True when a position's distribution depends on the tokens before it (penalties, min_tokens)."""
        return (self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0
                or self.min_tokens > 0)

    @property
    def processed(self) -> bool:
        """True when the request's own processing goes beyond temperature / top-k / top-p."""
        return self.history_dependent or self.min_p > 0.0


@dataclass(frozen=True)
class TokenHistory:
    """The tokens before a request's next position: its prompt and what it generated so far (in order)."""

    prompt_ids: tuple[int, ...] | list[int]
    output_ids: tuple[int, ...] | list[int]


def process_logits(
    # [n, vocab_size] raw logits; row i predicts the token after history + extra[:i]
    logits: torch.Tensor,
    params: SamplingParams,
    history: TokenHistory | None,
    # tokens that follow the history in front of rows 1..n-1 (drafts): row i also counts extra[:i]
    extra: tuple[int, ...] | list[int] = (),
) -> torch.Tensor:
    """The request's penalties and min_tokens applied to each row, given everything generated before it.

    Row i is the distribution of output token number len(history.output_ids) + i. Returns `logits`
    itself when the request has no history-dependent processing; otherwise a new float32 tensor.
    """
    if not params.history_dependent:
        return logits
    if history is None:
        raise InvalidArgument("history", None, "is required for requests with penalties or min_tokens")
    n, vocab = logits.shape
    if len(extra) < n - 1:
        raise InvalidArgument("extra", len(extra), f"must hold at least n - 1 = {n - 1} tokens")
    dev = logits.device
    scores = logits.float().clone()  # [n, vocab]
    out = torch.as_tensor(list(history.output_ids), dtype=torch.long, device=dev)
    counts = torch.bincount(out, minlength=vocab)[:vocab].float().expand(n, vocab).clone()  # [n, vocab]
    if n > 1:
        rows = torch.arange(1, n, device=dev)
        ahead = torch.zeros(n, vocab, device=dev)
        ahead[rows, torch.as_tensor(list(extra[: n - 1]), dtype=torch.long, device=dev)] = 1.0
        counts += ahead.cumsum(dim=0)  # row i: + extra[:i]
    if params.repetition_penalty != 1.0:
        seen = counts > 0  # [n, vocab]
        if len(history.prompt_ids):
            prompt = torch.as_tensor(list(history.prompt_ids), dtype=torch.long, device=dev)
            seen[:, prompt] = True
        r = params.repetition_penalty
        scores = torch.where(seen, torch.where(scores > 0, scores / r, scores * r), scores)
    if params.frequency_penalty != 0.0:
        scores = scores - params.frequency_penalty * counts
    if params.presence_penalty != 0.0:
        scores = scores - params.presence_penalty * (counts > 0).float()
    blocked = params.min_tokens - len(history.output_ids)  # rows 0..blocked-1 may not stop
    if blocked > 0 and params.stop_token_ids:
        stop = torch.tensor([t for t in params.stop_token_ids if t < vocab], dtype=torch.long, device=dev)
        scores[: min(blocked, n)].index_fill_(1, stop, -math.inf)
    return scores


def _filtered_scores(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature-scaled scores with the tokens top-k, top-p and min-p remove at -inf (sampled params)."""
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
    if params.min_p > 0.0:
        # Hugging Face's MinPLogitsWarper: drop tokens below min_p x the top probability (never the top one)
        probs = scores.softmax(dim=-1)
        scores = scores.masked_fill(probs < params.min_p * probs.amax(dim=-1, keepdim=True), -math.inf)
    return scores


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
    never drop the most likely token); min-p drops what is below min_p x the most likely token's
    probability; finally softmax over what is left. History-dependent processing (`process_logits`) comes
    before, on the raw logits.
    """
    if params.greedy:
        top = logits.argmax(dim=-1, keepdim=True)
        return torch.zeros(logits.shape, dtype=torch.float32, device=logits.device).scatter_(-1, top, 1.0)
    return _filtered_scores(logits, params).softmax(dim=-1)


def sampling_logprobs(
    # [..., vocab_size] logits after `process_logits`
    logits: torch.Tensor,
    params: SamplingParams,
) -> torch.Tensor:
    """float32 log-probabilities of the distribution the request's tokens are drawn from (-inf: removed).

    Sampled params: the log of `target_probs` (temperature, top-k, top-p, min-p applied). Greedy params
    take the argmax of the processed logits, whose one-hot carries no information, so they report the
    temperature-1 distribution those logits define (penalties and min_tokens applied, no truncation).
    """
    if params.greedy:
        return logits.float().log_softmax(dim=-1)
    return _filtered_scores(logits, params).log_softmax(dim=-1)


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability and the `top` most likely (id, log-probability) pairs."""

    token: int
    logprob: float
    top: tuple[tuple[int, float], ...] = ()


def token_logprobs(
    # [m, vocab_size] from `sampling_logprobs`
    logprobs: torch.Tensor,
    tokens: list[int] | tuple[int, ...],
    top: int,
) -> list[TokenLogprob]:
    """The log-probability of tokens[i] under row i and row i's `top` best tokens with a nonzero
    probability (one host transfer)."""
    m = len(tokens)
    if m == 0:
        return []
    rows = logprobs[:m]
    chosen = rows.gather(1, torch.as_tensor(list(tokens), dtype=torch.long, device=rows.device)[:, None])  # [m, 1]
    if top > 0:
        values, ids = rows.topk(min(top, rows.shape[-1]), dim=-1)  # [m, top] each
        best_lp, best_ids = values.tolist(), ids.tolist()
    else:
        best_lp, best_ids = [[]] * m, [[]] * m
    # tokens the processing removed (-inf) are not among the likely ones, even when fewer than `top` remain
    return [TokenLogprob(int(t), float(lp[0]), tuple((a, b) for a, b in zip(i, v) if b != -math.inf))
            for t, lp, i, v in zip(tokens, chosen.tolist(), best_ids, best_lp)]


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


# keeps the coupling streams apart from the generators derive_seed keys for the same (seed, position)
_COUPLING_SALT = 0xC0FFEE5EED


def coupling_noise(seed: int, position: int, size: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """[size] float64 Exp(1) variates E_v for the token at absolute `position` of a seeded request: a function
    of (seed, position) alone, drawn on the CPU whatever the device. Read-only: the tensor is memoised (the
    drafter, the engine's re-draw and verification each read a position's noise within one round; 0.35 ms
    per position for a 49,152-token vocabulary).

    A seeded sampled request commits at each position the token `coupled_choice(p, E)` = argmax_v p_v / E_v
    (the exponential race, i.e. Gumbel-max): exactly one draw from p, and the drafter's tokens are re-drawn
    from their own q with the same E (`dspark_core.verification.couple_draft`), so a draft is accepted when
    both races pick the same token. Each committed token therefore depends on the seed, its position and the
    distribution there alone, never on how many tokens were drafted or verified around it.
    """
    if not _is_int(seed) or not 0 <= seed < _MAX_SEED:
        raise InvalidArgument("seed", seed, "must be an integer in [0, 2**64)")
    if not _is_int(position) or position < 0:
        raise InvalidArgument("position", position, "must be an integer >= 0")
    return _coupling_noise(int(seed), int(position), int(size)).to(device)


@functools.lru_cache(maxsize=64)  # a round's positions of a few seeded requests (~25 MB at 49,152 tokens)
def _coupling_noise(seed: int, position: int, size: int) -> torch.Tensor:
    g = torch.Generator(device="cpu")
    g.manual_seed(derive_seed(seed, position) ^ _COUPLING_SALT)
    u = torch.rand(size, generator=g, dtype=torch.float64)
    # 1 - u lies in (0, 1]: E = -log(1 - u) is finite and >= 0; E = 0 (u = 0) wins outright, as it should
    return -torch.log1p(-u)


def coupled_choice(
    # [size] non-negative weights (normalised or not)
    weights: torch.Tensor,
    # [size] coupling_noise for this position, or the noise at the weights' token ids
    noise: torch.Tensor,
) -> int:
    """The index the exponential race picks: argmax weights / noise over the indices with weight > 0 (a
    categorical draw from the normalised weights). Raises InvalidArgument when no weight is positive."""
    w = weights.double()
    score = torch.where(w > 0, w / noise.to(w.device), torch.full_like(w, -1.0))
    best = int(score.argmax())
    if not w[best] > 0:
        raise InvalidArgument("weights", "all zero", "must have a positive total mass")
    return best


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
