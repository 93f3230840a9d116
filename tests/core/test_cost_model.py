"""Tests of dspark_core.cost_model: reading SPS(B), storing it, plotting it, measuring it."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest

from dspark_core.cost_model import SpsTable, monotone, plot_sps, profile_sps, sps_callable
from dspark_core.errors import InvalidArgument

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def table() -> SpsTable:
    return SpsTable(batch_sizes=(4, 8, 16), steps_per_second=(100.0, 80.0, 40.0))


# -- reading the table ---------------------------------------------------------------------------------


def test_table_returns_measured_values_at_measured_points():
    t = table()
    assert [t(b) for b in (4, 8, 16)] == [100.0, 80.0, 40.0]


def test_table_interpolates_sps_linearly_between_measured_points():
    t = table()
    assert t(6) == pytest.approx(90.0)
    assert t(12) == pytest.approx(60.0)
    assert t(10.0) == pytest.approx(70.0)


def test_table_clamps_below_first_point_to_first_value():
    t = table()
    assert t(1) == 100.0 and t(3.5) == 100.0 and t(0) == 100.0


def test_table_extrapolates_step_time_linearly_with_last_slope():
    t = table()
    # step times 1/80 at B=8 and 1/40 at B=16: slope (1/40 - 1/80) / 8 per token
    slope = (1 / 40 - 1 / 80) / 8
    for b in (17, 24, 100, 10_000):
        assert t.step_time(b) == pytest.approx(1 / 40 + slope * (b - 16))
        assert t(b) > 0


def test_extrapolation_stays_positive_when_last_segment_speeds_up():
    # noisy measurement: the last segment gets faster; extrapolating that would reach time <= 0
    t = SpsTable(batch_sizes=(1, 2), steps_per_second=(1.0, 3.0))
    assert t(3) == pytest.approx(3.0)
    assert t(1e9) == pytest.approx(3.0)


def test_single_point_table_extrapolates_with_flat_token_throughput():
    t = SpsTable(batch_sizes=(4,), steps_per_second=(2.0,))
    assert t(1) == 2.0 and t(4) == 2.0
    assert t(8) == pytest.approx(1.0)  # 8 tokens per pass: same 8 tokens/s as at B = 4
    assert 8 * t(8) == pytest.approx(4 * t(4))


def test_step_time_is_inverse_of_sps():
    t = table()
    for b in (1, 6, 16, 50):
        assert t.step_time(b) == pytest.approx(1.0 / t(b))


def test_sps_range_matches_pointwise_calls():
    for t in (table(), SpsTable(batch_sizes=(2,), steps_per_second=(5.0,)),
              SpsTable(batch_sizes=(1, 3), steps_per_second=(2.0, 4.0))):
        assert t.sps_range(1, 40) == pytest.approx([t(b) for b in range(1, 40)])
        assert t.sps_range(20, 25) == pytest.approx([t(b) for b in range(20, 25)])


def test_table_rejects_nan_batch_size_argument():
    with pytest.raises(InvalidArgument, match="^b "):
        table()(float("nan"))


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(batch_sizes=(), steps_per_second=()), "batch_sizes"),
        (dict(batch_sizes=(1, 2), steps_per_second=(1.0,)), "steps_per_second"),
        (dict(batch_sizes=(0, 2), steps_per_second=(1.0, 1.0)), "batch_sizes[0]"),
        (dict(batch_sizes=(2, 2), steps_per_second=(1.0, 1.0)), "batch_sizes[1]"),
        (dict(batch_sizes=(3, 2), steps_per_second=(1.0, 1.0)), "batch_sizes[1]"),
        (dict(batch_sizes=(1, 2.5), steps_per_second=(1.0, 1.0)), "batch_sizes[1]"),
        (dict(batch_sizes=(1, 2), steps_per_second=(1.0, 0.0)), "steps_per_second[1]"),
        (dict(batch_sizes=(1, 2), steps_per_second=(float("inf"), 1.0)), "steps_per_second[0]"),
        (dict(batch_sizes=(1, 2), steps_per_second=(1.0, float("nan"))), "steps_per_second[1]"),
        (dict(batch_sizes=(1,), steps_per_second=(1.0,), context_length=-1), "context_length"),
        (dict(batch_sizes=(1,), steps_per_second=(1.0,), device=3), "device"),
    ],
)
def test_invalid_table_raises_naming_field(kwargs, field):
    with pytest.raises(InvalidArgument) as info:
        SpsTable(**kwargs)
    assert info.value.field == field
    assert str(info.value).startswith(field + " ")


def test_table_accepts_lists_and_numpy_values_and_stores_tuples():
    t = SpsTable(batch_sizes=[np.int64(1), 2], steps_per_second=np.array([2.0, 1.0]).tolist())
    assert t.batch_sizes == (1, 2) and t.steps_per_second == (2.0, 1.0)
    assert all(type(b) is int for b in t.batch_sizes)
    assert hash(t) == hash(SpsTable(batch_sizes=(1, 2), steps_per_second=(2.0, 1.0)))


# -- storage -------------------------------------------------------------------------------------------


def full_table() -> SpsTable:
    return SpsTable(
        batch_sizes=(1, 16, 64, 256),
        steps_per_second=(50.0, 48.5, 40.0, 12.25),
        device="NVIDIA H200",
        dtype="bf16",
        context_length=2048,
        model="Qwen3-4B",
    )


def test_json_round_trip_keeps_points_and_metadata():
    t = full_table()
    again = SpsTable.from_json(t.to_json())
    assert again == t
    assert (again.device, again.dtype, again.context_length, again.model) == ("NVIDIA H200", "bf16", 2048, "Qwen3-4B")
    data = json.loads(t.to_json())
    assert data["format"] == "dspark-sps-table" and data["version"] == 1


def test_save_load_round_trip(tmp_path):
    path = tmp_path / "sps.json"
    full_table().save(path)
    assert SpsTable.load(path) == full_table()
    assert SpsTable.load(str(path)) == full_table()
    assert [p.name for p in tmp_path.iterdir()] == ["sps.json"]  # no temporary file left behind


def test_load_malformed_json_names_the_file(tmp_path):
    path = tmp_path / "broken.json"
    path.write_text('{"batch_sizes": [1, 2], ', encoding="utf-8")
    with pytest.raises(InvalidArgument) as info:
        SpsTable.load(path)
    assert str(path) in str(info.value) and "not valid JSON" in str(info.value)


def test_load_bad_entry_names_the_file_and_the_field(tmp_path):
    path = tmp_path / "bad.json"
    path.write_text(json.dumps({"batch_sizes": [1, 2], "steps_per_second": [1.0, -2.0]}), encoding="utf-8")
    with pytest.raises(InvalidArgument) as info:
        SpsTable.load(path)
    assert str(path) in info.value.field and "steps_per_second[1]" in info.value.field
    assert info.value.value == -2.0


def test_load_missing_keys_or_wrong_shape_names_the_file(tmp_path):
    for name, payload, field in (
        ("list.json", [1, 2], "sps table"),
        ("nokey.json", {"batch_sizes": [1]}, "steps_per_second"),
        ("other.json", {"format": "something-else", "batch_sizes": [1], "steps_per_second": [1.0]}, "format"),
        ("v2.json", {"version": 2, "batch_sizes": [1], "steps_per_second": [1.0]}, "version"),
    ):
        path = tmp_path / name
        path.write_text(json.dumps(payload), encoding="utf-8")
        with pytest.raises(InvalidArgument) as info:
            SpsTable.load(path)
        assert str(path) in info.value.field and info.value.field.endswith(field)


def test_load_missing_file_raises_file_not_found(tmp_path):
    with pytest.raises(FileNotFoundError):
        SpsTable.load(tmp_path / "absent.json")


def test_from_json_ignores_unknown_keys():
    data = full_table().to_dict() | {"measured_at": "2026-01-01"}
    assert SpsTable.from_json(json.dumps(data)) == full_table()


# -- sps_callable --------------------------------------------------------------------------------------


def test_sps_callable_returns_table_as_is():
    t = table()
    assert sps_callable(t) is t


def test_sps_callable_sequence_is_indexed_by_batch_size_and_ignores_index_zero():
    fn = sps_callable([None, 3.0, 2.0, 1.0])
    assert [fn(1), fn(2), fn(3)] == [3.0, 2.0, 1.0]
    fn = sps_callable(np.array([0.0, 3.0, 2.0]))
    assert fn(2) == 2.0 and type(fn(2)) is float


@pytest.mark.parametrize("b", [0, 4, -1])
def test_sps_callable_sequence_out_of_range_raises_naming_sps(b):
    fn = sps_callable([0.0, 3.0, 2.0, 1.0])
    with pytest.raises(InvalidArgument) as info:
        fn(b)
    assert info.value.field == "sps" and f"B={b}" in str(info.value)


def test_sps_callable_sequence_rejects_nonpositive_entries():
    fn = sps_callable([0.0, 3.0, 0.0])
    with pytest.raises(InvalidArgument, match=r"sps\[2\]"):
        fn(2)


def test_sps_callable_wraps_callables_and_rejects_bad_results():
    assert sps_callable(lambda b: 10.0 / b)(5) == 2.0
    for bad in (0.0, -1.0, float("nan"), float("inf")):
        with pytest.raises(InvalidArgument) as info:
            sps_callable(lambda b, bad=bad: bad)(3)
        assert info.value.field == "sps" and "B=3" in str(info.value)


@pytest.mark.parametrize("bad", ["fast", 3.0, {1: 2.0}, [1.0], np.ones((2, 2))])
def test_sps_callable_rejects_other_types_naming_sps(bad):
    with pytest.raises(InvalidArgument) as info:
        sps_callable(bad)
    assert info.value.field == "sps"


# -- plotting ------------------------------------------------------------------------------------------


def test_plot_sps_writes_png(tmp_path):
    path = tmp_path / "sps.png"
    plot_sps(full_table(), path)
    assert path.read_bytes()[:8] == PNG_MAGIC
    extrapolated = tmp_path / "sps_wide.png"
    plot_sps(full_table(), extrapolated, max_batch=512)
    assert extrapolated.read_bytes()[:8] == PNG_MAGIC


def test_plot_sps_rejects_non_table(tmp_path):
    with pytest.raises(InvalidArgument, match="^table "):
        plot_sps([0.0, 1.0], tmp_path / "x.png")


# -- profiling -----------------------------------------------------------------------------------------


class FakeDevice:
    """A deterministic clock plus a step function that advances it: step b takes `durations[b][i]`
    seconds on its i-th call (cycling), so medians are known in advance."""

    def __init__(self, durations: dict[int, list[float]]):
        self.now = 0.0
        self.durations = durations
        self.calls: list[int] = []

    def clock(self) -> float:
        return self.now

    def step(self, b: int) -> None:
        seq = self.durations[b]
        self.now += seq[self.calls.count(b) % len(seq)]
        self.calls.append(b)


def test_profile_sps_takes_median_of_timed_repeats_after_warmup():
    # warm-up calls are slow (first two entries); timed ones have one outlier that the median ignores
    device = FakeDevice({1: [9.0, 9.0, 0.01, 0.01, 0.5, 0.01, 0.01], 8: [9.0, 9.0, 0.02, 0.02, 0.02, 3.0, 0.02]})
    t = profile_sps(device.step, [1, 8], repeats=5, warmup=2, clock=device.clock, device="fake", dtype="fp32")
    assert t.batch_sizes == (1, 8)
    assert t.steps_per_second == pytest.approx((100.0, 50.0))
    # warm-up per size, then the timed repeats interleaved: one sweep over every size per repeat
    assert device.calls == [1, 1, 8, 8] + [1, 8] * 5
    assert t.device == "fake" and t.dtype == "fp32"


def test_profile_sps_without_warmup_times_every_call():
    device = FakeDevice({2: [0.25]})
    t = profile_sps(device.step, (2,), repeats=3, warmup=0, clock=device.clock)
    assert t(2) == pytest.approx(4.0) and device.calls == [2, 2, 2]


def test_profile_sps_rejects_a_clock_that_does_not_advance():
    with pytest.raises(InvalidArgument, match="^clock "):
        profile_sps(lambda b: None, [1], clock=lambda: 0.0)


@pytest.mark.parametrize(
    "kwargs, field",
    [
        (dict(batch_sizes=[]), "batch_sizes"),
        (dict(batch_sizes=[2, 1]), "batch_sizes[1]"),
        (dict(batch_sizes=[0]), "batch_sizes[0]"),
        (dict(batch_sizes=[1], repeats=0), "repeats"),
        (dict(batch_sizes=[1], warmup=-1), "warmup"),
    ],
)
def test_profile_sps_validates_arguments_before_measuring(kwargs, field):
    calls = []
    with pytest.raises(InvalidArgument) as info:
        profile_sps(calls.append, **kwargs)
    assert info.value.field == field and calls == []


def test_profile_sps_on_real_clock_gives_positive_finite_table():
    t = profile_sps(lambda b: sum(range(100 * b)), [1, 4], repeats=3, warmup=1)
    assert all(s > 0 and math.isfinite(s) for s in t.steps_per_second)


def test_monotone_removes_dips_in_step_time_and_keeps_rises():
    from dspark_core.cost_model import monotone

    # step times 10, 20, 12 (a dip: B=3 looked faster than B=2), 30, 40 ms
    raw = SpsTable(batch_sizes=(1, 2, 3, 4, 5), steps_per_second=(100.0, 50.0, 1 / 0.012, 1 / 0.03, 25.0),
                   device="cpu", model="m")
    fit = monotone(raw)
    times = [1 / s for s in fit.steps_per_second]
    assert times == pytest.approx([0.010, 0.016, 0.016, 0.030, 0.040])  # the violating pair pooled to its mean
    assert all(b >= a for a, b in zip(times, times[1:]))
    assert fit.device == "cpu" and fit.model == "m" and fit.batch_sizes == raw.batch_sizes
    assert monotone(fit) == fit  # already monotone: unchanged


def _rows_table():
    one = SpsTable(batch_sizes=(1, 8), steps_per_second=(100.0, 80.0))  # one request: 8 tokens cost 1.25 steps
    four = SpsTable(batch_sizes=(4, 32), steps_per_second=(60.0, 30.0))
    return SpsTable(batch_sizes=(1, 8, 32), steps_per_second=(100.0, 50.0, 30.0), by_requests=((1, one), (4, four)))


def test_for_requests_reads_the_row_and_interpolates_step_time_between_rows():
    t = _rows_table()
    assert t.for_requests(1)(8) == 80.0  # the row: one request verifying 8 tokens
    assert t(8) == 50.0  # B alone: 8 requests' worth of tokens
    assert t.for_requests(4) is t.by_requests[1][1]
    # R = 2 sits 1/3 of the way from R = 1 to R = 4: step times mix 2:1 at every B
    mid = t.for_requests(2)
    assert mid(8) == pytest.approx(1.0 / (2 / 3 * (1 / 80.0) + 1 / 3 * (1 / t.by_requests[1][1](8))))
    assert mid.batch_sizes[0] == 2 and t.for_requests(2) is mid  # cached
    assert t.for_requests(5) is t  # beyond the rows: the plain table
    assert SpsTable(batch_sizes=(1,), steps_per_second=(9.0,)).for_requests(3)(3) == pytest.approx(3.0)


def test_rows_survive_json_and_the_monotone_fit(tmp_path):
    t = _rows_table()
    t.save(tmp_path / "sps.json")
    back = SpsTable.load(tmp_path / "sps.json")
    assert back == t and back.for_requests(1)(8) == 80.0
    dipping = SpsTable(batch_sizes=(1, 2, 3), steps_per_second=(10.0, 12.0, 8.0))
    fitted = monotone(SpsTable(batch_sizes=(1,), steps_per_second=(10.0,), by_requests=((1, dipping),)))
    assert fitted.by_requests[0][1].steps_per_second == monotone(dipping).steps_per_second
    bad = json.loads(t.to_json())
    bad["by_requests"]["1"]["steps_per_second"] = [1.0, -2.0]
    (tmp_path / "bad.json").write_text(json.dumps(bad))
    with pytest.raises(InvalidArgument, match=r"by_requests\[1\].steps_per_second"):
        SpsTable.load(tmp_path / "bad.json")


def test_causal_schedule_at_batch_one_admits_what_the_row_says_is_cheap():
    from dspark_core.scheduling import causal_prefix_schedule

    t = _rows_table()
    conf = [[0.5] * 7]
    # B alone says 8 tokens halve the step rate, so only 2 drafts of confidence 0.5 pay (tokens/s 100, 146, 150,
    # then 147); the one-request row says 8 tokens cost 25% more than one, so 4 do (..., 171.4, 171.6, 168.7)
    assert causal_prefix_schedule(conf, t) == [2]
    assert causal_prefix_schedule(conf, t.for_requests(1)) == [4]


def test_with_overhead_adds_a_fixed_step_time():
    t = SpsTable(batch_sizes=(1, 8), steps_per_second=(100.0, 50.0))
    slow = t.with_overhead(0.01)
    assert slow(1) == pytest.approx(50.0) and slow(8) == pytest.approx(1 / 0.03)
    assert t.with_overhead(0) is t
    with pytest.raises(InvalidArgument, match="overhead"):
        t.with_overhead(-1.0)


def test_with_overhead_keeps_the_request_rows_with_the_same_fixed_cost():
    row = SpsTable(batch_sizes=(1, 8), steps_per_second=(100.0, 80.0))
    t = SpsTable(batch_sizes=(1, 8), steps_per_second=(100.0, 50.0), by_requests=((1, row),))
    slow = t.with_overhead(0.01)
    # a one-request pass of 8 tokens: its row's 12.5 ms plus the overhead (not the plain curve's 20 ms)
    assert slow.for_requests(1)(8) == pytest.approx(1 / 0.0225)
    assert slow(8) == pytest.approx(1 / 0.03)


def test_a_published_table_keeps_its_valid_rows_and_leaves_out_bad_ones():
    """What a scheduler reads from another pod's record: rows that do not make a table are left out, whatever
    their shape, and the plain curve stands alone as a table without rows always has."""
    from dspark_core.cost_model import table_from_points

    points = [[1, 100.0], [8, 50.0]]
    t = table_from_points(points, {"8": [[8, 50.0], [16, 40.0]], "1": [[1, 100.0], [8, 80.0]], "x": [[1, 2.0]],
                                   "0": [[1, 5.0]], "2": [[1, "fast"]], "3": [[1, -5.0]], "4": []})
    assert [r for r, _ in t.by_requests] == [1, 8] and t.for_requests(1)(8) == pytest.approx(80.0)
    assert t(8) == pytest.approx(50.0)
    for bad in (None, [], "rows", [[1, 2]], {"1": "x"}):
        plain = table_from_points(points, bad)
        assert plain.by_requests is None and plain(8) == pytest.approx(50.0)
    assert table_from_points([], {"1": [[1, 1.0]]}) is None
