"""Losses on hand examples: anchors, cumulative supervision, position weights, normalisation, TV and soft labels,
and the Eagle3 training-time-test unroll against the inference chain."""

from __future__ import annotations

import math

import pytest
import torch

from dspark_core.drafters import DrafterConfig, build_drafter
from dspark_core.errors import InvalidArgument
from dspark_core.training import losses as L


def test_position_weights_paper_and_reference_forms():
    ref = L.position_weights(7, 4.0)
    paper = L.position_weights(7, None)
    for j in range(7):
        assert ref[j].item() == pytest.approx(math.exp(-j / 4))  # DeepSpec: exp(-k/4), k from 0
        assert paper[j].item() == pytest.approx(math.exp(-((j + 1) - 1) / 7))  # paper: exp(-(k-1)/gamma), k from 1


def test_anchors_need_two_response_tokens_and_are_seeded():
    mask = torch.tensor([0, 0, 1, 1, 1, 0, 1, 1, 0, 1], dtype=torch.bool)
    assert L.sample_anchors(mask, 10).tolist() == [2, 3, 6]  # p with mask[p] = mask[p + 1] = 1
    long = torch.ones(200, dtype=torch.bool)
    a = L.sample_anchors(long, 16, torch.Generator().manual_seed(3))
    b = L.sample_anchors(long, 16, torch.Generator().manual_seed(3))
    c = L.sample_anchors(long, 16, torch.Generator().manual_seed(4))
    assert a.tolist() == b.tolist() != c.tolist()
    assert len(a) == 16 and a.tolist() == sorted(set(a.tolist())) and int(a.max()) <= 198
    assert L.sample_anchors(long, 300, max_position=50).tolist() == list(range(51))
    with pytest.raises(InvalidArgument, match="num_anchors"):
        L.sample_anchors(long, 0)


def test_block_labels_and_cumulative_supervision_mask():
    ids = torch.arange(100, 110)[None]  # x[p] = 100 + p
    mask = torch.tensor([[0, 0, 0, 1, 1, 1, 1, 0, 1, 1]], dtype=torch.bool)
    anchors = torch.tensor([[3, 5, 8, 0]])
    valid = torch.tensor([[True, True, True, False]])
    t = L.block_targets(ids, mask, anchors, valid, gamma=4, decay=4.0)
    assert t.supervised.tolist() == [[
        [True, True, True, False],  # labels at 4, 5, 6 are response tokens, 7 is not
        [True, False, False, False],  # 6 ok, 7 not: 8 and 9 are cut although they are response tokens
        [True, False, False, False],  # 9 ok, 10 does not exist
        [False, False, False, False],  # padding anchor
    ]]
    assert t.labels[0, 0, :3].tolist() == [104, 105, 106] and t.labels[0, 2, 0].item() == 109
    w = [math.exp(-j / 4) for j in range(4)]
    assert t.weights[0, 0].tolist() == pytest.approx([w[0], w[1], w[2], 0.0])


def _one_hot_lm(v: int) -> torch.Tensor:
    return torch.eye(v)  # lm_head = identity: final_hidden rows are the target logits


def test_ce_is_normalised_by_the_sum_of_weights():
    ids = torch.tensor([[5, 0, 1, 2, 3]])
    mask = torch.tensor([[0, 1, 1, 1, 1]], dtype=torch.bool)
    anchors, valid = torch.tensor([[1]]), torch.tensor([[True]])
    t = L.block_targets(ids, mask, anchors, valid, gamma=2, decay=4.0)  # labels x[2], x[3] = 1, 2
    logits = torch.randn(1, 1, 2, 6)
    cfg = L.LossConfig(kind="dflash")
    s = L.dspark_loss_sums(logits, None, t, torch.zeros(1, 5, 6), anchors, _one_hot_lm(6), cfg)
    ce = [-torch.log_softmax(logits[0, 0, j], -1)[lab].item() for j, lab in enumerate([1, 2])]
    w = [1.0, math.exp(-1 / 4)]
    assert s.num["ce"].item() == pytest.approx(w[0] * ce[0] + w[1] * ce[1], rel=1e-5)
    assert s.den["ce"].item() == pytest.approx(sum(w))
    assert s.total().item() == pytest.approx((w[0] * ce[0] + w[1] * ce[1]) / sum(w), rel=1e-5)
    assert set(s.num) == {"ce"}  # DFlash: CE only


def test_tv_and_soft_label_on_a_hand_example():
    # target (0.7, 0.3) at position p + j = 1, draft (0.5, 0.5): L1 = 0.4, c* = 1 - 0.2 = 0.8
    ids = torch.tensor([[0, 1, 0]])
    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    anchors, valid = torch.tensor([[1]]), torch.tensor([[True]])
    t = L.block_targets(ids, mask, anchors, valid, gamma=1, decay=4.0)
    final_hidden = torch.zeros(1, 3, 2)
    final_hidden[0, 1] = torch.tensor([0.7, 0.3]).log()
    logits = torch.zeros(1, 1, 1, 2)  # uniform draft
    conf = torch.tensor([[[0.3]]])
    s = L.dspark_loss_sums(logits, conf, t, final_hidden, anchors, _one_hot_lm(2), L.LossConfig())
    v = s.values()
    assert v["tv"] == pytest.approx(0.4, abs=1e-6)
    assert v["accept"] == pytest.approx(0.8, abs=1e-6)
    bce = -(0.8 * math.log(torch.sigmoid(torch.tensor(0.3)).item())
            + 0.2 * math.log(1 - torch.sigmoid(torch.tensor(0.3)).item()))
    assert v["conf"] == pytest.approx(bce, rel=1e-5)
    assert v["ce"] == pytest.approx(math.log(2), rel=1e-6)
    assert s.total().item() == pytest.approx(0.1 * math.log(2) + 0.9 * 0.4 + 1.0 * bce, rel=1e-5)


def test_tv_is_zero_and_soft_label_one_when_draft_equals_target():
    g = torch.Generator().manual_seed(0)
    b, s_len, v, gamma = 2, 9, 11, 3
    ids = torch.randint(0, v, (b, s_len), generator=g)
    mask = torch.ones(b, s_len, dtype=torch.bool)
    anchors = torch.tensor([[0, 2, 4], [1, 3, 5]])
    valid = torch.ones(2, 3, dtype=torch.bool)
    t = L.block_targets(ids, mask, anchors, valid, gamma, 4.0)
    final_hidden = torch.randn(b, s_len, v, generator=g)
    pos = L.block_target_positions(anchors, gamma)  # slot j's target comes from position p + j
    logits = final_hidden[torch.arange(b)[:, None, None], pos].clone().requires_grad_(True)
    conf = torch.zeros(b, 3, gamma, requires_grad=True)
    s = L.dspark_loss_sums(logits, conf, t, final_hidden, anchors, _one_hot_lm(v), L.LossConfig())
    assert s.num["tv"].item() == pytest.approx(0.0, abs=1e-5)
    assert s.values()["accept"] == pytest.approx(1.0, abs=1e-6)
    s.total().backward()  # the soft label is detached: only the BCE reaches the confidence logits
    assert conf.grad is not None and logits.grad is not None


def test_soft_label_matches_the_truncated_tempered_draft_inference_samples_from():
    # draft logits (2, 1, 0, -9): top-2 support at T = 1 is q = softmax(2, 1) on tokens 0, 1
    draft = torch.tensor([[2.0, 1.0, 0.0, -9.0]])
    target = torch.tensor([[0.0, 1.0, 1.5, 0.0]])
    p = torch.softmax(target, -1)[0]
    q2 = torch.softmax(torch.tensor([2.0, 1.0]), -1)
    want = float(torch.minimum(p[:2], q2).sum())  # sum_x min(p, q): tokens 2, 3 have q = 0
    assert L.acceptance_probability(draft, target, 1.0, 2).item() == pytest.approx(want, rel=1e-6)
    full = float(torch.minimum(p, torch.softmax(draft, -1)[0]).sum())
    assert L.acceptance_probability(draft, target, 1.0, None).item() == pytest.approx(full, rel=1e-6)
    assert L.acceptance_probability(draft, target, 1.0, 4).item() == pytest.approx(full, rel=1e-6)
    # temperature applies to both distributions
    pt, qt = torch.softmax(target / 0.5, -1)[0], torch.softmax(draft / 0.5, -1)[0]
    assert L.acceptance_probability(draft, target, 0.5).item() == pytest.approx(float(torch.minimum(pt, qt).sum()),
                                                                               rel=1e-6)
    # support 1: the draft is its argmax, accepted with the target's probability of it
    assert L.acceptance_probability(draft, target, 1.0, 1).item() == pytest.approx(float(p[0]), rel=1e-6)


def test_confidence_loss_uses_the_truncated_label_and_leaves_tv_full():
    # target (0.5, 0.3, 0.2) at position 1, draft (0.4, 0.35, 0.25): top-1 support -> q = (1, 0, 0), c* = 0.5
    ids = torch.tensor([[0, 1, 0]])
    mask = torch.tensor([[1, 1, 1]], dtype=torch.bool)
    anchors, valid = torch.tensor([[1]]), torch.tensor([[True]])
    t = L.block_targets(ids, mask, anchors, valid, gamma=1, decay=4.0)
    final_hidden = torch.zeros(1, 3, 3)
    final_hidden[0, 1] = torch.tensor([0.5, 0.3, 0.2]).log()
    logits = torch.tensor([0.4, 0.35, 0.25]).log().reshape(1, 1, 1, 3)
    conf = torch.tensor([[[0.0]]])
    s = L.dspark_loss_sums(logits, conf, t, final_hidden, anchors, _one_hot_lm(3), L.LossConfig(confidence_support=1))
    v = s.values()
    assert v["accept"] == pytest.approx(0.5, abs=1e-6)
    assert v["tv"] == pytest.approx(0.2, abs=1e-6)  # full L1 |0.4-0.5| + |0.35-0.3| + |0.25-0.2|
    assert v["conf"] == pytest.approx(math.log(2), rel=1e-5)  # BCE(sigmoid(0) = 0.5, 0.5)
    full = L.dspark_loss_sums(logits, conf, t, final_hidden, anchors, _one_hot_lm(3), L.LossConfig()).values()
    assert full["accept"] == pytest.approx(0.9, abs=1e-6)


def test_sums_over_micro_batches_equal_one_big_batch():
    g = torch.Generator().manual_seed(1)
    v, gamma = 7, 3
    ids = torch.randint(0, v, (2, 8), generator=g)
    mask = torch.tensor([[0, 0, 1, 1, 1, 1, 1, 1], [0, 1, 1, 1, 1, 0, 0, 0]], dtype=torch.bool)
    anchors, valid = torch.tensor([[2, 4], [1, 2]]), torch.ones(2, 2, dtype=torch.bool)
    logits, hid = torch.randn(2, 2, gamma, v, generator=g), torch.randn(2, 8, v, generator=g)
    conf = torch.randn(2, 2, gamma, generator=g)
    cfg, lm = L.LossConfig(), _one_hot_lm(v)

    def sums(sl):
        t = L.block_targets(ids[sl], mask[sl], anchors[sl], valid[sl], gamma, 4.0)
        return L.dspark_loss_sums(logits[sl], conf[sl], t, hid[sl], anchors[sl], lm, cfg)

    whole, a, b = sums(slice(0, 2)), sums(slice(0, 1)), sums(slice(1, 2))
    den = {k: a.den[k] + b.den[k] for k in a.den}
    for k in whole.num:
        torch.testing.assert_close(a.num[k] + b.num[k], whole.num[k])
        torch.testing.assert_close(den[k], whole.den[k])
    combined = a.total(den) + b.total(den)  # what the trainer does: local numerators over global denominators
    torch.testing.assert_close(combined, whole.total())


def test_loss_config_validates_with_field_names():
    assert (L.LossConfig().ce_weight, L.LossConfig().tv_weight, L.LossConfig().confidence_weight) == (0.1, 0.9, 1.0)
    assert L.LossConfig(kind="dflash").tv_weight == 0.0
    with pytest.raises(InvalidArgument, match="tv_weight"):
        L.LossConfig(tv_weight=-1.0)
    with pytest.raises(InvalidArgument, match="kind"):
        L.LossConfig(kind="medusa")
    with pytest.raises(InvalidArgument, match="position_decay"):
        L.LossConfig(position_decay=0)
    with pytest.raises(InvalidArgument, match="confidence_support"):
        L.LossConfig(confidence_support=0)
    with pytest.raises(InvalidArgument, match="confidence_temperature"):
        L.LossConfig(confidence_temperature=0.0)


# ---- Eagle3 ------------------------------------------------------------------------------------


def _eagle3(gamma=3, seed=0):
    cfg = DrafterConfig(architecture="Qwen3Eagle3Model", vocab_size=40, hidden_size=32, intermediate_size=48,
                        num_attention_heads=4, num_key_value_heads=2, head_dim=8, num_hidden_layers=1,
                        target_layer_ids=(0, 1), ttt_length=gamma, step_loss_decay=0.8)
    torch.manual_seed(seed)
    return build_drafter(cfg).eval()


def test_ttt_unroll_equals_extend_then_teacher_forced_chain():
    d = _eagle3(gamma=3)
    g = torch.Generator().manual_seed(0)
    s = 10
    ids = torch.randint(0, 40, (1, s), generator=g)
    feats = torch.randn(1, s, 64, generator=g)
    with torch.no_grad():
        steps = d.ttt_forward(ids, feats)
        assert len(steps) == 3 and steps[0].shape == (1, s - 1, 32)
        for p in (0, 3, 6):  # row p: committed rows 0..p, anchor x[p + 1] at position p + 1
            state = d.new_state()
            d.extend([state], [feats[0, : p + 1]], [ids[0, 1: p + 2].tolist()], [0])
            chain = d.chain([state], torch.tensor([p + 1]), teacher_tokens=ids[:, p + 2: p + 4])
            for k in range(3):
                torch.testing.assert_close(steps[k][0, p], chain.hidden[0, k], atol=1e-5, rtol=1e-5)


def test_ttt_targets_shift_and_cumulate():
    mask = torch.tensor([[0, 0, 1, 1, 1, 0]], dtype=torch.bool)
    t = L.ttt_targets(mask, 2)
    # step s, row p predicts position p + 2 + s
    assert t.mask[0, 0].tolist() == [True, True, True, False, False]
    assert t.mask[0, 1].tolist() == [True, True, False, False, False]
    assert L.ttt_denominators(t)["soft_ce"].tolist() == [3.0, 2.0]


def test_eagle3_soft_ce_equals_target_entropy_when_draft_matches():
    g = torch.Generator().manual_seed(2)
    b, s, v, gamma = 1, 7, 9, 2
    mask = torch.ones(b, s, dtype=torch.bool)
    t = L.ttt_targets(mask, gamma)
    hid = torch.randn(b, s, v, generator=g)
    # step k, row p: target distribution from position p + 1 + k
    logits = [hid[:, 1 + k: 1 + k + s - 1].clone() if 1 + k + s - 1 <= s else
              torch.cat((hid[:, 1 + k:], torch.zeros(b, k, v)), 1) for k in range(gamma)]
    sums = L.eagle3_loss_sums(logits, t, hid, _one_hot_lm(v), L.LossConfig(kind="eagle3"))
    for k in range(gamma):
        rows = t.mask[0, k].nonzero().flatten()
        p = torch.softmax(hid[0, rows + 1 + k], -1)
        entropy = -(p * p.log()).sum()
        assert sums.num["soft_ce"][k].item() == pytest.approx(entropy.item(), rel=1e-5)
    assert sums.coef["soft_ce"].tolist() == pytest.approx([1.0, 0.8])
    assert sums.values()["accept"] == pytest.approx(1.0, abs=1e-6)


def test_greedy_confidence_label_is_argmax_agreement():
    # two slots: slot 0's draft argmax (token 1) matches the target's argmax, slot 1's (token 0) does not
    ids = torch.tensor([[0, 1, 2, 0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    anchors, valid = torch.tensor([[1]]), torch.tensor([[True]])
    t = L.block_targets(ids, mask, anchors, valid, gamma=2, decay=4.0)
    final_hidden = torch.zeros(1, 4, 3)
    final_hidden[0, 1] = torch.tensor([0.2, 0.5, 0.3]).log()  # target at slot 0: argmax 1
    final_hidden[0, 2] = torch.tensor([0.3, 0.3, 0.4]).log()  # target at slot 1: argmax 2
    logits = torch.tensor([[0.1, 0.8, 0.1], [0.6, 0.1, 0.3]]).log().reshape(1, 1, 2, 3)
    conf, gconf = torch.zeros(1, 1, 2), torch.tensor([[[1.5, -0.5]]])
    s = L.dspark_loss_sums(logits, conf, t, final_hidden, anchors, _one_hot_lm(3), L.LossConfig(), gconf)
    w = [1.0, math.exp(-1 / 4)]
    bce = [-math.log(torch.sigmoid(torch.tensor(1.5)).item()),  # label 1
           -math.log(1 - torch.sigmoid(torch.tensor(-0.5)).item())]  # label 0
    assert s.num["gconf"].item() == pytest.approx(w[0] * bce[0] + w[1] * bce[1], rel=1e-5)
    assert s.coef["gconf"].item() == s.coef["conf"].item() == 1.0
    assert L.dspark_term_names(L.LossConfig(), True, True)[-1] == "gconf"
    assert "gconf" not in L.dspark_loss_sums(logits, conf, t, final_hidden, anchors, _one_hot_lm(3),
                                             L.LossConfig()).num
