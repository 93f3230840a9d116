"""Prompt split, self-distillation through the engine, and the target cache round trip."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from dspark_core.errors import InvalidArgument
from dspark_core.target import TargetConfig, TargetRuntime
from dspark_core.training.cache import TargetCache, build_target_cache, estimate_cache_bytes, merge_manifests
from dspark_core.training.data import Prompt, Sample, distill, load_prompts, split


def write_jsonl(path, texts):
    path.write_text("".join(json.dumps({"turns": [t, "second turn ignored"]}) + "\n" for t in texts))
    return path


def test_split_is_fixed_disjoint_and_order_independent(tmp_path):
    texts = [f"question number {i}" for i in range(400)]
    a = load_prompts(write_jsonl(tmp_path / "mbpp.jsonl", texts))
    b = load_prompts(write_jsonl(tmp_path / "mbpp2.jsonl", texts[::-1]))
    train_a, eval_a = split(a)
    train_b, eval_b = split(b)
    assert {p.text for p in eval_a} == {p.text for p in eval_b}
    assert not {p.text for p in train_a} & {p.text for p in eval_a}
    assert 0.12 < len(eval_a) / len(a) < 0.28
    assert a[0].domain == "code" and a[0].text == "question number 0"


def test_bad_prompt_file_names_file_and_line(tmp_path):
    f = tmp_path / "x.jsonl"
    f.write_text('{"turns": ["ok"]}\n{"nope": 1}\n')
    with pytest.raises(InvalidArgument, match="x.jsonl:2"):
        load_prompts(f)


def test_distilled_responses_are_the_targets_own(tiny_target_dir):
    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    prompts = [Prompt("def add(a, b):", "mbpp", "code"), Prompt("What is 12 * 7?", "math500", "math")]
    samples = distill(target, prompts, max_new_tokens=6, temperature=0.0, progress=False)
    assert len(samples) == 2 and all(1 <= len(s.response_ids) <= 6 for s in samples)
    assert samples[1].domain == "math"
    # greedy distillation reproduces the target's greedy continuation
    from dspark_core.engine import Engine, EngineConfig
    from dspark_core.sampling import SamplingParams

    ref = Engine(target, None, EngineConfig(policy="ar")).generate(
        samples[0].prompt_ids, SamplingParams(temperature=0, max_new_tokens=6, stop_token_ids=target.eos_token_ids))
    assert ref.output_ids == samples[0].response_ids


def test_an_interrupted_distillation_resumes_from_its_journal(tiny_target_dir, tmp_path, monkeypatch):
    """Answers are journaled as they finish; a rerun redoes only the missing ones and returns the same samples
    in prompt order (seeded T = 1, so a redone answer would differ if the seeds were not per prompt)."""
    from dspark_core import engine as engine_mod

    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32"))
    prompts = [Prompt(f"question {i}: what is {i} + {i}?", "gsm8k", "math") for i in range(6)]
    kw = dict(max_new_tokens=5, temperature=1.0, seed=3, concurrency=2, progress=False)
    whole = distill(target, prompts, **kw)
    journal = tmp_path / "j.jsonl"

    real_step, calls = engine_mod.Engine.step, {"n": 0}

    def dying_step(self):
        calls["n"] += 1
        if calls["n"] > 8:
            raise KeyboardInterrupt  # the job is killed part-way
        return real_step(self)

    monkeypatch.setattr(engine_mod.Engine, "step", dying_step)
    with pytest.raises(KeyboardInterrupt):
        distill(target, prompts, journal=journal, **kw)
    kept = len(journal.read_text().splitlines()) - 1
    assert 0 < kept < len(prompts)
    monkeypatch.setattr(engine_mod.Engine, "step", real_step)
    resumed = distill(target, prompts, journal=journal, **kw)
    assert [(s.prompt_ids, s.response_ids) for s in resumed] == [(s.prompt_ids, s.response_ids) for s in whole]
    assert len(journal.read_text().splitlines()) == len(prompts) + 1
    # a journal of other settings is not reused
    other = distill(target, prompts, journal=journal, **{**kw, "seed": 4})
    assert [s.response_ids for s in other] != [s.response_ids for s in whole]


@pytest.mark.parametrize("world_size", [1, 2])
def test_cache_round_trip_matches_a_direct_forward(tiny_target_dir, tmp_path, world_size):
    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32", tap_layer_ids=(0, 1)))
    g = torch.Generator().manual_seed(0)
    def rand(n):
        return torch.randint(0, 200, (n,), generator=g).tolist()

    samples = [Sample(rand(n), rand(m)) for n, m in [(5, 7), (9, 3), (4, 12)]]
    # answers sharing a prompt (distillation at several temperatures / seeds) run the prompt once and continue
    # forks of its KV cache; an empty answer is the prompt alone
    shared, other = rand(6), rand(3)
    samples += [Sample(shared, rand(4)), Sample(other, rand(2)), Sample(shared, rand(9)), Sample(shared, []),
                Sample(list(shared), rand(1)), Sample(other, rand(5))]
    for rank in range(world_size):
        build_target_cache(target, samples, tmp_path, dtype="float32", batch_tokens=20, rank=rank,
                           world_size=world_size, progress=False)
    if world_size > 1:
        merge_manifests(tmp_path, world_size)
    cache = TargetCache(tmp_path)
    assert len(cache) == len(samples) and cache.manifest.num_tokens == sum(len(s.input_ids) for s in samples)
    for i, s in enumerate(samples):
        seq = target.new_sequence()
        out = target.forward([(seq, s.input_ids)], return_final_hidden=True)
        target.release(seq)
        row = cache[i]
        assert row["input_ids"].tolist() == s.input_ids and row["loss_mask"].tolist() == s.loss_mask
        torch.testing.assert_close(row["features"], out.taps, atol=1e-5, rtol=0)
        torch.testing.assert_close(row["final_hidden"], out.final_hidden, atol=1e-5, rtol=0)
    assert estimate_cache_bytes(100, 2, 64, "float32") == 100 * (3 * 64 * 4 + 5)
    with pytest.raises(InvalidArgument, match="at least one token"):
        build_target_cache(target, samples + [Sample([], [])], tmp_path / "bad", progress=False)


def test_cache_refuses_a_mismatched_drafter(tiny_target_dir, tmp_path):
    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32", tap_layer_ids=(0, 1)))
    build_target_cache(target, [Sample([1, 2, 3], [4, 5])], tmp_path, progress=False)
    cache = TargetCache(tmp_path)
    cache.check_compatible((0, 1), 64, target.vocab_size)
    with pytest.raises(InvalidArgument, match="target_layer_ids"):
        cache.check_compatible((0, 2), 64)
    with pytest.raises(InvalidArgument, match="hidden_size"):
        cache.check_compatible((0, 1), 128)


def test_ranks_split_the_target_log_partition_and_each_ends_with_all_of_it(tiny_target_dir, tmp_path):
    """ensure_target_lse over two ranks: before the barrier each rank has computed only its own shards (r, r + W..);
    after it every shard's file exists, and the values are what one rank alone computes (the full-vocabulary
    logsumexp of the final hidden state through the LM head, at the positions predicting a supervised token)."""
    from dspark_core.training.cache import LSE_SUFFIX

    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32", tap_layer_ids=(0, 1)))
    g = torch.Generator().manual_seed(1)
    def rand(n):
        return torch.randint(0, 200, (n,), generator=g).tolist()

    samples = [Sample(rand(6), rand(9)) for _ in range(8)]
    build_target_cache(target, samples, tmp_path / "c", dtype="float32", shard_tokens=40, batch_tokens=20,
                       progress=False)
    head = target.model.get_output_embeddings().weight.detach().float()
    cache = TargetCache(tmp_path / "c")
    files = [tmp_path / "c" / (s["file"] + LSE_SUFFIX) for s in cache.manifest.shards]
    assert len(files) >= 3
    seen = []
    cache.ensure_target_lse(head, progress=False, rank=1, world_size=2,
                            barrier=lambda: seen.append([f.is_file() for f in files]))
    assert seen == [[i % 2 == 1 for i in range(len(files))]]  # rank 1's share only, then the barrier
    assert all(f.is_file() for f in files)
    for i, s in enumerate(samples):
        row = cache[i]
        lab = torch.zeros_like(row["loss_mask"], dtype=torch.bool)
        lab[:-1] = row["loss_mask"][1:].bool()  # positions that predict a supervised token
        want = torch.logsumexp(F.linear(row["final_hidden"].float(), head), dim=-1)
        torch.testing.assert_close(row["target_lse"][lab], want[lab])
