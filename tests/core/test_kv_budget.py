"""The KV store's budget: admission counts each request's whole context (prompt + max_new_tokens + a verify
block) against it, so that many long requests cannot take a verifier past its memory. A request that does not
fit beside the others waits at the head of the queue and runs when they are done; one that cannot fit even
alone is refused with a clear error; nobody else's output changes."""

from __future__ import annotations

import pytest

from dspark_core.engine import Engine, EngineConfig
from dspark_core.errors import InvalidArgument, ResourceExhausted
from dspark_core.sampling import SamplingParams
from dspark_core.target import KVCacheFull, TargetConfig, TargetRuntime
from dspark_core.verifier import PrefillItem, Verifier

PROMPTS = [[5, 9, 12, 30, 41], [7, 7, 8], [100, 3, 19, 22, 23, 24, 60, 61, 90], [2, 4, 6]]
NEW = 16


def _target(model_dir, budget_positions=None):
    probe = TargetRuntime(TargetConfig(str(model_dir), device="cpu", dtype="float32"))
    per = probe.kv_bytes_per_token
    budget = None if budget_positions is None else budget_positions * per
    return TargetRuntime(TargetConfig(str(model_dir), device="cpu", dtype="float32", kv_cache_bytes=budget))


@pytest.fixture(scope="module")
def reference(tiny_target_dir):
    engine = Engine(_target(tiny_target_dir), None, EngineConfig(policy="ar"))
    return [engine.generate(p, SamplingParams(temperature=0, max_new_tokens=NEW)).output_ids for p in PROMPTS]


def test_bytes_per_token_and_the_default_budget(tiny_target_dir, monkeypatch):
    t = _target(tiny_target_dir)
    cfg = t.hf_config
    heads = cfg.num_attention_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    assert t.kv_bytes_per_token == cfg.num_hidden_layers * 2 * (cfg.num_key_value_heads or heads) * head_dim * 4
    assert t.kv_budget_bytes > 0
    monkeypatch.setenv("DSPARK_KV_CACHE_GB", "0.5")
    assert _target(tiny_target_dir).kv_budget_bytes == 2**29
    monkeypatch.setenv("DSPARK_KV_CACHE_GB", "lots")
    with pytest.raises(InvalidArgument, match="DSPARK_KV_CACHE_GB"):
        _target(tiny_target_dir)
    with pytest.raises(InvalidArgument, match="kv_cache_bytes"):
        TargetConfig(str(tiny_target_dir), kv_cache_bytes=0)


def test_requests_beyond_the_budget_wait_and_outputs_are_unchanged(tiny_target_dir, reference):
    # room for two of these requests' whole contexts at a time (each reserves prompt + 16 + 33 < 64 positions)
    target = _target(tiny_target_dir, budget_positions=2 * 64)
    engine = Engine(target, None, EngineConfig(policy="ar", max_active=8))
    rids = [engine.add_request(p, SamplingParams(temperature=0, max_new_tokens=NEW)) for p in PROMPTS]
    most = 0
    while engine.has_work:
        engine.step()
        most = max(most, len(engine.active))
        assert target.cache.nbytes() <= target.kv_budget_bytes
    outs = [engine.pop(r) for r in rids]
    assert [o.output_ids for o in outs] == reference
    assert all(o.finish_reason == "length" for o in outs)
    assert most == 2  # never more than the budget holds, and the queue kept moving


def test_a_request_that_cannot_fit_alone_is_refused_and_the_others_run(tiny_target_dir, reference):
    target = _target(tiny_target_dir, budget_positions=64)
    engine = Engine(target, None, EngineConfig(policy="ar"))
    big = engine.add_request(PROMPTS[0], SamplingParams(temperature=0, max_new_tokens=500))
    small = engine.add_request(PROMPTS[1], SamplingParams(temperature=0, max_new_tokens=NEW))
    engine.run()
    refused, ok = engine.pop(big), engine.pop(small)
    assert refused.finish_reason == "error" and isinstance(refused.error, ResourceExhausted)
    assert "KV cache budget" in str(refused.error) and "--kv-cache-gb" in str(refused.error)
    assert ok.output_ids == reference[1]


def test_the_verifier_refuses_a_batch_past_the_budget_and_a_caller_running_past_its_reservation(tiny_target_dir):
    target = _target(tiny_target_dir, budget_positions=64)
    v = Verifier(target)
    params = SamplingParams(temperature=0, max_new_tokens=8)
    v.prefill([PrefillItem("a", tuple(PROMPTS[0]), params)])
    with pytest.raises(KVCacheFull) as info:
        v.prefill([PrefillItem("b", tuple(PROMPTS[1]), params)])
    assert info.value.fits_alone and target.num_active == 1  # nothing of b stays behind
    seq = v._slots["a"].seq
    with pytest.raises(KVCacheFull):
        target.extend_reservation(seq, 65)
    target.extend_reservation(seq, 60)
    assert seq.reserved == 60
