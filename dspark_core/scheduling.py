"""Verification-length policies: how many of each request's draft tokens the target checks this round.

What it knows: per-request confidences c_{r,1..gamma} (the calibrated probability that draft position j
survives given that 1..j-1 did), the verifier's cost curve SPS(B) (steps per second of a forward pass
carrying B tokens; see `dspark_core.cost_model`), and the policies that turn them into lengths:

- "causal"   paper Algorithm 1: greedy over candidates by prefix survival a_{r,j} = prod_{i<=j} c_{r,i},
             stopping at the first candidate that does not raise expected accepted tokens per second.
- "async"    paper section 5.2: capacity K from the pool of two steps earlier, top-K admission now.
- "threshold", "fixed", "gamma1", "ar"   baselines.

What it does not know: tokens, tensors, models, batching or time. Every function is pure (the one class,
`AsyncScheduler`, only remembers confidences) and runs on plain Python floats: at serving sizes
(<= a few hundred candidates) a Python sort beats numpy's per-call overhead.

Conventions: `confidences` is a sequence with one sequence per active request (lengths may differ, an
empty one means a request with no drafts this round); values are numbers in [0, 1]. Error fields use
Python's 0-based indices (`confidences[2][0]` is request 2's first draft position, c_{2,1} in the paper).
Every active request always verifies its anchor, so a round with R requests and lengths l_r carries
B = R + sum(l_r) tokens. Returned lengths are in 0..len(confidences[r]).

Losslessness: admitting draft position j may depend only on what was known before x_j was sampled. The
causal policy gets this from its early stop, the async one from its two-step lag. `retrospective_global_
schedule` breaks it on purpose and exists only to demonstrate the bias in tests and benchmarks.
"""

from __future__ import annotations

import numbers
import random
import statistics
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dspark_core.cost_model import SpsLike, SpsTable, sps_callable
from dspark_core.errors import InvalidArgument

Confidences = Sequence[Sequence[float]]
# policy(confidences, sps, request_ids=None) -> lengths (see the registry below)
Policy = Callable[..., list[int]]


# -- input handling ----------------------------------------------------------------------------------


def _rows(confidences: Any) -> list[Any]:
    """The per-request rows, accepting lists, tuples and array-likes with `.tolist()` (numpy, torch)."""
    if hasattr(confidences, "tolist") and not isinstance(confidences, (list, tuple)):
        confidences = confidences.tolist()
    if isinstance(confidences, (str, bytes)) or not isinstance(confidences, Sequence):
        raise InvalidArgument(
            "confidences", confidences, "must be a sequence with one sequence of confidences per request"
        )
    rows = list(confidences)
    for r, row in enumerate(rows):
        if row.__class__ is list or row.__class__ is tuple:
            continue
        if hasattr(row, "tolist"):
            rows[r] = row = row.tolist()
        if isinstance(row, (str, bytes)) or not isinstance(row, Sequence):
            raise InvalidArgument(f"confidences[{r}]", row, "must be a sequence of confidences in [0, 1]")
    return rows


def _is_confidence(c: Any) -> bool:
    return isinstance(c, numbers.Real) and not isinstance(c, bool) and 0.0 <= c <= 1.0


def _bad_row(r: int, row: Any) -> InvalidArgument:
    """The error for the first invalid value of request r's row (called only once one is known)."""
    for j, c in enumerate(row):
        if not _is_confidence(c):
            return InvalidArgument(f"confidences[{r}][{j}]", c, "must be a number in [0, 1]")
    raise AssertionError(f"row {r} has no invalid confidence")


class _Pool:
    """The candidate pool of one step, flattened (request-major) for speed.

    neg[i] = -a_{r,j} for every candidate with a_{r,j} > 0, owner[i] = r, and `order` lists the indices
    best first: sorted by -a, ties kept in flat order, i.e. by (r, j). Within a request a is
    non-increasing in j, so every prefix of `order` is prefix-closed per request.
    """

    __slots__ = ("num_requests", "neg", "owner", "order", "cond", "left", "num_slots")

    def __init__(self, rows: list[Any]):
        # [num_candidates]
        neg: list[float] = []
        # [num_candidates]
        owner: list[int] = []
        # [num_candidates] the candidate's own conditional c_{r,j}, and the draft slots its row has after it
        cond: list[float] = []
        left: list[int] = []
        for r, row in enumerate(rows):
            a = 1.0
            n = len(row)
            for j, c in enumerate(row):
                if c.__class__ is not float and not _is_confidence(c):
                    raise _bad_row(r, row)
                if not 0.0 <= c <= 1.0:  # also rejects NaN
                    raise _bad_row(r, row)
                a *= c  # once a reaches 0 it stays 0, so zeros and everything after them are skipped
                if a > 0.0:
                    neg.append(-a)
                    cond.append(float(c))
                    left.append(n - j - 1)
            owner.extend([r] * (len(neg) - len(owner)))
        self.num_requests = len(rows)
        self.neg, self.owner, self.cond, self.left = neg, owner, cond, left
        # draft slots of the step whatever the drafts turn out to be (row lengths; zeros included)
        self.num_slots = sum(len(row) for row in rows)
        self.order = sorted(range(len(neg)), key=neg.__getitem__)

    def best_prefix(self, sps: Callable[[int], float], early_stop: bool, lookahead: bool = False,
                    slack: float = 0.0) -> int:
        """Number of leading candidates that maximises theta = tau * SPS(B), B = R + k; with `early_stop`
        the walk ends at the first candidate that does not strictly raise theta (paper Algorithm 1).

        With `early_stop`, two causal refinements (both off by default, the paper's walk):
        - `slack` > 0: when verifying every draft slot of the step would cost at most `slack` (a fraction)
          more step time than verifying none, SPS(R + slots) >= (1 - slack) SPS(R), the budget does not
          bind and every candidate is admitted, as the fixed policy would. The test reads only R and the
          row lengths, never a confidence, so it cannot depend on the drafts.
        - `lookahead`: a candidate that does not raise theta still passes when its own request's
          continuation, projected with its own conditional confidence (a_{j+m} = a_j c_j^m over the slots
          its row has left), would beat the best theta within those slots. That reads c_{r,<=j} only, so
          the decision on x_j stays independent of x_j; it stops the walk from halting at a dip of a
          jagged table (a flat step after a steep one). Candidates passed this way are admitted: the walk
          returns every candidate before its first failure, never an argmax over later ones.
        """
        neg, order, r0 = self.neg, self.order, self.num_requests
        n = len(order)
        if early_stop and slack > 0 and n and sps(r0 + self.num_slots) >= (1.0 - slack) * sps(r0):
            return n
        bulk = getattr(sps, "sps_range", None)
        # [<= n + 1] SPS at B = R, R + 1, ... read in one call where the callable offers it (an SpsTable
        # slices a cached table); past what it returned, sps(B) is called per step
        values = bulk(r0, r0 + n + 1) if bulk is not None else ()
        nv = len(values)
        tau = float(r0)
        best = tau * (values[0] if nv else sps(r0))
        best_k = 0
        for k, i in enumerate(order, 1):
            tau -= neg[i]
            theta = tau * (values[k] if k < nv else sps(r0 + k))
            if theta > best:
                best, best_k = theta, k
            elif early_stop:
                if lookahead and self._continuation_beats(i, k, tau, best, sps):
                    best_k = k
                    continue
                break
        return best_k

    def _continuation_beats(self, i: int, k: int, tau: float, best: float, sps: Callable[[int], float]) -> bool:
        """Whether candidate i's own request, continued with its conditional confidence for the slots its row
        has left, reaches a theta above `best` (k candidates admitted so far, tau their expected tokens)."""
        c, a = self.cond[i], -self.neg[i]
        b = self.num_requests + k
        for m in range(1, self.left[i] + 1):
            a *= c
            tau += a
            if tau * sps(b + m) > best:
                return True
        return False

    def lengths(self, k: int) -> list[int]:
        """Per-request lengths admitting the first k candidates (a prefix-closed set: count = length)."""
        out = [0] * self.num_requests
        owner = self.owner
        for i in self.order[:k]:
            out[owner[i]] += 1
        return out


# -- the causal scheduler (paper Algorithm 1) -------------------------------------------------------


def causal_prefix_schedule(confidences: Confidences, sps: SpsLike, *, slack: float = 0.0,
                           lookahead: bool = False) -> list[int]:
    """Paper Algorithm 1: verification length per request, in 0..len(confidences[r]).

    Candidates (r, j) with a_{r,j} > 0 are taken in order of a_{r,j} descending (ties by r, then j).
    Starting from l_r = 0, B = R, tau = R, best = R * SPS(R), each candidate sets l_r = j, B += 1,
    tau += a_{r,j}; theta = tau * SPS(B) is recorded if strictly greater than the best so far, and the
    first candidate that does not improve ends the search. The early stop is what makes the decision on
    position j independent of x_j (non-anticipating); do not "optimise" it away.

    `sps`: an SpsTable, a callable B -> steps per second, or a sequence with sps[B] = SPS at B tokens
    (index 0 ignored); see `dspark_core.cost_model.sps_callable`.

    `slack`, `lookahead`: the causal refinements of `_Pool.best_prefix` (defaults: the paper's literal walk;
    the engine's "causal" policy uses CAUSAL_SLACK and the lookahead, so that at low load, where the
    budget does not bind, it verifies what the fixed policy verifies).
    """
    if not isinstance(slack, numbers.Real) or isinstance(slack, bool) or not 0.0 <= slack < 1.0:
        raise InvalidArgument("slack", slack, "must be a number in [0, 1)")
    rows = _rows(confidences)
    fn = sps_callable(sps)
    if not rows:
        return []
    pool = _Pool(rows)
    return pool.lengths(pool.best_prefix(fn, early_stop=True, lookahead=lookahead, slack=slack))


# The engine's causal policy (EngineConfig.causal_slack): verify every slot while that costs under 5% more
# step time than verifying none (within what an SPS table measures reliably), and look past dips of a
# jagged table.
CAUSAL_SLACK = 0.05
# EngineConfig.draft_window's default (a request's drafter context begins at most this many positions before
# its first anchor). SmolLM2 + DSpark, held-out prompts (median 341 tokens), fixed policy, batch 1, tau with the
# whole prompt -> the last 128 / 64 positions: 64 code prompts greedy 2.347 -> 2.353 / 2.335 (-0.5%; 16 prompts:
# -3.3% at 16); 16 code prompts T = 1 1.812 -> 1.822 / 1.832; 16 math + chat greedy 1.654 -> - / 1.668
DRAFT_WINDOW = 128


# -- async: lagged capacity + top-K (paper section 5.2) ---------------------------------------------


def async_capacity(lagged_confidences: Confidences, sps: SpsLike) -> int:
    """Capacity K (total draft tokens to admit) from the confidences of two steps earlier: an
    unconstrained global search, the best theta over every prefix of that step's sorted pool.

    The anchors counted in B are the lagged pool's requests (len(lagged_confidences)). Searching globally
    is safe here only because the pool is two steps old: nothing in it depends on the tokens being
    verified now. Suited to jagged, non-unimodal SPS curves where the early stop halts too soon.
    """
    rows = _rows(lagged_confidences)
    fn = sps_callable(sps)
    if not rows:
        return 0
    return _Pool(rows).best_prefix(fn, early_stop=False)


def async_topk_schedule(confidences: Confidences, capacity: int) -> list[int]:
    """Admit the top-`capacity` current candidates by a_{r,j} (ties by r, then j; a = 0 never), which
    respects prefixes; returns the length per request. Fewer candidates than `capacity` admits them all."""
    if not isinstance(capacity, numbers.Integral) or isinstance(capacity, bool) or capacity < 0:
        raise InvalidArgument("capacity", capacity, "must be an integer >= 0")
    rows = _rows(confidences)
    return _Pool(rows).lengths(int(capacity))


class AsyncScheduler:
    """The async policy with its memory: call `schedule(confidences, sps)` once per step.

    Step t admits the top-K candidates of step t, with K = async_capacity(pool of step t-2, sps). With
    fewer than two earlier steps remembered (the first two steps, or after `reset()`), it falls back to
    `causal_prefix_schedule`, which is causal on its own. `next_capacity(sps)` gives, right after step t,
    the K that step t+1 will use (it depends only on step t-1), so a pipeline can size the next batch early.
    """

    def __init__(self) -> None:
        # [<= 2] pools of the last two steps, oldest first, as tuples of tuples of floats
        self._history: deque[tuple[tuple[Any, ...], ...]] = deque(maxlen=2)

    def schedule(self, confidences: Confidences, sps: SpsLike, request_ids: Any = None) -> list[int]:
        rows = _rows(confidences)
        if len(self._history) == 2:
            lengths = async_topk_schedule(rows, async_capacity(self._history[0], sps))
        else:
            lengths = causal_prefix_schedule(rows, sps)
        self._history.append(tuple(tuple(row) for row in rows))
        return lengths

    __call__ = schedule

    def next_capacity(self, sps: SpsLike) -> int | None:
        """K for the next `schedule` call, or None when that call will fall back to the causal policy."""
        if len(self._history) < 2:
            return None
        return async_capacity(self._history[0], sps)  # after step t: [t-1, t]; step t+1 reads t-1

    def reset(self) -> None:
        self._history.clear()


# -- baselines ---------------------------------------------------------------------------------------


def threshold_schedule(confidences: Confidences, threshold: float) -> list[int]:
    """Static per-position threshold: verify up to, not including, the first position j whose own
    confidence c_{r,j} < threshold. threshold = 0 verifies everything (the fixed policy); any threshold
    > 0 stops at a zero confidence, so a = 0 is then never admitted."""
    if not isinstance(threshold, numbers.Real) or isinstance(threshold, bool) or not 0.0 <= threshold <= 1.0:
        raise InvalidArgument("threshold", threshold, "must be a number in [0, 1]")
    rows = _rows(confidences)
    for r, row in enumerate(rows):
        for c in row:
            if not _is_confidence(c):
                raise _bad_row(r, row)
    lengths = []
    for row in rows:
        n = 0
        for c in row:
            if c < threshold:
                break
            n += 1
        lengths.append(n)
    return lengths


def fixed_schedule(confidences: Confidences, length: int | None = None) -> list[int]:
    """Fixed length: every draft token (l_r = len(c_r)), or min(length, len(c_r)). Reads only the row
    lengths, so a drafter without a confidence head may pass placeholder values."""
    if length is not None and (not isinstance(length, numbers.Integral) or isinstance(length, bool) or length < 0):
        raise InvalidArgument("length", length, "must be an integer >= 0 or None")
    rows = _rows(confidences)
    if length is None:
        return [len(row) for row in rows]
    return [min(int(length), len(row)) for row in rows]


def gamma1_schedule(confidences: Confidences) -> list[int]:
    """One draft token per request (an MTP-1-like setting), 0 for a request with no drafts. Reads only
    the row lengths."""
    return [min(1, len(row)) for row in _rows(confidences)]


def ar_schedule(confidences: Confidences) -> list[int]:
    """Autoregressive baseline: verify no drafts (every request advances by the target's own token)."""
    return [0] * len(_rows(confidences))


def retrospective_global_schedule(confidences: Confidences, sps: SpsLike) -> list[int]:
    """BIASED, MUST NEVER SHIP. The best theta over every prefix of the *current* sorted pool (no early
    stop). Whether position j is verified then depends on c_{r,j+1..}, which the drafter computed after
    sampling x_j, so the output distribution is no longer the target's (paper Appendix A: target
    (0.7, 0.3) comes out as (0.85, 0.15)). Kept only for tests and benchmarks that demonstrate the bias;
    it is deliberately absent from `make_policy`.
    """
    rows = _rows(confidences)
    fn = sps_callable(sps)
    if not rows:
        return []
    pool = _Pool(rows)
    return pool.lengths(pool.best_prefix(fn, early_stop=False))


# -- the policy registry -----------------------------------------------------------------------------
#
# The one place policies are named: the engine, the CLI, the benchmark and the services all resolve names
# here. A built policy is called as policy(confidences, sps, request_ids=None) -> lengths, where
# `request_ids` names the rows' requests in order (for wrappers that route requests, e.g. the scheduler
# service's cluster budgets; the policies here ignore it).


@dataclass(frozen=True)
class PolicySpec:
    """What a named policy needs from the engine: a cost table, per-position confidences."""

    name: str
    needs_sps: bool
    needs_confidence: bool


POLICIES: dict[str, PolicySpec] = {spec.name: spec for spec in (
    PolicySpec("causal", needs_sps=True, needs_confidence=True),
    PolicySpec("async", needs_sps=True, needs_confidence=True),
    PolicySpec("threshold", needs_sps=False, needs_confidence=True),
    PolicySpec("fixed", needs_sps=False, needs_confidence=False),
    PolicySpec("gamma1", needs_sps=False, needs_confidence=False),
    PolicySpec("ar", needs_sps=False, needs_confidence=False),
)}
POLICY_NAMES = tuple(POLICIES)
# other spellings accepted wherever a policy is named (the wire, flags)
POLICY_ALIASES = {"async_topk": "async"}


def policy_spec(name: str, field: str = "policy") -> PolicySpec:
    """The registered policy `name` (or an alias of it); InvalidArgument naming `field` otherwise."""
    spec = POLICIES.get(POLICY_ALIASES.get(name, name)) if isinstance(name, str) else None
    if spec is None:
        raise InvalidArgument(field, name, f"must be one of {', '.join(POLICY_NAMES)}")
    return spec


class _Stateless:
    """A pure schedule function bound to its options, with the registry's call signature."""

    __slots__ = ("fn", "options")

    def __init__(self, fn: Callable[..., list[int]], **options: Any):
        self.fn, self.options = fn, options

    def __call__(self, confidences: Confidences, sps: SpsLike = None, request_ids: Any = None) -> list[int]:
        return self.fn(confidences, **self.options)


class _Causal:
    """The causal walk with its refinements' options (`causal_prefix_schedule`)."""

    __slots__ = ("slack", "lookahead")

    def __init__(self, slack: float = 0.0, lookahead: bool = False):
        self.slack, self.lookahead = slack, lookahead

    def __call__(self, confidences: Confidences, sps: SpsLike, request_ids: Any = None) -> list[int]:
        return causal_prefix_schedule(confidences, sps, slack=self.slack, lookahead=self.lookahead)


def make_policy(name: str, **kw: Any) -> Policy:
    """A policy by name (or alias), with one signature: policy(confidences, sps, request_ids=None) -> lengths.

    "causal" and "async" use sps; the baselines ignore it. Options: "causal" takes `slack=` and
    `lookahead=` (default the paper's walk); "threshold" needs `threshold=`; "fixed" takes an optional
    `length=`. "async" returns a fresh `AsyncScheduler` (it keeps state, so
    use one per verifier batch stream).
    """
    name = policy_spec(name).name

    def no_options() -> None:
        if kw:
            key = sorted(kw)[0]
            raise InvalidArgument(key, kw[key], f"is not an option of policy {name!r}")

    if name == "causal":
        slack, lookahead = kw.pop("slack", 0.0), kw.pop("lookahead", False)
        no_options()
        causal_prefix_schedule([], (1.0, 1.0), slack=slack)  # validate now, not on the first round
        return _Causal(slack, bool(lookahead))
    if name == "async":
        no_options()
        return AsyncScheduler()
    if name == "threshold":
        if "threshold" not in kw:
            raise InvalidArgument("threshold", None, "is required by policy 'threshold'")
        threshold = kw.pop("threshold")
        no_options()
        threshold_schedule([], threshold)  # validate now, not on the first round
        return _Stateless(threshold_schedule, threshold=threshold)
    if name == "fixed":
        length = kw.pop("length", None)
        no_options()
        fixed_schedule([], length)
        return _Stateless(fixed_schedule, length=length)
    no_options()
    return _Stateless(gamma1_schedule if name == "gamma1" else ar_schedule)


# -- overhead measurement ----------------------------------------------------------------------------


def benchmark_schedule_overhead(
    num_requests: int = 64,
    gamma: int = 7,
    repeats: int = 200,
    *,
    sps: SpsLike | None = None,
    policy: Callable[[Confidences, SpsLike], list[int]] = causal_prefix_schedule,
    seed: int = 0,
) -> float:
    """Median wall time in seconds of one `policy(confidences, sps)` call on random confidences.

    The default `sps` is flat (SPS = 1 at every B), the worst case: every candidate improves theta, so
    the whole pool of num_requests * gamma candidates is walked without an early stop.
    """
    for key, value, low in (("num_requests", num_requests, 1), ("gamma", gamma, 0), ("repeats", repeats, 1)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < low:
            raise InvalidArgument(key, value, f"must be an integer >= {low}")
    rng = random.Random(seed)
    confidences = [[rng.uniform(0.3, 1.0) for _ in range(gamma)] for _ in range(num_requests)]
    if sps is None:
        sps = SpsTable(batch_sizes=(1, 2), steps_per_second=(1.0, 1.0))
    policy(confidences, sps)  # warm-up
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        policy(confidences, sps)
        times.append(time.perf_counter() - start)
    return statistics.median(times)
