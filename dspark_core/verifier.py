"""The verifier side of a round: prefill and batched ragged verification on the target, per request.

`Verifier` owns the target runtime and, for every request it serves, the request's KV cache, sampling
parameters and random generator. It is the unit the embedded engine calls in-process and the verifier
service wraps over gRPC, so both deployments run the same code:
- `prefill(items)`: one batched forward over whole prompts; samples each request's first token (the
  anchor) and returns the prompt positions' tapped features for the drafter;
- `verify(items)`: one batched forward over each request's `[anchor, d_1..d_l]`, lossless acceptance,
  rollback of the KV cache to the accepted prefix, and the committed positions' features;
- `resume(...)`: rebuild a request's KV cache from its committed tokens (failover to this replica);
- `release(request_id)`: free it.

Knows nothing about drafters, scheduling, text or networking.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from .errors import InvalidArgument, NotFound
from .sampling import SamplingParams, TokenHistory, TokenLogprob, derive_seed, make_generator
from .target import Sequence, TargetRuntime
from .verification import DraftBlock, verify_block


@dataclass(frozen=True)
class PrefillItem:
    request_id: str
    prompt_ids: tuple[int, ...]
    params: SamplingParams
    # trailing prompt tokens that were generated (a request adopted from a lost scheduler resumes from its
    # prompt + what it had generated): penalties and min_tokens count them as output, as they did before
    generated_in_prompt: int = 0
    # how many of the prompt's last positions' features to return (None: every position; 0: none): a drafter
    # whose context begins there (EngineConfig.draft_window) never reads the others, so they are not sent
    feature_rows: int | None = None


@dataclass(frozen=True)
class VerifyItem:
    request_id: str
    anchor: int  # newest committed token, not yet in the KV cache
    anchor_pos: int  # its position; the KV cache is rolled back to exactly this length first
    draft: DraftBlock


@dataclass
class StepResult:
    """What the target committed for one request in a prefill or verify call."""

    request_id: str
    # tokens committed this call: accepted drafts then the recovered / bonus token (prefill: the first token)
    tokens: list[int]
    num_accepted: int
    stopped: bool  # a stop token was committed (the output ends with it)
    # [n, num_taps * hidden] target features of the positions that became context this call
    # (prefill: the prompt; verify: the anchor and the accepted drafts)
    features: torch.Tensor
    features_start: int  # position of features[0]
    context_tokens: list[int]  # the tokens at those positions
    # one per token of `tokens`, from the request's processed target distribution (requests with logprobs)
    logprobs: list[TokenLogprob] | None = None


@dataclass(eq=False)
class _Slot:
    seq: Sequence
    params: SamplingParams
    generator: torch.Generator
    # every committed token, prompt first (the last one is the anchor): what penalties and min_tokens count
    tokens: list[int]
    prompt_len: int

    def history(self, length: int) -> TokenHistory:
        """The request's history up to position `length` (exclusive)."""
        return TokenHistory(self.tokens[: self.prompt_len], self.tokens[self.prompt_len: length])


def validate_prompt_ids(ids, vocab_size: int | None, max_context: int | None, field: str = "prompt_ids") -> None:
    """The one prompt check (engine, verifier, services): refuse a prompt a target with this vocabulary and
    context window can never serve: empty, too long, or with unknown token ids (None: not known yet)."""
    if not ids:
        raise InvalidArgument(field, list(ids), "must not be empty")
    if max_context is not None and len(ids) >= max_context:
        raise InvalidArgument(field, f"{len(ids)} tokens",
                              f"must be shorter than the context window ({max_context} tokens)")
    bad = [] if vocab_size is None else [t for t in ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidArgument(field, bad[:5], f"must be token ids in [0, {vocab_size})")


def _listed(logprobs) -> list[TokenLogprob] | None:
    return None if logprobs is None else list(logprobs)


class Verifier:
    """`on_forward(tokens, seconds, context_length, requests)`, when set, is called after every verify pass
    with the tokens it carried, its duration on `clock` (seconds; on an accelerator the pass is synchronised
    first), the mean context per request and the number of requests: what
    `dspark_core.cost_model.OnlineSpsTable.observe` takes."""

    def __init__(self, target: TargetRuntime, clock: Callable[[], float] = time.perf_counter,
                 isolate_seeded: bool = True):
        self.target = target
        self.isolate_seeded = isolate_seeded
        self._slots: dict[str, _Slot] = {}
        self.clock = clock
        self.on_forward: Callable[[int, float, float, int], object] | None = None

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._slots

    @property
    def num_active(self) -> int:
        return len(self._slots)

    def validate_prompt(self, ids) -> None:
        """Refuse a prompt this target can never serve (see validate_prompt_ids)."""
        validate_prompt_ids(ids, self.target.vocab_size, self.target.max_context)

    def _check_prompt(self, request_id: str, ids) -> None:
        self.validate_prompt(ids)
        if request_id in self._slots:
            raise InvalidArgument("request_id", request_id, "is already active on this verifier")

    def prefill(self, items: list[PrefillItem]) -> list[StepResult]:
        """Prefill the prompts in one batched forward. Items with the same prompt (the n choices of one
        request) share it: the prompt runs once, the others get a copy of its KV cache, and each samples
        its own first token from the shared last-position logits with its own generator."""
        seen: set[str] = set()
        for it in items:
            self._check_prompt(it.request_id, it.prompt_ids)
            if it.request_id in seen:  # two items of one call under one id: the second would orphan the first's KV
                raise InvalidArgument("request_id", it.request_id, "appears twice in one prefill")
            seen.add(it.request_id)
            g = it.generated_in_prompt
            if not (isinstance(g, int) and 0 <= g < len(it.prompt_ids)):
                raise InvalidArgument("generated_in_prompt", g,
                                      f"must be an integer in [0, {len(it.prompt_ids)}) (the prompt's length)")
            n = it.feature_rows
            if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
                raise InvalidArgument("feature_rows", n, "must be None (every prompt position) or an integer >= 0")
        first_of: dict[tuple[int, ...], int] = {}  # prompt -> index of the item whose forward it shares
        unique = [first_of.setdefault(tuple(it.prompt_ids), i) == i for i, it in enumerate(items)]
        owners = [i for i, u in enumerate(unique) if u]
        # every item holds a sequence (shared prompts too, as copies) reserving its whole context
        reserved = [self.target.kv_reservation(len(it.prompt_ids), it.params.max_new_tokens) for it in items]
        self.target.check_kv_room(reserved)
        seqs = {i: self.target.new_sequence() for i in owners}
        try:
            # one prompt a pass where that is faster and gives the same bits (TargetRuntime.prefills_alone)
            alone = getattr(self.target, "prefills_alone", False)
            out = self._forward([(seqs[i], list(items[i].prompt_ids)) for i in owners],
                                [items[i].params for i in owners], each_alone=alone, last_logits_only=True)
            for i, it in enumerate(items):
                if not unique[i]:
                    seqs[i] = self.target.fork(seqs[first_of[tuple(it.prompt_ids)]])
        except Exception:
            for seq in seqs.values():
                self.target.release(seq)
            raise
        for i, seq in seqs.items():
            seq.reserved = reserved[i]  # a copy of a shared prompt reserves what its own request may generate
        row = {i: r for r, i in enumerate(owners)}
        results, slots = [], {}
        try:
            for i, it in enumerate(items):
                s = _Slot(seqs[i], it.params, make_generator(it.params.seed), list(it.prompt_ids),
                          len(it.prompt_ids) - it.generated_in_prompt)
                r = row[first_of[tuple(it.prompt_ids)]]
                logits, taps = out[r]
                # the first token is a round with no drafts: exactly plain sampling, with the request's processing
                first = verify_block(logits[:1], DraftBlock(tokens=()), s.params, s.generator,
                                     s.history(len(s.tokens)), position=self._position(len(it.prompt_ids)))
                s.tokens.extend(first.tokens)
                slots[it.request_id] = s
                cut = 0 if it.feature_rows is None else max(0, len(it.prompt_ids) - it.feature_rows)
                rows = taps[cut:].clone() if cut else taps  # a copy: the whole prompt's taps are freed
                results.append(StepResult(it.request_id, list(first.tokens), 0, first.stopped, rows, cut,
                                          list(it.prompt_ids[cut:]), _listed(first.logprobs)))
        except Exception:
            # all or nothing: one item's first token failed (its sampling values), so no item of the call is
            # left active here (the caller retries the others alone, under the same ids) and no KV leaks
            for seq in seqs.values():
                self.target.release(seq)
            raise
        self._slots.update(slots)
        return results

    def _position(self, position: int) -> int | None:
        """The position verification keys a seeded request's coupling by; None (plain speculative sampling
        from the request's seeded streams) when seeded requests are not isolated."""
        return position if self.isolate_seeded else None

    def _forward(self, batch: list, params: list[SamplingParams], each_alone: bool = False, **kw
                 ) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """target.forward over [(sequence, tokens)] -> [(logits, taps)] per entry, except that each seeded
        sampled request runs in a pass of its own where a batched forward rounds differently with the batch's
        shape (dense matmuls): a seeded request's logits and features (which its drafts come from) must not
        depend on what else runs. Where the target's passes are batch-invariant (packed weights on the CPU)
        they share the pass with the same bits. Unseeded and greedy requests share one pass (and, without
        `isolate_seeded`, all). `each_alone`: every entry in a pass of its own (prompts, where the target
        prefills faster that way)."""
        if each_alone:
            alone = list(range(len(batch)))
        else:
            alone = [i for i, p in enumerate(params) if p.seed is not None and not p.greedy] \
                if self.isolate_seeded else []
            invariant = getattr(self.target, "batch_invariant", None)
            if alone and invariant is not None and invariant(max(len(t) for _, t in batch)):
                alone = []
        solo = set(alone)
        rest = [i for i in range(len(batch)) if i not in solo]
        out: list = [None] * len(batch)
        for group in [[i] for i in alone] + ([rest] if rest else []):
            res = self.target.forward([batch[i] for i in group], **kw)
            for j, i in enumerate(group):
                out[i] = (res.logits_of(j), res.taps_of(j))
        return out

    def resume(self, request_id: str, prompt_ids, generated_ids, params: SamplingParams) -> StepResult:
        """Rebuild the KV cache of a request whose committed tokens are known (its anchor is the last one).

        Returns the features of every position before the anchor, for a drafter that lost its state too.
        """
        ids = list(prompt_ids) + list(generated_ids)
        if not generated_ids:
            raise InvalidArgument("generated_ids", list(generated_ids), "must hold at least the anchor token")
        vocab = self.target.vocab_size
        bad = [t for t in generated_ids if not 0 <= t < vocab]  # the anchor too: no prompt check covers it
        if bad:
            raise InvalidArgument("generated_ids", bad[:5], f"must be token ids in [0, {vocab})")
        self._check_prompt(request_id, ids[:-1])
        reserved = self.target.kv_reservation(len(ids), params.max_new_tokens - len(generated_ids))
        self.target.check_kv_room([reserved])
        s = _Slot(self.target.new_sequence(), params, make_generator(derive_seed(params.seed, len(ids))), ids,
                  len(prompt_ids))
        s.seq.reserved = reserved
        try:
            out = self.target.forward([(s.seq, ids[:-1])], last_logits_only=True)
        except Exception:
            self.target.release(s.seq)
            raise
        self._slots[request_id] = s
        return StepResult(request_id, [], 0, False, out.taps_of(0), 0, ids[:-1])

    def verify(self, items: list[VerifyItem]) -> list[StepResult]:
        slots = []
        for it in items:
            s = self._slots.get(it.request_id)
            if s is None:
                raise NotFound(f"request {it.request_id!r} is not active on this verifier")
            if not 0 <= it.anchor_pos <= s.seq.length:
                raise InvalidArgument("anchor_pos", it.anchor_pos,
                                      f"must be <= the cached length {s.seq.length} of {it.request_id!r}")
            if it.anchor_pos + 1 + len(it.draft.tokens) > self.target.max_context:
                raise InvalidArgument("draft", f"{len(it.draft.tokens)} tokens",
                                      f"must fit in the context window ({self.target.max_context})")
            # past what admission reserved for it (a caller running a request beyond its max_new_tokens): only
            # where the KV budget has the room
            self.target.extend_reservation(s.seq, it.anchor_pos + 1 + len(it.draft.tokens))
            # Idempotent retries: whatever a lost reply committed is rolled back first.
            self.target.truncate(s.seq, it.anchor_pos)
            slots.append(s)
        t0 = self.clock()
        out = self._forward([(s.seq, [it.anchor, *it.draft.tokens]) for s, it in zip(slots, items)],
                            [s.params for s in slots])
        if self.on_forward is not None and items:
            device = getattr(self.target, "device", None)
            if getattr(device, "type", None) == "cuda":
                torch.cuda.synchronize(device)
            self.on_forward(sum(1 + len(it.draft.tokens) for it in items), self.clock() - t0,
                            sum(it.anchor_pos for it in items) / len(items), len(items))
        results = []
        for i, (it, s) in enumerate(zip(items, slots)):
            # the committed tokens before the anchor, then the anchor (it may be news to a resumed slot)
            del s.tokens[it.anchor_pos:]
            s.tokens.append(it.anchor)
            if s.params.seed is not None and not s.params.greedy:
                # the round's draws are a function of (seed, anchor position) alone: a retried or resumed
                # round, or one batched differently, draws the same numbers
                s.generator = make_generator(derive_seed(s.params.seed, it.anchor_pos))
            logits, taps = out[i]
            outcome = verify_block(logits, it.draft, s.params, s.generator, s.history(len(s.tokens)),
                                   position=self._position(it.anchor_pos + 1))
            a = outcome.num_accepted
            self.target.truncate(s.seq, it.anchor_pos + a + 1)
            s.tokens.extend(outcome.tokens)
            results.append(StepResult(it.request_id, list(outcome.tokens), a, outcome.stopped,
                                      taps[: a + 1], it.anchor_pos, [it.anchor, *it.draft.tokens[:a]],
                                      _listed(outcome.logprobs)))
        return results

    def release(self, request_id: str) -> bool:
        s = self._slots.pop(request_id, None)
        if s is None:
            return False
        self.target.release(s.seq)
        return True
