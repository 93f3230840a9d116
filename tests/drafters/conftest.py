"""Fixtures for the drafter tests: the deepspec-tiny-a reference checkpoints and a minimal greedy
speculative-decoding loop that verifies with the Hugging Face target directly (full re-forward each
round, fine for tiny models) and drafts through the drafter's `propose()` API."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from dspark_core.drafters import ProposeItem, load_drafter


FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "deepspec-tiny-a"
DRAFTERS = ("dspark", "dspark-rnn", "dflash", "eagle3")
MAX_NEW_TOKENS = 64


def _require_fixtures() -> None:
    if not (FIXTURES / "target" / "model.safetensors").is_file():
        pytest.skip(f"reference fixtures not found at {FIXTURES} (tests/fixtures/ of the repository)")


@pytest.fixture(scope="session")
def fixtures_dir() -> Path:
    _require_fixtures()
    return FIXTURES


@pytest.fixture(scope="session")
def target(fixtures_dir):
    transformers = pytest.importorskip("transformers")
    model = transformers.Qwen3ForCausalLM.from_pretrained(
        fixtures_dir / "target", dtype=torch.float32, attn_implementation="sdpa")
    return model.eval()


class Reference:
    """One fixture folder's reference.json (`meta`) and reference.safetensors (`tensors`)."""

    def __init__(self, folder: Path):
        self.meta = json.loads((folder / "reference.json").read_text())
        self.tensors = load_file(str(folder / "reference.safetensors"))
        self.prompts = self.meta["prompts"]

    def t(self, prompt_index: int, name: str) -> torch.Tensor:
        return self.tensors[f"p{prompt_index}.{name}"]


@pytest.fixture(scope="session")
def reference(fixtures_dir):
    cache: dict[str, Reference] = {}

    def get(name: str) -> Reference:
        if name not in cache:
            cache[name] = Reference(fixtures_dir / name)
        return cache[name]

    return get


@pytest.fixture(scope="session")
def drafter(fixtures_dir):
    cache: dict[str, object] = {}

    def get(name: str):
        if name not in cache:
            cache[name] = load_drafter(fixtures_dir / name)
        return cache[name]

    return get


def target_forward(target, ids: list[int], layer_ids) -> tuple[torch.Tensor, torch.Tensor]:
    """-> logits [n, V], features [n, L * H] (concat of hidden_states[l + 1])."""
    with torch.no_grad():
        out = target(input_ids=torch.tensor([ids]), output_hidden_states=True)
    feats = torch.cat([out.hidden_states[l + 1][0] for l in layer_ids], dim=-1)
    return out.logits[0], feats


def greedy_speculative_decode(target, drafter, prompts: list[list[int]], conf_threshold: float = 0.0,
                              max_new_tokens: int = MAX_NEW_TOKENS) -> list[dict]:
    """Greedy speculative decoding of several prompts in lockstep (one batched propose per round).

    Returns per prompt a DeepSpec-style trace: new_tokens, accepted_draft_lengths and rounds with start,
    verify_input_ids, accepted_draft_tokens, next_token, confidence_logits (proposed slots only).
    """
    reqs = []
    for prompt in prompts:
        logits, feats = target_forward(target, prompt, drafter.target_layer_ids)
        anchor = int(logits[-1].argmax())
        reqs.append(dict(T=len(prompt), seq=list(prompt) + [anchor], start=len(prompt), state=drafter.new_state(),
                         new_features=feats, new_start=0, new_tokens=list(prompt), rounds=[]))
    while True:
        active = [r for r in reqs if r["start"] < r["T"] + max_new_tokens]
        if not active:
            break
        items = [ProposeItem(state=r["state"], new_features=r["new_features"], new_positions_start=r["new_start"],
                             new_tokens=r["new_tokens"], anchor=r["seq"][r["start"]], anchor_pos=r["start"],
                             temperature=0.0, generator=None) for r in active]
        for r, prop in zip(active, drafter.propose(items)):
            n = len(prop.tokens)
            if conf_threshold > 0:
                below = [k for k, c in enumerate(prop.confidences.tolist()) if c < conf_threshold]
                n = below[0] if below else n
            drafts = prop.tokens[:n]
            start, anchor = r["start"], r["seq"][r["start"]]
            verify = [anchor] + drafts
            logits, feats = target_forward(target, r["seq"][:start] + verify, drafter.target_layer_ids)
            argmax = logits[start:].argmax(dim=-1).tolist()  # [n + 1]
            a = 0
            while a < n and drafts[a] == argmax[a]:
                a += 1
            nxt = argmax[a]
            r["rounds"].append(dict(
                start=start, verify_input_ids=verify, accepted_draft_tokens=a, next_token=nxt,
                confidence_logits=None if prop.confidence_logits is None else prop.confidence_logits[:n].tolist()))
            r["new_features"], r["new_start"], r["new_tokens"] = feats[start : start + a + 1], start, verify[: a + 1]
            r["seq"] = r["seq"][: start + 1] + drafts[:a] + [nxt]
            r["start"] = start + a + 1
    return [dict(new_tokens=r["seq"][r["T"] : r["T"] + max_new_tokens],
                 accepted_draft_lengths=[x["accepted_draft_tokens"] for x in r["rounds"]],
                 rounds=r["rounds"]) for r in reqs]


def assert_trace_matches(mine: dict, ref: dict, atol: float = 1e-4) -> float:
    """Round by round comparison; returns the max abs confidence-logit difference."""
    worst = 0.0
    for k, (got, want) in enumerate(zip(mine["rounds"], ref["rounds"])):
        for key in ("start", "verify_input_ids", "accepted_draft_tokens", "next_token"):
            assert got[key] == want[key], f"round {k}: {key} {got[key]} != {want[key]}"
        if "confidence_logits" in want:
            diff = (torch.tensor(got["confidence_logits"]) - torch.tensor(want["confidence_logits"])).abs()
            worst = max(worst, float(diff.max()) if diff.numel() else 0.0)
            assert worst <= atol, f"round {k}: confidence logits differ by {worst}"
    assert len(mine["rounds"]) == len(ref["rounds"])
    assert mine["accepted_draft_lengths"] == ref["accepted_draft_lengths"]
    assert mine["new_tokens"] == ref["new_tokens"]
    return worst


@pytest.fixture(scope="session")
def spec_decode(target):
    """greedy_speculative_decode bound to the fixture target: spec_decode(drafter, prompts, conf_threshold=0)."""
    return lambda drafter, prompts, conf_threshold=0.0: greedy_speculative_decode(
        target, drafter, prompts, conf_threshold)


@pytest.fixture(scope="session")
def check_trace():
    return assert_trace_matches


@pytest.fixture(scope="session")
def target_features(target):
    """target_features(ids, layer_ids) -> (logits [n, V], features [n, L * H])."""
    return lambda ids, layer_ids: target_forward(target, ids, layer_ids)


@pytest.fixture(autouse=True)
def _drafter_tests_use_one_thread(one_torch_thread):
    """Every drafter test runs its tiny models on one intra-op thread (see tests/conftest.py)."""
