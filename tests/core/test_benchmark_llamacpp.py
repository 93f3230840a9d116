"""The llama.cpp peer of `dspark bench`: when it runs, and (with llama-cpp-python and SmolLM2 installed) that it
decodes our prompt ids greedily on the target's own GGUF file."""

from __future__ import annotations

import importlib.util

import pytest

from types import SimpleNamespace

from dspark_core.benchmark import BenchSettings, LlamaCppPeer, llamacpp_speedups, plan_llamacpp


def test_plan_runs_the_peer_greedy_at_batch_one_only():
    peer = LlamaCppPeer(llm=object(), lookup_llm=object())
    assert plan_llamacpp(BenchSettings(policies=("ar",), concurrencies=(1, 4)), peer) == (
        ["greedy", "prompt_lookup"], [])
    assert plan_llamacpp(BenchSettings(policies=("ar",), concurrencies=(1,)), LlamaCppPeer(llm=object())) == (
        ["greedy"], [])
    modes, warnings = plan_llamacpp(BenchSettings(policies=("ar",), concurrencies=(1,), temperature=1.0), peer)
    assert modes == [] and "greedy only" in warnings[0]
    modes, warnings = plan_llamacpp(BenchSettings(policies=("ar",), concurrencies=(2,)), peer)
    assert modes == [] and "concurrency 1" in warnings[0]
    assert plan_llamacpp(BenchSettings(policies=("ar",), concurrencies=(1,)), None) == ([], [])


def test_every_speculative_policy_is_paired_against_llamacpp_prompt_by_prompt():
    def runs(*rates):
        return [(0, i, SimpleNamespace(tokens_per_s=r)) for i, r in enumerate(rates)]

    batch1 = {"ar": runs(70, 80, 90), "causal": runs(84, 88, 90), "fixed": runs(56, 60, 63),
              "llamacpp_greedy": runs(100, 100, 100), "llamacpp_prompt_lookup": runs(30, 40, 50)}
    out = llamacpp_speedups(batch1, "fixed", ["greedy", "prompt_lookup"], ["causal", "fixed", "ar", "gamma1"])
    assert out["ar_vs_llamacpp_batch1"] == 0.8 and out["speedup_vs_llamacpp_batch1"] == 0.6
    # gamma1 did not run, ar is the baseline: neither is a speculative entry
    assert out["speedup_vs_llamacpp_batch1_by_policy"] == {"causal": 0.88, "fixed": 0.6}
    assert out["speedup_vs_llamacpp_prompt_lookup_batch1"] == 1.5  # fixed: 56/30 60/40 63/50 -> median 1.5


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("llama_cpp") is None, reason="llama-cpp-python is not installed")
def test_llamacpp_decodes_the_targets_gguf_from_our_prompt_ids():
    from dspark_cli.models import target_dirs
    from dspark_core.benchmark import llamacpp_generate, load_llamacpp_peer
    from dspark_core.gguf_import import gguf_source
    from dspark_core.target import TargetConfig, TargetRuntime
    from dspark_core.text import encode_prompt

    path = target_dirs()["smollm2"]
    if not (path / "gguf_source.json").is_file():
        pytest.skip("SmolLM2 is not installed")
    target = TargetRuntime(TargetConfig(str(path), device="cpu", weights="gguf"))
    peer = load_llamacpp_peer(str(gguf_source(path)), 1, 1024, 4, target.eos_token_ids)
    prompt = encode_prompt(target.tokenizer, "Write a Python function that reverses a string.")
    plain, secs = llamacpp_generate(peer, "greedy", prompt, 16)
    lookup, _ = llamacpp_generate(peer, "prompt_lookup", prompt, 16)
    assert len(plain) == 16 and secs > 0
    assert lookup == plain  # prompt lookup is lossless under greedy decoding
    assert "def" in target.tokenizer.decode(plain)
