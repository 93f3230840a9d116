"""A request's own processing (penalties, min_p, min_tokens, logprobs) through the engine on the bundled
model, with the real DSpark drafter speculating: greedy output equals the target's own decode with the same
processing, logprobs of drafted tokens equal those of the same tokens without speculation (atol 1e-4,
float32), the n choices of one prompt share its prefill. The distributional side (sampled requests follow
the processed target) is the statistical test in test_verification.py.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from dspark_core.drafters.checkpoint import load_drafter
from dspark_core.engine import Engine, EngineConfig
from dspark_core.errors import InvalidArgument
from dspark_core.sampling import SamplingParams, TokenHistory, process_logits, sampling_logprobs
from dspark_core.target import TargetConfig, TargetRuntime

pytestmark = pytest.mark.usefixtures("one_torch_thread")

MODELS = Path(__file__).resolve().parents[2] / "models"
PROMPTS = ["def reverse(s):\n", "What is 12 * 7?", "for i in range(10):\n    print(i)\n" * 2]


@pytest.fixture(scope="module")
def drafter():
    return load_drafter(MODELS / "dspark")


@pytest.fixture(scope="module")
def target(drafter):
    return TargetRuntime(TargetConfig(str(MODELS / "target"), device="cpu", dtype="float32",
                                      tap_layer_ids=tuple(drafter.target_layer_ids)))


@pytest.fixture(scope="module")
def prompts(target):
    return [target.tokenizer.encode(p, add_special_tokens=False) for p in PROMPTS]


def _run(engine: Engine, prompts, params_list):
    rids = [engine.add_request(p, params) for p, params in zip(prompts, params_list)]
    engine.run()
    return [engine.pop(r) for r in rids]


PROCESSING = [
    dict(presence_penalty=0.8, frequency_penalty=0.6),
    dict(repetition_penalty=1.4),
    dict(repetition_penalty=1.2, frequency_penalty=1.0, presence_penalty=-0.5, min_p=0.2),
    dict(min_tokens=20),
]


@pytest.mark.parametrize("fields", PROCESSING, ids=lambda f: ",".join(f))
def test_speculative_greedy_with_processing_equals_the_targets_own(target, drafter, prompts, fields):
    params = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=target.eos_token_ids, logprobs=2,
                            **fields)
    plain = SamplingParams(temperature=0, max_new_tokens=20, stop_token_ids=target.eos_token_ids)
    ar = _run(Engine(target, None, EngineConfig(policy="ar")), prompts, [params] * len(prompts))
    spec = _run(Engine(target, drafter, EngineConfig(policy="fixed")), prompts, [params] * len(prompts))
    unprocessed = _run(Engine(target, None, EngineConfig(policy="ar")), prompts, [plain] * len(prompts))
    assert [r.output_ids for r in spec] == [r.output_ids for r in ar]
    assert sum(sum(r.accepted_per_round) for r in spec) > 0  # drafts were accepted, not only bonus tokens
    # the processing is real: it changes what the target decodes
    assert [r.output_ids for r in ar] != [r.output_ids for r in unprocessed]
    for s, a in zip(spec, ar):
        assert len(s.logprobs) == len(s.output_ids)
        for x, y in zip(s.logprobs, a.logprobs):
            assert x.token == y.token and abs(x.logprob - y.logprob) < 1e-4
            assert [t for t, _ in x.top] == [t for t, _ in y.top]
            assert all(abs(u - v) < 1e-4 for (_, u), (_, v) in zip(x.top, y.top))
    if "min_tokens" in fields:
        assert all(not set(r.output_ids) & set(target.eos_token_ids) for r in spec)
        assert any(set(r.output_ids) & set(target.eos_token_ids) for r in unprocessed)


class _Recording:
    """The drafter, recording every proposal; `strip` hides the items' processing from it (what a drafter that
    does not process its own logits sees)."""

    def __init__(self, inner, strip: bool = False):
        self.inner, self.strip, self.proposals = inner, strip, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def propose(self, items):
        if self.strip:
            items = [dataclasses.replace(it, processing=None) for it in items]
        out = self.inner.propose(items)
        self.proposals += out
        return out


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_the_drafter_drafts_from_its_own_logits_processed_as_the_targets(target, drafter, prompts, temperature):
    """min_tokens bans the request's most frequent tokens (as stop ids) for the whole answer: a drafter given the
    processing never proposes them, one that is not proposes them and loses those rounds; outputs are the same
    either way (the processed target decides)."""
    plain = SamplingParams(temperature=0, max_new_tokens=40)
    ar = _run(Engine(target, None, EngineConfig(policy="ar")), prompts, [plain] * len(prompts))
    counts = torch.bincount(torch.tensor([t for r in ar for t in r.output_ids]))
    banned = tuple(counts.topk(6).indices.tolist())
    params = SamplingParams(temperature=temperature, seed=5 if temperature else None, max_new_tokens=40,
                            min_tokens=40, stop_token_ids=banned)
    outs, drafted = {}, {}
    for name, strip in (("native", False), ("stripped", True)):
        rec = _Recording(drafter, strip)
        res = _run(Engine(target, rec, EngineConfig(policy="fixed")), prompts, [params] * len(prompts))
        outs[name] = [r.output_ids for r in res]
        drafted[name] = [t for p in rec.proposals for t in p.tokens]
        assert all(p.processed is not strip for p in rec.proposals)
    assert outs["native"] == outs["stripped"]
    assert not set(t for o in outs["native"] for t in o) & set(banned)
    assert not set(drafted["native"]) & set(banned)
    assert set(drafted["stripped"]) & set(banned)  # the test can tell the two apart


def _teacher_forced_logprobs(target, prompt, output, params):
    """Logprobs of `output` from one plain forward over prompt + output, processed row by row."""
    seq = target.new_sequence()
    try:
        logits = target.forward([(seq, list(prompt) + list(output))]).logits_of(0)[len(prompt) - 1: -1]
    finally:
        target.release(seq)
    rows = [process_logits(logits[i: i + 1], params, TokenHistory(prompt, output[:i])) for i in range(len(output))]
    lps = sampling_logprobs(torch.cat(rows), params)
    return lps.gather(1, torch.tensor(output)[:, None])[:, 0].tolist()


def test_sampled_logprobs_of_drafted_tokens_equal_those_without_speculation(target, drafter, prompts):
    params = SamplingParams(temperature=0.8, top_k=50, min_p=0.02, repetition_penalty=1.2, frequency_penalty=0.4,
                            max_new_tokens=24, seed=3, logprobs=0)
    spec = _run(Engine(target, drafter, EngineConfig(policy="fixed")), prompts,
                [dataclasses.replace(params, seed=s) for s in range(len(prompts))])
    assert sum(sum(r.accepted_per_round) for r in spec) > 0
    for prompt, r in zip(prompts, spec):
        want = _teacher_forced_logprobs(target, prompt, r.output_ids, params)
        assert max(abs(x.logprob - y) for x, y in zip(r.logprobs, want)) < 1e-4


def test_choices_of_one_prompt_share_its_prefill_and_equal_separate_requests(target, drafter, prompts):
    params = SamplingParams(temperature=1.0, max_new_tokens=12, presence_penalty=0.5)
    seeds = (11, 12, 13)
    alone = [_run(Engine(target, drafter, EngineConfig()), [prompts[0]], [dataclasses.replace(params, seed=s)])[0]
             for s in seeds]
    calls = []
    forward = target.forward

    def counting(batch, **kw):
        calls.append(sum(len(toks) for _, toks in batch))
        return forward(batch, **kw)

    target.forward = counting
    try:
        together = _run(Engine(target, drafter, EngineConfig()), [prompts[0]] * 3,
                        [dataclasses.replace(params, seed=s) for s in seeds])
    finally:
        del target.forward
    assert [r.output_ids for r in together] == [r.output_ids for r in alone]
    assert len({tuple(r.output_ids) for r in together}) > 1  # independent samples
    assert calls[0] == len(prompts[0])  # the prefill ran the prompt once for the three requests
    assert target.num_active == 0


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_an_adopted_request_counts_its_earlier_tokens_as_output(target, drafter, prompts, temperature):
    """A request adopted from a lost scheduler resumes from prompt + what it had generated: with
    `generated_in_prompt` the penalties count those tokens as output, so the rest of its output is what the
    uninterrupted request produced (greedy; and seeded sampled, which coupling makes position-keyed). Counted
    as prompt instead (what adoption did before), the frequency penalty misses them and the output moves."""
    params = SamplingParams(temperature=temperature, seed=5, max_new_tokens=24, frequency_penalty=1.5,
                            presence_penalty=0.5)
    prompt = prompts[1]  # the bundled model's output for it is one the penalties change
    whole = _run(Engine(target, drafter, EngineConfig(policy="fixed")), [prompt], [params])[0].output_ids
    k = 10
    rest = dataclasses.replace(params, max_new_tokens=24 - k)

    def adopted(generated: int):
        engine = Engine(target, drafter, EngineConfig(policy="fixed"))
        rid = engine.add_request(prompt + whole[:k], rest, generated_in_prompt=generated)
        engine.run()
        return engine.pop(rid).output_ids

    assert adopted(k) == whole[k:]
    if temperature == 0:
        assert adopted(0) != whole[k:]
    with pytest.raises(InvalidArgument, match="generated_in_prompt"):
        Engine(target, drafter).add_request(prompt, rest, generated_in_prompt=len(prompt))
