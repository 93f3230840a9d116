"""The drafter's context window (EngineConfig.draft_window): a request's drafter context begins at most W
positions before its first anchor. The verifier returns only those rows of the prompt's features, a fresh
drafter state begins wherever its first item starts (and continues from there), positions stay absolute,
and the output stays exactly the target's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dspark_core.drafters import load_drafter
from dspark_core.drafters.base import ProposeItem
from dspark_core.engine import Engine, EngineConfig
from dspark_core.errors import InvalidArgument
from dspark_core.sampling import SamplingParams
from dspark_core.scheduling import DRAFT_WINDOW
from dspark_core.verifier import PrefillItem, Verifier

pytestmark = pytest.mark.usefixtures("one_torch_thread")
FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec-tiny-a"
GREEDY = SamplingParams(temperature=0, max_new_tokens=24)


@pytest.fixture(scope="module")
def stack(fixture_dspark_stack):
    return fixture_dspark_stack


def _prompt(target, n: int) -> list[int]:
    """n tokens the drafter can follow: a fixture prompt and the target's own greedy continuation of it."""
    import json

    base = json.loads((FIXTURES / "target" / "reference.json").read_text())["prompts"][2]["prompt_ids"]
    more = Engine(target, None, EngineConfig(policy="ar")).generate(
        list(base), SamplingParams(temperature=0, max_new_tokens=max(1, n - len(base)))).output_ids
    ids = list(base) + list(more)
    assert len(ids) >= n
    return ids[:n]


def test_the_prefill_returns_the_last_rows_it_is_asked_for(stack):
    target, _ = stack
    v = Verifier(target)
    prompt = tuple(_prompt(target, 40))
    full = v.prefill([PrefillItem("full", prompt, GREEDY)])[0]
    assert full.features_start == 0 and full.features.shape[0] == 40
    for rows, start in ((8, 32), (0, 40), (40, 0), (100, 0)):
        res = v.prefill([PrefillItem(f"w{rows}", prompt, GREEDY, feature_rows=rows)])[0]
        assert res.features_start == start and res.context_tokens == list(prompt[start:])
        assert torch.equal(res.features, full.features[start:])  # the same rows, bit for bit
        assert res.tokens == full.tokens
    for bad in (-1, True, 2.5, "8"):
        with pytest.raises(InvalidArgument, match="feature_rows"):
            v.prefill([PrefillItem("bad", prompt, GREEDY, feature_rows=bad)])


def _item(drafter, state, feats, start, anchor=11):
    return ProposeItem(state=state, new_features=feats, new_positions_start=start, new_tokens=[1] * feats.shape[0],
                       anchor=anchor, anchor_pos=start + feats.shape[0])


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_a_fresh_drafter_state_begins_where_its_first_item_starts(kind):
    drafter = load_drafter(FIXTURES / kind)
    g = torch.Generator().manual_seed(0)
    feats = torch.randn((6, drafter.config.feature_size), generator=g)
    state = drafter.new_state()
    drafter.propose([_item(drafter, state, feats, 50)])
    assert state.first == 50 and state.length == 56
    drafter.propose([_item(drafter, state, feats[:2], 56)])  # continues from there
    assert state.length == 58
    with pytest.raises(InvalidArgument, match="new_positions_start"):  # a held context is never restarted
        drafter.propose([_item(drafter, state, feats[:2], 40)])
    limit = drafter.config.max_position_embeddings
    with pytest.raises(InvalidArgument, match="anchor_pos"):  # no position table grows to what a caller names
        drafter.propose([_item(drafter, drafter.new_state(), feats, limit)])
    with pytest.raises(InvalidArgument, match="new_positions_start"):
        drafter.propose([_item(drafter, drafter.new_state(), feats, -3)])


@pytest.mark.parametrize("kind", ["dspark", "eagle3"])
def test_a_windowed_context_keeps_absolute_positions(kind):
    """Attention sees relative positions only: the same context rows and anchor moved by 100 positions draft
    the same block (their logits equal to float32 rounding). A context that began counting at 0 while the
    block counted from the anchor's absolute position would shift every relative distance and fail this."""
    drafter = load_drafter(FIXTURES / kind)
    g = torch.Generator().manual_seed(1)
    feats = torch.randn((12, drafter.config.feature_size), generator=g)
    at = {}
    for start in (20, 120):
        state = drafter.new_state()
        out = drafter.draft([_item(drafter, state, feats, start)])
        at[start] = out
    a, b = at[20], at[120]
    torch.testing.assert_close(a.logits, b.logits, rtol=1e-4, atol=1e-4)
    assert a.tokens.tolist() == b.tokens.tolist()


def _run(target, drafter, prompts, window, params=GREEDY, policy="fixed"):
    engine = Engine(target, drafter, EngineConfig(policy=policy, draft_window=window))
    firsts = {}
    rids = [engine.add_request(p, params) for p in prompts]
    while engine.has_work:
        engine.step()
        for rid in rids:
            r = engine.requests.get(rid)
            if r is not None and r.draft_state is not None and r.draft_state.cache.length:
                firsts.setdefault(rid, r.draft_state.first)
    reqs = [engine.pop(r) for r in rids]
    return [r.output_ids for r in reqs], [firsts.get(r) for r in rids], sum(sum(r.accepted_per_round) for r in reqs)


def test_the_engine_begins_each_drafter_context_inside_the_window_and_stays_exact(stack):
    target, drafter = stack
    prompts = [_prompt(target, n) for n in (40, 9, 33)]
    want = [Engine(target, None, EngineConfig(policy="ar")).generate(p, GREEDY).output_ids for p in prompts]
    got, firsts, accepted = _run(target, drafter, prompts, window=8)
    assert got == want
    assert firsts == [32, 1, 25]  # len - 8 (a 9-token prompt: its first row the drafter reads is position 1)
    assert accepted > 0  # it drafted, and drafts were accepted
    whole, firsts, _ = _run(target, drafter, prompts, window=None)
    assert whole == want and firsts == [0, 0, 0]


def test_a_seeded_requests_output_does_not_depend_on_the_window(stack):
    target, drafter = stack
    prompts = [_prompt(target, 40)]
    params = SamplingParams(temperature=1.0, max_new_tokens=24, seed=7)
    outs = {w: _run(target, drafter, prompts, w, params)[0] for w in (4, 16, None)}
    assert outs[4] == outs[16] == outs[None]


class _Spy(Verifier):
    def __init__(self, target):
        super().__init__(target)
        self.rows = []

    def prefill(self, items):
        self.rows += [it.feature_rows for it in items]
        return super().prefill(items)


def test_the_engine_asks_for_no_features_without_a_drafter_and_the_window_with_one(stack):
    target, drafter = stack
    prompt = _prompt(target, 20)
    for d, cfg, want in ((None, EngineConfig(policy="ar"), 0), (drafter, EngineConfig(policy="fixed"), DRAFT_WINDOW),
                         (drafter, EngineConfig(policy="fixed", draft_window=None), None)):
        spy = _Spy(target)
        Engine(target, d, cfg, verifier=spy).generate(prompt, SamplingParams(temperature=0, max_new_tokens=4))
        assert spy.rows == [want]
    for bad in (0, -1, True, 1.5):
        with pytest.raises(InvalidArgument, match="draft_window"):
            EngineConfig(draft_window=bad)
