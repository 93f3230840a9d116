"""Draft vocabularies: the drafter predicts only some target ids; losses stay exact, drafts map back to target ids."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dspark_core.drafters.sampling import TokenChooser
from dspark_core.training import losses as L
from dspark_core.training.trainer import choose_draft_vocab

V, H, GAMMA = 50, 8, 3


def _setup(seed=0):
    g = torch.Generator().manual_seed(seed)
    b, s = 2, 12
    ids = torch.randint(0, V, (b, s), generator=g)
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[:, 3:] = True
    anchors = torch.tensor([[3, 6], [4, 7]])
    valid = torch.ones(2, 2, dtype=torch.bool)
    targets = L.block_targets(ids, mask, anchors, valid, GAMMA, 4.0)
    final_hidden = torch.randn(b, s, H, generator=g)
    head = torch.randn(V, H, generator=g)
    lse = torch.logsumexp(F.linear(final_hidden, head), -1)  # [B, S]
    logits_full = torch.randn(b, 2, GAMMA, V, generator=g)
    conf = torch.randn(b, 2, GAMMA, generator=g)
    return targets, final_hidden, head, lse, anchors, logits_full, conf


def test_a_draft_vocabulary_of_every_id_gives_the_full_vocabulary_loss():
    targets, fh, head, lse, anchors, logits, conf = _setup()
    cfg = L.LossConfig(kind="dspark", confidence_support=None)
    full = L.dspark_loss_sums(logits, conf, targets, fh, anchors, head, cfg, conf)
    every = L.dspark_loss_sums(logits, conf, targets, fh, anchors, head, cfg, conf,
                               draft_vocab_ids=torch.arange(V), target_lse=lse)
    for k in full.num:
        assert torch.allclose(full.num[k], every.num[k], atol=1e-4), k


def test_a_subset_counts_the_target_mass_outside_it_exactly():
    """Draft logits on a subset == full-vocabulary logits that are -inf outside it: same TV, acceptance and
    confidence label; CE only on labels inside the subset."""
    targets, fh, head, lse, anchors, logits, conf = _setup(1)
    ids = torch.tensor(sorted(torch.randperm(V, generator=torch.Generator().manual_seed(3))[:20].tolist()))
    sub = logits[..., ids]
    masked = torch.full_like(logits, float("-inf"))
    masked[..., ids] = sub
    for support in (None, 5):
        cfg = L.LossConfig(kind="dspark", ce_weight=0.0, confidence_support=support)
        ref = L.dspark_loss_sums(masked, conf, targets, fh, anchors, head, cfg, conf)
        got = L.dspark_loss_sums(sub, conf, targets, fh, anchors, head[ids], cfg, conf, draft_vocab_ids=ids,
                                 target_lse=lse)
        for k in ("tv", "accept", "conf"):
            assert torch.allclose(ref.num[k], got.num[k], atol=1e-4), (k, support)
        # the greedy label can only lose hits it cannot prove (target argmax outside the subset)
        assert float(got.num["gconf"]) >= 0
    # CE: the data token's -log q over the subset, 0 where the label lies outside it
    cfg = L.LossConfig(kind="dspark")
    got = L.dspark_loss_sums(sub, conf, targets, fh, anchors, head[ids], cfg, conf, draft_vocab_ids=ids,
                             target_lse=lse)
    sel = targets.supervised
    labels, w = targets.labels[sel], targets.weights[sel]
    inside = torch.isin(labels, ids)
    cols = torch.searchsorted(ids, labels).clamp_max(len(ids) - 1)
    ce = F.cross_entropy(sub[sel], cols, reduction="none") * inside
    assert torch.allclose(got.num["ce"], (ce * w).sum().reshape(1), atol=1e-4)


def test_eagle3_soft_ce_on_a_subset_uses_the_true_target_probabilities():
    g = torch.Generator().manual_seed(5)
    b, s = 1, 8
    mask = torch.zeros(b, s, dtype=torch.bool)
    mask[:, 2:] = True
    t = L.ttt_targets(mask, 2)
    fh, head = torch.randn(b, s, H, generator=g), torch.randn(V, H, generator=g)
    lse = torch.logsumexp(F.linear(fh, head), -1)
    ids = torch.arange(0, V, 2)
    step_logits = [torch.randn(b, s - 1, len(ids), generator=g) for _ in range(2)]
    got = L.eagle3_loss_sums(step_logits, t, fh, head[ids], L.LossConfig(kind="eagle3"), target_lse=lse)
    sel = t.mask[:, 0]
    idx = sel.nonzero()
    p = torch.softmax(F.linear(fh[idx[:, 0], idx[:, 1] + 1], head), -1)[:, ids]  # true probabilities, not renormalised
    want = -(p * torch.log_softmax(step_logits[0][sel], -1)).sum()
    assert torch.allclose(got.num["soft_ce"][0], want, atol=1e-4)


def test_token_chooser_maps_columns_back_to_target_ids():
    ids = torch.tensor([3, 8, 20, 41])
    logits = torch.tensor([[0.0, 5.0, 1.0, 0.0], [9.0, 0.0, 0.0, 0.0]])
    greedy = TokenChooser(torch.zeros(2), 32, 4, ids)(logits, None)
    assert greedy.tokens.tolist() == [8, 3]
    temps = torch.tensor([1.0, 0.0])
    for k in (4, 2):  # the whole draft vocabulary in id order, and a top-k support
        choice = TokenChooser(temps, k, 4, ids)(logits, torch.tensor([0.99, 0.5]))
        assert choice.tokens[1] == 3  # the greedy row
        assert int(choice.tokens[0]) in set(choice.support_ids[0].tolist()) <= set(ids.tolist())
        # q on the support is the softmax over the drafter's columns (top-k renormalised)
        top = logits[0].topk(k).values if k < 4 else logits[0]
        assert torch.allclose(choice.support_probs[0].sort().values, torch.softmax(top, -1).sort().values)


def test_choose_draft_vocab_keeps_the_most_frequent_labels_and_the_always_ids():
    counts = torch.tensor([0, 5, 9, 1, 5, 0, 7])
    assert choose_draft_vocab(counts, 3).tolist() == [1, 2, 6]  # a tie goes to the lower id
    assert choose_draft_vocab(counts, 3, always=(5,)).tolist() == [2, 5, 6]
    assert choose_draft_vocab(counts, 7).tolist() == list(range(7))
