"""The verifier's cost curve: steps per second SPS(B) as a function of the tokens B in one forward pass.

What it knows: a measured table of (batch size in tokens, steps per second) points, how to read it at any
B (linear interpolation inside, clamping below, a conservative extrapolation above), how to store it as
JSON, plot it, and measure it with a caller-supplied step function.

What it does not know: models, devices or torch. `profile_sps` times whatever `step_fn(b)` does; the target
runtime supplies a function that runs one verification pass carrying `b` tokens and blocks until it is
done (on a GPU that means synchronising inside `step_fn`). Schedulers only ever see a callable B -> SPS,
obtained through `sps_callable`.
"""

from __future__ import annotations

import json
import math
import numbers
import os
import statistics
import time
from bisect import bisect_right
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Union

from dspark_core.errors import InvalidArgument

SPS_TABLE_FORMAT = "dspark-sps-table"
SPS_TABLE_VERSION = 1

_METADATA_FIELDS = ("device", "dtype", "context_length", "model", "weights", "kernels")
_DENSE_LIMIT = 1 << 16  # largest B cached by SpsTable.sps_range; larger B are computed per call


def _is_int(value: object) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _is_real(value: object) -> bool:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


@dataclass(frozen=True)
class SpsTable:
    """Measured SPS(B) points of one verifier configuration.

    Reading the table at a batch size `b` (tokens in one forward pass):
    - b <= batch_sizes[0]: steps_per_second[0] (clamped; a pass never gets faster than the smallest
      measured one).
    - between two measured points: linear interpolation of steps per second.
    - b > batch_sizes[-1]: the step *time* 1/SPS is extrapolated linearly with the slope of the last two
      points, floored at 0 (a noisy table whose last segment speeds up extrapolates as flat). A one-point
      table extrapolates as step time proportional to b (token throughput saturates), the conservative
      guess when nothing is known. The result is always > 0.
    """

    # [num_points] strictly increasing, >= 1
    batch_sizes: tuple[int, ...]
    # [num_points] positive, finite
    steps_per_second: tuple[float, ...]
    device: str | None = None
    dtype: str | None = None
    context_length: int | None = None
    model: str | None = None
    # the target's served weight format (`--weights`): the cost curve is that format's
    weights: str | None = None
    # the build of our CPU kernels the table was measured with (`dspark_core.kernels.build_id()`; None: none ran):
    # a rebuilt kernel can move the curve (2026-12-05: 5-8 rows ~15% cheaper), so a table of another build is stale
    kernels: str | None = None
    # Optional rows measured with exactly R requests in the pass ((R, table over B >= R), R increasing): a step
    # of 8 tokens costs less as one request verifying 8 than as 8 requests verifying one each (attention over
    # one context, not 8). `for_requests(R)` reads them; the plain table is what B alone says.
    by_requests: tuple[tuple[int, "SpsTable"], ...] | None = None
    # step times 1/SPS, derived once for extrapolation
    _step_times: tuple[float, ...] = field(init=False, repr=False, compare=False)
    # SPS at B = 0 .. min(batch_sizes[-1], _DENSE_LIMIT), filled on the first `sps_range` call
    _dense: list[float] | None = field(init=False, repr=False, compare=False, default=None)
    # for_requests results by R
    _per_requests: dict | None = field(init=False, repr=False, compare=False, default=None)

    def __post_init__(self) -> None:
        sizes, speeds = self.batch_sizes, self.steps_per_second
        if isinstance(sizes, (str, bytes)) or not isinstance(sizes, Sequence):
            raise InvalidArgument("batch_sizes", sizes, "must be a sequence of integers")
        if isinstance(speeds, (str, bytes)) or not isinstance(speeds, Sequence):
            raise InvalidArgument("steps_per_second", speeds, "must be a sequence of numbers")
        if len(sizes) == 0:
            raise InvalidArgument("batch_sizes", sizes, "must hold at least one batch size")
        if len(sizes) != len(speeds):
            raise InvalidArgument(
                "steps_per_second", speeds, f"must have one value per batch size ({len(sizes)})"
            )
        for i, b in enumerate(sizes):
            if not _is_int(b) or b < 1:
                raise InvalidArgument(f"batch_sizes[{i}]", b, "must be an integer >= 1")
            if i > 0 and b <= sizes[i - 1]:
                raise InvalidArgument(
                    f"batch_sizes[{i}]", b, f"must be greater than batch_sizes[{i - 1}] = {sizes[i - 1]}"
                )
        for i, s in enumerate(speeds):
            if not _is_real(s) or not math.isfinite(s) or s <= 0:
                raise InvalidArgument(f"steps_per_second[{i}]", s, "must be a positive finite number")
        for name in ("device", "dtype", "model", "weights", "kernels"):
            value = getattr(self, name)
            if value is not None and not isinstance(value, str):
                raise InvalidArgument(name, value, "must be a string or None")
        if self.context_length is not None and (not _is_int(self.context_length) or self.context_length < 0):
            raise InvalidArgument("context_length", self.context_length, "must be an integer >= 0 or None")
        object.__setattr__(self, "batch_sizes", tuple(int(b) for b in sizes))
        object.__setattr__(self, "steps_per_second", tuple(float(s) for s in speeds))
        if self.context_length is not None:
            object.__setattr__(self, "context_length", int(self.context_length))
        object.__setattr__(self, "_step_times", tuple(1.0 / s for s in self.steps_per_second))
        if self.by_requests is not None:
            rows = tuple(self.by_requests)
            for i, (r, t) in enumerate(rows):
                if not _is_int(r) or r < 1 or (i and r <= rows[i - 1][0]):
                    raise InvalidArgument("by_requests", r, "must be increasing request counts >= 1")
                if not isinstance(t, SpsTable):
                    raise InvalidArgument(f"by_requests[{r}]", t, "must be an SpsTable")
            object.__setattr__(self, "by_requests", tuple((int(r), t) for r, t in rows) or None)
        object.__setattr__(self, "_per_requests", {})

    def __call__(self, b: int | float) -> float:
        """Steps per second of a forward pass carrying `b` tokens (see the class docstring)."""
        sizes, speeds = self.batch_sizes, self.steps_per_second
        if b <= sizes[0]:
            if b != b:  # NaN fails every comparison; catch it here rather than return garbage
                raise InvalidArgument("b", b, "must be a number")
            return speeds[0]
        i = bisect_right(sizes, b)
        if i < len(sizes):
            b0, b1 = sizes[i - 1], sizes[i]
            s0, s1 = speeds[i - 1], speeds[i]
            return s0 + (s1 - s0) * (b - b0) / (b1 - b0)
        if not math.isfinite(b):
            raise InvalidArgument("b", b, "must be a finite number")
        times = self._step_times
        if len(sizes) == 1:
            return speeds[0] * sizes[0] / b
        slope = max(0.0, (times[-1] - times[-2]) / (sizes[-1] - sizes[-2]))
        return 1.0 / (times[-1] + slope * (b - sizes[-1]))

    def sps_range(self, lo: int, hi: int) -> list[float]:
        """SPS at the integer batch sizes lo .. hi-1 in one call (what schedulers use in their inner loop:
        a slice of a cached dense table instead of one interpolation per step)."""
        dense = self._dense
        if dense is None:
            top = min(self.batch_sizes[-1], _DENSE_LIMIT)
            dense = [self(b) for b in range(top + 1)]
            object.__setattr__(self, "_dense", dense)
        if lo < 1:
            raise InvalidArgument("lo", lo, "must be >= 1")
        if hi <= len(dense):
            return dense[lo:hi]
        start = max(lo, len(dense))
        sizes, times = self.batch_sizes, self._step_times
        if start <= sizes[-1] or len(sizes) == 1:  # past the cache but inside the table, or one point
            return dense[lo:] + [self(b) for b in range(start, hi)]
        # the extrapolation of __call__, inlined: 1 / (t_last + slope * (b - b_last))
        slope = max(0.0, (times[-1] - times[-2]) / (sizes[-1] - sizes[-2]))
        t_last, b_last = times[-1], sizes[-1]
        return dense[lo:] + [1.0 / (t_last + slope * (b - b_last)) for b in range(start, hi)]

    def step_time(self, b: int | float) -> float:
        """Seconds per forward pass carrying `b` tokens: 1 / SPS(b)."""
        return 1.0 / self(b)

    def with_overhead(self, seconds: float) -> "SpsTable":
        """The curve of a step that also spends a fixed `seconds` outside the forward pass (drafting, the
        engine's own work): SPS'(B) = 1 / (1 / SPS(B) + seconds) at every measured point. A fixed cost makes
        extra verified tokens relatively cheaper, so a scheduler that ignores it admits too few."""
        if not _is_real(seconds) or not math.isfinite(seconds) or seconds < 0:
            raise InvalidArgument("overhead", seconds, "must be a finite number of seconds >= 0")
        if seconds == 0:
            return self
        rows = None if not self.by_requests else tuple((r, t.with_overhead(seconds)) for r, t in self.by_requests)
        return SpsTable(batch_sizes=self.batch_sizes,
                        steps_per_second=tuple(1.0 / (t + seconds) for t in self._step_times),
                        device=self.device, dtype=self.dtype, context_length=self.context_length, model=self.model,
                        weights=self.weights, kernels=self.kernels, by_requests=rows)

    def for_requests(self, r: int) -> "SpsTable":
        """SPS(B) of a pass that carries `r` requests' tokens (what a scheduler deciding one step knows).

        The profiled row for `r`; between two rows, step time interpolated linearly in r at every B; below
        the first row, the first row; above the last row (or without rows), this table itself.
        """
        rows = self.by_requests
        if not rows or r > rows[-1][0]:
            return self
        cached = self._per_requests.get(r)
        if cached is not None:
            return cached
        hi = next(i for i, (rr, _) in enumerate(rows) if rr >= r)
        r1, t1 = rows[hi]
        if r1 == r or hi == 0:
            table = t1
        else:
            r0, t0 = rows[hi - 1]
            w = (r - r0) / (r1 - r0)
            sizes = sorted({b for b in (*t0.batch_sizes, *t1.batch_sizes) if b >= r} | {r})
            table = SpsTable(batch_sizes=tuple(sizes),
                             steps_per_second=tuple(1.0 / ((1 - w) * t0.step_time(b) + w * t1.step_time(b))
                                                    for b in sizes),
                             device=self.device, dtype=self.dtype, context_length=self.context_length,
                             model=self.model, weights=self.weights, kernels=self.kernels)
        self._per_requests[r] = table
        return table

    # -- serialisation -------------------------------------------------------------------------------

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "format": SPS_TABLE_FORMAT,
            "version": SPS_TABLE_VERSION,
            "batch_sizes": list(self.batch_sizes),
            "steps_per_second": list(self.steps_per_second),
        }
        for name in _METADATA_FIELDS:
            out[name] = getattr(self, name)
        if self.by_requests:
            out["by_requests"] = {str(r): {"batch_sizes": list(t.batch_sizes),
                                           "steps_per_second": list(t.steps_per_second)}
                                  for r, t in self.by_requests}
        return out

    @classmethod
    def from_dict(cls, data: object) -> "SpsTable":
        """Build a table from `to_dict` output. Unknown keys are ignored (forward compatibility)."""
        if not isinstance(data, dict):
            raise InvalidArgument("sps table", data, "must be a JSON object")
        fmt = data.get("format", SPS_TABLE_FORMAT)
        if fmt != SPS_TABLE_FORMAT:
            raise InvalidArgument("format", fmt, f"must be {SPS_TABLE_FORMAT!r}")
        version = data.get("version", SPS_TABLE_VERSION)
        if version != SPS_TABLE_VERSION:
            raise InvalidArgument("version", version, f"must be {SPS_TABLE_VERSION}")
        for key in ("batch_sizes", "steps_per_second"):
            if key not in data:
                raise InvalidArgument(key, None, "is required")
            if not isinstance(data[key], list):
                raise InvalidArgument(key, data[key], "must be a list")
        rows = data.get("by_requests")
        if rows is not None:
            if not isinstance(rows, dict):
                raise InvalidArgument("by_requests", rows, "must be an object {requests: table}")
            parsed = []
            for key, row in rows.items():
                if not (isinstance(key, str) and key.isdigit()) or int(key) < 1:
                    raise InvalidArgument("by_requests", key, "keys must be request counts >= 1")
                if not isinstance(row, dict):
                    raise InvalidArgument(f"by_requests[{key}]", row, "must be a table object")
                try:
                    parsed.append((int(key), cls.from_dict(row)))
                except InvalidArgument as exc:
                    raise InvalidArgument(f"by_requests[{key}].{exc.field}", exc.value, exc.requirement) from exc
            rows = tuple(sorted(parsed))
        return cls(
            batch_sizes=tuple(data["batch_sizes"]),
            steps_per_second=tuple(data["steps_per_second"]),
            **{name: data.get(name) for name in _METADATA_FIELDS},
            by_requests=rows,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)

    @classmethod
    def from_json(cls, text: str | bytes) -> "SpsTable":
        try:
            data = json.loads(text)
        except (ValueError, TypeError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise InvalidArgument("sps table JSON", _snippet(text), f"is not valid JSON ({exc})") from exc
        return cls.from_dict(data)

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the table as JSON; atomic (temporary file then rename), so readers never see half."""
        path = Path(path)
        tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
        tmp.write_text(self.to_json() + "\n", encoding="utf-8")
        os.replace(tmp, path)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> "SpsTable":
        """Read a table written by `save`. A missing file raises FileNotFoundError; a malformed one raises
        InvalidArgument whose field names the file (and the bad entry, when the JSON parsed)."""
        path = Path(path)
        text = path.read_text(encoding="utf-8", errors="replace")
        try:
            data = json.loads(text)
        except ValueError as exc:
            raise InvalidArgument(
                f"sps table file {str(path)!r}", _snippet(text), f"is not valid JSON ({exc})"
            ) from exc
        try:
            return cls.from_dict(data)
        except InvalidArgument as exc:
            raise InvalidArgument(f"sps table file {str(path)!r}: {exc.field}", exc.value, exc.requirement) from exc


def _snippet(text: object, limit: int = 80) -> object:
    if isinstance(text, (str, bytes)) and len(text) > limit:
        return text[:limit] + (b"..." if isinstance(text, bytes) else "...")
    return text


SpsLike = Union[SpsTable, Callable[[int], float], Sequence[float]]


class _SequenceSps:
    """SPS given as a sequence indexed by batch size: sps[B] is SPS at B tokens, index 0 is ignored."""

    __slots__ = ("_values", "_n")

    def __init__(self, values: Any):
        self._values = values
        self._n = len(values)

    def __call__(self, b: int) -> float:
        if b.__class__ is not int:
            if not _is_int(b):
                raise InvalidArgument(
                    "sps", f"<sequence of length {self._n}>", f"is indexed by integer batch sizes; asked for B={b!r}"
                )
            b = int(b)
        if not 1 <= b < self._n:
            raise InvalidArgument(
                "sps", f"<sequence of length {self._n}>", f"covers batch sizes 1..{self._n - 1}; asked for B={b}"
            )
        value = self._values[b]
        if not value > 0 or not math.isfinite(value):
            raise InvalidArgument(f"sps[{b}]", value, "must be a positive finite steps-per-second")
        return float(value)

    def sps_range(self, lo: int, hi: int) -> list[float]:
        """SPS at B = lo .. hi-1, cut short where the sequence ends or at its first invalid value (a
        caller that reads on goes through __call__, which raises there, naming `sps`)."""
        if lo < 1:
            raise InvalidArgument("lo", lo, "must be >= 1")
        values = [float(v) for v in self._values[lo:min(hi, self._n)]]
        for k, v in enumerate(values):
            if not v > 0 or not math.isfinite(v):
                return values[:k]
        return values


class _CheckedSps:
    """Wraps a caller's callable so that a non-positive or non-finite SPS fails loudly, naming `sps`."""

    __slots__ = ("_fn",)

    def __init__(self, fn: Callable[[int], float]):
        self._fn = fn

    def __call__(self, b: int) -> float:
        value = self._fn(b)
        if not value > 0 or not math.isfinite(value):
            raise InvalidArgument("sps", value, f"must return a positive finite steps-per-second; at B={b}")
        return value


def monotone(table: SpsTable) -> SpsTable:
    """The closest table (least squares on step time) whose step time never falls as B grows.

    A forward pass carrying more tokens is never faster on the same hardware, so a measured table that
    dips is showing noise from the rest of the machine: a burst during B = 12's repeats makes B = 12 look
    slower than B = 14. Isotonic regression (pool adjacent violators) on the step times removes such dips
    and keeps every genuine rise; a table that is already monotone comes back unchanged.
    """
    blocks: list[list[float]] = []  # [sum of step times, count]
    for t in table._step_times:
        blocks.append([t, 1.0])
        while len(blocks) > 1 and blocks[-2][0] / blocks[-2][1] > blocks[-1][0] / blocks[-1][1]:
            total, count = blocks.pop()
            blocks[-1][0] += total
            blocks[-1][1] += count
    times = [total / count for total, count in blocks for _ in range(int(count))]
    rows = None if not table.by_requests else tuple((r, monotone(t)) for r, t in table.by_requests)
    return SpsTable(batch_sizes=table.batch_sizes, steps_per_second=tuple(1.0 / t for t in times),
                    device=table.device, dtype=table.dtype, context_length=table.context_length, model=table.model,
                    weights=table.weights, kernels=table.kernels, by_requests=rows)


def sps_callable(sps: SpsLike) -> Callable[[int], float]:
    """Normalise the ways a caller can give SPS(B) into one callable B -> steps per second.

    - an `SpsTable`: returned as is.
    - a callable: wrapped so that a non-positive or non-finite result raises InvalidArgument naming `sps`.
    - a sequence (list, tuple, 1-D numpy array) indexed by batch size: `sps[B]` is SPS at B tokens;
      index 0 is ignored (there is no zero-token pass), so a list covering B = 1..N has length N + 1.
      A B outside 1..len(sps)-1 raises InvalidArgument naming `sps`.
    """
    if isinstance(sps, (SpsTable, _SequenceSps, _CheckedSps)):
        return sps
    if callable(sps):
        return _CheckedSps(sps)
    if isinstance(sps, (str, bytes, dict)) or not hasattr(sps, "__len__") or not hasattr(sps, "__getitem__"):
        raise InvalidArgument("sps", sps, "must be an SpsTable, a callable B -> SPS, or a sequence indexed by B")
    if getattr(sps, "ndim", 1) != 1:
        raise InvalidArgument("sps", sps, "must be one-dimensional when given as an array")
    if len(sps) < 2:
        raise InvalidArgument("sps", sps, "as a sequence must cover at least B = 1 (index 0 is ignored)")
    return _SequenceSps(sps)


def plot_sps(table: SpsTable, path: str | os.PathLike[str], *, max_batch: int | None = None,
             raw: SpsTable | None = None) -> None:
    """Write a PNG with SPS(B) and token throughput B * SPS(B), measured points marked (and the raw
    medians as grey dots when `table` is a smoothed version of `raw`).

    The curve is drawn from B = 1 to `max_batch` (default: the last measured batch size); past the last
    measured point it shows the extrapolation, dashed.
    """
    if not isinstance(table, SpsTable):
        raise InvalidArgument("table", table, "must be an SpsTable")
    last = table.batch_sizes[-1]
    top = last if max_batch is None else max_batch
    if not _is_int(top) or top < 1:
        raise InvalidArgument("max_batch", max_batch, "must be an integer >= 1")
    # Figure + Agg canvas directly: no pyplot global state, no backend switching in the caller's process.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=(10, 4))
    FigureCanvasAgg(fig)
    ax_sps, ax_tok = fig.subplots(1, 2)
    inside = list(range(1, min(top, last) + 1))
    beyond = list(range(last, top + 1)) if top > last else []
    for ax, fn, raw_fn, label in (
        (ax_sps, lambda b: table(b), lambda b: raw(b), "steps per second"),
        (ax_tok, lambda b: b * table(b), lambda b: b * raw(b), "tokens per second (B x SPS)"),
    ):
        ax.plot(inside, [fn(b) for b in inside], "-", color="C0", label="interpolated")
        if beyond:
            ax.plot(beyond, [fn(b) for b in beyond], "--", color="C1", label="extrapolated")
        measured = [b for b in table.batch_sizes if b <= top]
        if raw is not None:
            ax.plot(measured, [raw_fn(b) for b in measured], ".", color="0.6", label="raw medians")
            ax.plot(measured, [fn(b) for b in measured], "o", color="C0", ms=3, label="monotone fit")
        else:
            ax.plot(measured, [fn(b) for b in measured], "o", color="C0", label="measured")
        for r, row in table.by_requests or ():
            bs = [b for b in range(row.batch_sizes[0], row.batch_sizes[-1] + 1) if b <= top]
            ax.plot(bs, [(1 if ax is ax_sps else b) * row(b) for b in bs], "-", lw=0.8, alpha=0.7,
                    label=f"{r} request{'s' if r > 1 else ''}")
        ax.set_xlabel("tokens per forward pass (B)")
        ax.set_ylabel(label)
        ax.grid(True, alpha=0.3)
        ax.legend(loc="best", fontsize="small")
    meta = ", ".join(f"{n}={getattr(table, n)}" for n in _METADATA_FIELDS if getattr(table, n) is not None)
    fig.suptitle("Verifier cost curve" + (f" ({meta})" if meta else ""))
    fig.tight_layout()
    fig.savefig(os.fspath(path), format="png", dpi=100)


def profile_sps(
    step_fn: Callable[[int], object],
    batch_sizes: Sequence[int],
    repeats: int = 5,
    warmup: int = 2,
    clock: Callable[[], float] = time.perf_counter,
    *,
    device: str | None = None,
    dtype: str | None = None,
    context_length: int | None = None,
    model: str | None = None,
    weights: str | None = None,
    kernels: str | None = None,
    progress: Callable[[], object] | None = None,
) -> SpsTable:
    """Measure SPS(B): for each batch size, `warmup` untimed calls of `step_fn(b)`, then `repeats` timed
    sweeps over all batch sizes; SPS = 1 / median step time. `progress()` is called after each sweep.

    `step_fn(b)` must run one forward pass carrying `b` tokens and return only when it is finished (call
    `torch.cuda.synchronize()` inside it on a GPU). `clock` returns seconds; it is a parameter so that the
    harness can be tested with a fake clock.
    """
    if not callable(step_fn):
        raise InvalidArgument("step_fn", step_fn, "must be callable as step_fn(b)")
    if not _is_int(repeats) or repeats < 1:
        raise InvalidArgument("repeats", repeats, "must be an integer >= 1")
    if not _is_int(warmup) or warmup < 0:
        raise InvalidArgument("warmup", warmup, "must be an integer >= 0")
    if isinstance(batch_sizes, (str, bytes)) or not isinstance(batch_sizes, Sequence) or len(batch_sizes) == 0:
        raise InvalidArgument("batch_sizes", batch_sizes, "must be a non-empty sequence of integers")
    for i, b in enumerate(batch_sizes):  # validate before spending time on measurements
        if not _is_int(b) or b < 1:
            raise InvalidArgument(f"batch_sizes[{i}]", b, "must be an integer >= 1")
        if i > 0 and b <= batch_sizes[i - 1]:
            raise InvalidArgument(f"batch_sizes[{i}]", b, f"must be greater than batch_sizes[{i - 1}]")
    for b in batch_sizes:
        for _ in range(warmup):
            step_fn(b)
    # Repeats are interleaved (every B once per sweep) so that a burst of outside load spreads over all
    # batch sizes instead of corrupting a few neighbouring ones; the median then drops it.
    elapsed: dict[int, list[float]] = {b: [] for b in batch_sizes}
    for _ in range(repeats):
        for b in batch_sizes:
            start = clock()
            step_fn(b)
            elapsed[b].append(clock() - start)
        if progress is not None:
            progress()
    speeds = []
    for b in batch_sizes:
        median = statistics.median(elapsed[b])
        if not median > 0:
            raise InvalidArgument("clock", median, f"must advance during a step (median step time at B={b})")
        speeds.append(1.0 / median)
    return SpsTable(
        batch_sizes=tuple(batch_sizes),
        steps_per_second=tuple(speeds),
        device=device,
        dtype=dtype,
        context_length=context_length,
        model=model,
        weights=weights,
        kernels=kernels,
    )


# -- the live table ----------------------------------------------------------------------------------

# batch sizes at which the online table keeps its corrections (about 1.4x apart); a measured pass at B
# counts for the nearest one in log space, so a few steps anywhere in a region refresh that region
_ONLINE_KNOTS = (1, 2, 3, 4, 6, 8, 11, 16, 22, 32, 45, 64, 90, 128, 181, 256, 362, 512, 724, 1024, 1448, 2048,
                 2896, 4096, 5793, 8192, 11585, 16384)
# context-length buckets (tokens of context per request in the pass): step time grows with attention
DEFAULT_CONTEXT_BUCKETS = (0, 512, 2048, 8192, 32768)


class OnlineSpsTable:
    """SPS(B) kept true online: a prior table (from `dspark profile`) corrected by every real forward pass.

    Each measured pass (tokens B, seconds, mean context length) gives a ratio r = seconds / prior step
    time at B, filed at the nearest correction knot (`_ONLINE_KNOTS`, log spaced) of its context bucket.
    The live step time at any B is the prior's times the median of the last `window` ratios at the nearest
    knots (interpolated in between; a knot with no data takes its nearest measured neighbour's, a bucket
    with no data its nearest measured bucket's, nothing measured = the prior), then made monotone in B
    (`monotone`).

    Outliers: a ratio outside [1 / max_ratio, max_ratio] is dropped (a broken clock); one more than
    `spike` x the knot's current median, or less than 1 / spike of it, is held back; after `persist` such
    samples in a row the next one is a regime change, not a spike: the knot restarts from the held ones.
    A median over a window already ignores a lone spike; the spike filter keeps a burst of them out too.

    Exploration: `stale_batch(lo, hi, context)` names a knot in [lo, hi] not measured for `stale_after`
    observations (the one measured longest ago), so the caller can run one step at that size and no batch
    size keeps an old measurement forever (the "dead spot" of fully online tables, where one spike makes a
    size look bad and the policy never visits it again).
    """

    def __init__(self, prior: SpsTable, *, window: int = 9, spike: float = 4.0, persist: int = 3,
                 max_ratio: float = 20.0, stale_after: int = 200, refresh_every: int = 4,
                 context_buckets: Sequence[int] = DEFAULT_CONTEXT_BUCKETS):
        if not isinstance(prior, SpsTable):
            raise InvalidArgument("prior", prior, "must be an SpsTable")
        if not _is_int(window) or window < 1:
            raise InvalidArgument("window", window, "must be an integer >= 1")
        if not spike > 1 or not max_ratio > 1:
            raise InvalidArgument("spike", spike, "spike and max_ratio must be > 1")
        if not _is_int(stale_after) or stale_after < 1 or not _is_int(refresh_every) or refresh_every < 1:
            raise InvalidArgument("stale_after", stale_after, "stale_after and refresh_every must be integers >= 1")
        buckets = tuple(int(c) for c in context_buckets)
        if not buckets or buckets[0] != 0 or any(b <= a for a, b in zip(buckets, buckets[1:])):
            raise InvalidArgument("context_buckets", context_buckets, "must start at 0 and increase")
        self.prior, self.window, self.spike, self.persist = prior, window, spike, persist
        self.max_ratio, self.stale_after, self.refresh_every = max_ratio, stale_after, refresh_every
        self.context_buckets = buckets
        top = max(prior.batch_sizes[-1], 1)
        self.knots = tuple(k for k in _ONLINE_KNOTS if k <= 2 * top) or (1,)
        nb, nk = len(buckets), len(self.knots)
        self._ratios = [[deque(maxlen=window) for _ in range(nk)] for _ in range(nb)]
        self._rejected = [[[] for _ in range(nk)] for _ in range(nb)]  # outliers held back, per knot
        self._last_seen = [[-1] * nk for _ in range(nb)]  # observation count at the last accepted sample
        self._contexts = [deque(maxlen=window) for _ in range(nb)]
        self.observations = 0  # passes offered
        self.last_context = 0.0  # mean context length of the latest accepted pass
        self.accepted = 0  # passes that entered the table
        self.rejected = 0
        self._tables: dict[int, SpsTable] = {}
        self._dirty_since = [0] * nb

    # -- feeding ---------------------------------------------------------------------------------------

    def bucket(self, context_length: float | None) -> int:
        c = 0 if context_length is None or not context_length > 0 else context_length
        return max(0, bisect_right(self.context_buckets, c) - 1)

    def _knot(self, b: float) -> int:
        # nearest knot in log space
        i = bisect_right(self.knots, b)
        if i == 0:
            return 0
        if i == len(self.knots):
            return len(self.knots) - 1
        lo, hi = self.knots[i - 1], self.knots[i]
        return i - 1 if math.log(b / lo) <= math.log(hi / b) else i

    def observe(self, tokens: int, seconds: float, context_length: float | None = None,
                requests: int | None = None) -> bool:
        """One real forward pass carrying `tokens` tokens took `seconds`; `context_length`: mean context per
        request in it; `requests`: how many sequences carried them (None: as many as tokens, the plain curve's
        shape). The pass is compared with the prior's prediction for that shape (its row for `requests` when
        it has rows): one request verifying 8 tokens costs far less than 8 requests' one-token pass, and
        filing it against the latter read as the machine having become faster at every size. Returns whether
        the sample entered the table (False: rejected as an outlier)."""
        self.observations += 1
        if not _is_int(tokens) or tokens < 1 or not _is_real(seconds) or not math.isfinite(seconds) or seconds <= 0:
            self.rejected += 1
            return False
        prior = self.prior
        if requests is not None and prior.by_requests and _is_int(requests) and 1 <= requests <= tokens:
            prior = prior.for_requests(requests)
        ratio = seconds / prior.step_time(tokens)
        bi, ki = self.bucket(context_length), self._knot(tokens)
        window = self._ratios[bi][ki]
        if not 1.0 / self.max_ratio <= ratio <= self.max_ratio:
            self.rejected += 1
            return False
        held = self._rejected[bi][ki]
        if len(window) >= 3:
            med = statistics.median(window)
            if not med / self.spike <= ratio <= med * self.spike:
                if len(held) < self.persist:
                    held.append(ratio)
                    self.rejected += 1
                    return False
                # `persist` outliers in a row: the cost really moved; restart the knot from them
                window.clear()
                window.extend(held)
                self._dirty_since[bi] = self.refresh_every
        held.clear()
        window.append(ratio)
        self._contexts[bi].append(0.0 if context_length is None else float(context_length))
        self.last_context = self._contexts[bi][-1]
        self._last_seen[bi][ki] = self.observations
        self.accepted += 1
        self._dirty_since[bi] += 1
        return True

    # -- reading ---------------------------------------------------------------------------------------

    def _corrections(self, bi: int) -> list[float] | None:
        """Median ratio per knot of bucket `bi` with the gaps filled from the nearest measured knot; None
        when the bucket has no data at all."""
        meds = [statistics.median(w) if w else None for w in self._ratios[bi]]
        have = [i for i, m in enumerate(meds) if m is not None]
        if not have:
            return None
        return [m if m is not None else meds[min(have, key=lambda j: (abs(j - i), j))] for i, m in enumerate(meds)]

    def correction(self, b: float, context_length: float | None = None) -> float:
        """The live step time at B divided by the prior's (1.0 where nothing was measured)."""
        corr = self._bucket_corrections(self.bucket(context_length))
        if corr is None:
            return 1.0
        knots = self.knots
        if b <= knots[0]:
            return corr[0]
        i = bisect_right(knots, b)
        if i >= len(knots):
            return corr[-1]
        w = math.log(b / knots[i - 1]) / math.log(knots[i] / knots[i - 1])
        return corr[i - 1] + (corr[i] - corr[i - 1]) * w

    def _bucket_corrections(self, bi: int) -> list[float] | None:
        corr = self._corrections(bi)
        if corr is not None:
            return corr
        measured = [j for j in range(len(self.context_buckets)) if any(self._ratios[j])]
        if not measured:
            return None
        return self._corrections(min(measured, key=lambda j: (abs(j - bi), j)))

    def table(self, context_length: float | None = None) -> SpsTable:
        """The live SpsTable for passes whose mean context is `context_length` (cached; rebuilt after
        `refresh_every` new samples in that bucket)."""
        bi = self.bucket(context_length)
        cached = self._tables.get(bi)
        if cached is not None and self._dirty_since[bi] < self.refresh_every:
            return cached
        self._dirty_since[bi] = 0
        ctx = self._contexts[bi]
        context = int(statistics.median(ctx)) if ctx else self.context_buckets[bi]

        def scaled(t: SpsTable) -> SpsTable:
            return SpsTable(batch_sizes=t.batch_sizes,
                            steps_per_second=tuple(s / self.correction(b, context)
                                                   for b, s in zip(t.batch_sizes, t.steps_per_second)),
                            device=t.device, dtype=t.dtype, context_length=context, model=t.model)

        prior = self.prior
        rows = None if not prior.by_requests else tuple((r, scaled(t)) for r, t in prior.by_requests)
        base = scaled(prior)
        live = monotone(SpsTable(batch_sizes=base.batch_sizes, steps_per_second=base.steps_per_second,
                                 device=base.device, dtype=base.dtype, context_length=context, model=base.model,
                                 by_requests=rows))
        self._tables[bi] = live
        return live

    def stale_batch(self, lo: int, hi: int, context_length: float | None = None) -> int | None:
        """A knot batch size in [lo, hi] whose last accepted measurement is `stale_after` or more passes old
        (never measured counts as oldest), the oldest first; None when every knot there is fresh."""
        bi = self.bucket(context_length)
        best = None
        for ki, b in enumerate(self.knots):
            if not lo <= b <= hi:
                continue
            age = self.observations - self._last_seen[bi][ki] if self._last_seen[bi][ki] >= 0 else math.inf
            if age >= self.stale_after and (best is None or age > best[0]):
                best = (age, b)
        return None if best is None else best[1]

    def points(self, context_length: float | None = None) -> list[list[float]]:
        """[[batch size, steps per second], ...] of the live table (what a pod publishes in Redis)."""
        return _points(self.table(context_length))

    def row_points(self, context_length: float | None = None) -> dict[str, list[list[float]]]:
        """{requests: [[batch size, steps per second], ...]} of the live table's request rows (empty when the
        prior has none), keyed as `table_from_points` reads them."""
        return {str(r): _points(t) for r, t in self.table(context_length).by_requests or ()}


def _points(t: SpsTable) -> list[list[float]]:
    return [[b, s] for b, s in zip(t.batch_sizes, t.steps_per_second)]


def table_from_points(points: Sequence[Sequence[float]], rows: Mapping[str, Sequence[Sequence[float]]] | None = None
                      ) -> "SpsTable | None":
    """An SpsTable from published points ([[batch size, steps per second], ...]) and request rows
    ({requests: points}; a pod's `OnlineSpsTable.points` / `row_points`), None without points. Rows that do
    not make a valid table (another pod's bad record) are left out: the plain curve alone is what a table
    without rows has always been."""
    if not points:
        return None
    table = SpsTable(tuple(int(b) for b, _ in points), tuple(float(s) for _, s in points))
    good = []
    for key, pts in (rows.items() if isinstance(rows, Mapping) else ()):
        r = _row_key(key)
        if r is None or not pts:
            continue
        try:
            good.append((r, SpsTable(tuple(int(b) for b, _ in pts), tuple(float(s) for _, s in pts))))
        except (InvalidArgument, TypeError, ValueError):
            continue
    good.sort(key=lambda rt: rt[0])
    if not good:
        return table
    try:
        return SpsTable(table.batch_sizes, table.steps_per_second, by_requests=tuple(good))
    except InvalidArgument:
        return table


def _row_key(key) -> int | None:
    try:
        r = int(key)
    except (TypeError, ValueError):
        return None
    return r if r >= 1 else None
