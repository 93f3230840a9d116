"""Online operation through the services: the scheduler exports the calibration / collapse metrics and
records its rounds (which `dspark calibrate --online` refits from); the verifier corrects its cost table with
every pass and publishes the live table in Redis, where the scheduler picks it up."""

from __future__ import annotations

import json
import shutil
import time

from dspark_core.cost_model import SpsTable, table_from_points
from dspark_core.monitoring import read_rounds
from services.common import metrics
from services.common.registry import Registry, RegistryConfig

import svc_cluster as cluster

# the plain curve (B requests, one token each) and the one-request row (one request verifying B tokens)
PRIOR = SpsTable((1, 8, 16, 64), (100.0, 90.0, 60.0, 20.0),
                 by_requests=((1, SpsTable((1, 4, 8), (100.0, 97.0, 95.0))),))


def _target_with_sps(fixtures_dir, tmp_path):
    target = tmp_path / "target"
    shutil.copytree(fixtures_dir / "target", target)
    PRIOR.save(target / "sps.json")
    return target


def test_embedded_scheduler_exports_spec_metrics_records_rounds_and_calibrate_online_refits(
        aio, fixtures_dir, reference, tmp_path, capsys):
    from dspark_cli.main import main as cli

    target = _target_with_sps(fixtures_dir, tmp_path)
    drafter = tmp_path / "dspark"
    shutil.copytree(fixtures_dir / "dspark", drafter)
    rounds_file = tmp_path / "rounds.jsonl"
    s = cluster.scheduler(aio, embedded_target=str(target), embedded_drafter=str(drafter), policy="causal",
                          record_rounds=str(rounds_file), slot_correction=True)
    try:
        stub, ch = cluster.scheduler_stub(s)
        for prompt, greedy in reference[:2]:
            resp = stub.GenerateUnary(cluster.ids_request(prompt, 64), timeout=120)
            assert list(resp.token_ids) == greedy[:len(resp.token_ids)]
        ch.close()
        assert s.engine.online_sps is not None and s.engine.online_sps.accepted > 0  # embedded: measured passes
        assert s.engine.calibration is not None and s.engine.collapse is not None
        assert s.engine.correction is not None and s.engine.correction.observed[True][0] > 0
        s.loop._watch_gauges()  # (once a second in the loop) the gauges now, not up to a second later
    finally:
        cluster.stop(aio, s)
    text = metrics.render().decode()
    name = drafter.name
    assert f'dspark_spec_decode_expected_accepted_tokens_total{{drafter="{name}",position="1"}}' in text
    assert f'dspark_spec_decode_realized_accepted_tokens_total{{drafter="{name}",position="1"}}' in text
    assert f'dspark_spec_decode_calibrated{{drafter="{name}"}} 1.0' in text
    assert f'dspark_spec_decode_drafter_collapsed{{drafter="{name}"}}' in text
    assert f'dspark_spec_decode_confidence_offset{{drafter="{name}",kind="greedy",position="1"}}' in text
    rounds = read_rounds(rounds_file)
    assert rounds and all(r.drafter == name and r.greedy for r in rounds)
    # the greedy regime refits only for a drafter with a greedy confidence output; dry run either way
    assert cli(["calibrate", "--online", str(rounds_file), "--drafter-path", str(drafter), "--min-rounds", "5",
                "--dry-run", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["drafter"] == name and out["rounds_file"] == str(rounds_file)
    assert cli(["calibrate", "--online", str(tmp_path / "missing.jsonl"), "--drafter-path", str(drafter)]) == 2
    assert "--online" in capsys.readouterr().err


def test_verifier_publishes_its_live_cost_table_and_the_scheduler_adopts_it(aio, redis_server, fixtures_dir,
                                                                           reference, tmp_path):
    target = _target_with_sps(fixtures_dir, tmp_path)
    v = cluster.verifier(aio, target, None, redis_server.url, "v-live")
    s = cluster.scheduler(aio, redis_url=redis_server.url, use_drafter=False, scheduler_id="s-live")
    reg = Registry(RegistryConfig(redis_server.url))
    try:
        stub, ch = cluster.scheduler_stub(s)
        prompt, _ = reference[0]
        stub.GenerateUnary(cluster.ids_request(prompt, 48), timeout=120)
        ch.close()
        measured = v.servicer.online_sps
        deadline = time.monotonic() + 10
        rec = live = None
        while time.monotonic() < deadline:
            recs = [r for r in reg.pods("verifier") if r.id == "v-live"]
            rec = recs[0] if recs else None
            if rec is not None and rec.sps_context_length > 0:
                live = SpsTable(tuple(int(b) for b, _ in rec.sps_table), tuple(float(x) for _, x in rec.sps_table))
                # a heartbeat from before the request's last passes is superseded by the next one
                if live(1) == measured.table(measured.last_context)(1):
                    break
            time.sleep(0.2)
        assert rec is not None and rec.sps_context_length >= len(prompt)
        # the tiny fixture model is nowhere near the made-up prior: the published table is the measured one
        assert measured.accepted > 0
        assert live(1) == measured.table(measured.last_context)(1) and live(1) != PRIOR(1)
        # its request rows too, corrected by the same passes: a scheduler plans a one-request step on the row
        row = measured.table(measured.last_context).for_requests(1)
        assert set(rec.sps_rows) == {"1"} and rec.sps_rows["1"] == [[b, x] for b, x in zip(row.batch_sizes,
                                                                                          row.steps_per_second)]
        deadline = time.monotonic() + 5
        while s.engine.sps(1) != live(1) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert s.engine.sps(1) == live(1)  # the scheduler's policy reads the live table
        assert s.engine.sps.for_requests(1)(8) == row(8) != s.engine.sps(8)
        # GetInfo (what a scheduler starts from) carries the rows as well
        from dspark_protos.dspark.v1 import types_pb2
        from services.common.convert import target_info_from_proto

        vs, vch = cluster.verifier_stub(v)
        info = target_info_from_proto(vs.GetInfo(types_pb2.VerifierServiceGetInfoRequest()))
        vch.close()
        assert list(info.sps_rows) == ["1"] and len(info.sps_rows["1"]) == len(row.batch_sizes)
        assert table_from_points(info.sps_points, info.sps_rows).for_requests(1).batch_sizes == row.batch_sizes
    finally:
        reg.close()
        cluster.stop(aio, s, v)


def test_scheduler_serves_lookup_drafts_losslessly_and_counts_them(aio, fixtures_dir, reference, tmp_path):
    """The scheduler's lookup drafts (on by default): greedy outputs over a real socket stay the target's own; a
    prompt that repeats itself gets lookup rounds, exported as counters; --lookup-ngram 0 turns them off."""
    target = _target_with_sps(fixtures_dir, tmp_path)
    drafter = tmp_path / "dspark"
    shutil.copytree(fixtures_dir / "dspark", drafter)
    prompt, greedy = reference[0]
    seen = {}
    for ngram in (3, 0):
        s = cluster.scheduler(aio, embedded_target=str(target), embedded_drafter=str(drafter), policy="fixed",
                              **({} if ngram else {"lookup_ngram": 0}))
        try:
            assert s.engine.config.lookup_ngram == ngram
            stub, ch = cluster.scheduler_stub(s)
            resp = stub.GenerateUnary(cluster.ids_request(prompt, 64), timeout=120)
            assert list(resp.token_ids) == greedy[:len(resp.token_ids)]
            # the prompt followed by its own greedy answer, twice: the answer's n-grams recur
            loop = list(prompt) + list(greedy) + list(prompt) + list(greedy)
            first = list(stub.GenerateUnary(cluster.ids_request(loop, 32), timeout=120).token_ids)
            seen[ngram] = (first, s.engine.num_lookup_rounds, s.engine.num_lookup_accepted)
            ch.close()
        finally:
            cluster.stop(aio, s)
    assert seen[3][0] == seen[0][0]  # the same greedy tokens with and without lookup drafts
    assert seen[0][1] == 0 and seen[3][1] > 0 and seen[3][2] > 0
    text = metrics.render().decode()
    assert f'dspark_spec_decode_lookup_rounds_total{{drafter="{drafter.name}"}}' in text
