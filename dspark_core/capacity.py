"""Replicas for a per-user speed objective: how many verifiers and drafters hold N tokens/s per user.

The model is the causal policy's own (dspark_core.scheduling): a verifier holding n requests runs the causal
policy on their confidence rows against its SPS table, so each request r verifies l_r drafts and expects
tau_r = 1 + sum_{j <= l_r} a_{r,j} tokens per step; a step takes 1 / SPS(B) (B = n + sum l_r, the table's row
for n requests) plus the drafting time of its drafter, which holds m requests. Per-user speed is the mean
tau_r divided by that step time. Spreading U users evenly over V verifiers and D drafters gives
n = ceil(U / V) and m = ceil(U / D); `plan_replicas` returns the cheapest pair (verifiers weigh
`verifier_cost` drafters) whose predicted speed is at least the objective times (1 + headroom).

Why this scales out before the objective is lost: as n grows the causal policy trims drafts (the budget
binds: extra tokens cost more step time than they bring), tau falls and the step slows, both of which the
prediction sees at the load the cluster has now, instead of waiting for a queue to form. The headroom makes
the plan ask for the next replica while the current ones still hold the objective, so the stabilisation
windows and pod start-up happen before users notice.

What it does not know: Kubernetes, metrics or time. Inputs are plain numbers; the representative rows are
the confidences of the requests being served now (cycled when a verifier would hold more of them).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .cost_model import SpsLike, sps_callable
from .errors import InvalidArgument
from .scheduling import causal_prefix_schedule


def _rows_for(rows: Sequence[Sequence[float]], n: int) -> list[Sequence[float]]:
    """n representative rows: the observed ones cycled (an empty population means requests without drafts)."""
    if not rows:
        return [()] * n
    return [rows[i % len(rows)] for i in range(n)]


def user_speed(rows: Sequence[Sequence[float]], sps: SpsLike, draft_seconds: float = 0.0) -> float:
    """Predicted tokens per second of each of these requests sharing one verifier step (mean over them)."""
    if not rows:
        raise InvalidArgument("rows", rows, "must hold at least one request")
    fn = sps_callable(sps)
    for_requests = getattr(fn, "for_requests", None)
    table = for_requests(len(rows)) if for_requests is not None else fn
    lengths = causal_prefix_schedule(rows, table)
    tau = 0.0
    for row, l in zip(rows, lengths):
        a = 1.0
        tau += 1.0
        for c in row[:l]:
            a *= c
            tau += a
    tokens = len(rows) + sum(lengths)
    step = 1.0 / table(tokens) + max(0.0, draft_seconds)
    return tau / len(rows) / step


@dataclass(frozen=True)
class DraftCost:
    """Drafting time of one step on a drafter holding m requests: base + per_request * m seconds."""

    base: float = 0.0
    per_request: float = 0.0

    def __call__(self, m: int) -> float:
        return self.base + self.per_request * m

    @classmethod
    def from_observation(cls, seconds: float, requests: float, base_share: float = 0.5) -> "DraftCost":
        """From one measured step (`seconds` for `requests` requests, or a mean of steps and their mean size):
        `base_share` of it fixed, the rest per request (a batched drafter pays a fixed cost per call and a small
        one per request)."""
        if not seconds > 0 or requests < 1:
            return cls()
        return cls(base=seconds * base_share, per_request=seconds * (1 - base_share) / requests)


class DraftCostFit:
    """`DraftCost` fitted online to a drafter's measured passes: least squares of seconds on requests over the
    last `window` passes. A batched drafter pays a fixed cost per pass (launch, the parallel backbone's shared
    work, a drafter pod's transport) and a small one per request; which of the two a pass's time is can only be
    told apart once passes of different sizes have been seen. Until then (or when the fit is degenerate: a
    negative slope or base from noise) the split is `base_share` of the mean pass fixed, the rest per request.
    Only steady passes belong here: a pass that extends a request's drafter context over a backlog (its prompt,
    or positions skipped while gated) costs more than drafting for it will from then on."""

    def __init__(self, window: int = 128, base_share: float = 0.5):
        if not isinstance(window, int) or isinstance(window, bool) or window < 2:
            raise InvalidArgument("window", window, "must be an integer >= 2")
        if not 0.0 <= base_share <= 1.0:
            raise InvalidArgument("base_share", base_share, "must be in [0, 1]")
        self.window, self.base_share = window, base_share
        self._passes: deque[tuple[int, float]] = deque(maxlen=window)
        self._cost: DraftCost | None = None

    def observe(self, requests: int, seconds: float) -> None:
        if requests < 1 or not seconds >= 0.0 or not math.isfinite(seconds):
            return
        self._passes.append((int(requests), float(seconds)))
        self._cost = None

    @property
    def observed(self) -> int:
        return len(self._passes)

    @property
    def cost(self) -> DraftCost:
        if self._cost is None:
            self._cost = self._fit()
        return self._cost

    def _fit(self) -> DraftCost:
        k = len(self._passes)
        if not k:
            return DraftCost()
        mn = sum(n for n, _ in self._passes) / k
        mt = sum(t for _, t in self._passes) / k
        sxx = sum((n - mn) ** 2 for n, _ in self._passes)
        if sxx > 0:
            slope = sum((n - mn) * (t - mt) for n, t in self._passes) / sxx
            base = mt - slope * mn
            if slope >= 0.0 and base >= 0.0:
                return DraftCost(base=base, per_request=slope)
        return DraftCost.from_observation(mt, mn, self.base_share)


@dataclass(frozen=True)
class CapacityPlan:
    verifiers: int
    drafters: int
    # per-user tokens/s predicted with these replicas, and with the current ones
    predicted_user_tps: float
    current_user_tps: float
    feasible: bool  # False: even the maximum replicas miss the objective (the plan is then the maximum)


def plan_replicas(rows: Sequence[Sequence[float]], users: int, sps: SpsLike, target_user_tps: float, *,
                  draft_cost: Callable[[int], float] = DraftCost(), current: tuple[int, int] = (1, 1),
                  max_verifiers: int = 64, max_drafters: int = 64, headroom: float = 0.2,
                  verifier_cost: float = 4.0, has_drafter: bool = True) -> CapacityPlan:
    """The cheapest replicas (a verifier costs `verifier_cost` drafters) predicted to give each of `users`
    users >= target_user_tps x (1 + headroom) tokens/s, among the fewest verifiers that can and up to two
    more; `rows` are the confidence rows of the requests served now (the population)."""
    if not target_user_tps > 0 or not math.isfinite(target_user_tps):
        raise InvalidArgument("target_user_tps", target_user_tps, "must be a finite number > 0")
    if not isinstance(users, int) or users < 0:
        raise InvalidArgument("users", users, "must be an integer >= 0")
    if headroom < 0:
        raise InvalidArgument("headroom", headroom, "must be >= 0")
    if max_verifiers < 1 or max_drafters < 1:
        raise InvalidArgument("max_verifiers", max_verifiers, "max_verifiers and max_drafters must be >= 1")
    rows = [list(r) for r in rows] if has_drafter else []
    cache: dict[tuple[int, int], float] = {}

    def speed(v: int, d: int) -> float:
        n = max(1, math.ceil(users / v))
        m = max(1, math.ceil(users / d)) if has_drafter else 0
        key = (n, m)
        if key not in cache:
            cache[key] = user_speed(_rows_for(rows, n), sps, draft_cost(m) if has_drafter else 0.0)
        return cache[key]

    cur_v, cur_d = max(1, current[0]), max(1, current[1])
    now = speed(cur_v, cur_d) if users else math.inf
    if users == 0:
        return CapacityPlan(1, 1 if has_drafter else 0, math.inf, now, True)
    want = target_user_tps * (1 + headroom)
    d_cap = max_drafters if has_drafter else 1
    if speed(max_verifiers, d_cap) < want:
        return CapacityPlan(max_verifiers, d_cap if has_drafter else 0, speed(max_verifiers, d_cap), now, False)

    def fewest(ok: Callable[[int], bool], hi: int) -> int:
        """Smallest x in 1..hi with ok(x), for ok monotone in x (more replicas never slow a user down)."""
        lo = 1
        while lo < hi:
            mid = (lo + hi) // 2
            if ok(mid):
                hi = mid
            else:
                lo = mid + 1
        return lo

    v_min = fewest(lambda x: speed(x, d_cap) >= want, max_verifiers)
    # the fewest verifiers may need very many drafters; one or two more verifiers may need far fewer: take
    # the cheapest of those (a verifier costs `verifier_cost` drafters)
    best = None
    for v in range(v_min, min(max_verifiers, v_min + 2) + 1):
        d = fewest(lambda x: speed(v, x) >= want, d_cap) if has_drafter else 0
        cost = v * verifier_cost + d
        if best is None or cost < best[0]:
            best = (cost, v, d)
    _, v, d = best
    return CapacityPlan(v, d, speed(v, max(d, 1)), now, True)


class DemandForecast:
    """Users expected `horizon` seconds ahead: the current count plus the rising trend (least-squares slope
    over the last `window_s` seconds; a falling trend forecasts no change, scaling down is the stabilisation
    window's business). Planning for the forecast is what lets the replicas arrive before the users do: a
    scale-up waits out its stabilisation window and the pod's start-up."""

    def __init__(self, window_s: float = 60.0):
        if not window_s > 0:
            raise InvalidArgument("window_s", window_s, "must be > 0")
        self.window_s = window_s
        self._points: list[tuple[float, float]] = []

    def observe(self, t: float, users: float) -> None:
        self._points.append((float(t), float(users)))
        while self._points and t - self._points[0][0] > self.window_s:
            self._points.pop(0)

    def slope(self) -> float:
        pts = self._points
        if len(pts) < 2:
            return 0.0
        mt = sum(t for t, _ in pts) / len(pts)
        mu = sum(u for _, u in pts) / len(pts)
        var = sum((t - mt) ** 2 for t, _ in pts)
        return sum((t - mt) * (u - mu) for t, u in pts) / var if var > 0 else 0.0

    def forecast(self, horizon_s: float) -> int:
        if not self._points:
            return 0
        now = self._points[-1][1]
        return int(math.ceil(now + max(0.0, self.slope()) * max(0.0, horizon_s)))
