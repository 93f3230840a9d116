"""scripts/expand_draft_vocab.py: a drafter's draft vocabulary widened without training keeps every old column's
logits and gives each new column the target's LM-head row with no Markov bias."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_core.drafters import load_drafter, save_drafter
from dspark_core.target import TargetConfig, TargetRuntime
from dspark_core.training.trainer import TrainConfig, default_target_layers, fresh_drafter

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "expand_draft_vocab.py"
pytestmark = pytest.mark.usefixtures("one_torch_thread")


@pytest.fixture(scope="module")
def narrow(tiny_target_dir, tmp_path_factory):
    """A DSpark drafter of the tiny target with a 64-id draft vocabulary and a non-zero Markov W2."""
    target = TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="float32",
                                        tap_layer_ids=default_target_layers(4)))
    ids = torch.arange(0, 128, 2)  # every other id: the odd ones are outside
    cfg = TrainConfig(kind="dspark", block_size=4, draft_vocab_size=64)
    drafter = fresh_drafter(target, cfg, ids)
    with torch.no_grad():
        drafter.markov_head.markov_w2.weight.normal_(0, 0.5, generator=torch.Generator().manual_seed(0))
    path = tmp_path_factory.mktemp("narrow")
    save_drafter(drafter, path, reference_target=True)  # the LM head's rows come from the target at load time
    return path


def _widen(src, out, size, counts):
    return subprocess.run([sys.executable, str(SCRIPT), str(src), str(out), "--size", str(size), "--counts",
                           str(counts), "--coverage", str(counts)], capture_output=True, text=True)


def test_widened_drafter_keeps_old_columns_and_adds_the_most_frequent_ids(narrow, tiny_target_dir, tmp_path):
    counts = tmp_path / "answers.jsonl"  # ids 5 and 7 are the most frequent answer ids outside the vocabulary
    counts.write_text(json.dumps({"prompt_ids": [1], "response_ids": [5, 5, 5, 7, 7, 9, 2, 2]}) + "\n")
    res = _widen(narrow, tmp_path / "wide", 66, counts)
    assert res.returncode == 0, res.stderr
    assert "coverage of 8 answer tokens: 0.2500 (64 ids) -> 0.8750 (66 ids)" in res.stdout
    a, b = load_drafter(narrow, target=tiny_target_dir), load_drafter(tmp_path / "wide", target=tiny_target_dir)
    new = b.draft_vocab_ids.tolist()
    assert len(new) == 66 and new == sorted(set(range(0, 128, 2)) | {5, 7})
    old_cols = torch.searchsorted(b.draft_vocab_ids, a.draft_vocab_ids)
    w2a, w2b = a.markov_head.markov_w2.weight, b.markov_head.markov_w2.weight
    assert torch.equal(w2b[old_cols], w2a)
    extra = torch.tensor([new.index(5), new.index(7)])
    assert torch.count_nonzero(w2b[extra]) == 0  # no Markov bias for the new ids
    assert torch.equal(b.lm_head.weight[old_cols], a.lm_head.weight)  # the target's rows, as before
    # teacher-forced logits on the old columns are the narrow drafter's, bit for bit
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 128, (1, 12), generator=g)
    feats = torch.randn(1, 12, a.config.feature_size, generator=g)
    anchors = torch.tensor([[2, 5]])
    with torch.no_grad():
        la = a.training_forward(ids, feats, anchors).logits
        lb = b.training_forward(ids, feats, anchors).logits
    assert torch.equal(lb[..., old_cols], la)


def test_widening_refuses_a_smaller_size_and_its_own_source(narrow, tmp_path):
    counts = tmp_path / "answers.jsonl"
    counts.write_text(json.dumps({"prompt_ids": [1], "response_ids": [3]}) + "\n")
    res = _widen(narrow, tmp_path / "w", 32, counts)
    assert res.returncode != 0 and "--size 32 is below the current 64 ids" in res.stderr
    res = _widen(narrow, narrow, 65, counts)
    assert res.returncode != 0 and "not over the source" in res.stderr
