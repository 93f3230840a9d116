"""The drafter's request-history recalibration reaches the scheduler: the drafter service reports it in GetInfo
(sampled and greedy), the scheduler's RemoteDrafter reads it back exactly as the embedded engine's drafter has
it, and a malformed one is dropped with a warning (it only moves lengths) instead of failing the drafter."""

from __future__ import annotations

import logging
import shutil
from types import SimpleNamespace

import pytest

from dspark_core.calibration import Calibration, RequestHistory, write_calibration
from dspark_core.drafters import load_drafter
from dspark_protos.dspark.v1 import types_pb2
from services.scheduler.remote import RemoteDrafter

import svc_cluster as cluster

HIST = RequestHistory((1.1, -0.5, 0.25, 0.0), strength=4.0, prior=0.375)


@pytest.fixture(scope="module")
def drafter_dir(fixtures_dir, tmp_path_factory):
    d = tmp_path_factory.mktemp("hist") / "dspark"
    shutil.copytree(fixtures_dir / "dspark", d)
    write_calibration(d, Calibration((1.2,) * 4, (-0.2,) * 4, HIST))
    return d


def _remote(info) -> RemoteDrafter:
    return RemoteDrafter(None, SimpleNamespace(caller=None), info, hidden_size=64, vocab_size=512)


def _info(aio, path):
    """GetInfo of a drafter service started on `path` (and stopped)."""
    app = cluster.drafter(aio, path)
    stub, ch = cluster.drafter_stub(app)
    try:
        return stub.GetInfo(types_pb2.DrafterServiceGetInfoRequest())
    finally:
        ch.close()
        cluster.stop(aio, app)


def test_get_info_carries_the_history_the_engine_would_apply(aio, drafter_dir):
    info = _info(aio, drafter_dir)
    assert info.HasField("request_history") and info.HasField("request_history_greedy")
    local = load_drafter(drafter_dir)
    remote = _remote(info)
    for greedy in (False, True):
        want, got = local.confidence_history(greedy), remote.confidence_history(greedy)
        assert got.weights == pytest.approx(want.weights, rel=1e-6)
        assert (got.strength, got.prior) == pytest.approx((want.strength, want.prior), rel=1e-6)


def test_a_drafter_without_one_reports_none(aio, fixtures_dir):
    info = _info(aio, fixtures_dir / "dspark")
    assert not info.HasField("request_history")
    assert _remote(info).confidence_history(False) is None and _remote(info).confidence_history(True) is None


@pytest.mark.parametrize("bad", [
    dict(weights=[1.0, 0.0], strength=4.0, prior=0.4),           # not one per slot
    dict(weights=[1.0] * 4, strength=0.0, prior=0.4),            # no prior strength
    dict(weights=[1.0] * 4, strength=4.0, prior=1.5),            # not a rate
    dict(weights=[float("nan")] * 4, strength=4.0, prior=0.4),   # not a number
])
def test_a_malformed_history_is_dropped_with_a_warning(bad, caplog):
    info = types_pb2.DrafterServiceGetInfoResponse(
        drafter_name="dspark", kind=types_pb2.DRAFTER_KIND_DSPARK, has_confidence_head=True, block_size=4,
        max_support_size=8, request_history=types_pb2.ConfidenceHistory(**bad))
    with caplog.at_level(logging.WARNING, logger="dspark.remote"):
        remote = _remote(info)
    assert remote.confidence_history(False) is None
    assert any("request_history" in r.getMessage() for r in caplog.records)
