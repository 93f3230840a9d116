"""`dspark serve all` on the bundled model (target + DSpark drafter), driven over a real socket by the
official `openai` Python package, unchanged: completions, chat, streaming with usage, logprobs, n, seed,
penalties, min_p, stop / min_tokens / ignore_eos, echo, and strict validation (400s naming the field).

Every greedy answer is compared with the target's own autoregressive decode under the same processing
(dspark_core's engine with no drafter, in this process), token for token, and every logprob with that
decode's (atol 1e-4, float32 on both sides).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

openai = pytest.importorskip("openai")

from dspark_core.engine import Engine, EngineConfig  # noqa: E402
from dspark_core.sampling import SamplingParams  # noqa: E402
from dspark_core.target import TargetConfig, TargetRuntime  # noqa: E402

from svc_redis import free_port  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
TARGET = REPO / "models" / "target"
PROMPT = "def reverse(s):\n"
NEW = 24


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """`dspark serve all` in its own process, float32 on CPU, with its HTTP port open."""
    grpc_port, http_port = free_port(), free_port()
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "dspark_cli.main", "serve", "all", "--host", "127.0.0.1",
                             "--port", str(grpc_port), "--http-port", str(http_port), "--device", "cpu",
                             "--dtype", "float32"], cwd=REPO, env=env, stdout=open(log, "w"),
                            stderr=subprocess.STDOUT)
    base = f"http://127.0.0.1:{http_port}"
    deadline = time.monotonic() + 180
    while True:
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=2) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"dspark serve all never became healthy:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    yield base
    proc.terminate()
    try:
        proc.wait(30)
    except subprocess.TimeoutExpired:
        proc.kill()


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server}/v1", api_key="unused", max_retries=0, timeout=120)


@pytest.fixture(scope="module")
def target():
    return TargetRuntime(TargetConfig(str(TARGET), device="cpu", dtype="float32"))


@pytest.fixture(scope="module")
def prompt_ids(target):
    return target.tokenizer.encode(PROMPT, add_special_tokens=False)


def reference(target, prompt_ids, **fields):
    """The target's own autoregressive decode (no drafter) with the same processing as the server's."""
    stop = list(fields.pop("stop_token_ids", ()))
    if not fields.pop("ignore_eos", False):
        stop += [t for t in target.eos_token_ids if t not in stop]
    params = SamplingParams(max_new_tokens=fields.pop("max_tokens", NEW), stop_token_ids=tuple(stop), **fields)
    return Engine(target, None, EngineConfig(policy="ar")).generate(prompt_ids, params)


def extension(resp) -> dict:
    return resp.model_extra["dspark"]


GREEDY_COMBINATIONS = [
    {},
    {"presence_penalty": 0.8, "frequency_penalty": 0.6},
    {"repetition_penalty": 1.4},
    {"repetition_penalty": 1.2, "frequency_penalty": 1.0, "presence_penalty": -0.5, "min_p": 0.1},
    {"min_tokens": NEW, "max_tokens": NEW},
    {"ignore_eos": True, "frequency_penalty": 0.3, "max_tokens": 40},
]


@pytest.mark.parametrize("fields", GREEDY_COMBINATIONS, ids=lambda f: ",".join(f) or "plain")
def test_greedy_completion_equals_the_targets_own_decode_with_the_same_processing(client, target, prompt_ids,
                                                                                  fields):
    sent = dict(fields)
    max_tokens = sent.pop("max_tokens", NEW)
    resp = client.completions.create(model="target", prompt=PROMPT, max_tokens=max_tokens, temperature=0,
                                     logprobs=3, extra_body=sent)
    want = reference(target, prompt_ids, temperature=0.0, logprobs=3, max_tokens=max_tokens, **sent)
    got = extension(resp)["token_ids"]
    assert got == want.output_ids
    choice = resp.choices[0]
    assert choice.text == target.tokenizer.decode(want.output_ids, skip_special_tokens=True)
    lps = choice.logprobs
    assert len(lps.token_logprobs) == len(got)
    # drafted tokens included: the served logprobs equal those of the decode without speculation
    assert max(abs(a - b.logprob) for a, b in zip(lps.token_logprobs, want.logprobs)) < 1e-4
    for top, ref in zip(lps.top_logprobs, want.logprobs):
        assert len(top) == len(ref.top) and all(abs(top[target.tokenizer.decode([t])] - v) < 1e-4
                                                for t, v in ref.top if target.tokenizer.decode([t]) in top)
    if fields.get("min_tokens"):
        assert not set(got) & set(target.eos_token_ids) and choice.finish_reason == "length"
    spec = resp.usage.model_extra["speculative"]
    assert spec["num_rounds"] >= 1 and spec["num_accepted_tokens"] <= spec["num_draft_tokens"]
    assert len(spec["accepted_per_position"]) >= 1 and spec["accepted_per_position"][0] <= spec["num_rounds"]
    assert sum(spec["accepted_per_position"]) == spec["num_accepted_tokens"]


def test_the_drafter_is_really_speculating(client):
    # a repetitive prompt: the drafter's guesses get accepted, so the equalities above cover drafted tokens
    resp = client.completions.create(model="target", prompt="for i in range(10):\n    print(i)\n" * 3,
                                     max_tokens=NEW, temperature=0)
    spec = resp.usage.model_extra["speculative"]
    assert spec["num_accepted_tokens"] > 0 and spec["mean_verification_length"] > 1


def test_chat_logprobs_and_streaming_with_usage(client):
    messages = [{"role": "user", "content": "Write a Python function that reverses a string."}]
    full = client.chat.completions.create(model="target", messages=messages, max_tokens=NEW, temperature=0,
                                          logprobs=True, top_logprobs=2, presence_penalty=0.4)
    content = full.choices[0].logprobs.content
    assert len(content) == full.usage.completion_tokens
    assert all(len(c.top_logprobs) <= 2 and c.logprob <= 0 for c in content)
    assert all(c.top_logprobs[0].logprob >= c.logprob - 1e-6 for c in content)  # the best is listed first
    stream = client.chat.completions.create(model="target", messages=messages, max_tokens=NEW, temperature=0,
                                            presence_penalty=0.4, stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    assert chunks[0].choices[0].delta.role == "assistant"
    last = chunks[-1]
    assert last.choices == [] and last.usage.completion_tokens == full.usage.completion_tokens
    assert last.usage.model_extra["speculative"]["num_rounds"] == full.usage.model_extra["speculative"]["num_rounds"]
    finishing = [c for c in chunks if c.choices and c.choices[0].finish_reason]
    assert len(finishing) == 1 and finishing[0].model_extra["dspark"]["speculative"]["num_rounds"] >= 1


def test_streamed_completion_logprobs_line_up_with_the_tokens(client):
    stream = client.completions.create(model="target", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=1,
                                       stream=True)
    chunks = list(stream)
    tokens = [t for c in chunks for t in (c.choices[0].logprobs.tokens if c.choices[0].logprobs else [])]
    plain = client.completions.create(model="target", prompt=PROMPT, max_tokens=NEW, temperature=0, logprobs=1)
    assert tokens == plain.choices[0].logprobs.tokens
    assert "".join(c.choices[0].text for c in chunks) == plain.choices[0].text


def test_n_samples_are_seeded_independent_and_reproducible(client):
    kw = dict(model="target", prompt=PROMPT, max_tokens=16, temperature=1.0, seed=1234)
    first = client.completions.create(n=4, **kw)
    again = client.completions.create(n=4, **kw)
    texts = [c.text for c in sorted(first.choices, key=lambda c: c.index)]
    assert [c.index for c in sorted(first.choices, key=lambda c: c.index)] == [0, 1, 2, 3]
    assert texts == [c.text for c in sorted(again.choices, key=lambda c: c.index)]
    assert len(set(texts)) > 1  # independent samples, not one sample copied
    assert first.usage.completion_tokens == sum(len(c["token_ids"]) for c in extension(first)["choices"])
    # chat, streamed, n = 2: every choice index appears and ends once
    chunks = list(client.chat.completions.create(model="target", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=8, temperature=1.0, seed=5, n=2, stream=True))
    ends = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason)
    assert ends == [0, 1]
    roles = sorted(c.choices[0].index for c in chunks if c.choices and c.choices[0].delta.role)
    assert roles == [0, 1]  # each choice's first chunk, and only that one, carries the role


def test_sampled_penalties_are_served_with_speculation(client, target, prompt_ids):
    kw = dict(model="target", prompt=PROMPT, max_tokens=16, temperature=0.9, seed=7,
              extra_body={"repetition_penalty": 1.3, "min_p": 0.05}, frequency_penalty=0.5)
    a, b = client.completions.create(**kw), client.completions.create(**kw)
    assert a.choices[0].text == b.choices[0].text  # seeded: reproducible with penalties and speculation on
    assert a.usage.model_extra["speculative"]["num_draft_tokens"] > 0  # speculation was not switched off


def test_stop_token_ids_and_echo(client, target, prompt_ids):
    want = reference(target, prompt_ids, temperature=0.0)
    stop_at = want.output_ids[3]
    resp = client.completions.create(model="target", prompt=PROMPT, max_tokens=NEW, temperature=0,
                                     extra_body={"stop_token_ids": [stop_at]})
    ids = extension(resp)["token_ids"]
    assert ids == want.output_ids[: want.output_ids.index(stop_at) + 1]
    assert resp.choices[0].finish_reason == "stop"
    echoed = client.completions.create(model="target", prompt=PROMPT, max_tokens=4, temperature=0, echo=True)
    assert echoed.choices[0].text.startswith(PROMPT) and len(echoed.choices[0].text) > len(PROMPT)


@pytest.mark.parametrize("body,param", [
    ({"top_k": 2.7}, "top_k"),
    ({"stream": "yes"}, "stream"),
    ({"n": 1.5}, "n"),
    ({"n": 0}, "n"),
    ({"seed": "7"}, "seed"),
    ({"best_of": 3}, "best_of"),
    ({"echo": True, "logprobs": 2}, "echo"),
    ({"logprobs": 21}, "logprobs"),
    ({"min_p": 1.5}, "min_p"),
    ({"presence_penalty": 3}, "presence_penalty"),
    ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"min_tokens": 100, "max_tokens": 4}, "min_tokens"),
    ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ({"ignore_eos": "no"}, "ignore_eos"),
    ({"logit_bias": {"5": 10}}, "logit_bias"),
    ({"suffix": "x"}, "suffix"),
    ({"stream_options": {"include_usage": True}}, "stream_options"),
])
def test_bad_fields_are_a_400_naming_the_field(server, body, param):
    req = urllib.request.Request(f"{server}/v1/completions", method="POST",
                                 data=json.dumps({"prompt": "x", "max_tokens": 4, **body}).encode(),
                                 headers={"Content-Type": "application/json"})
    with pytest.raises(urllib.error.HTTPError) as err:
        urllib.request.urlopen(req, timeout=30)
    assert err.value.code == 400
    error = json.loads(err.value.read())["error"]
    assert error["param"] == param and param in error["message"], error


def test_the_openai_client_sees_the_400s_too(client):
    with pytest.raises(openai.BadRequestError, match="top_k"):
        client.completions.create(model="target", prompt="x", max_tokens=4, extra_body={"top_k": 2.7})
    with pytest.raises(openai.BadRequestError, match="top_logprobs"):
        client.chat.completions.create(model="target", messages=[{"role": "user", "content": "x"}], max_tokens=4,
                                       top_logprobs=2)
