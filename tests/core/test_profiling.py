"""VerifyStepBench: B tokens one per sequence up to max_sequences, then a few each; the context is restored."""

from __future__ import annotations

import pytest

from dspark_core.errors import InvalidArgument
from dspark_core.profiling import VerifyStepBench
from dspark_core.target import TargetConfig, TargetRuntime

pytestmark = pytest.mark.usefixtures("one_torch_thread")


def record_forward_calls(target, monkeypatch) -> list[list[int]]:
    """Token counts per sequence of every `target.forward` call from now on (the calls still run)."""
    calls = []
    real_forward = target.forward
    monkeypatch.setattr(target, "forward", lambda batch, **kw: (calls.append([len(t) for _, t in batch]),
                                                                real_forward(batch, **kw))[1])
    return calls


def test_tokens_spread_one_per_sequence_then_evenly(tiny_target_dir, monkeypatch):
    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    bench = VerifyStepBench(target, context_length=16, block=4, max_sequences=3)
    calls = record_forward_calls(target, monkeypatch)
    for b in (1, 2, 3, 4, 7, 13):
        bench(b)
    # prefill calls (16 tokens each) interleave; keep the timed steps only
    steps = [c for c in calls if c != [16]]
    assert steps == [[1], [1, 1], [1, 1, 1], [2, 1, 1], [3, 2, 2], [4, 3, 3, 3]]  # 13 > 3 x 4: ceil(13 / 4) seqs
    assert all(s.length == 16 for s in bench.seqs)  # rolled back after every step
    bench.close()
    assert target.num_active == 0


def test_bad_max_sequences_is_named(tiny_target_dir):
    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    with pytest.raises(InvalidArgument, match="max_sequences"):
        VerifyStepBench(target, context_length=8, max_sequences=0)


def test_requests_rows_put_the_tokens_on_exactly_r_sequences(tiny_target_dir, monkeypatch):
    from dspark_core.profiling import requests_grid

    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    bench = VerifyStepBench(target, context_length=16, block=4, max_sequences=8)
    calls = record_forward_calls(target, monkeypatch)
    bench(8, requests=1)
    bench(7, requests=2)
    assert [c for c in calls if c != [16]] == [[8], [4, 3]]  # the plain spread would be 7 sequences of one
    with pytest.raises(InvalidArgument, match="requests"):
        bench(2, requests=3)
    bench.close()
    assert requests_grid([1, 4], block=8, points=5) == {1: [1, 3, 5, 7, 8], 4: [4, 11, 18, 25, 32]}


def test_the_quick_table_has_the_one_request_row_and_warms_up_first(tiny_target_dir, monkeypatch):
    from dspark_core.profiling import quick_sps_table

    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    calls = record_forward_calls(target, monkeypatch)
    table = quick_sps_table(target, max_tokens=16, budget_s=30.0, repeats=2, block=4)
    assert table.batch_sizes == (1, 2, 4, 8, 16)
    row = table.for_requests(1)
    assert row.batch_sizes == (1, 2, 3, 4) and row is not table
    eight = table.for_requests(8)  # 8 sequences verifying 1 .. 4 tokens each (16 tokens: max_sequences 16, no 32)
    assert eight is not table and eight.batch_sizes[0] == 8 and eight.batch_sizes[-1] == 32
    assert [r for r, _ in table.by_requests] == [1, 8]
    assert [4] * 8 in calls  # the row's last pass: 8 sequences verifying 4 tokens each
    # monotone: a step never gets faster with more tokens
    for t in (table, row, eight):
        assert all(a >= b for a, b in zip(t.steps_per_second, t.steps_per_second[1:]))
    steps = [c for c in calls if c != [target.max_context // 4]]  # the contexts' prefills left out
    assert steps[0] == [1] and steps.count([1]) >= 5  # untimed single-token passes before anything is timed
    assert [3] in steps and [4] in steps  # the row: one sequence verifying 3 and 4 tokens
    assert target.num_active == 0
