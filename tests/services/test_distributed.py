"""Distributed serving on loopback: 2 verifiers + 1 drafter + 1 scheduler, discovered through a real Redis.

Greedy output through the services equals the embedded engine's and the target's own; bad input gets the
right status codes; cancel frees state everywhere; a verifier stopped mid-generation loses nothing; a
Redis restart does not stop serving.
"""

from __future__ import annotations

import concurrent.futures as cf
import json
import time

import grpc
import pytest

from dspark_protos.dspark.v1 import types_pb2

import svc_cluster as cluster
from svc_cluster import ids_request

NEW = 24


@pytest.fixture(scope="module")
def stack(aio, redis_server, fixtures_dir):
    t, d = fixtures_dir / "target", fixtures_dir / "dspark"
    v1 = cluster.verifier(aio, t, d, redis_server.url, "v1")
    v2 = cluster.verifier(aio, t, d, redis_server.url, "v2")
    dr = cluster.drafter(aio, d, redis_server.url, "d1")
    s = cluster.scheduler(aio, redis_url=redis_server.url)
    stub, ch = cluster.scheduler_stub(s)
    yield {"v": [v1, v2], "d": dr, "s": s, "stub": stub, "redis": redis_server}
    ch.close()
    cluster.stop(aio, s, dr, v1, v2)


def wait_until(pred, timeout=10.0, what="condition"):
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def embedded_greedy(fixtures_dir, prompts, n, params=None, use_drafter=True):
    from dspark_core.drafters import load_drafter
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams
    from dspark_core.target import TargetConfig, TargetRuntime

    drafter = load_drafter(fixtures_dir / "dspark")
    target = TargetRuntime(TargetConfig(str(fixtures_dir / "target"), device="cpu", dtype="float32",
                                        tap_layer_ids=tuple(drafter.target_layer_ids)))
    engine = Engine(target, drafter if use_drafter else None, EngineConfig(policy="fixed" if use_drafter else "ar"))
    params = params or SamplingParams(temperature=0, max_new_tokens=n)
    rids = [engine.add_request(p, params) for p in prompts]
    engine.run()
    return [engine.pop(r).output_ids for r in rids]


def test_greedy_through_services_equals_embedded_engine_and_target_greedy(stack, reference, fixtures_dir):
    prompts = [p for p, _ in reference]
    with cf.ThreadPoolExecutor(len(prompts)) as pool:  # concurrent: the engine batches them together
        outs = list(pool.map(lambda p: stack["stub"].GenerateUnary(ids_request(p, NEW), timeout=120), prompts))
    got = [list(o.token_ids) for o in outs]
    assert got == [g[:NEW] for _, g in reference]
    assert got == embedded_greedy(fixtures_dir, prompts, NEW)
    for o in outs:
        assert o.finish_reason == types_pb2.FINISH_REASON_LENGTH
        assert o.summary.num_rounds > 0 and o.summary.completion_tokens == NEW
    # the drafter really drafted: some drafts were accepted
    assert sum(o.summary.accepted_per_round for o in outs) > 0


def test_stream_chunks_carry_rounds_and_a_final_summary(stack, reference):
    prompt, greedy = reference[1]
    chunks = list(stack["stub"].Generate(ids_request(prompt, 12, cls=types_pb2.GenerateRequest), timeout=60))
    assert [t for c in chunks for t in c.token_ids] == greedy[:12]
    assert chunks[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    assert chunks[-1].summary.num_rounds == sum(1 for c in chunks if c.HasField("round"))
    assert all(c.request_id == chunks[0].request_id for c in chunks)


def test_seeded_sampling_through_services_is_reproducible(stack, reference):
    prompt, _ = reference[0]

    def run(seed):
        return list(stack["stub"].GenerateUnary(ids_request(prompt, 16, temperature=1.0, seed=seed), timeout=60).token_ids)

    a = run(7)
    assert len(a) == 16 and a == run(7)
    assert any(run(s) != a for s in (8, 9, 10))


def test_seeded_sampling_through_services_equals_the_same_seeds_autoregressive_decode(stack, reference,
                                                                                      fixtures_dir):
    """Position-keyed coupling across processes: the scheduler re-draws the drafter service's drafts, the
    verifier service verifies by coupling, and the tokens are the seed's own autoregressive draws."""
    from dspark_core.sampling import SamplingParams

    prompt, _ = reference[0]
    got = list(stack["stub"].GenerateUnary(ids_request(prompt, 16, temperature=1.0, seed=7), timeout=60).token_ids)
    want = embedded_greedy(fixtures_dir, [prompt], 16, SamplingParams(temperature=1.0, seed=7, max_new_tokens=16),
                           use_drafter=False)[0]
    assert got == want


def test_the_drafter_service_draws_a_coupled_item_by_the_seeds_race(stack):
    """ProposeItem.coupling_seed: slot k is the exponential race of (seed, anchor_position + 1 + k) over the
    drafter's own support, so the scheduler's re-draw (couple_draft) keeps every token."""
    import torch

    from dspark_core.sampling import coupled_choice, coupling_noise
    from dspark_core.verification import DraftBlock, couple_draft
    from dspark_protos.tensors import tensor_to_proto
    from services.common.convert import proposal_from_proto

    stub, ch = cluster.drafter_stub(stack["d"])
    info = stub.GetInfo(types_pb2.DrafterServiceGetInfoRequest())
    feats = torch.randn((5, len(info.target_layer_ids), info.target_hidden_size))
    vocab = stack["v"][0].servicer.verifier.target.vocab_size
    try:
        for seed in (3, 4):
            rid = f"coupled-{seed}"
            it = types_pb2.ProposeItem(request_id=rid, anchor_token_id=11, anchor_position=5, temperature=1.0,
                                       coupling_seed=seed)
            it.context_features.start_position = 0
            tensor_to_proto(feats, it.context_features.hidden_states)
            prop = proposal_from_proto(stub.Propose(types_pb2.ProposeRequest(items=[it])).proposals[0])
            for k, tok in enumerate(prop.tokens):
                ids = prop.support_ids[k].long()
                won = ids[coupled_choice(prop.support_probs[k], coupling_noise(seed, 6 + k, vocab)[ids])]
                assert tok == int(won)
            block = DraftBlock(tuple(prop.tokens), prop.support_ids, prop.support_probs)
            assert couple_draft(block, seed, 6, vocab).tokens == block.tokens
            stub.Release(types_pb2.DrafterServiceReleaseRequest(request_ids=[rid]))
    finally:
        ch.close()


def test_the_drafter_service_drafts_from_its_logits_processed_as_the_targets(stack):
    """ProposeItem.processing: the drafter applies the request's processing to its own logits (here min_tokens
    banning the very tokens it drafts unprocessed) and says so in Proposal.processed; a malformed processing
    fails its own item, naming the field, and the item beside it is drafted."""
    import torch

    from dspark_protos.tensors import tensor_to_proto

    stub, ch = cluster.drafter_stub(stack["d"])
    info = stub.GetInfo(types_pb2.DrafterServiceGetInfoRequest())
    feats = torch.randn((5, len(info.target_layer_ids), info.target_hidden_size), generator=torch.Generator().manual_seed(1))

    def item(rid, banned=None, prompt=(1, 2, 3, 4, 5), output=(11,)):
        it = types_pb2.ProposeItem(request_id=rid, anchor_token_id=11, anchor_position=5, temperature=0.0)
        it.context_features.start_position = 0
        tensor_to_proto(feats, it.context_features.hidden_states)
        if banned is not None:
            it.processing.params.min_tokens = 50
            it.processing.params.stop_token_ids.extend(banned)
            it.processing.prompt_token_ids.extend(prompt)
            it.processing.output_token_ids.extend(output)
        return it

    try:
        raw = stub.Propose(types_pb2.ProposeRequest(items=[item("plain")])).proposals[0]
        assert raw.status == types_pb2.ITEM_STATUS_OK and not raw.processed
        banned = sorted(set(raw.draft_token_ids))
        resp = stub.Propose(types_pb2.ProposeRequest(items=[
            item("banned", banned), item("short", banned, output=()), item("huge", banned, prompt=(1, 2, 3, 4, 99999))]))
        ok, short, huge = resp.proposals
        assert ok.status == types_pb2.ITEM_STATUS_OK and ok.processed
        assert len(ok.draft_token_ids) == len(raw.draft_token_ids) and not set(ok.draft_token_ids) & set(banned)
        assert short.status == types_pb2.ITEM_STATUS_INVALID_ARGUMENT
        assert "items[1].processing.output_token_ids" in short.error_message and "6" in short.error_message
        assert huge.status == types_pb2.ITEM_STATUS_INVALID_ARGUMENT
        assert "items[2].processing.prompt_token_ids" in huge.error_message and "99999" in huge.error_message
        stub.Release(types_pb2.DrafterServiceReleaseRequest(request_ids=["plain", "banned", "short", "huge"]))
    finally:
        ch.close()


def test_list_models_and_reflection(stack):
    resp = stack["stub"].ListModels(types_pb2.ListModelsRequest())
    assert resp.default_model == "target" and resp.models[0].default_drafter == "dspark"
    from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

    ch = grpc.insecure_channel(f"127.0.0.1:{stack['s'].port}")
    refl = reflection_pb2_grpc.ServerReflectionStub(ch)
    names = [s.name for r in refl.ServerReflectionInfo(iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
             for s in r.list_services_response.service]
    ch.close()
    assert "dspark.v1.SchedulerService" in names and "grpc.health.v1.Health" in names


@pytest.mark.parametrize("mutate,code,words", [
    (lambda r: r.sampling.__setattr__("temperature", -1.0), "INVALID_ARGUMENT", ["sampling.temperature", "-1"]),
    (lambda r: r.sampling.__setattr__("top_p", 1.5), "INVALID_ARGUMENT", ["sampling.top_p", "1.5"]),
    (lambda r: r.prompt_token_ids.token_ids.append(99999), "INVALID_ARGUMENT", ["prompt_token_ids", "99999"]),
    (lambda r: r.ClearField("prompt_token_ids"), "INVALID_ARGUMENT", ["prompt"]),
    (lambda r: r.__setattr__("prompt_text", "hello"), "INVALID_ARGUMENT", ["prompt_text", "tokenizer"]),
    (lambda r: r.__setattr__("model", "gpt-9"), "INVALID_ARGUMENT", ["model", "gpt-9"]),
    (lambda r: r.__setattr__("policy", "psychic"), "INVALID_ARGUMENT", ["policy", "psychic"]),
    # choice i runs as <request_id>-<i>: an id that leaves no room for the suffix is refused at the edge, not
    # admitted and then refused by the verifier (whose bound the choice ids exceed)
    (lambda r: (r.__setattr__("request_id", "x" * 127), r.__setattr__("n", 2)), "INVALID_ARGUMENT",
     ["request_id", "at most 126", "n = 2"]),
    # `$` also matches before a final newline: an id ending in one must be refused like any other control character
    (lambda r: r.__setattr__("request_id", "job-1\n"), "INVALID_ARGUMENT", ["request_id", "letters", "job-1\\n"]),
])
def test_bad_input_is_invalid_argument_naming_field_and_value(stack, mutate, code, words):
    req = ids_request([1, 2, 3], 4)
    mutate(req)
    with pytest.raises(grpc.RpcError) as e:
        stack["stub"].GenerateUnary(req, timeout=30)
    assert e.value.code().name == code
    for w in words:
        assert w in e.value.details()
    assert "Traceback" not in e.value.details()


def test_full_queue_is_resource_exhausted(stack):
    import dataclasses

    engine = stack["s"].engine
    old = engine.config
    engine.config = dataclasses.replace(old, max_waiting=0)
    try:
        with pytest.raises(grpc.RpcError) as e:
            stack["stub"].GenerateUnary(ids_request([1, 2, 3], 4), timeout=30)
    finally:
        engine.config = old
    assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "max_waiting" in e.value.details()


def test_verifier_batched_rpcs_report_per_item_status(stack):
    stub, ch = cluster.verifier_stub(stack["v"][0])
    resp = stub.Verify(types_pb2.VerifyRequest(items=[types_pb2.VerifyItem(request_id="nobody", anchor_token_id=1,
                                                                           anchor_position=3)]))
    assert resp.results[0].status == types_pb2.ITEM_STATUS_UNKNOWN_REQUEST
    with pytest.raises(grpc.RpcError) as e:
        stub.Prefill(types_pb2.PrefillRequest(request_id="", prompt_token_ids=[1, 2]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "request_id" in e.value.details()
    info = stub.GetInfo(types_pb2.VerifierServiceGetInfoRequest())
    assert list(info.tap_layer_ids) == [0, 1, 2] and info.vocab_size == 512
    ch.close()


def test_client_cli_json_and_bad_input_exit_2(stack, reference, capsys):
    from dspark_cli.main import main

    prompt, greedy = reference[0]
    addr = f"127.0.0.1:{stack['s'].port}"
    rc = main(["client", "generate", "--address", addr, "--prompt-ids", ",".join(map(str, prompt)),
               "--temperature", "0", "--max-new-tokens", "10", "--json"])
    out = json.loads(capsys.readouterr().out)
    assert rc == 0 and out["token_ids"] == greedy[:10]
    assert {"text", "token_ids", "num_rounds", "accepted_per_round", "tokens_per_second"} <= set(out)
    assert len(out["accepted_per_round"]) == out["num_rounds"]
    rc = main(["client", "generate", "--address", addr, "--prompt-ids", "99999", "--temperature", "0"])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and err.count("\n") == 0 and "INVALID_ARGUMENT" in err and "99999" in err


def _held(stack):
    return [v.servicer.verifier.num_active for v in stack["v"]], len(stack["d"].servicer.contexts)


def test_cancel_releases_state_on_verifier_and_drafter(stack, reference):
    prompt, _ = reference[2]
    wait_until(lambda: _held(stack) == ([0, 0], 0), what="earlier requests released")
    call = stack["stub"].Generate(ids_request(prompt, 200, cls=types_pb2.GenerateRequest), timeout=60)
    it = iter(call)
    next(it), next(it)
    held, ctx = _held(stack)
    assert sum(held) == 1 and ctx == 1
    call.cancel()
    wait_until(lambda: _held(stack) == ([0, 0], 0), what="verifier and drafter release")
    wait_until(lambda: stack["s"].loop.num_requests == 0, what="scheduler forgets the request")


def test_checkpoints_load_records_and_autoscaling_signal_in_redis(stack, reference):
    r = stack["redis"].client()
    prompt, greedy = reference[0]
    call = stack["stub"].Generate(ids_request(prompt, 40, cls=types_pb2.GenerateRequest, ), timeout=60)
    it = iter(call)
    first = next(it)
    rid = first.request_id
    wait_until(lambda: r.get(f"dspark:request:{rid}") is not None, what="checkpoint")
    ck = json.loads(r.get(f"dspark:request:{rid}"))
    wait_until(lambda: any(json.loads(r.get(k) or '{"mass": 0}')["mass"] > 0 for k in r.keys("dspark:demand:*")),
               what="demand (survival-probability mass) published per verifier")
    assert ck["prompt_ids"] == prompt and ck["generated"] == greedy[: len(ck["generated"])]
    assert ck["params"]["temperature"] == 0.0 and ck["verifier"]
    list(it)
    wait_until(lambda: r.get(f"dspark:request:{rid}") is None, what="checkpoint deleted at the end")
    rec = json.loads(r.get("dspark:pod:verifier:v1"))
    assert rec["address"].startswith("127.0.0.1:") and rec["capacity"] == 256 and "step_time_ewma_s" in rec
    wait_until(lambda: r.get("dspark:autoscale:desired:verifier") is not None, what="autoscale signal")
    assert int(r.get("dspark:autoscale:desired:verifier")) >= 1
    # KEDA's redis list scaler reads a length: the list mirrors the count
    assert r.llen("dspark:autoscale:replicas:verifier") == int(r.get("dspark:autoscale:desired:verifier"))
    from services.common import metrics

    text = metrics.render().decode()
    for name in ("dspark_spec_decode_drafts_total", "dspark_spec_decode_draft_tokens_total",
                 "dspark_spec_decode_accepted_tokens_total", 'dspark_spec_decode_accepted_tokens_per_pos_total{position="0"}',
                 'dspark_desired_replicas{pool="verifier"}', "dspark_time_to_first_token_seconds_bucket"):
        assert name in text


def test_redis_restart_keeps_serving(stack, reference):
    redis_server = stack["redis"]
    prompt, greedy = reference[1]
    redis_server.stop()
    try:
        out = stack["stub"].GenerateUnary(ids_request(prompt, 12), timeout=60)
        assert list(out.token_ids) == greedy[:12]
    finally:
        redis_server.start()
    r = redis_server.client()
    wait_until(lambda: {"dspark:pod:verifier:v1", "dspark:pod:verifier:v2", "dspark:pod:drafter:d1"} <= set(r.keys()),
               what="pods re-published after the restart")
    out = stack["stub"].GenerateUnary(ids_request(prompt, 12), timeout=60)
    assert list(out.token_ids) == greedy[:12]


def test_verifier_lost_mid_generation_request_finishes_on_the_other(aio, stack, reference):
    prompt, greedy = reference[2]
    call = stack["stub"].Generate(ids_request(prompt, 48, cls=types_pb2.GenerateRequest), timeout=120)
    it = iter(call)
    chunks = [next(it), next(it), next(it)]
    held = [v.servicer.verifier.num_active for v in stack["v"]]
    victim = stack["v"][held.index(1)]
    survivor = stack["v"][1 - held.index(1)]
    cluster.stop(aio, victim)  # the server goes away mid-generation
    chunks.extend(it)
    assert [t for c in chunks for t in c.token_ids] == greedy[:48]
    assert chunks[-1].finish_reason == types_pb2.FINISH_REASON_LENGTH
    wait_until(lambda: survivor.servicer.verifier.num_active == 0, what="survivor releases the request")
    from services.common import metrics

    assert metrics.FAILOVERS.labels(pool="verifier")._value.get() >= 1


def test_drafter_lost_mid_generation_context_is_rebuilt_on_another(aio, stack, reference, fixtures_dir):
    d2 = cluster.drafter(aio, fixtures_dir / "dspark", stack["redis"].url, "d2")
    try:
        pool = stack["s"].drafters
        wait_until(lambda: len([p for p in pool.pods.values() if p.alive]) == 2, what="second drafter discovered")
        prompt, greedy = reference[1]
        call = stack["stub"].Generate(ids_request(prompt, 48, cls=types_pb2.GenerateRequest), timeout=120)
        it = iter(call)
        chunks = [next(it), next(it), next(it)]
        drafters = [stack["d"], d2]
        holder = [len(d.servicer.contexts) for d in drafters].index(1)
        cluster.stop(aio, drafters[holder])
        chunks.extend(it)
        assert [t for c in chunks for t in c.token_ids] == greedy[:48]
        survivor = drafters[1 - holder]
        wait_until(lambda: len(survivor.servicer.contexts) == 0, what="survivor releases the context")
        from services.common import metrics

        assert metrics.FAILOVERS.labels(pool="drafter")._value.get() >= 1
    finally:
        cluster.stop(aio, d2)


@pytest.mark.parametrize("sampling", [{"temperature": 0.0},
                                      {"temperature": 1.5, "seed": 11, "frequency_penalty": 2.0, "presence_penalty": 2.0}],
                         ids=["greedy", "seeded-penalised"])
def test_scheduler_lost_mid_generation_client_retry_is_adopted_by_another(aio, stack, reference, capsys, sampling):
    """A second scheduler adopts a request whose scheduler vanished, from its Redis checkpoint, and the
    client (retrying with the same request id on the next address) gets the uninterrupted output: the
    target's greedy one, or for a seeded penalised request what it gives uninterrupted (coupling makes the
    re-sampled anchor the same token; the adopted tokens count as output for the penalty)."""
    prompt, greedy = reference[0]
    if sampling["temperature"] == 0:
        want = greedy[:60]
    else:
        want = list(stack["stub"].GenerateUnary(ids_request(prompt, 60, **sampling), timeout=60).token_ids)
    s1 = cluster.scheduler(aio, redis_url=stack["redis"].url, adopt_after_s=0.5)
    s2 = cluster.scheduler(aio, redis_url=stack["redis"].url, adopt_after_s=0.5)
    rid = "adopt-me-" + ("greedy" if sampling["temperature"] == 0 else "seeded")
    try:
        stub1, ch = cluster.scheduler_stub(s1)
        req = ids_request(prompt, 60, cls=types_pb2.GenerateRequest, **sampling)
        req.request_id = rid
        call = stub1.Generate(req, timeout=60)
        it = iter(call)
        got = list(next(it).token_ids)
        r = stack["redis"].client()
        while r.get(f"dspark:request:anon/{rid}") is None:  # an anonymous client's own id, scoped
            got.extend(next(it).token_ids)
        s1.loop.stop()  # the scheduler "crashes": no more rounds, no cleanup
        cluster.stop(aio, s1)
        ch.close()
        from dspark_cli.main import main

        flags = [f"--{k.replace('_', '-')}={v}" for k, v in sampling.items()]
        rc = main(["client", "generate", "--address", f"127.0.0.1:{s1.port},127.0.0.1:{s2.port}", "--request-id",
                   rid, "--prompt-ids", ",".join(map(str, prompt)), *flags, "--max-new-tokens", "60", "--json"])
        out = json.loads(capsys.readouterr().out)
        assert rc == 0 and out["token_ids"] == want
        assert got == want[: len(got)] and 0 < len(got) < 60
        assert s2.frontend.adopted == 1 and out["prompt_tokens"] == len(prompt)
    finally:
        cluster.stop(aio, s1, s2)


def _run_until_checkpointed_then_crash(aio, stack, sched, prompt, rid, key, metadata=None) -> list[int]:
    """Stream a 60-token request `rid` from `sched` until its checkpoint `key` is in Redis, then "crash" the
    scheduler (no more rounds, no cleanup: the checkpoint stays for an adoption). Returns the tokens received."""
    stub, ch = cluster.scheduler_stub(sched)
    req = ids_request(prompt, 60, cls=types_pb2.GenerateRequest)
    req.request_id = rid
    it = iter(stub.Generate(req, timeout=60, metadata=metadata))
    got = list(next(it).token_ids)
    r = stack["redis"].client()
    while r.get(key) is None:
        got.extend(next(it).token_ids)
    sched.loop.stop()
    cluster.stop(aio, sched)
    ch.close()
    return got


def test_another_clients_request_cannot_overwrite_or_delete_a_checkpoint_it_does_not_own(aio, stack, reference):
    """Checkpoint keys are request ids, which clients choose: a client of another scheduler that names its
    request `job` with n = 2 runs choice ids job-0 and job-1, which no adoption check guards. Its scheduler
    must neither overwrite the checkpoint of another client's request `job-0` nor delete it when its own
    `job-0` finishes: the victim, retrying after its scheduler is lost, is still adopted (its tokens kept)."""
    prompt, greedy = reference[0]
    s1 = cluster.scheduler(aio, redis_url=stack["redis"].url, adopt_after_s=0.5)
    s2 = cluster.scheduler(aio, redis_url=stack["redis"].url, adopt_after_s=0.5)
    key = "dspark:request:anon/job-0"  # both clients are anonymous: their own ids share one scope
    try:
        got = _run_until_checkpointed_then_crash(aio, stack, s1, prompt, "job-0", key)
        r = stack["redis"].client()
        victim = json.loads(r.get(key))
        stub2, ch2 = cluster.scheduler_stub(s2)
        attack = ids_request(reference[1][0], 8)
        attack.request_id, attack.n = "job", 2
        out = stub2.GenerateUnary(attack, timeout=60)
        assert [list(c.token_ids) for c in out.choices] == [reference[1][1][:8]] * 2  # it is served, alone
        time.sleep(1.5)  # the attacker's checkpoint writes and deletes have reached Redis
        held = r.get(key)
        assert held is not None and json.loads(held) == victim
        retry = ids_request(prompt, 60)
        retry.request_id = "job-0"
        assert list(stub2.GenerateUnary(retry, timeout=60).token_ids) == greedy[:60]
        assert s2.frontend.adopted == 1 and 0 < len(got) < 60
        ch2.close()
    finally:
        cluster.stop(aio, s1, s2)


def test_a_lost_schedulers_request_is_adopted_only_by_the_api_key_that_chose_its_id(aio, stack, reference):
    """Schedulers checking API keys scope a client's own request ids by its key: another key's client retrying
    with the victim's id and very prompt after the victim's scheduler is lost is served afresh (the checkpoint is
    not its to adopt, and stays); the victim's own retry is adopted."""
    from services.common.identity import credentials_owner, scoped_request_id

    prompt, greedy = reference[0]
    keys = ("tenant-a-key-0123456789", "tenant-b-key-0123456789")
    s1 = cluster.scheduler(aio, redis_url=stack["redis"].url, adopt_after_s=0.5, api_keys=keys)
    s2 = cluster.scheduler(aio, redis_url=stack["redis"].url, adopt_after_s=0.5, api_keys=keys)
    auth = [[("authorization", f"Bearer {k}")] for k in keys]
    key = f"dspark:request:{scoped_request_id(credentials_owner(f'Bearer {keys[0]}'), 'mine-1')}"
    try:
        got = _run_until_checkpointed_then_crash(aio, stack, s1, prompt, "mine-1", key, auth[0])
        r = stack["redis"].client()
        victim = json.loads(r.get(key))
        time.sleep(0.6)  # past adopt_after_s: the checkpoint is up for adoption
        stub2, ch2 = cluster.scheduler_stub(s2)
        retry = ids_request(prompt, 60)
        retry.request_id = "mine-1"
        assert list(stub2.GenerateUnary(retry, timeout=60, metadata=auth[1]).token_ids) == greedy[:60]
        assert s2.frontend.adopted == 0 and json.loads(r.get(key)) == victim
        assert list(stub2.GenerateUnary(retry, timeout=60, metadata=auth[0]).token_ids) == greedy[:60]
        assert s2.frontend.adopted == 1 and 0 < len(got) < 60
        ch2.close()
    finally:
        cluster.stop(aio, s1, s2)


def test_a_checkpoint_is_written_and_deleted_by_its_holder_and_moved_by_one_adopter(stack):
    from services.common.registry import Registry, RegistryConfig

    reg = Registry(RegistryConfig(stack["redis"].url))
    reg.write_checkpoints({"own-1": {"scheduler": "a", "generated": [1]}})
    reg.write_checkpoints({"own-1": {"scheduler": "b", "generated": [2]}})  # another scheduler's request, same id
    reg.delete_checkpoint("own-1", "b")
    assert reg.read_checkpoint("own-1") == {"scheduler": "a", "generated": [1]}
    assert reg.adopt_checkpoint("own-1", "a", {"scheduler": "b", "generated": [1]})
    assert not reg.adopt_checkpoint("own-1", "a", {"scheduler": "c", "generated": [1]})  # b adopted it first
    reg.write_checkpoints({"own-1": {"scheduler": "b", "generated": [1, 3]}})
    reg.delete_checkpoint("own-1", "a")
    assert reg.read_checkpoint("own-1") == {"scheduler": "b", "generated": [1, 3]}
    reg.delete_checkpoint("own-1", "b")
    assert reg.read_checkpoint("own-1") is None and not reg.adopt_checkpoint("own-1", "b", {"scheduler": "c"})
    reg.close()


def test_a_resume_rebuilds_only_from_its_own_schedulers_checkpoint(stack):
    """A verifier failover rebuilds a request from its Redis checkpoint when that is current. Another client's
    request of the same id on another scheduler, with the same prompt and length, must not lend it its tokens."""
    from dspark_core.sampling import SamplingParams
    from services.common.registry import Registry, RegistryConfig
    from services.scheduler.remote import RemoteVerifier, _Request

    reg = Registry(RegistryConfig(stack["redis"].url))
    try:
        rv = RemoteVerifier(pool=None, checkpoints=reg, caller="sched-own")
        req = _Request([5, 6, 7], SamplingParams(), 0)
        req.generated = [8, 9]
        reg.write_checkpoints({"ck-x": {"scheduler": "sched-other", "prompt_ids": [5, 6, 7], "generated": [40, 41]}})
        assert rv._committed("ck-x", req, anchor_pos=4) == [8, 9]
        reg.delete_checkpoint("ck-x", "sched-other")
        reg.write_checkpoints({"ck-x": {"scheduler": "sched-own", "prompt_ids": [5, 6, 7], "generated": [8, 9, 10]}})
        assert rv._committed("ck-x", req, anchor_pos=5) == [8, 9, 10]  # its own, one step ahead of its copy
    finally:
        reg.close()
