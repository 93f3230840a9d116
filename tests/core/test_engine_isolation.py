"""A request's failure ends that request only: a batched prefill or verify that throws because of one
request's input is retried without it; a failure of the call itself (nobody's input) leaves every request
queued or active, committing nothing, for the caller to retry. Seeded requests are verified by
position-keyed coupling (and run their target passes alone), so their output does not depend on what else
runs or on how many tokens were drafted."""

from __future__ import annotations

import pytest

from dspark_core.engine import Engine, EngineConfig
from dspark_core.sampling import SamplingParams
from dspark_core.verifier import Verifier

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIXTURES = __import__("pathlib").Path(__file__).resolve().parents[1] / "fixtures" / "deepspec-tiny-a"
GREEDY = SamplingParams(temperature=0, max_new_tokens=16)


class Flaky(Verifier):
    """A real verifier whose batched calls throw while `poison` is in the batch (or `down` is set; or
    `verify_down` for verify calls only)."""

    def __init__(self, target):
        super().__init__(target)
        self.poison, self.down, self.verify_down, self.calls = set(), False, 0, 0

    def _check(self, items):
        self.calls += 1
        if self.down:
            raise ConnectionError("verifier is gone")
        if any(it.request_id in self.poison for it in items):
            raise ValueError("a value no proto field holds")

    def prefill(self, items):
        self._check(items)
        return super().prefill(items)

    def verify(self, items):
        if self.verify_down:
            self.verify_down -= 1
            raise ConnectionError("verifier went away after the prefill")
        self._check(items)
        return super().verify(items)


@pytest.fixture(scope="module")
def stack(fixture_dspark_stack):
    return fixture_dspark_stack


def _reference(target, prompts):
    engine = Engine(target, None, EngineConfig(policy="ar"))
    return [engine.generate(p, GREEDY).output_ids for p in prompts]


PROMPTS = [[5, 9, 12, 30, 41], [7, 7, 8], [100, 3, 19, 22, 23, 24, 60, 61, 90]]


@pytest.mark.parametrize("when", ["prefill", "verify"])
def test_the_request_at_fault_fails_alone(stack, when):
    target, drafter = stack
    want = _reference(target, PROMPTS)
    v = Flaky(target)
    engine = Engine(target, drafter, EngineConfig(policy="fixed"), verifier=v)
    rids = [engine.add_request(p, GREEDY, request_id=f"r{i}") for i, p in enumerate(PROMPTS)]
    bad = engine.add_request([1, 2, 3], GREEDY, request_id="bad")
    if when == "prefill":
        v.poison.add("bad")
    else:
        engine.step()  # admitted; its verify will throw
        v.poison.add("bad")
    events = []
    while engine.has_work:
        events += engine.step()
    assert [engine.pop(r).output_ids for r in rids] == want
    failed = engine.pop(bad)
    assert failed.finish_reason == "error" and isinstance(failed.error, ValueError)
    assert any(e.request_id == "bad" and e.finish_reason == "error" for e in events)
    assert v.num_active == 0 and target.num_active == 0


def test_a_failure_of_the_call_itself_keeps_every_request_for_a_retry(stack):
    target, drafter = stack
    want = _reference(target, PROMPTS)
    v = Flaky(target)
    engine = Engine(target, drafter, EngineConfig(policy="fixed"), verifier=v)
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS[:1]]
    engine.step()  # the first is active
    rids += [engine.add_request(p, GREEDY) for p in PROMPTS[1:]]  # these wait for a prefill
    v.down = True
    for _ in range(3):
        with pytest.raises(ConnectionError):
            engine.step()
    assert len(engine.active) == 1 and len(engine.waiting) == 2  # nothing lost, nothing committed
    v.down = False
    engine.run()
    assert [engine.pop(r).output_ids for r in rids] == want


def test_seeded_sampled_output_does_not_depend_on_the_batch(stack):
    target, drafter = stack
    seeded = SamplingParams(temperature=1.0, seed=99, max_new_tokens=24)

    def run(others: int):
        engine = Engine(target, drafter, EngineConfig(policy="fixed"))
        rid = engine.add_request(PROMPTS[0], seeded)
        for i in range(others):
            engine.add_request(PROMPTS[1 + i % 2], SamplingParams(temperature=1.0, max_new_tokens=24))
        engine.run()
        return engine.requests[rid].output_ids

    alone = run(0)
    assert len(alone) == 24 and run(5) == alone == run(2)


def test_seeded_sampled_output_does_not_depend_on_the_verification_length_or_the_drafter(stack):
    """Position-keyed coupling: the committed token at each position is the seed's draw from the target
    there, so autoregressive decoding, one draft per round, seven per round, batched beside other sampled
    traffic or drafted by no drafter at all give the same tokens."""
    target, drafter = stack
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=7, max_new_tokens=24)

    def run(policy: str, others: int = 0, use_drafter=True):
        engine = Engine(target, drafter if use_drafter else None, EngineConfig(policy=policy))
        rid = engine.add_request(PROMPTS[2], seeded)
        for i in range(others):
            engine.add_request(PROMPTS[i % 2], SamplingParams(temperature=1.0, max_new_tokens=24))
        engine.run()
        return engine.requests[rid].output_ids

    ar = run("ar", use_drafter=False)
    assert len(ar) == 24
    assert run("fixed") == ar == run("gamma1")
    assert run("fixed", others=3) == ar
    # and it is a sample, not a fixed sequence: another seed draws other tokens
    seeded = SamplingParams(temperature=1.0, top_p=0.95, seed=8, max_new_tokens=24)
    assert run("fixed") != ar


def test_tokens_committed_by_a_step_that_then_failed_are_reported_by_the_next(stack):
    """A prefill commits the first token, then the same step's verify fails: the next step reports it."""
    target, drafter = stack
    want = _reference(target, PROMPTS[:2])
    v = Flaky(target)
    engine = Engine(target, drafter, EngineConfig(policy="fixed"), verifier=v)
    rids = [engine.add_request(p, GREEDY) for p in PROMPTS[:2]]
    v.verify_down = 3  # the batched verify, then each of the two alone
    seen = {r: [] for r in rids}
    with pytest.raises(ConnectionError):
        engine.step()
    while engine.has_work:
        for ev in engine.step():
            seen[ev.request_id] += ev.new_token_ids
    assert [seen[r] for r in rids] == want == [engine.pop(r).output_ids for r in rids]
