"""Lossless verification of drafted tokens (speculative sampling), per request and for a ragged batch.

Given the target's logits at [anchor, d_1..d_n] and the draft distribution q_i each d_i was sampled
from, decide which drafts to keep and which token comes next, so that the committed tokens are
distributed exactly as plain sampling from the target (temperature, top-k and top-p applied by
`dspark_core.sampling.target_probs`). Greedy requests accept while the draft equals the target argmax
and draw no random numbers; sampled requests draw one uniform per tested draft and one for the final
token, so a request with no drafts draws exactly what `sample_token` would. A seeded sampled request
given its position (`verify_block(..., position=)`) is verified by coupling instead: the target's token at
each absolute position is the exponential race of (seed, position) (`dspark_core.sampling.coupled_choice`),
a draft is kept iff it equals that token, and `couple_draft` re-draws the drafts with the same noise, so the
output depends on the seed alone, not on how many tokens were drafted or verified.

A request's own processing (penalties, min_tokens: `dspark_core.sampling.process_logits`) makes row i's
distribution depend on the request's history and on the drafts d_1..d_i in front of it, so verification
applies it per row with those drafts counted: the committed tokens follow the processed target exactly.
`process_draft` applies the same processing to a draft block before verification (for acceptance, not for
correctness: any draft distribution q is lossless as long as verification compares against the q the
token was actually drawn from, which `process_draft` returns). Logprobs of committed tokens (requests
with `logprobs` set) come from the same processed target rows.

This module knows nothing about drafters, models, KV caches or tokenizers. It does not enforce
`max_new_tokens`: the caller truncates a round that would run past it.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field

import math

import torch

from dspark_core.errors import InvalidArgument
from dspark_core.sampling import (SamplingParams, TokenHistory, TokenLogprob, _inverse_cdf, _is_int, _uniform,
                                  coupled_choice, coupling_noise, process_logits, sample_from_probs,
                                  sampling_logprobs, target_probs, token_logprobs)

_ROW_SUM_TOLERANCE = 1e-3  # a draft row summing further from 1 is a caller bug (logits passed as probs, ...)
_MIN_RESIDUAL_MASS = 1e-12  # below this, max(0, p - q) is rounding noise: sample from p instead


@dataclass(frozen=True, eq=False)
class DraftBlock:
    """The n tokens drafted for one request and, for sampled requests, the distribution each came from.

    Row i of the support describes q_i: `support_probs[i, j]` is the draft probability of token
    `support_ids[i, j]`; tokens outside the row have q = 0. Each drafted token must be in its row with
    q > 0. Greedy requests may leave the support as None.
    """

    tokens: tuple[int, ...]
    # [n, k] integer token ids (k >= 1 when n >= 1)
    support_ids: torch.Tensor | None = None
    # [n, k] float, each row sums to 1
    support_probs: torch.Tensor | None = None
    # q_i(d_i) for each draft, read from the support at construction (empty without a support)
    draft_probs: tuple[float, ...] = field(init=False, repr=False)
    # largest id in the support (-1 without a support), checked against the vocabulary at verification
    max_support_id: int = field(init=False, repr=False)

    def __post_init__(self) -> None:
        try:
            tokens = tuple(self.tokens)
        except TypeError:
            raise InvalidArgument("tokens", self.tokens, "must be a sequence of token ids") from None
        if not all(_is_int(t) and t >= 0 for t in tokens):
            raise InvalidArgument("tokens", self.tokens, "must contain only integers >= 0")
        tokens = tuple(int(t) for t in tokens)
        object.__setattr__(self, "tokens", tokens)
        ids, probs = self.support_ids, self.support_probs
        if (ids is None) != (probs is None):
            missing = "support_probs" if probs is None else "support_ids"
            raise InvalidArgument(missing, None, "must be given together with the other support tensor")
        if ids is None:
            object.__setattr__(self, "draft_probs", ())
            object.__setattr__(self, "max_support_id", -1)
            return
        n = len(tokens)
        if not isinstance(ids, torch.Tensor) or ids.dtype not in (torch.int64, torch.int32):
            raise InvalidArgument("support_ids", type(ids).__name__ if not isinstance(ids, torch.Tensor)
                                  else ids.dtype, "must be an int64 or int32 tensor")
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point():
            raise InvalidArgument("support_probs", type(probs).__name__ if not isinstance(probs, torch.Tensor)
                                  else probs.dtype, "must be a floating-point tensor")
        if ids.dim() != 2 or ids.shape[0] != n or (n > 0 and ids.shape[1] < 1):
            raise InvalidArgument("support_ids", tuple(ids.shape), f"must have shape [{n}, k] with k >= 1")
        if probs.shape != ids.shape:
            raise InvalidArgument("support_probs", tuple(probs.shape), f"must match support_ids {tuple(ids.shape)}")
        if probs.device != ids.device:
            raise InvalidArgument("support_probs", str(probs.device), f"must be on support_ids' device {ids.device}")
        if n == 0:
            object.__setattr__(self, "draft_probs", ())
            object.__setattr__(self, "max_support_id", -1)
            return
        drafted = torch.tensor(tokens, dtype=ids.dtype, device=ids.device)  # [n]
        q64 = probs.double()  # [n, k]
        at_draft = (q64 * (ids == drafted[:, None])).sum(dim=-1)  # [n] q_i(d_i)
        checks = torch.stack([
            torch.isfinite(q64).all().double(),
            q64.min(),
            (q64.sum(dim=-1) - 1.0).abs().max(),
            ids.min().double(),
            ids.max().double(),
        ])  # [5]
        values = torch.cat([checks, at_draft]).tolist()  # the one transfer to the host
        (finite, q_min, sum_err, id_min, id_max), at_draft = values[:5], values[5:]
        if not finite or q_min < 0:
            raise InvalidArgument("support_probs", f"min {q_min}", "must hold finite probabilities >= 0")
        if sum_err > _ROW_SUM_TOLERANCE:
            raise InvalidArgument("support_probs", f"a row sum off by {sum_err:.3g}",
                                  f"rows must each sum to 1 (within {_ROW_SUM_TOLERANCE})")
        if id_min < 0:
            raise InvalidArgument("support_ids", int(id_min), "must hold token ids >= 0")
        for i, q in enumerate(at_draft):
            if not q > 0:
                raise InvalidArgument(f"tokens[{i}]", tokens[i],
                                      "must be in row %d of support_ids with draft probability > 0" % i)
        object.__setattr__(self, "draft_probs", tuple(at_draft))
        object.__setattr__(self, "max_support_id", int(id_max))

    def subtract_from(
        self,
        # [vocab_size] float
        dense: torch.Tensor,
        i: int,
    ) -> torch.Tensor:
        """A new tensor [vocab_size]: `dense` minus q_i, with q_i scattered from row i of the support."""
        assert self.support_ids is not None and self.support_probs is not None
        q = self.support_probs[i].to(dense.dtype).neg()  # [k]
        return dense.scatter_add(0, self.support_ids[i].long(), q)


@dataclass(frozen=True)
class VerifyOutcome:
    """What one round commits for one request.

    `tokens` is the accepted drafts then one recovered or bonus token, except when an accepted draft is a
    stop token: the round ends right after it, with no further token. `num_accepted` counts the drafts in
    `tokens`; drafts after an accepted stop token are not tested and not counted.
    """

    num_accepted: int
    tokens: tuple[int, ...]
    stopped: bool
    # one per token of `tokens` when the request asked for logprobs, else None
    logprobs: tuple[TokenLogprob, ...] | None = None

    def __post_init__(self) -> None:
        extra = len(self.tokens) - self.num_accepted
        if self.num_accepted < 0 or extra not in (0, 1) or (extra == 0 and not self.stopped):
            raise InvalidArgument("num_accepted", self.num_accepted,
                                  f"must be len(tokens) - 1, or len(tokens) after a stop; tokens {self.tokens}")


def _finish(accepted: list[int], token: int, stop: tuple[int, ...]) -> VerifyOutcome:
    """Append the recovered or bonus token to the accepted drafts."""
    return VerifyOutcome(len(accepted), tuple(accepted) + (token,), token in stop)


def _verify_greedy(tokens: tuple[int, ...], argmax: list[int], stop: tuple[int, ...]) -> VerifyOutcome:
    """Accept while the draft equals the target argmax; argmax has one entry per row (n + 1)."""
    accepted: list[int] = []
    for i, d in enumerate(tokens):
        if d != argmax[i]:
            return _finish(accepted, argmax[i], stop)
        accepted.append(d)
        if d in stop:
            return VerifyOutcome(len(accepted), tuple(accepted), True)
    return _finish(accepted, argmax[len(tokens)], stop)


def _verify_sampled(
    # [n + 1, vocab_size] after process_logits
    target_logits: torch.Tensor,
    draft: DraftBlock,
    params: SamplingParams,
    generator: torch.Generator,
) -> VerifyOutcome:
    tokens, stop = draft.tokens, params.stop_token_ids
    n = len(tokens)
    probs = target_probs(target_logits, params)  # [n + 1, vocab_size] float32
    if n == 0:
        return _finish([], sample_from_probs(probs[0], generator), stop)
    drafted = torch.tensor([[d] for d in tokens], dtype=torch.long, device=probs.device)  # [n, 1]
    p_at_draft = [row[0] for row in probs[:n].gather(1, drafted).tolist()]  # n floats, p_i(d_i)
    q_at_draft = draft.draft_probs
    accepted: list[int] = []
    for i, d in enumerate(tokens):
        u = _uniform(generator, generator.device).item()  # stays on the generator's device until read
        if u < p_at_draft[i] / q_at_draft[i]:  # accept with probability min(1, p/q)
            accepted.append(d)
            if d in stop:
                return VerifyOutcome(len(accepted), tuple(accepted), True)
            continue
        residual = draft.subtract_from(probs[i], i).clamp_(min=0.0)  # [vocab_size] p_i - q_i, then max(0, .)
        if residual.sum().item() <= _MIN_RESIDUAL_MASS:
            residual = probs[i]
        return _finish(accepted, _inverse_cdf(residual, _uniform(generator, probs.device)), stop)
    return _finish(accepted, sample_from_probs(probs[n], generator), stop)


def _verify_coupled(
    # [n + 1, vocab_size] after process_logits
    target_logits: torch.Tensor,
    draft: DraftBlock,
    params: SamplingParams,
    # absolute position of the token row 0 predicts (the anchor's position + 1)
    position: int,
) -> VerifyOutcome:
    """A seeded request: row i commits x_i = the exponential race over p_i with the noise of (seed, position
    + i); draft d_i is accepted iff d_i == x_i, else x_i is the round's last token. Each committed token is one
    exact draw from the target there whatever was drafted (drafts decide only how many rows one pass
    commits), so the output equals the request's own autoregressive decode with the same seed."""
    tokens, stop = draft.tokens, params.stop_token_ids
    probs = target_probs(target_logits, params)  # [n + 1, vocab_size] float32
    accepted: list[int] = []
    for i in range(len(tokens) + 1):
        x = coupled_choice(probs[i], coupling_noise(params.seed, position + i, probs.shape[1]))
        if i == len(tokens) or tokens[i] != x:
            return _finish(accepted, x, stop)
        accepted.append(x)
        if x in stop:
            return VerifyOutcome(len(accepted), tuple(accepted), True)
    raise AssertionError("unreachable")


def couple_draft(draft: DraftBlock, seed: int, position: int, vocab_size: int) -> DraftBlock:
    """The block with each draft re-drawn from its own q_k by the exponential race of (seed, position + k),
    the noise the verification of a seeded request uses at that position: a draft then survives exactly when
    the target's race picks the same token (an acceptance of at least (1 - TV) / (1 + TV) per slot, against
    1 - TV for independent speculative sampling). The supports are kept; a block without one (greedy) is
    returned unchanged. Only acceptance depends on this: verification of a seeded request is exact for any
    drafts."""
    if not draft.tokens or draft.support_ids is None:
        return draft
    assert draft.support_probs is not None
    ids = draft.support_ids.long().cpu()
    q = draft.support_probs.cpu()
    if int(ids.max()) >= vocab_size:
        raise InvalidArgument("support_ids", int(ids.max()), f"must be < vocab_size {vocab_size}")
    tokens = []
    for k in range(len(draft.tokens)):
        # the noise of the whole vocabulary at this position (as verification draws it), read at the support
        noise = coupling_noise(seed, position + k, vocab_size)[ids[k]]
        tokens.append(int(ids[k, coupled_choice(q[k], noise)]))
    return DraftBlock(tokens=tuple(tokens), support_ids=draft.support_ids, support_probs=draft.support_probs)


def _check_block(num_rows: int, vocab_size: int, draft: DraftBlock, params: SamplingParams,
                 name: str, value: object) -> None:
    n = len(draft.tokens)
    if num_rows != n + 1:
        raise InvalidArgument(name, value, f"must give n + 1 = {n + 1} rows for {n} draft tokens")
    if n and max(draft.tokens) >= vocab_size:
        raise InvalidArgument("tokens", draft.tokens, f"must be < vocab_size {vocab_size}")
    if params.greedy or n == 0:
        return
    if draft.support_ids is None:
        raise InvalidArgument("support_probs", None, "is required for sampled (temperature > 0) requests")
    if draft.max_support_id >= vocab_size:
        raise InvalidArgument("support_ids", draft.max_support_id, f"must be < vocab_size {vocab_size}")


def _with_logprobs(outcome: VerifyOutcome, processed: torch.Tensor, params: SamplingParams) -> VerifyOutcome:
    """Attach the committed tokens' logprobs (row j of `processed` predicts token j of the outcome)."""
    if params.logprobs is None:
        return outcome
    m = len(outcome.tokens)
    rows = sampling_logprobs(processed[:m], params)  # [m, vocab_size]
    return dataclasses.replace(outcome, logprobs=tuple(token_logprobs(rows, outcome.tokens, params.logprobs)))


def _verify_one(logits: torch.Tensor, draft: DraftBlock, params: SamplingParams, generator: torch.Generator,
                history: TokenHistory | None, argmax: list[int] | None = None,
                position: int | None = None) -> VerifyOutcome:
    """`logits` [n + 1, vocab_size] raw; `argmax` of those rows when the caller has it already."""
    processed = process_logits(logits, params, history, draft.tokens)
    if params.greedy:
        if argmax is None or processed is not logits:
            argmax = processed.argmax(dim=-1).tolist()
        outcome = _verify_greedy(draft.tokens, argmax, params.stop_token_ids)
    elif params.seed is not None and position is not None:
        outcome = _verify_coupled(processed, draft, params, position)
    else:
        outcome = _verify_sampled(processed, draft, params, generator)
    return _with_logprobs(outcome, processed, params)


def verify_block(
    # [n + 1, vocab_size] raw target logits at [anchor, d_1..d_n]; row i predicts the token after position i
    target_logits: torch.Tensor,
    draft: DraftBlock,
    params: SamplingParams,
    generator: torch.Generator,
    # the request's prompt and generated tokens up to and including the anchor (needed with penalties or
    # min_tokens: row i is processed with history + d_1..d_i)
    history: TokenHistory | None = None,
    # absolute position of the token row 0 predicts (anchor position + 1): with it, a seeded sampled request
    # is verified by position-keyed coupling (`_verify_coupled`) instead of drawing from `generator`
    position: int | None = None,
) -> VerifyOutcome:
    """Verify one request's draft block; the committed tokens are distributed as plain sampling from the
    request's processed target."""
    if target_logits.dim() != 2:
        raise InvalidArgument("target_logits", tuple(target_logits.shape), "must be 2-D [n + 1, vocab_size]")
    _check_block(target_logits.shape[0], target_logits.shape[1], draft, params,
                 "target_logits", tuple(target_logits.shape))
    if position is not None and (not _is_int(position) or position < 0):
        raise InvalidArgument("position", position, "must be None or an integer >= 0")
    return _verify_one(target_logits, draft, params, generator, history, position=position)


def verify_batch(
    # [total_tokens, vocab_size] raw target logits, requests concatenated
    logits: torch.Tensor,
    # [num_requests + 1] cumulative row offsets, starting at 0 and ending at total_tokens
    cu_seqlens: torch.Tensor,
    drafts: Sequence[DraftBlock],
    params: Sequence[SamplingParams],
    generators: Sequence[torch.Generator],
    histories: Sequence[TokenHistory | None] | None = None,
    # per request, as `verify_block`'s `position`
    positions: Sequence[int | None] | None = None,
) -> list[VerifyOutcome]:
    """Verify a ragged batch: request r owns rows cu_seqlens[r]:cu_seqlens[r + 1] of `logits`.

    Results equal calling `verify_block` per request. Greedy requests share one argmax over all rows and
    one transfer to the host; sampled requests compute target probabilities on their own rows only.
    """
    if logits.dim() != 2:
        raise InvalidArgument("logits", tuple(logits.shape), "must be 2-D [total_tokens, vocab_size]")
    if cu_seqlens.dim() != 1 or cu_seqlens.is_floating_point() or cu_seqlens.shape[0] < 1:
        raise InvalidArgument("cu_seqlens", tuple(cu_seqlens.shape), "must be a 1-D integer tensor [num_requests + 1]")
    offsets = cu_seqlens.tolist()
    num_requests = len(offsets) - 1
    for name, seq in (("drafts", drafts), ("params", params), ("generators", generators)):
        if len(seq) != num_requests:
            raise InvalidArgument(name, len(seq), f"must have one entry per request ({num_requests})")
    if offsets[0] != 0 or offsets[-1] != logits.shape[0] or any(a > b for a, b in zip(offsets, offsets[1:])):
        raise InvalidArgument("cu_seqlens", offsets, f"must rise from 0 to total_tokens {logits.shape[0]}")
    vocab_size = logits.shape[1]
    histories = [None] * num_requests if histories is None else list(histories)
    if len(histories) != num_requests:
        raise InvalidArgument("histories", len(histories), f"must have one entry per request ({num_requests})")
    positions = [None] * num_requests if positions is None else list(positions)
    if len(positions) != num_requests:
        raise InvalidArgument("positions", len(positions), f"must have one entry per request ({num_requests})")
    argmax = logits.argmax(dim=-1).tolist() if any(p.greedy for p in params) else None
    outcomes = []
    for r in range(num_requests):
        start, end = offsets[r], offsets[r + 1]
        _check_block(end - start, vocab_size, drafts[r], params[r], f"cu_seqlens[{r}:{r + 2}]", [start, end])
        outcomes.append(_verify_one(logits[start:end], drafts[r], params[r], generators[r], histories[r],
                                    argmax[start:end] if argmax is not None else None, positions[r]))
    return outcomes


def process_draft(
    draft: DraftBlock,
    params: SamplingParams,
    # the request's prompt and generated tokens up to and including the anchor
    history: TokenHistory,
    generator: torch.Generator,
) -> DraftBlock:
    """The block re-drawn from the drafter's q_k processed as the target will be, position by position.

    For a sampled request with penalties, min_tokens or min_p, slot k's draft distribution q_k (on its
    support) becomes q'_k: the penalties with the history plus the re-drawn d'_1..d'_{k-1} counted, the
    stop tokens masked while min_tokens is not reached, min-p on the result. d'_k is drawn from q'_k by
    maximal coupling with the drafter's own d_k ~ q_k (keep d_k with probability min(1, q'_k(d_k) /
    q_k(d_k)), else draw from the positive part of q'_k - q_k), so d'_k = d_k whenever q'_k and q_k agree
    there, and the block returned carries q'_k as its support probabilities: what verification compares
    the penalised target against. Frequency, presence, min_tokens and min-p are exact on the draft's
    log-probabilities; the repetition penalty is applied to them as if they were the logits (the drafter's
    raw logits, whose sign the penalty depends on, are not in the block).

    Draws one uniform per slot plus one per re-drawn slot from `generator` (the request's draft-side
    stream, never the verifier's). The block is cut before a slot whose processed support has no mass.
    Greedy requests and blocks without a support are returned unchanged.
    """
    n = len(draft.tokens)
    if params.greedy or not params.processed or n == 0 or draft.support_ids is None:
        return draft
    assert draft.support_probs is not None
    ids, q_all = draft.support_ids.long(), draft.support_probs
    dev = q_all.device
    t = params.temperature
    tokens: list[int] = []
    rows: list[torch.Tensor] = []
    output = list(history.output_ids)
    cache: dict = {}
    for k in range(n):
        support, q = ids[k], q_all[k].double()  # [s] each
        pseudo = (q.log() * t).float()[None, :]  # [1, s] logits of q up to a constant (q = softmax(pseudo / t))
        local = _LocalVocab(support, params, history, output + tokens, cache)
        scores = process_logits(pseudo, local.params, local.history)[0] / t  # [s]
        q_new = scores.double().softmax(dim=-1)
        if params.min_p > 0.0:
            q_new = q_new.masked_fill(q_new < params.min_p * q_new.max(), 0.0)
        q_new = q_new.float()  # the row verification reads; draw from exactly these values
        total = float(q_new.double().sum())
        if not total > 0 or not math.isfinite(total):
            break
        q_new = q_new / q_new.sum()
        q_new64 = q_new.double()
        d = draft.tokens[k]
        at = (support == d).nonzero()
        j = int(at[0, 0])
        u = float(_uniform(generator, dev))
        if not (q_new64[j] > 0 and u < float(q_new64[j] / q[j])):
            residual = (q_new64 - q).clamp_(min=0.0)
            if float(residual.sum()) <= _MIN_RESIDUAL_MASS:
                residual = q_new64
            j = _inverse_cdf(residual, _uniform(generator, dev))
            d = int(support[j])
        tokens.append(d)
        rows.append(q_new)
    if not tokens:
        return DraftBlock(tokens=())
    m = len(tokens)
    return DraftBlock(tokens=tuple(tokens), support_ids=draft.support_ids[:m],
                      support_probs=torch.stack(rows).to(draft.support_probs.dtype))


class _LocalVocab:
    """A support row seen as a small vocabulary: the history re-indexed into it, the stop ids too.

    Lets `process_logits` work on [1, s] support scores: a token outside the support cannot be drawn, so
    only the support ids' counts, prompt presence and stop status matter.
    """

    def __init__(self, support: torch.Tensor, params: SamplingParams, history: TokenHistory, output: list[int],
                 cache: dict | None = None):
        """`cache` (one dict per block) keeps the id -> slot map of a support row the previous slot had too."""
        size = support.shape[0]
        if int(support[0]) == 0 and int(support[-1]) == size - 1 and torch.equal(
                support, torch.arange(size, device=support.device)):
            # the whole vocabulary in id order (the drafters' default support): ids are their own slots
            prompt = [x for x in history.prompt_ids if x < size]
            out = [x for x in output if x < size]
            stop = tuple(x for x in params.stop_token_ids if x < size)
        else:
            slot = _slot_map(support, cache)
            prompt = _slots(slot, history.prompt_ids)
            out = _slots(slot, output)
            stop = tuple(_slots(slot, params.stop_token_ids))
        # min_tokens counts all generated tokens, including those outside the support: pad the output with
        # a sentinel the re-indexed counts never see (an id past the support is dropped by bincount's slice)
        pad = [size] * (len(output) - len(out))
        self.history = TokenHistory(prompt, out + pad)
        self.params = dataclasses.replace(params, stop_token_ids=stop)


def _slot_map(support: torch.Tensor, cache: dict | None) -> torch.Tensor:
    """[max id + 1] long: the first slot of each id in `support`, -1 for ids not in it (reused from `cache`
    while the rows are equal: a draft vocabulary's support is the same every slot)."""
    if cache is not None and "support" in cache and torch.equal(cache["support"], support):
        return cache["slot"]
    ids = support.long().cpu()
    size = ids.shape[0]
    slot = torch.full((int(ids.max()) + 1,), size, dtype=torch.long)
    # padded duplicates (zero probability) keep their first slot
    slot.scatter_reduce_(0, ids, torch.arange(size), reduce="amin")
    slot[slot == size] = -1
    if cache is not None:
        cache["support"], cache["slot"] = support, slot
    return slot


def _slots(slot: torch.Tensor, ids) -> list[int]:
    """The slots of `ids` that are in the support (those outside it dropped), in order."""
    if not len(ids):
        return []
    t = torch.as_tensor(list(ids), dtype=torch.long)
    inside = (t >= 0) & (t < slot.shape[0])
    s = slot[t[inside]]
    return s[s >= 0].tolist()
