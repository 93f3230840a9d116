"""Watching speculation online: calibration of the confidences and collapse of a drafter's acceptance.

What it knows: per verified round, the conditional confidences c_1..c_l the policy saw for the l draft
positions the target checked, and how many of them it accepted. From those:

- `CalibrationMonitor`: per position k, predicted survival a_k = prod_{i<=k} c_i against the realised
  prefix indicator `accepted >= k` over a sliding window of rounds; the running ECE per position
  (equal-width bins, as `dspark_core.calibration`), its sampling-noise floor, and expected vs accepted
  token totals. When the ECE in excess of its noise floor leaves `bound` at any position with enough
  rounds the monitor turns `ok` False (a confidence-driven policy should then fall back to the fixed
  length) and it turns back when every position is below `recover * bound` again (hysteresis, so a
  border case does not flap). It also keeps the last rounds for `dspark calibrate --online`.
- `CollapseDetector`: per drafter, position-1 acceptance over a window of rounds against its expectation
  (the mean predicted c_1, or 1.0 for a drafter without a confidence head). A drafter whose acceptance
  falls under `ratio` x expectation (a mismatched checkpoint, a target updated under it) is flagged:
  `should_draft()` is then False except on probe rounds, spaced `probe_every` steps apart; every
  `probe_rounds` probed rounds give a verdict: acceptance back above `recover_ratio` x expectation clears
  the flag, otherwise the spacing doubles (up to `max_probe_every`). A probe needs to verify only the first
  draft position (that is all the verdict reads), so it costs about one autoregressive step.
- `SlotCorrection`: what the workload does to the confidences' level. A calibration fitted offline holds on
  its own prompts; on another workload the drafter's acceptance per position sits above or below it (SmolLM2,
  held-out code + math at batch 1: greedy slot 2 predicted 0.209 against 0.261 accepted, sampled slot 1
  0.378 against 0.344). Per kind of request (greedy / sampled) and per position k it keeps a logit offset
  b_k, added to every confidence before the policy reads it, and after each verified round moves it by
  `rate` x (outcome - prediction) for every position whose outcome the round shows (slot k is seen when
  slots < k were accepted): stochastic gradient descent on the log loss of the conditional events, i.e.
  online Platt biases, clamped to +-`limit`. Applied before a request's own history correction, whose slot-1
  record then measures the request against the corrected level, so the two do not count one deviation twice.

Losslessness: neither decides anything from the draft tokens of the round being verified. The fallback
and the collapse flag (and the slot offsets) are functions of earlier rounds' outcomes only, so the round they apply to verifies
a length chosen before its drafts were seen (the fixed length, or none).

What it does not know: tensors, models, metrics libraries or time; it is fed plain Python numbers.
"""

from __future__ import annotations

import dataclasses

import json
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from .errors import InvalidArgument

_TWO_OVER_PI_SQRT = math.sqrt(2.0 / math.pi)


@dataclass(frozen=True)
class RoundRecord:
    """One verified round of one request, as the policy saw it."""

    drafter: str
    # [verified] conditional confidences c_1..c_l of the verified positions (what the policy read)
    confidences: tuple[float, ...]
    accepted: int  # drafts accepted (0..verified)
    greedy: bool = False  # the request decodes at temperature 0 (the greedy confidence output)

    @property
    def verified(self) -> int:
        return len(self.confidences)

    def to_json(self) -> str:
        return json.dumps({"drafter": self.drafter, "confidences": list(self.confidences),
                           "accepted": self.accepted, "greedy": self.greedy})

    @classmethod
    def from_json(cls, text: str) -> "RoundRecord":
        d = json.loads(text)
        if not isinstance(d, dict):
            raise InvalidArgument("round", text[:80], "must be a JSON object")
        confs = d.get("confidences")
        if not isinstance(confs, list) or not all(isinstance(c, (int, float)) and 0.0 <= c <= 1.0 for c in confs):
            raise InvalidArgument("confidences", confs, "must be a list of numbers in [0, 1]")
        acc = d.get("accepted")
        if not isinstance(acc, int) or isinstance(acc, bool) or not 0 <= acc <= len(confs):
            raise InvalidArgument("accepted", acc, f"must be an integer in [0, {len(confs)}]")
        return cls(str(d.get("drafter", "")), tuple(float(c) for c in confs), acc, bool(d.get("greedy", False)))


def _ece_and_floor(pairs: Sequence[tuple[float, bool]], bins: int) -> tuple[float, float]:
    """ECE of (prediction, outcome) pairs and its noise floor: the expected ECE of a perfectly calibrated
    predictor with these predictions, sum_b sqrt(2/pi) * sqrt(sum_{i in b} p_i (1 - p_i)) / n (normal
    approximation of E|sum(y) - sum(p)| per bin)."""
    n = len(pairs)
    if n == 0:
        return math.nan, math.nan
    sp = [0.0] * bins
    sy = [0.0] * bins
    var = [0.0] * bins
    for p, y in pairs:
        b = min(int(p * bins), bins - 1)
        sp[b] += p
        sy[b] += y
        var[b] += p * (1.0 - p)
    ece = sum(abs(a - b) for a, b in zip(sp, sy)) / n
    floor = _TWO_OVER_PI_SQRT * sum(math.sqrt(v) for v in var) / n
    return ece, floor


class CalibrationMonitor:
    """Running per-position calibration of the confidences the policy reads (see the module docstring)."""

    def __init__(self, gamma: int, *, window: int = 2000, bins: int = 10, bound: float = 0.1,
                 recover: float = 0.7, min_rounds: int = 200, check_every: int = 50, keep_rounds: int = 20000):
        if not isinstance(gamma, int) or gamma < 1:
            raise InvalidArgument("gamma", gamma, "must be an integer >= 1")
        if not 0.0 < bound <= 1.0:
            raise InvalidArgument("calibration_bound", bound, "must be in (0, 1]")
        if not 0.0 < recover <= 1.0:
            raise InvalidArgument("recover", recover, "must be in (0, 1]")
        if window < 1 or min_rounds < 1 or check_every < 1 or bins < 1 or keep_rounds < 0:
            raise InvalidArgument("window", window, "window, min_rounds, check_every, bins must be >= 1")
        self.gamma, self.bins, self.bound, self.recover = gamma, bins, bound, recover
        self.min_rounds, self.check_every = min_rounds, check_every
        # per position k (0-based): (predicted survival a_k, realised accepted >= k + 1)
        self._pairs: list[deque[tuple[float, bool]]] = [deque(maxlen=window) for _ in range(gamma)]
        self.rounds: deque[RoundRecord] = deque(maxlen=keep_rounds)
        # totals since start, per position: sum of a_k over verified positions, and accepted drafts there
        self.expected_tokens = [0.0] * gamma
        self.accepted_tokens = [0] * gamma
        self.ece = [math.nan] * gamma
        self.floor = [math.nan] * gamma
        self.ok = True
        self.transitions = 0  # times `ok` changed
        self._since_check = 0

    def observe(self, record: RoundRecord) -> bool | None:
        """Add one round. Returns the new `ok` when this call changed it, else None."""
        if record.verified == 0:
            return None
        self.rounds.append(record)
        a = 1.0
        for k, c in enumerate(record.confidences[: self.gamma]):
            a *= c
            hit = record.accepted > k
            self._pairs[k].append((a, hit))
            self.expected_tokens[k] += a
            self.accepted_tokens[k] += int(hit)
        self._since_check += 1
        if self._since_check < self.check_every:
            return None
        self._since_check = 0
        return self.check()

    def excess(self) -> list[float]:
        """Per position: ECE above its noise floor (NaN where fewer than `min_rounds` rounds)."""
        return [e - f if len(p) >= self.min_rounds else math.nan
                for e, f, p in zip(self.ece, self.floor, self._pairs)]

    def check(self) -> bool | None:
        """Recompute the ECEs and the `ok` state; returns the new state if it changed, else None."""
        for k, pairs in enumerate(self._pairs):
            self.ece[k], self.floor[k] = _ece_and_floor(pairs, self.bins)
        measured = [x for x in self.excess() if x == x]
        if not measured:
            return None
        worst = max(measured)
        now = worst <= self.bound if self.ok else worst <= self.recover * self.bound
        if now == self.ok:
            return None
        self.ok = now
        self.transitions += 1
        return now

    def worst_position(self) -> int | None:
        """1-based position with the largest excess ECE (None before any position has enough rounds)."""
        ex = self.excess()
        best = max((x, k) for k, x in enumerate(ex) if x == x) if any(x == x for x in ex) else None
        return None if best is None else best[1] + 1


def shift_logit(c: float, delta: float) -> float:
    """sigmoid(logit(c) + delta), c clamped into (0, 1)."""
    c = min(max(float(c), 1e-7), 1.0 - 1e-7)
    return 1.0 / (1.0 + math.exp(-(math.log(c / (1.0 - c)) + delta)))


class SlotCorrection:
    """Online per-position logit offsets of the confidences, one set per kind of request (module docstring)."""

    def __init__(self, gamma: int, *, rate: float = 0.02, limit: float = 2.0):
        if not isinstance(gamma, int) or isinstance(gamma, bool) or gamma < 1:
            raise InvalidArgument("gamma", gamma, "must be an integer >= 1")
        if isinstance(rate, bool) or not (isinstance(rate, (int, float)) and 0.0 < rate <= 1.0):
            raise InvalidArgument("slot_correction_rate", rate, "must be in (0, 1]")
        if not (isinstance(limit, (int, float)) and 0.0 < limit <= 10.0):
            raise InvalidArgument("limit", limit, "must be in (0, 10]")
        self.gamma, self.rate, self.limit = gamma, float(rate), float(limit)
        # greedy (True) / sampled (False) -> b_1..b_gamma, and how many outcomes moved each
        self.offsets = {True: [0.0] * gamma, False: [0.0] * gamma}
        self.observed = {True: [0] * gamma, False: [0] * gamma}

    def apply(self, confidences: Sequence[float], greedy: bool, undo: bool = False) -> list[float]:
        """The confidences with this kind's offsets added to their logits (positions past gamma unchanged);
        `undo`: subtracted instead (the confidences as they were before `apply`, while no round was observed)."""
        b = self.offsets[bool(greedy)]
        sign = -1.0 if undo else 1.0
        return [shift_logit(c, sign * b[k]) if k < self.gamma and b[k] != 0.0 else float(c)
                for k, c in enumerate(confidences)]

    def observe(self, record: RoundRecord) -> None:
        """One verified round; `record.confidences` are the corrected ones the policy read. Position k's
        outcome is known when the k - 1 before it were accepted (the conditional event the head predicts)."""
        b, n = self.offsets[record.greedy], self.observed[record.greedy]
        seen = record.confidences[: min(self.gamma, record.accepted + 1)]
        if not all(0.0 <= c <= 1.0 for c in seen):  # NaN or out of range: nothing to learn from this round
            return
        for k, c in enumerate(seen):
            hit = 1.0 if record.accepted > k else 0.0
            b[k] = min(self.limit, max(-self.limit, b[k] + self.rate * (hit - c)))
            n[k] += 1

    def snapshot(self) -> dict:
        """{"greedy": [...], "sampled": [...]} offsets and outcome counts (for metrics and logs)."""
        return {kind: {"offsets": [round(x, 4) for x in self.offsets[g]], "observed": list(self.observed[g])}
                for kind, g in (("greedy", True), ("sampled", False))}


class CollapseDetector:
    """Per-drafter collapse alarm with probing (see the module docstring)."""

    def __init__(self, *, ratio: float = 0.25, window: int = 24, min_rounds: int = 12, probe_every: int = 32,
                 max_probe_every: int = 256, recover_ratio: float = 0.5, probe_rounds: int = 4):
        if not 0.0 < ratio < 1.0:
            raise InvalidArgument("collapse_ratio", ratio, "must be in (0, 1)")
        if not ratio <= recover_ratio <= 1.0:
            raise InvalidArgument("recover_ratio", recover_ratio, f"must be in [collapse_ratio={ratio}, 1]")
        if min(window, min_rounds, probe_every, probe_rounds) < 1 or max_probe_every < probe_every:
            raise InvalidArgument("probe_every", probe_every, "window, min_rounds, probe_every, probe_rounds must be "
                                  ">= 1 and max_probe_every >= probe_every")
        self.ratio, self.recover_ratio = ratio, recover_ratio
        self.window, self.min_rounds, self.probe_rounds = window, min_rounds, probe_rounds
        self.probe_every, self.max_probe_every = probe_every, max_probe_every
        # drafter -> deque of (expected c_1, accepted position 1)
        self._window: dict[str, deque[tuple[float, bool]]] = {}
        self.collapsed: dict[str, bool] = {}
        self.collapses: dict[str, int] = {}  # times each drafter was flagged
        self._interval: dict[str, int] = {}  # current probe spacing (steps)
        self._next_probe: dict[str, int] = {}  # step at which the next probe runs
        self._step = 0

    def _w(self, drafter: str) -> deque:
        w = self._window.get(drafter)
        if w is None:
            w = self._window[drafter] = deque(maxlen=self.window)
        return w

    def acceptance_ratio(self, drafter: str) -> float:
        """Position-1 acceptance over the window divided by its expectation (NaN with no rounds)."""
        w = self._window.get(drafter) or ()
        expected = sum(e for e, _ in w)
        return sum(1 for _, y in w if y) / expected if expected > 0 else math.nan

    def is_collapsed(self, drafter: str) -> bool:
        return self.collapsed.get(drafter, False)

    def should_draft(self, drafter: str, step: int) -> bool:
        """Whether requests of `drafter` draft at engine step `step` (always, unless it is flagged: then only
        on probe steps)."""
        self._step = step
        if not self.collapsed.get(drafter, False):
            return True
        return step >= self._next_probe.get(drafter, 0)

    def observe(self, drafter: str, records: Sequence[RoundRecord], step: int) -> bool | None:
        """One step's verified rounds of `drafter` (rounds that verified no draft are skipped). Returns True
        when this call flagged the drafter, False when it cleared it, else None."""
        w = self._w(drafter)
        added = 0
        for rec in records:
            if rec.verified == 0:
                continue
            w.append((rec.confidences[0], rec.accepted > 0))
            added += 1
        if not added:
            return None
        ratio = self.acceptance_ratio(drafter)
        if not self.collapsed.get(drafter, False):
            if len(w) >= self.min_rounds and ratio < self.ratio:
                self.collapsed[drafter] = True
                self.collapses[drafter] = self.collapses.get(drafter, 0) + 1
                self._interval[drafter] = self.probe_every
                self._next_probe[drafter] = step + self.probe_every
                w.clear()  # probes alone decide recovery
                return True
            return None
        # a probe step: judge the probes gathered since the last verdict
        if len(w) >= self.probe_rounds:
            if ratio >= self.recover_ratio:
                self.collapsed[drafter] = False
                w.clear()
                return False
            self._interval[drafter] = min(self.max_probe_every, 2 * self._interval[drafter])
            w.clear()
        self._next_probe[drafter] = step + self._interval[drafter]
        return None


# -- recorded rounds and the online refit ----------------------------------------------------------------

_EPS = 1e-6


def write_rounds(path, records, append: bool = True) -> int:
    """Append (or write) rounds as JSON lines; returns how many were written."""
    n = 0
    with open(path, "a" if append else "w", encoding="utf-8") as f:
        for rec in records:
            f.write(rec.to_json() + "\n")
            n += 1
    return n


def read_rounds(path) -> list[RoundRecord]:
    """Rounds written by `write_rounds`; a bad line raises InvalidArgument naming the file and line."""
    out = []
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                out.append(RoundRecord.from_json(line))
            except (ValueError, InvalidArgument) as exc:
                raise InvalidArgument(f"{path}:{i}", line.strip()[:80], f"must be a recorded round ({exc})") from exc
    return out


def refit_calibration(records: Sequence[RoundRecord], temperatures: Sequence[float],
                      biases: Sequence[float] | None = None, *, method: str = "platt", min_rounds: int = 50,
                      history=None):
    """Refit from rounds recorded online. The recorded c_k = sigmoid(raw_k / t_k + b_k) were produced with
    the calibration (t, b) being served, so logit(c_k) = raw_k / t_k + b_k; a fit (t', b') on those logits gives
    sigmoid(raw_k / (t_k t'_k) + b_k / t'_k + b'_k): the new calibration is t_k t'_k and b_k / t'_k + b'_k.
    With a request `history` (dspark_core.calibration.RequestHistory) served too, the recorded logits carry
    its w_k g as well, which the refit scales the same way: its weights become w_k / t'_k.
    `method` "platt" fits both, "sts" the temperatures alone (b' = 0). Positions with fewer than `min_rounds`
    rounds keep (t_k, b_k).

    Returns (Calibration, table): the table is `dspark_core.calibration.calibration_table` on the recorded
    rounds, before (the recorded confidences) and after (the refit)."""
    from .calibration import Calibration, RolloutRecords, calibration_table, fit_calibration

    if not records:
        raise InvalidArgument("rounds", 0, "must hold at least one recorded round")
    gamma = len(temperatures)
    biases = [0.0] * gamma if biases is None else list(biases)
    if len(biases) != gamma:
        raise InvalidArgument("biases", len(biases), f"must match the temperatures ({gamma})")
    logits = [[math.log(min(max(c, _EPS), 1 - _EPS) / (1 - min(max(c, _EPS), 1 - _EPS))) for c in r.confidences[:gamma]]
              for r in records]
    rr = RolloutRecords.from_rounds(logits, [min(r.accepted, gamma) for r in records], gamma=gamma)
    fit = fit_calibration(rr, method, min_rounds=min_rounds)
    table = calibration_table(rr, None, fit)
    db = fit.bias_list()
    temps = tuple(float(t) * float(s) for t, s in zip(temperatures, fit.temperatures))
    new_b = tuple(float(b) / float(s) + d for b, s, d in zip(biases, fit.temperatures, db))
    if history is not None:
        history = dataclasses.replace(history, weights=tuple(
            float(w) / float(s) for w, s in zip(history.weights, fit.temperatures)))
    return Calibration(temps, new_b, history), table


def refit_temperatures(records: Sequence[RoundRecord], temperatures: Sequence[float], *, min_rounds: int = 50):
    """STS refit (temperatures alone) of rounds served with `temperatures` and no biases: (temperatures, table).
    See `refit_calibration`."""
    calib, table = refit_calibration(records, temperatures, None, method="sts", min_rounds=min_rounds)
    return calib.temperatures, table
