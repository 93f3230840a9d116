"""Confidence calibration: sequential temperature scaling (STS), sequential Platt scaling, ECE, ROC-AUC and
reliability data.

Input is a set of rollout records (algorithms.md section 6): for every drafting round of held-out
requests, the raw confidence logits of the proposed positions and how many drafts were accepted. At
position k (1-based) a round counts only if it proposed at least k drafts; its label is the prefix
indicator `accepted >= k`.

Two views of the same confidences, never mixed up:
- conditional: `c_k = sigmoid(logit_k / t_k)`, the head's meaning "P(slot k accepted | slots < k were)";
  it is scored against `accepted >= k` among rounds whose first k-1 drafts *were* accepted;
- survival: `a_k = prod_{i<=k} c_i`, "P(prefix of length k accepted)", scored against `accepted >= k` over
  every round that proposed k.
STS fits t_1..t_gamma in order, each by grid search minimising the ECE of the survival a_k (20 equal-width
bins) with the earlier temperatures fixed. Temperature scaling is monotone per position, so the conditional
ranking (and its AUC) is unchanged; survival AUC can move slightly because a_k mixes positions.

A temperature only stretches logits about 0: a head that is over-confident in the middle of its range and
right at both ends (a shift in logit space) stays miscalibrated. Sequential Platt scaling fits a bias beside
each temperature, `c_k = sigmoid(logit_k / t_k + b_k)`, in the same order, by maximum likelihood of the
survival event (`a_k = a_{k-1} * c_k` against `accepted >= k`, earlier positions fixed): a proper scoring rule,
so two parameters do not chase the binning noise the way an ECE grid over two parameters does. It is monotone
per position too; with every b_k = 0 it is STS's model. `Calibration` carries (temperatures, biases); every
function below that takes `temperatures` takes a `Calibration` as well.

Both are the same map for every request, and a head's error is partly the request's own: on SmolLM2 at T = 0
one request's drafts are accepted more often than its confidences say all answer long, another's less, so a
population fit stays ~2% off at position 1 on prompts it did not see. Request-history recalibration
(`RequestHistory`) adds what the request's own earlier rounds say: after n rounds that verified slot 1, A of
them accepted and C the sum of their calibrated c_1,
    g = logit((A + s m) / (n + s)) - logit((C + s m) / (n + s))        (0 before any round; s, m: a prior)
is how much more (g > 0) or less the request accepts than its calibrated confidences predicted, shrunk to 0
by s pseudo-rounds; every position's logit gets w_k g, c_k = sigmoid(logit_k / t_k + b_k + w_k g). It reads
only rounds already verified (non-anticipating, like every confidence the policies use) and moves lengths,
never outputs. With a history, (t_k, b_k, w_k) are fitted together, position by position by maximum
likelihood of the same survival event (starting from a Platt fit for the offsets). Records carry the request
of each round (`RolloutRecords.request`, rows in round order); records without it get g = 0.

Pure numpy on arrays: knows nothing about engines, models or files beyond writing `calibration.json`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import InvalidArgument

NUM_BINS = 20
# log-spaced temperatures from 0.05 to 20, plus exactly 1.0 (no change)
DEFAULT_GRID = tuple(sorted(set(np.round(np.geomspace(0.05, 20.0, 241), 6).tolist()) | {1.0}))


@dataclass(frozen=True)
class RolloutRecords:
    """Per drafting round: raw confidence logits of the proposed positions and the accepted count."""

    # [N, gamma] float64, NaN past `proposed`
    logits: np.ndarray
    # [N] int: drafts the target verified that round
    proposed: np.ndarray
    # [N] int: drafts accepted that round (the bonus token is not a draft)
    accepted: np.ndarray
    # [N] int or None: the request of each round, rows in round order within a request (request-history
    # recalibration reads a request's earlier rounds); None = unknown (no history)
    request: np.ndarray | None = None

    def __post_init__(self):
        if self.logits.ndim != 2 or self.proposed.shape != (self.logits.shape[0],) \
                or self.accepted.shape != self.proposed.shape:
            raise InvalidArgument("records", (self.logits.shape, self.proposed.shape, self.accepted.shape),
                                  "must be logits [N, gamma], proposed [N], accepted [N]")
        if self.request is not None and np.shape(self.request) != self.proposed.shape:
            raise InvalidArgument("records.request", np.shape(self.request), f"must be [N] = {self.proposed.shape}")
        if (self.accepted > self.proposed).any() or (self.proposed > self.gamma).any() or (self.accepted < 0).any():
            raise InvalidArgument("records.accepted", "out of range", "must satisfy 0 <= accepted <= proposed <= gamma")

    @property
    def gamma(self) -> int:
        return int(self.logits.shape[1])

    def __len__(self) -> int:
        return int(self.proposed.shape[0])

    @classmethod
    def from_rounds(cls, confidence_logits: list[list[float]], accepted: list[int],
                    proposed: list[int] | None = None, gamma: int | None = None) -> RolloutRecords:
        """One entry per round; `proposed` defaults to the number of logits given for that round."""
        if len(confidence_logits) != len(accepted):
            raise InvalidArgument("accepted", len(accepted),
                                  f"must have one entry per round ({len(confidence_logits)})")
        proposed = [len(c) for c in confidence_logits] if proposed is None else list(proposed)
        gamma = gamma or max([len(c) for c in confidence_logits] + [1])
        logits = np.full((len(accepted), gamma), np.nan)
        for i, (row, n) in enumerate(zip(confidence_logits, proposed)):
            if len(row) < n:
                raise InvalidArgument(f"confidence_logits[{i}]", len(row), f"must cover the {n} proposed positions")
            logits[i, :n] = row[:n]
        return cls(logits, np.asarray(proposed, dtype=np.int64), np.asarray(accepted, dtype=np.int64))

    def subset(self, mask: np.ndarray) -> RolloutRecords:
        """The rounds of `mask` (a boolean mask keeps the round order, so request histories stay intact when it
        selects whole requests)."""
        return RolloutRecords(self.logits[mask], self.proposed[mask], self.accepted[mask],
                              None if self.request is None else self.request[mask])

    def with_requests(self, request) -> RolloutRecords:
        return RolloutRecords(self.logits, self.proposed, self.accepted,
                              None if request is None else np.asarray(request, dtype=np.int64))


def requests_from_runs(prompt_index) -> np.ndarray:
    """Request ids from a per-round prompt index whose rounds come request by request (what `dspark calibrate`
    logs): a new request wherever the prompt changes. Two rollouts of the same prompt in a row would merge;
    give ids explicitly where that can happen."""
    p = np.asarray(prompt_index, dtype=np.int64)
    if p.size == 0:
        return p
    return np.cumsum(np.r_[0, (p[1:] != p[:-1]).astype(np.int64)])


# ---- metrics ------------------------------------------------------------------------------------

def _check_pair(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    p, y = np.asarray(probs, dtype=np.float64).ravel(), np.asarray(labels, dtype=np.float64).ravel()
    if p.shape != y.shape:
        raise InvalidArgument("labels", y.shape, f"must match the scores' shape {p.shape}")
    return p, y


def _bin_index(p: np.ndarray, bins: int) -> np.ndarray:
    """Equal-width bins on [0, 1]; 1.0 falls in the last bin."""
    return np.clip((p * bins).astype(np.int64), 0, bins - 1)


def ece(probs, labels, bins: int = NUM_BINS) -> float:
    """Expected calibration error: sum_b n_b / n * |mean(p in b) - mean(y in b)| (NaN when empty)."""
    p, y = _check_pair(probs, labels)
    if p.size == 0:
        return math.nan
    idx = _bin_index(p, bins)
    # per bin |sum(p) - sum(y)| = n_b * |mean(p) - mean(y)|
    gap = np.abs(np.bincount(idx, weights=p, minlength=bins) - np.bincount(idx, weights=y, minlength=bins))
    return float(gap.sum() / p.size)


def ece_noise_floor(probs, bins: int = NUM_BINS, draws: int = 200, seed: int = 0) -> float:
    """Mean ECE of these scores against labels drawn from the scores themselves (y ~ Bernoulli(p)): what a
    perfectly calibrated predictor with these confidences scores on this many rounds, by sampling noise
    alone (about 0.4 * sqrt(occupied bins / n) at p near 0.5). Differences in ECE below it are not measurable."""
    p = np.asarray(probs, dtype=np.float64).ravel()
    if p.size == 0:
        return math.nan
    rng = np.random.default_rng(seed)
    idx = _bin_index(p, bins)
    sp = np.bincount(idx, weights=p, minlength=bins)
    out = []
    for _ in range(draws):
        y = (rng.random(p.size) < p).astype(np.float64)
        out.append(np.abs(sp - np.bincount(idx, weights=y, minlength=bins)).sum() / p.size)
    return float(np.mean(out))


def reliability(probs, labels, bins: int = NUM_BINS) -> dict[str, list]:
    """Reliability-diagram data per equal-width bin: count, mean confidence, observed frequency (None if empty)."""
    p, y = _check_pair(probs, labels)
    idx = _bin_index(p, bins)
    counts = np.bincount(idx, minlength=bins)
    sp = np.bincount(idx, weights=p, minlength=bins)
    sy = np.bincount(idx, weights=y, minlength=bins)
    return {
        "bin_edges": np.linspace(0.0, 1.0, bins + 1).round(6).tolist(),
        "count": counts.tolist(),
        "confidence": [float(a / n) if n else None for a, n in zip(sp, counts)],
        "accuracy": [float(a / n) if n else None for a, n in zip(sy, counts)],
    }


def _average_ranks(x: np.ndarray) -> np.ndarray:
    """1-based ranks, ties share the average rank."""
    order = np.argsort(x, kind="mergesort")
    xs = x[order]
    ranks = np.empty(x.size, dtype=np.float64)
    i = 0
    while i < x.size:
        j = i
        while j + 1 < x.size and xs[j + 1] == xs[i]:
            j += 1
        ranks[order[i : j + 1]] = (i + j) / 2.0 + 1.0
        i = j + 1
    return ranks


def roc_auc(scores, labels) -> float:
    """ROC-AUC by the rank-sum (Mann-Whitney) formula with average ranks for ties; NaN if a class is missing."""
    s, y = _check_pair(scores, labels)
    pos = y > 0.5
    n_pos, n_neg = int(pos.sum()), int((~pos).sum())
    if n_pos == 0 or n_neg == 0:
        return math.nan
    ranks = _average_ranks(s)
    return float((ranks[pos].sum() - n_pos * (n_pos + 1) / 2.0) / (n_pos * n_neg))


# ---- the two views --------------------------------------------------------------------------------

def expected_auc(scores, alpha) -> float:
    """The ROC-AUC `scores` get in expectation when each item's label is a coin that lands 1 with probability
    `alpha` (ties count one half; an item is never paired with itself). With scores = alpha this is the best
    any score can do: the ceiling for a confidence that cannot see the coin (the speculative-sampling accept
    draw), whatever it knows. NaN when every alpha is 0 or every alpha is 1."""
    s, a = np.asarray(scores, dtype=np.float64).ravel(), np.asarray(alpha, dtype=np.float64).ravel()
    if s.shape != a.shape:
        raise InvalidArgument("alpha", a.shape, f"must match scores {s.shape}")
    if ((a < 0) | (a > 1) | ~np.isfinite(a)).any():
        raise InvalidArgument("alpha", "out of [0, 1]", "must be probabilities")
    neg = 1.0 - a
    pairs = a.sum() * neg.sum() - (a * neg).sum()
    if s.size < 2 or pairs <= 0:
        return math.nan
    order = np.argsort(s, kind="stable")
    s, a, neg = s[order], a[order], neg[order]
    starts = np.flatnonzero(np.r_[True, s[1:] != s[:-1]])  # first index of each group of equal scores
    group = np.repeat(np.arange(starts.size), np.diff(np.r_[starts, s.size]))
    neg_in_group = np.add.reduceat(neg, starts)  # [groups]
    neg_below = np.r_[0.0, np.cumsum(neg_in_group)[:-1]]  # negatives' mass strictly below each group
    # a positive item beats every lower-scored negative and ties (half) with its group's other items
    wins = a * (neg_below[group] + 0.5 * (neg_in_group[group] - neg))
    return float(wins.sum() / pairs)


@dataclass(frozen=True)
class RequestHistory:
    """Request-history recalibration (module docstring): weights w_k, one per position, of the request's offset
    g, with the prior's strength s (pseudo-rounds) and mean m (its slot-1 acceptance rate)."""

    weights: tuple[float, ...]
    strength: float = 4.0
    prior: float = 0.5

    def __post_init__(self):
        w = tuple(float(x) for x in self.weights)
        if not w or any(not math.isfinite(x) for x in w):
            raise InvalidArgument("request_history.weights", list(w), "must be a non-empty list of finite numbers")
        object.__setattr__(self, "weights", w)
        if not (isinstance(self.strength, (int, float)) and math.isfinite(self.strength) and self.strength > 0):
            raise InvalidArgument("request_history.strength", self.strength, "must be a finite number > 0")
        if not (isinstance(self.prior, (int, float)) and 0.0 < self.prior < 1.0):
            raise InvalidArgument("request_history.prior", self.prior, "must be a number in (0, 1)")
        object.__setattr__(self, "strength", float(self.strength))
        object.__setattr__(self, "prior", float(self.prior))

    def offset(self, rounds: float, accepted: float, confidence_sum: float) -> float:
        """g of a request after `rounds` rounds that verified slot 1, `accepted` of them accepted, whose
        calibrated c_1 summed to `confidence_sum` (values outside [0, rounds] clamped)."""
        n = max(float(rounds), 0.0)
        return float(self.offsets(n, min(max(float(accepted), 0.0), n), min(max(float(confidence_sum), 0.0), n)))

    def offsets(self, rounds, accepted, confidence_sum):
        """`offset` elementwise over arrays (counts already in [0, rounds])."""
        s, m = self.strength, self.prior
        r = (accepted + s * m) / (rounds + s)
        q = (confidence_sum + s * m) / (rounds + s)
        return np.log(r / (1 - r)) - np.log(q / (1 - q))

    def to_dict(self) -> dict:
        return {"weights": list(self.weights), "strength": self.strength, "prior": self.prior}

    @classmethod
    def from_dict(cls, d, name: str = "request_history") -> RequestHistory:
        if not isinstance(d, Mapping):
            raise InvalidArgument(name, d, 'must be an object {"weights": [...], "strength": s, "prior": m}')
        unknown = sorted(set(d) - {"weights", "strength", "prior"})
        if unknown:
            raise InvalidArgument(f"{name}.{unknown[0]}", d[unknown[0]], "is not a request_history key")
        w = d.get("weights")
        if not isinstance(w, list) or not all(isinstance(x, (int, float)) and not isinstance(x, bool) for x in w):
            raise InvalidArgument(f"{name}.weights", w, "must be a non-empty list of finite numbers")
        for key in ("strength", "prior"):
            if key in d and (isinstance(d[key], bool) or not isinstance(d[key], (int, float))):
                raise InvalidArgument(f"{name}.{key}", d[key], "must be a number")
        try:
            return cls(tuple(w), d.get("strength", 4.0), d.get("prior", 0.5))
        except InvalidArgument as exc:
            raise InvalidArgument(exc.field.replace("request_history", name, 1), exc.value, exc.requirement) from None


@dataclass(frozen=True)
class Calibration:
    """Per position: c_k = sigmoid(logit_k / t_k + b_k [+ w_k g]). No biases = all 0 (STS); no history = no
    per-request term."""

    temperatures: tuple[float, ...]
    biases: tuple[float, ...] | None = None
    history: RequestHistory | None = None

    def __post_init__(self):
        t = tuple(float(x) for x in self.temperatures)
        if not t or any(not math.isfinite(x) or x <= 0 for x in t):
            raise InvalidArgument("temperatures", list(t), "must be a non-empty list of finite numbers > 0")
        object.__setattr__(self, "temperatures", t)
        if self.biases is not None:
            b = tuple(float(x) for x in self.biases)
            if len(b) != len(t) or any(not math.isfinite(x) for x in b):
                raise InvalidArgument("biases", list(b), f"must be {len(t)} finite numbers (one per temperature)")
            object.__setattr__(self, "biases", None if not any(b) else b)
        if self.history is not None and len(self.history.weights) != len(t):
            raise InvalidArgument("request_history.weights", list(self.history.weights),
                                  f"must be {len(t)} numbers (one per temperature)")

    @property
    def method(self) -> str:
        return "sts" if self.biases is None else "platt"

    def bias_list(self) -> list[float]:
        return list(self.biases) if self.biases is not None else [0.0] * len(self.temperatures)


def _params(records: RolloutRecords, temperatures) -> tuple[np.ndarray, np.ndarray]:
    """(t, b) arrays [gamma] from None (identity), a temperature sequence (b = 0) or a `Calibration`."""
    if isinstance(temperatures, Calibration):
        t = np.asarray(temperatures.temperatures, dtype=np.float64)
        b = np.asarray(temperatures.bias_list(), dtype=np.float64)
    else:
        t = np.ones(records.gamma) if temperatures is None else np.asarray(temperatures, dtype=np.float64)
        b = np.zeros(t.shape)
    if t.shape != (records.gamma,) or not (t > 0).all():
        raise InvalidArgument("temperatures", list(np.atleast_1d(t)), f"must be {records.gamma} numbers > 0")
    return t, b


def _sigmoid(x: np.ndarray) -> np.ndarray:
    return 0.5 * (1.0 + np.tanh(0.5 * x))  # stable for large |x|, NaN stays NaN


def history_offsets(records: RolloutRecords, slot1_logits: np.ndarray, history: RequestHistory) -> np.ndarray:
    """[N] each round's request offset g (module docstring) from the request's earlier rounds: those that
    verified slot 1 count, with c_1 = sigmoid(`slot1_logits`). Zero without request ids."""
    n_rows = len(records)
    if records.request is None or n_rows == 0:
        return np.zeros(n_rows)
    verified = records.proposed >= 1
    hits = ((records.accepted >= 1) & verified).astype(np.float64)
    conf = np.where(verified, _sigmoid(np.nan_to_num(slot1_logits)), 0.0)
    order = np.argsort(records.request, kind="stable")  # rounds of a request together, in their order
    req = records.request[order]
    start = np.r_[True, req[1:] != req[:-1]]
    group_first = np.maximum.accumulate(np.where(start, np.arange(n_rows), 0))

    def before(x):  # sum over the request's earlier rounds
        c = np.cumsum(x[order])
        excl = c - x[order]
        return excl - excl[group_first]

    out = np.empty(n_rows)
    n = before(verified.astype(np.float64))
    out[order] = history.offsets(n, before(hits), np.minimum(before(conf), n))
    return out


def calibrated_logits(records: RolloutRecords, temperatures=None) -> np.ndarray:
    """[N, gamma] logit_k / t_k + b_k (+ w_k g with a request history and request ids); NaN past `proposed`."""
    t, b = _params(records, temperatures)
    u = records.logits / t[None, :] + b[None, :]
    hist = temperatures.history if isinstance(temperatures, Calibration) else None
    if hist is not None and records.request is not None:
        u = u + np.asarray(hist.weights)[None, :] * history_offsets(records, u[:, 0], hist)[:, None]
    return u


def conditional_confidences(records: RolloutRecords, temperatures=None) -> np.ndarray:
    """[N, gamma] c_k = sigmoid(logit_k / t_k + b_k [+ w_k g]) (NaN past `proposed`)."""
    return _sigmoid(calibrated_logits(records, temperatures))


def survival_confidences(records: RolloutRecords, temperatures=None) -> np.ndarray:
    """[N, gamma] a_k = prod_{i<=k} c_i (NaN past `proposed`)."""
    return np.cumprod(conditional_confidences(records, temperatures), axis=1)


def position_view(records: RolloutRecords, k: int, temperatures=None, view: str = "survival"):
    """(scores, labels) at 1-based position k: survival over rounds that proposed k, or conditional over
    those rounds whose first k-1 drafts were accepted."""
    rows = records.proposed >= k
    if view == "conditional":
        rows &= records.accepted >= k - 1
        scores = conditional_confidences(records, temperatures)[rows, k - 1]
    elif view == "survival":
        scores = survival_confidences(records, temperatures)[rows, k - 1]
    else:
        raise InvalidArgument("view", view, "must be 'survival' or 'conditional'")
    return scores, (records.accepted[rows] >= k).astype(np.float64)


# ---- STS -------------------------------------------------------------------------------------------

def fit_sts(records: RolloutRecords, grid=DEFAULT_GRID, bins: int = NUM_BINS, min_rounds: int = 1
            ) -> tuple[float, ...]:
    """Sequential temperature scaling: t_1..t_gamma, each minimising the survival ECE at its position with
    the earlier ones fixed. A position with fewer than `min_rounds` rounds keeps t = 1 (too little data to
    fit). Ties in ECE go to the t closest to 1."""
    if len(records) == 0:
        raise InvalidArgument("records", 0, "must hold at least one round to calibrate on")
    grid = np.asarray(sorted(grid), dtype=np.float64)
    if grid.size == 0 or not (grid > 0).all():
        raise InvalidArgument("grid", grid.tolist(), "must be non-empty positive temperatures")
    prefer = np.abs(np.log(grid))  # tie-break: least change
    temps: list[float] = []
    prefix = np.ones(len(records))  # a_{k-1} with the fitted temperatures
    for k in range(1, records.gamma + 1):
        rows = records.proposed >= k
        labels = (records.accepted[rows] >= k).astype(np.float64)
        if rows.sum() < max(min_rounds, 1):
            temps.append(1.0)
            continue
        logits, base = records.logits[rows, k - 1], prefix[rows]
        errors = np.array([ece(base * _sigmoid(logits / t), labels, bins) for t in grid])
        best = np.flatnonzero(errors <= errors.min() + 1e-12)
        t_k = float(grid[best[np.argmin(prefer[best])]])
        temps.append(t_k)
        prefix = prefix * np.where(records.proposed >= k, _sigmoid(np.nan_to_num(records.logits[:, k - 1]) / t_k), 1.0)
    return tuple(temps)


# ---- sequential Platt scaling ----------------------------------------------------------------------

T_RANGE = (0.05, 20.0)  # as STS's grid
B_RANGE = (-10.0, 10.0)


def _fisher_fit(u_of, base: np.ndarray, y: np.ndarray, n_params: int, lo, hi, ridge: float = 1.0,
                iters: int = 100) -> np.ndarray:
    """Maximum likelihood theta of P(y = 1) = base * sigmoid(u(theta)), by Fisher scoring with a backtracking
    line search inside the box [lo, hi]; `u_of(theta)` returns (u [N], du/dtheta [n_params, N]). `ridge` is a
    Gaussian prior's weight pulling theta to 0, one round's worth: it keeps a position whose labels are all 1
    (or all 0) finite and changes nothing measurable on hundreds of rounds."""
    base = np.clip(base, 1e-12, 1.0)
    lo, hi = np.asarray(lo, dtype=np.float64), np.asarray(hi, dtype=np.float64)

    def loss(theta):
        p = np.clip(base * _sigmoid(u_of(theta)[0]), 1e-12, 1 - 1e-12)
        return float(-(y * np.log(p) + (1 - y) * np.log1p(-p)).sum() + 0.5 * ridge * float(theta @ theta))

    theta = np.zeros(n_params)
    cur = loss(theta)
    for _ in range(iters):
        u, du = u_of(theta)
        sig = _sigmoid(u)
        p = np.clip(base * sig, 1e-12, 1 - 1e-12)
        dp_du = p * (1.0 - sig)                      # d p / d u
        g_u = (p - y) / (p * (1.0 - p)) * dp_du      # d loss / d u per round
        fisher_u = dp_du * dp_du / (p * (1.0 - p))
        grad = du @ g_u + ridge * theta
        hess = (du * fisher_u) @ du.T + ridge * np.eye(n_params)
        step = np.linalg.solve(hess, grad)
        scale = 1.0
        while scale > 1e-6:
            new_theta = np.clip(theta - scale * step, lo, hi)
            new = loss(new_theta)
            if new <= cur + 1e-12:
                break
            scale *= 0.5
        else:
            break
        done = bool(np.all(np.abs(new_theta - theta) < 1e-9))
        theta, cur = new_theta, new
        if done or float(np.abs(grad).max()) < 1e-8 * max(len(y), 1):
            break
    return theta


def _fit_platt_position(z: np.ndarray, base: np.ndarray, y: np.ndarray, ridge: float = 1.0,
                        iters: int = 100) -> tuple[float, float]:
    """Maximum likelihood (t, b) of P(y = 1) = base * sigmoid(z / t + b), fitted in (s = log(1 / t), b)."""
    def u_of(theta):
        w = math.exp(theta[0])
        return z * w + theta[1], np.stack((z * w, np.ones_like(z)))

    s, b = _fisher_fit(u_of, base, y, 2, (-math.log(T_RANGE[1]), B_RANGE[0]), (-math.log(T_RANGE[0]), B_RANGE[1]),
                       ridge, iters)
    return math.exp(-s), float(b)


def fit_platt(records: RolloutRecords, min_rounds: int = 1, ridge: float = 1.0) -> Calibration:
    """Sequential Platt scaling: (t_k, b_k) for k = 1..gamma in order, each the maximum-likelihood fit of the
    survival a_k = a_{k-1} * sigmoid(logit_k / t_k + b_k) to `accepted >= k` over the rounds that proposed k,
    with the earlier positions fixed. A position with fewer than `min_rounds` rounds keeps (1, 0)."""
    if len(records) == 0:
        raise InvalidArgument("records", 0, "must hold at least one round to calibrate on")
    temps, biases = [], []
    prefix = np.ones(len(records))
    for k in range(1, records.gamma + 1):
        rows = records.proposed >= k
        if rows.sum() < max(min_rounds, 1):
            temps.append(1.0)
            biases.append(0.0)
            continue
        y = (records.accepted[rows] >= k).astype(np.float64)
        t_k, b_k = _fit_platt_position(records.logits[rows, k - 1], prefix[rows], y, ridge=ridge)
        temps.append(t_k)
        biases.append(b_k)
        prefix = prefix * np.where(rows, _sigmoid(np.nan_to_num(records.logits[:, k - 1]) / t_k + b_k), 1.0)
    return Calibration(tuple(temps), tuple(biases))


HISTORY_STRENGTH = 4.0


def _fit_history_position(z: np.ndarray, g: np.ndarray, base: np.ndarray, y: np.ndarray, with_bias: bool = True,
                          ridge: float = 1.0, iters: int = 100) -> tuple[float, float, float]:
    """Maximum likelihood (t, b, w) of P(y = 1) = base * sigmoid(z / t + b + w g), fitted in (log(1 / t), [b,] w);
    without `with_bias` b stays 0 (STS keeps temperatures alone)."""
    extra = (np.ones_like(z),) if with_bias else ()

    def u_of(theta):
        zs = z * math.exp(theta[0])
        return zs + (theta[1] if with_bias else 0.0) + theta[-1] * g, np.stack((zs, *extra, g))

    lo = (-math.log(T_RANGE[1]),) + ((B_RANGE[0],) if with_bias else ()) + (-10.0,)
    hi = (-math.log(T_RANGE[0]),) + ((B_RANGE[1],) if with_bias else ()) + (10.0,)
    th = _fisher_fit(u_of, base, y, len(lo), lo, hi, ridge, iters)
    return math.exp(-th[0]), float(th[1]) if with_bias else 0.0, float(th[-1])


def fit_history(records: RolloutRecords, base: Calibration, strength: float = HISTORY_STRENGTH,
                min_rounds: int = 1, ridge: float = 1.0, passes: int = 2) -> Calibration:
    """`base` (a Platt or STS fit) refitted with a request history (module docstring): the prior's mean is the fitting
    rounds' slot-1 acceptance rate; then (t_k, b_k, w_k) for k = 1..gamma in order, each the maximum-likelihood
    fit of the survival event with the earlier positions fixed. Fitted jointly, not w after a fixed (t, b): once
    the history moves c_1 request by request, the (t, b) fitted without it no longer suit the later positions
    (measured on SmolLM2's greedy rounds: position 2's held-out ECE 1.05% -> 0.81%). The offsets g read the
    calibrated slot-1 confidence, which the fit moves, so `passes` alternate g and the fit. Needs
    `records.request`; positions with fewer than `min_rounds` rounds keep base's (t, b) and get w = 0."""
    if records.request is None:
        raise InvalidArgument("records.request", None, "must name each round's request to fit a request history")
    verified = records.proposed >= 1
    if not verified.any():
        raise InvalidArgument("records", 0, "must hold rounds that verified a draft to fit a request history")
    rate = float((records.accepted[verified] >= 1).mean())
    prior = min(max(rate, 0.01), 0.99)
    temps, biases = list(base.temperatures), base.bias_list()
    weights = [0.0] * records.gamma
    for _ in range(max(1, passes)):
        u = calibrated_logits(records, Calibration(tuple(temps), tuple(biases)))
        g = history_offsets(records, u[:, 0], RequestHistory((0.0,) * records.gamma, strength, prior))
        prefix = np.ones(len(records))
        for k in range(1, records.gamma + 1):
            rows = records.proposed >= k
            if rows.sum() < max(min_rounds, 1):
                weights[k - 1] = 0.0
                continue
            y = (records.accepted[rows] >= k).astype(np.float64)
            temps[k - 1], biases[k - 1], weights[k - 1] = _fit_history_position(
                records.logits[rows, k - 1], g[rows], prefix[rows], y, with_bias=base.biases is not None,
                ridge=ridge)
            z = np.nan_to_num(records.logits[:, k - 1]) / temps[k - 1] + biases[k - 1] + weights[k - 1] * g
            prefix = prefix * np.where(rows, _sigmoid(z), 1.0)
    return Calibration(tuple(temps), tuple(biases) if base.biases is not None else None,
                       RequestHistory(tuple(weights), strength, prior))


METHODS = ("platt", "sts")


def fit_calibration(records: RolloutRecords, method: str = "platt", min_rounds: int = 1,
                    request_history: bool = False, strength: float = HISTORY_STRENGTH) -> Calibration:
    """`method` "platt" (temperature and bias per position, the default) or "sts" (temperatures alone);
    `request_history`: then the request-history weights on top (`fit_history`; needs `records.request`)."""
    if method == "platt":
        calib = fit_platt(records, min_rounds=min_rounds)
    elif method == "sts":
        calib = Calibration(fit_sts(records, min_rounds=min_rounds))
    else:
        raise InvalidArgument("method", method, f"must be one of {list(METHODS)}")
    if request_history:
        calib = fit_history(records, calib, strength=strength, min_rounds=min_rounds)
    return calib


def calibration_table(records: RolloutRecords, before=None, after=None, bins: int = NUM_BINS) -> list[dict]:
    """Per position: rounds, ECE of survival (raw / STS, and the sampling-noise floor of the STS scores), ECE of
    conditional (raw / STS), and AUCs of both views."""
    rows = []
    for k in range(1, records.gamma + 1):
        s_raw, y_s = position_view(records, k, before, "survival")
        s_cal, _ = position_view(records, k, after, "survival")
        c_raw, y_c = position_view(records, k, before, "conditional")
        c_cal, _ = position_view(records, k, after, "conditional")
        rows.append({
            "position": k,
            "rounds": int(y_s.size),
            "prefix_accept_rate": float(y_s.mean()) if y_s.size else math.nan,
            "ece_survival_raw": ece(s_raw, y_s, bins),
            "ece_survival_sts": ece(s_cal, y_s, bins),
            "ece_survival_floor": ece_noise_floor(s_cal, bins),
            "auc_survival": roc_auc(s_cal, y_s),
            "conditional_rounds": int(y_c.size),
            "ece_conditional_raw": ece(c_raw, y_c, bins),
            "ece_conditional_sts": ece(c_cal, y_c, bins),
            "auc_conditional": roc_auc(c_cal, y_c),
        })
    return rows


def reliability_by_position(records: RolloutRecords, temperatures=None, bins: int = NUM_BINS,
                            view: str = "survival") -> list[dict]:
    return [reliability(*position_view(records, k, temperatures, view), bins) for k in range(1, records.gamma + 1)]


def write_calibration(drafter_dir: str | Path, temperatures, metadata: dict | None = None,
                      greedy: bool = False, base_dir: str | Path | None = None) -> Path:
    """Write `<drafter_dir>/calibration.json` = {"method": "sts" | "platt", "temperatures": [...],
    "biases": [...] (Platt only), "request_history": {...} (if fitted), ...metadata}; `temperatures` is a list
    or a `Calibration`.

    `greedy`: this calibrates the greedy confidence output instead; it goes to the file's `"greedy"` section
    and the sampled-regime calibration already there is kept (identity if none). A sampled-regime write keeps
    an existing greedy section likewise. When `<drafter_dir>` has no file yet, the section kept comes from
    `<base_dir>/calibration.json` (the drafter's own, when writing elsewhere)."""
    calib = temperatures if isinstance(temperatures, Calibration) else Calibration(tuple(temperatures))
    temps = list(calib.temperatures)
    fitted = {"temperatures": temps}
    if calib.biases is not None:
        fitted["biases"] = list(calib.biases)
    if calib.history is not None:
        fitted["request_history"] = calib.history.to_dict()
    path = Path(drafter_dir) / "calibration.json"
    source = path if path.is_file() or base_dir is None else Path(base_dir) / "calibration.json"
    try:
        old = json.loads(source.read_text()) if source.is_file() else {}
    except (OSError, json.JSONDecodeError):
        old = {}
    path.parent.mkdir(parents=True, exist_ok=True)
    if greedy:
        body = {"method": "sts", "temperatures": [1.0] * len(temps), **old,
                "greedy": {"method": calib.method, **fitted, **(metadata or {})}}
    else:
        body = {"method": calib.method, **fitted, **(metadata or {})}
        if "greedy" in old:
            body["greedy"] = old["greedy"]
    path.write_text(json.dumps(body, indent=2, default=_jsonable) + "\n")
    return path


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    raise TypeError(type(x).__name__)
