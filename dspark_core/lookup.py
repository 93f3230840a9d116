"""N-gram lookup drafts beside the drafter (prompt-lookup / llama.cpp's lookup decoding, one request at a time).

A greedy request's output often repeats its prompt or itself: code copies identifiers and whole lines, lists
repeat their scaffolding, and a small target like SmolLM2-135M loops. When the last `n` tokens of a request
occurred earlier in its prompt + output, the tokens that followed them there are a draft that costs nothing to
make and is often right. The engine (EngineConfig.lookup_ngram) verifies that draft instead of the drafter's:
verification decides every token as before (greedy: a draft is accepted only where it is the target's argmax;
sampled: speculative sampling against a one-point draft distribution), so the output is unchanged (in
distribution, sampled); only how many tokens a round accepts moves.

The draft comes from the longest suffix (MIN_NGRAM..MAX_NGRAM tokens) that occurred before, and the longer the
match, the likelier the draft: the policies price it by LOOKUP_ACCEPTANCE, the conditional acceptance per
position and match length measured offline on SmolLM2's own greedy answers to training-split prompts (the six
`data/distill/smollm2-t0*.jsonl` files, 4,040 answers; `python scripts/lookup_acceptance.py
data/distill/smollm2-t0*.jsonl` rebuilds it), and the engine verifies it only when that prices it above the
drafter's own calibrated block. Another target's loops may differ: the table is SmolLM2's.
"""

from __future__ import annotations

from typing import Sequence

from .errors import InvalidArgument

# the longest matched suffix length n (MIN_NGRAM..MAX_NGRAM; MAX_NGRAM: that long or longer) -> conditional
# acceptance at draft positions 1..7 of the lookup draft, greedy, measured by `scripts/lookup_acceptance.py` on
# SmolLM2's own greedy answers to training-split prompts (module docstring; 45,317 lookup rounds)
LOOKUP_ACCEPTANCE: dict[int, tuple[float, ...]] = {
    3: (0.671, 0.709, 0.767, 0.790, 0.806, 0.816, 0.833),  # 29,854 rounds
    4: (0.610, 0.737, 0.786, 0.757, 0.847, 0.826, 0.887),  # 1,422
    5: (0.697, 0.726, 0.824, 0.840, 0.864, 0.860, 0.901),  # 776
    6: (0.715, 0.753, 0.843, 0.835, 0.815, 0.891, 0.860),  # 414
    7: (0.628, 0.770, 0.823, 0.901, 0.899, 0.908, 0.921),  # 304
    8: (0.927, 0.916, 0.925, 0.931, 0.943, 0.946, 0.954),  # 12,547
}
# the same for sampled requests, measured on SmolLM2's T = 1 answers (the seven `smollm2-t1*.jsonl` files of
# data/distill but -f: 5,872 answers, 36,865 lookup rounds). A draft token matching a sampled answer has, in
# expectation, the probability of being accepted against a one-point draft distribution (the target's own
# probability of it), so the replay measures what speculative sampling will accept. Used for every temperature
# > 0 (lower temperatures accept more: the table under-promises there).
LOOKUP_ACCEPTANCE_SAMPLED: dict[int, tuple[float, ...]] = {
    3: (0.505, 0.568, 0.635, 0.670, 0.714, 0.738, 0.793),  # 32,400 rounds
    4: (0.477, 0.611, 0.710, 0.632, 0.749, 0.836, 0.735),  # 1,433
    5: (0.530, 0.640, 0.731, 0.689, 0.714, 0.883, 0.774),  # 492
    6: (0.593, 0.654, 0.755, 0.779, 0.883, 0.792, 0.857),  # 263
    7: (0.541, 0.738, 0.746, 0.682, 0.767, 0.826, 0.789),  # 148
    8: (0.804, 0.822, 0.824, 0.860, 0.849, 0.854, 0.880),  # 2,129
}
MIN_NGRAM, MAX_NGRAM = 3, 8
# serving's default shortest match (dspark serve --lookup-ngram; 0 = off)
DEFAULT_LOOKUP_NGRAM = 3


def check_ngram(n: int, name: str = "lookup_ngram") -> int:
    """`n` as the shortest match of lookup drafts: 0 (off) or an integer in [MIN_NGRAM, MAX_NGRAM]."""
    if isinstance(n, bool) or not isinstance(n, int) or not (n == 0 or MIN_NGRAM <= n <= MAX_NGRAM):
        raise InvalidArgument(name, n, f"must be 0 (off) or an integer in [{MIN_NGRAM}, {MAX_NGRAM}]")
    return n


def acceptance(n: int, length: int, greedy: bool = True) -> list[float]:
    """The conditional acceptance of a lookup draft of `length` tokens whose longest match was `n` tokens, for a
    greedy request or (`greedy=False`) a sampled one."""
    table = (LOOKUP_ACCEPTANCE if greedy else LOOKUP_ACCEPTANCE_SAMPLED)[min(max(n, MIN_NGRAM), MAX_NGRAM)]
    return [table[min(i, len(table) - 1)] for i in range(length)]


class NgramIndex:
    """A growing token sequence and, for each n-gram in it (n from `n` to MAX_NGRAM) that something followed,
    where it last began.

    `extend` appends tokens (O(MAX_NGRAM) each); `propose(k)` returns (draft, n): the `k` tokens that followed the
    latest earlier occurrence of the sequence's longest suffix seen before (n tokens, at least `n`, at most
    MAX_NGRAM), a repeating loop continued past the sequence's end; ([], 0) when no suffix of `n` tokens occurred
    before. One index per request; its memory is bounded by the request's context (measured: a random 8,192-token
    context indexes in 25 ms into 7.5 MB; a proposal takes ~25 us).
    """

    def __init__(self, n: int):
        if isinstance(n, bool) or not isinstance(n, int) or not MIN_NGRAM <= n <= MAX_NGRAM:
            raise InvalidArgument("n", n, f"must be an integer in [{MIN_NGRAM}, {MAX_NGRAM}]")
        self.n = n
        self.tokens: list[int] = []
        self._last: dict[int, dict[tuple[int, ...], int]] = {m: {} for m in range(n, MAX_NGRAM + 1)}

    def __len__(self) -> int:
        return len(self.tokens)

    def extend(self, ids: Sequence[int]) -> None:
        toks, last = self.tokens, self._last
        for t in ids:
            toks.append(int(t))
            end = len(toks) - 1  # the n-grams just before the new token now have a continuation
            for m, table in last.items():
                if end >= m:
                    table[tuple(toks[end - m:end])] = end - m

    def propose(self, k: int) -> tuple[list[int], int]:
        toks = self.tokens
        for m in range(MAX_NGRAM, self.n - 1, -1):
            if k < 1 or len(toks) <= m:
                continue
            start = self._last[m].get(tuple(toks[-m:]))
            if start is None:
                continue
            out = toks[start + m:start + m + k]
            # a continuation that runs into the end repeats itself (a loop of period len(toks) - m - start):
            # copied on from the draft's own tokens, as LZ77 copies an overlapping match
            period = len(toks) - m - start
            while len(out) < k:
                out.append(out[len(out) - period])
            return out, m
        return [], 0


class LookupPricing:
    """The lookup tables corrected online by the rounds actually verified (earlier rounds only, so lengths stay
    non-anticipating): per kind of request (greedy / sampled), match length and position, the conditional
    acceptance is (accepted + s x table) / (tried + s), the table a prior worth `strength` rounds. The tables are
    SmolLM2's; another target's repetitions are priced by its own rounds after a few hundred of them."""

    def __init__(self, strength: float = 50.0):
        if not strength > 0:
            raise InvalidArgument("strength", strength, "must be > 0")
        self.strength = float(strength)
        # (greedy, n) -> [tried per position, accepted per position]
        self._counts: dict[tuple[bool, int], tuple[list[float], list[float]]] = {}

    def _slot(self, greedy: bool, n: int):
        key = (bool(greedy), min(max(n, MIN_NGRAM), MAX_NGRAM))
        if key not in self._counts:
            positions = len(LOOKUP_ACCEPTANCE[MIN_NGRAM])  # the tables' positions; deeper ones share the last
            self._counts[key] = ([0.0] * positions, [0.0] * positions)
        return self._counts[key]

    def acceptance(self, n: int, length: int, greedy: bool = True) -> list[float]:
        """`acceptance(n, length, greedy)` corrected by the rounds observed so far."""
        prior = acceptance(n, length, greedy)
        tried, ok = self._slot(greedy, n)
        s = self.strength
        out = []
        for i, p in enumerate(prior):
            j = min(i, len(tried) - 1)
            out.append((ok[j] + s * p) / (tried[j] + s))
        return out

    def observe(self, n: int, verified: int, accepted: int, greedy: bool = True) -> None:
        """One verified lookup round: `verified` draft tokens of a match of `n`, the first `accepted` accepted."""
        tried, ok = self._slot(greedy, n)
        for i in range(min(verified, accepted + 1)):  # positions reached: every accepted one and the first rejected
            j = min(i, len(tried) - 1)
            tried[j] += 1.0
            ok[j] += 1.0 if i < accepted else 0.0
