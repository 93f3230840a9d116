"""The protocol the engine calls on every drafter, and its per-round data types.

One drafting round for a batch of requests is one `Drafter.propose(items)` call. Each `ProposeItem`
carries a request's opaque drafter state (from `new_state_for(request_id)`, mutated by the drafter, handed
back with `release_state` when the request ends), the target
features of the positions committed since the last call and the new anchor token. The drafter returns
one `Proposal` per item: `gamma` draft tokens and, when sampling, the top-k support and renormalised
draft probabilities the verifier needs for lossless rejection sampling.

Timeline of one request (positions are token indices; the anchor has no target state yet):
- after prefill: new_features = prompt positions 0..T-1, new_tokens = the prompt, anchor = first
  target token at position T;
- after a round with `a` accepted drafts: new_features = verify-pass features of positions
  start..start+a, new_tokens = [old anchor, accepted drafts], anchor = recovered / bonus token.

Drafters know nothing about tokenization, gRPC, verification or scheduling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from dspark_core.errors import InvalidArgument

# Top-k of the draft distribution that drafts are sampled from (and that travels with each draft token).
# Truncation is lossless but lowers acceptance by the draft mass it cuts: on the bundled 4,096-token
# drafters at T = 1, top-32 cost 19-24% of tau (1.74 vs 2.28 on math500, 1.86 vs 2.30 on mbpp) and
# top-1024 cost 5-6%. 4,096 is the whole vocabulary of small models and a bounded message (7 slots x
# 4,096 x 8 bytes) for large ones, whose tails past the top few thousand are negligible. A drafter whose own
# measurement says less costs nothing sets `draft_support_size` in its config.json (SmolLM2's DSpark: 256, tau
# unchanged at T = 1, its sampled heads 1.16 -> 0.76 ms a round).
DEFAULT_SUPPORT_SIZE = 4096


@dataclass
class ProposeItem:
    """One request's input for one drafting round."""

    state: object  # from drafter.new_state(); the drafter mutates it
    # [n_new, L * H] target taps (concat of target_layer_ids outputs) for the newly committed positions
    new_features: torch.Tensor
    # position of new_features[0]: the state's next position, or any position for a state that holds nothing yet
    # (the request's drafter context then begins there: the positions before it are never seen)
    new_positions_start: int
    new_tokens: list[int]  # committed tokens at those positions (len n_new)
    anchor: int  # newest committed token, no target state yet
    anchor_pos: int  # == new_positions_start + n_new
    temperature: float = 0.0  # 0 = greedy (argmax, no randomness)
    generator: torch.Generator | None = None
    # a seeded sampled request verified by position-keyed coupling: slot k is drawn by the exponential race
    # of (coupling_seed, anchor_pos + 1 + k), as verification draws the target's token there (None: drawn
    # with a uniform from `generator`)
    coupling_seed: int | None = None
    # the request's own processing beyond temperature / top-k / top-p (penalties, min_tokens, min_p; see
    # DraftProcessing): the drafter chooses every slot from its logits processed as the target's will be
    processing: "DraftProcessing | None" = None


@dataclass(frozen=True)
class DraftProcessing:
    """What verification will do to the target's logits of a request, for the drafter to do to its own.

    `params` (a `dspark_core.sampling.SamplingParams` with `processed`) and `history` (its
    `TokenHistory`: the prompt and the generated tokens up to and including the anchor). Slot k's logits get
    the penalties with history + the block's slots 1..k-1 counted (exact: the drafter's raw logits, so the
    repetition penalty's sign rule is the target's), the stop ids masked while min_tokens is not reached,
    and min-p on the tempered distribution. A greedy request drafts the argmax of that, the token the
    target's processed argmax is most likely to be; a sampled one draws from it, and the proposal carries the
    processed q that verification then compares against. Losslessness never depends on it (verification
    checks every draft against the processed target); acceptance does.
    """

    params: object
    history: object


@dataclass
class Proposal:
    """One request's draft for one round."""

    tokens: list[int]  # [gamma] d_1..d_gamma
    # [gamma, k] long: top-k support each token was sampled from (None when greedy)
    support_ids: torch.Tensor | None = None
    # [gamma, k] float32: draft probabilities q on that support, renormalised (None when greedy)
    support_probs: torch.Tensor | None = None
    # [gamma] calibrated per-slot acceptance probabilities c_k = sigmoid(logit_k / t_k) (None without a head)
    confidences: torch.Tensor | None = None
    # [gamma] raw confidence logits
    confidence_logits: torch.Tensor | None = None
    # the item's `processing` was applied by the drafter (tokens and q are already the processed ones)
    processed: bool = False


@runtime_checkable
class Drafter(Protocol):
    name: str
    kind: str  # "dspark" | "dflash" | "eagle3"
    block_size: int  # gamma: draft tokens per proposal
    target_layer_ids: tuple[int, ...]
    support_size: int  # k of the top-k support when sampling
    vocab_size: int
    has_confidence: bool  # proposals carry per-position confidences

    def new_state(self) -> object: ...

    def new_state_for(self, request_id: str) -> object:
        """The state of request `request_id` (the engine calls this once per request): drafters that key
        state by request (a remote one) use the id; local ones return `new_state()`."""
        ...

    def release_state(self, state: object) -> None:
        """The request of `state` is finished: free what the drafter holds for it (a no-op for local ones)."""
        ...

    def propose(self, items: list[ProposeItem]) -> list[Proposal]: ...


class LocalStates:
    """`new_state_for` / `release_state` for drafters whose whole per-request state is the object that
    `new_state()` returns (garbage-collected with the request)."""

    def new_state_for(self, request_id: str) -> object:
        return self.new_state()

    def release_state(self, state: object) -> None:
        return None


def context_dtype(config) -> "torch.dtype | None":
    """The torch dtype of a drafter config's `context_feature_dtype` (None when it has none)."""
    name = getattr(config, "context_feature_dtype", None)
    return getattr(torch, name) if name else None


def trained_features(features: torch.Tensor, config) -> torch.Tensor:
    """Context features rounded to the precision the drafter of `config` was trained on (`context_feature_dtype`;
    none: as they come). Rounding is idempotent, so features already in it (from a verifier pod that sends them
    so, or from the engine, which keeps them so) give the same drafts as the float32 ones they were rounded from."""
    dtype = context_dtype(config)
    return features if dtype is None or features.dtype == dtype else features.to(dtype)


def validate_items(items: list[ProposeItem], state_type: type, feature_size: int, vocab_size: int,
                   max_positions: int | None = None) -> None:
    """Raise InvalidArgument for anything a drafter cannot work with; checks positions are contiguous and,
    with `max_positions` (the drafter's max_position_embeddings), that every anchor lies below it (a context
    may begin at any position: the position tables must not grow to what a client names)."""
    if not items:
        raise InvalidArgument("items", items, "must hold at least one ProposeItem")
    seen: set[int] = set()
    for i, it in enumerate(items):
        where = f"items[{i}]"
        if not isinstance(it.state, state_type):
            raise InvalidArgument(f"{where}.state", type(it.state).__name__,
                                  f"must be a {state_type.__name__} from this drafter's new_state()")
        if id(it.state) in seen:
            raise InvalidArgument(f"{where}.state", "shared", "must not appear twice in one propose() call")
        seen.add(id(it.state))
        f = it.new_features
        if not isinstance(f, torch.Tensor) or f.dim() != 2 or f.shape[1] != feature_size:
            shape = list(f.shape) if isinstance(f, torch.Tensor) else type(f).__name__
            raise InvalidArgument(f"{where}.new_features", shape, f"must be a [n_new, {feature_size}] tensor")
        n_new = f.shape[0]
        if len(it.new_tokens) != n_new:
            raise InvalidArgument(f"{where}.new_tokens", len(it.new_tokens), f"must have n_new = {n_new} tokens")
        start = it.new_positions_start
        if isinstance(start, bool) or not isinstance(start, int) or start < 0:
            raise InvalidArgument(f"{where}.new_positions_start", start, "must be an integer >= 0")
        if start != it.state.length and not _fresh(it.state):
            raise InvalidArgument(f"{where}.new_positions_start", start,
                                  f"must continue the drafter state (next position {it.state.length})")
        if it.anchor_pos != it.new_positions_start + n_new:
            raise InvalidArgument(f"{where}.anchor_pos", it.anchor_pos,
                                  f"must equal new_positions_start + n_new = {it.new_positions_start + n_new}")
        if max_positions is not None and it.anchor_pos >= max_positions:
            raise InvalidArgument(f"{where}.anchor_pos", it.anchor_pos,
                                  f"must be below the drafter's max_position_embeddings ({max_positions})")
        if it.anchor_pos < 1:
            raise InvalidArgument(f"{where}.anchor_pos", it.anchor_pos, "must be >= 1 (prefill a non-empty prompt)")
        for tok in (*it.new_tokens, it.anchor):
            if not 0 <= int(tok) < vocab_size:
                raise InvalidArgument(f"{where}.tokens", tok, f"must be token ids in [0, {vocab_size})")
        t = it.temperature
        if isinstance(t, bool) or not isinstance(t, (int, float)) or not math.isfinite(t) or t < 0:
            raise InvalidArgument(f"{where}.temperature", t, "must be a finite number >= 0")


def _fresh(state) -> bool:
    """Whether a drafter state holds no context yet (its first item may begin at any position)."""
    return state.cache.length == 0


def begin_contexts(items: list[ProposeItem]) -> None:
    """After `validate_items`: a state that holds nothing yet begins its context at its item's start (the
    positions before it stay unseen: a drafter context window). Its K/V rows then hold positions first.."""
    for it in items:
        if _fresh(it.state):
            it.state.first = it.new_positions_start


@dataclass
class Coupling:
    """The noise of the batch rows drawn by coupling (`ProposeItem.coupling_seed`)."""

    rows: torch.Tensor  # [n] long
    noise: torch.Tensor  # [n, gamma, vocab] float64 Exp(1): slot k of row j = coupling_noise(seed, anchor_pos + 1 + k)

    def at(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.rows, self.noise[:, k]


def draw_coupling(items: list[ProposeItem], gamma: int, vocab_size: int, device: torch.device) -> Coupling | None:
    """The coupling noise of every sampled item with a `coupling_seed` (None when there is none)."""
    from dspark_core.sampling import coupling_noise

    rows = [i for i, it in enumerate(items) if it.coupling_seed is not None and it.temperature > 0]
    if not rows:
        return None
    noise = torch.stack([torch.stack([coupling_noise(items[i].coupling_seed, items[i].anchor_pos + 1 + k, vocab_size)
                                      for k in range(gamma)]) for i in rows])
    return Coupling(torch.tensor(rows, dtype=torch.long, device=device), noise.to(device))


def draw_uniforms(items: list[ProposeItem], gamma: int, device: torch.device) -> torch.Tensor | None:
    """[B, gamma] uniforms, one row per sampled request from its own generator (None if all greedy).

    Drawn up front, gamma per sampled request per round, so a request's stream does not depend on
    which other requests share the batch.
    """
    if all(it.temperature == 0 for it in items):
        return None
    rows = []
    for it in items:
        if it.temperature == 0:
            rows.append(torch.zeros(gamma))
        elif it.generator is None:
            rows.append(torch.rand(gamma))
        else:
            rows.append(torch.rand(gamma, generator=it.generator, device=it.generator.device).cpu())
    return torch.stack(rows).to(device)  # [B, gamma]
