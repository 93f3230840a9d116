"""Our CPU kernels (dspark_core/kernels): the row-by-row attention against PyTorch's SDPA, its batch invariance,
and its refusals. (The integer matmuls are tested with the GGUF blocks in test_packed_weights.py.)"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dspark_core.kernels import parallel_min_work, q8dot_unavailable

WHY = q8dot_unavailable()
pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(WHY is not None, reason=f"CPU kernels: {WHY}")]


def _attn(q, k, v, lengths, scale):
    return torch.ops.dspark_cpu.row_attention(q, k, v, torch.tensor(lengths, dtype=torch.long), scale)


@pytest.mark.parametrize("d,h,kvh", [(64, 9, 3), (16, 4, 4), (128, 8, 2)])
def test_row_attention_is_sdpa_over_each_rows_keys(d, h, kvh):
    torch.manual_seed(0)
    n, rows, kv = 3, 5, 70
    q = torch.randn(n, h, rows, d)
    # the cache's layout: a view into a longer buffer, heads-major, strided
    kbuf, vbuf = torch.randn(n, kvh, kv + 30, d) * 3, torch.randn(n, kvh, kv + 30, d)
    k, v = kbuf[:, :, :kv], vbuf[:, :, :kv]
    lengths = [[66, 67, 68, 69, 70], [1, 2, 0, 0, 0], [10, 30, 50, 70, 33]]
    out = _attn(q, k, v, lengths, d ** -0.5)
    for r in range(n):
        for i in range(rows):
            n_keys = lengths[r][i]
            if n_keys == 0:
                assert torch.equal(out[r, :, i], torch.zeros(h, d))  # a padded row
                continue
            ref = F.scaled_dot_product_attention(q[r:r + 1, :, i:i + 1], k[r:r + 1, :, :n_keys],
                                                 v[r:r + 1, :, :n_keys], scale=d ** -0.5, enable_gqa=kvh != h)
            assert torch.allclose(out[r, :, i], ref[0, :, 0], atol=2e-6, rtol=1e-5), (r, i)


def test_a_rows_attention_does_not_depend_on_what_shares_its_call():
    torch.manual_seed(1)
    h, kvh, d, kv = 9, 3, 64, 200
    q, k, v = torch.randn(2, h, 8, d), torch.randn(2, kvh, kv, d), torch.randn(2, kvh, kv, d)
    lengths = [[193 + i for i in range(8)], [100, 120, 140, 160, 180, 200, 0, 0]]
    full = _attn(q, k, v, lengths, 0.125)
    for r in range(2):
        for i in range(8):
            alone = _attn(q[r:r + 1, :, i:i + 1], k[r:r + 1, :, : max(lengths[r][i], 1)],
                          v[r:r + 1, :, : max(lengths[r][i], 1)], [[lengths[r][i]]], 0.125)
            assert torch.equal(alone[0, :, 0], full[r, :, i]), (r, i)
    torch.set_num_threads(2)
    try:
        with parallel_min_work(0):  # split even this small call between the threads
            assert torch.equal(_attn(q, k, v, lengths, 0.125), full)  # threads split rows, never a row
    finally:
        torch.set_num_threads(1)


@pytest.mark.parametrize("threads", [1, 2])
def test_a_prefills_rows_get_their_one_row_bits_across_the_kernels_row_blocks(threads):
    """The kernel takes up to 8 rows of a sequence at a time (fewer when threads would idle), sharing each block of
    keys and values between them: every row of a 19-row prefill, with lengths that end inside, at and past a
    block of 16 keys, must still equal the row scored alone."""
    torch.manual_seed(7)
    h, kvh, d, rows = 9, 3, 64, 19
    kv = 40
    q, k, v = torch.randn(1, h, rows, d), torch.randn(1, kvh, kv, d) * 2, torch.randn(1, kvh, kv, d)
    lengths = [[22 + i for i in range(rows)]]  # 22 .. 40: a partial, a full and a second partial key block
    lengths[0][5] = 0  # a padded row among them
    torch.set_num_threads(threads)
    try:
        with parallel_min_work(0):
            full = _attn(q, k, v, lengths, 0.125)
    finally:
        torch.set_num_threads(1)
    for i in range(rows):
        n_keys = lengths[0][i]
        alone = _attn(q[:, :, i:i + 1], k[:, :, :max(n_keys, 1)], v[:, :, :max(n_keys, 1)], [[n_keys]], 0.125)
        assert torch.equal(alone[0, :, 0], full[0, :, i]), i


@pytest.mark.parametrize("d", [64, 128, 48])
@pytest.mark.parametrize("group", [1, 2, 3, 4])
def test_a_head_gets_the_same_bits_alone_or_with_its_group(d, group):
    """The kernel runs the query heads of one key head together (and unrolls common head sizes); each head must
    still be computed exactly as alone."""
    torch.manual_seed(group)
    kvh, kv = 2, 45
    h = group * kvh
    q, k, v = torch.randn(2, h, 3, d), torch.randn(2, kvh, kv, d), torch.randn(2, kvh, kv, d)
    lengths = [[45, 17, 16], [3, 0, 33]]
    full = _attn(q, k, v, lengths, d ** -0.5)
    for hh in range(h):
        g = hh // group
        alone = _attn(q[:, hh:hh + 1], k[:, g:g + 1], v[:, g:g + 1], lengths, d ** -0.5)
        assert torch.equal(alone[:, 0], full[:, hh]), hh


@pytest.mark.parametrize("d", [64, 48])
def test_sixteen_keys_scored_at_once_equal_one_at_a_time(d):
    """Blocks of 16 keys reduce their dot products together (reduce_add16), a shorter tail one key at a time
    (reduce_add): both must give every key the same score. A 16th key whose weight underflows to exactly 0 makes
    the 16-key call (one block) comparable with the 15-key call (all tail)."""
    torch.manual_seed(d)
    q, k, v = torch.randn(1, 1, 1, d), torch.randn(1, 1, 16, d), torch.randn(1, 1, 16, d)
    k[0, 0, 15] = -1000.0 * q[0, 0, 0] / q[0, 0, 0].dot(q[0, 0, 0])  # score -1000 * scale: exp gives 0
    assert torch.equal(_attn(q, k, v, [[16]], 0.125), _attn(q, k[:, :, :15], v[:, :, :15], [[15]], 0.125))


def test_the_rows_major_output_is_the_same_attention_laid_out_for_the_output_projection():
    torch.manual_seed(3)
    n, h, kvh, rows, d = 2, 9, 3, 4, 64
    q, k, v = torch.randn(n, h, rows, d), torch.randn(n, kvh, 30, d), torch.randn(n, kvh, 30, d)
    lengths = torch.tensor([[27, 28, 29, 30], [5, 0, 1, 2]])
    heads = torch.ops.dspark_cpu.row_attention(q, k, v, lengths, 0.125)
    flat = torch.ops.dspark_cpu.row_attention_rows(q, k, v, lengths, 0.125)
    assert flat.shape == (n * rows, h * d) and flat.is_contiguous()
    assert torch.equal(flat, heads.transpose(1, 2).reshape(n * rows, h * d))


def test_kv_append_writes_one_slot_and_returns_the_views_attention_reads():
    slots, kvh, cap, d = 3, 2, 10, 16
    k_store, v_store = torch.zeros(slots, kvh, cap, d), torch.zeros(slots, kvh, cap, d)
    before_k, before_v = k_store.clone(), v_store.clone()
    k_new = torch.randn(1, kvh, 8, d)[:, :, 2:5]  # a strided view: 3 new positions
    v_new = torch.randn(1, kvh, 3, d)
    keys, values = torch.ops.dspark_cpu.kv_append(k_store, v_store, k_new, v_new, 1, 4, 7)
    before_k[1, :, 4:7], before_v[1, :, 4:7] = k_new[0], v_new[0]
    assert torch.equal(k_store, before_k) and torch.equal(v_store, before_v)  # only slot 1, positions 4-6
    assert keys.shape == (1, kvh, 7, d) and keys.data_ptr() == k_store[1].data_ptr()  # views, no copies
    assert torch.equal(keys, k_store[1:2, :, :7]) and torch.equal(values, v_store[1:2, :, :7])
    for bad, match in (((3, 0, 3), "slot 3 out of range"), ((0, 8, 10), "out of the capacity"),
                       ((0, 4, 6), "out of the capacity"), ((-1, 0, 3), "slot -1")):
        with pytest.raises(RuntimeError, match=match):
            torch.ops.dspark_cpu.kv_append(k_store, v_store, k_new, v_new, *bad)
    with pytest.raises(RuntimeError, match="new keys / values"):
        torch.ops.dspark_cpu.kv_append(k_store, v_store, torch.randn(1, kvh, 3, 8), v_new, 0, 0, 3)
    assert torch.equal(k_store, before_k)  # refused calls wrote nothing


def test_extreme_scores_stay_finite_and_exact_where_one_key_dominates():
    q = torch.zeros(1, 1, 1, 16)
    q[..., 0] = 1000.0
    k = torch.zeros(1, 1, 3, 16)
    k[0, 0, 1, 0] = 1.0  # score 1000 against 0 and 0: all weight on key 1
    v = torch.arange(48, dtype=torch.float32).reshape(1, 1, 3, 16)
    out = _attn(q, k, v, [[3]], 1.0)
    assert torch.equal(out[0, 0, 0], v[0, 0, 1])


def test_bad_inputs_are_refused_by_name():
    q, k = torch.randn(1, 2, 1, 16), torch.randn(1, 2, 4, 16)
    with pytest.raises(RuntimeError, match="out of range"):
        _attn(q, k, k, [[5]], 1.0)
    with pytest.raises(RuntimeError, match="multiple of 16"):
        _attn(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 4, 8), torch.randn(1, 2, 4, 8), [[4]], 1.0)
    with pytest.raises(RuntimeError, match="float32"):
        _attn(q.double(), k, k, [[4]], 1.0)
    with pytest.raises(RuntimeError, match="lengths"):
        torch.ops.dspark_cpu.row_attention(q, k, k, torch.tensor([[4]], dtype=torch.int32), 1.0)


def test_rms_norm_and_swiglu_are_the_formulas():
    torch.manual_seed(3)
    x, w = torch.randn(5, 576) * 4, torch.randn(576)
    ref = w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5))
    torch.testing.assert_close(torch.ops.dspark_cpu.rms_norm(x, w, 1e-5), ref, atol=1e-5, rtol=1e-5)
    gu = torch.randn(3, 2 * 1536) * 6
    gu[0, :4] = torch.tensor([-100.0, 100.0, 0.0, -1e-8])  # the gate's far tails
    got = torch.ops.dspark_cpu.silu_mul(gu)
    torch.testing.assert_close(got, F.silu(gu[:, :1536]) * gu[:, 1536:], atol=1e-5, rtol=1e-5)
    assert torch.isfinite(got).all()
    with pytest.raises(RuntimeError, match="multiple of 16"):
        torch.ops.dspark_cpu.rms_norm(torch.randn(2, 40), torch.randn(40), 1e-5)


def test_the_gates_exp_holds_its_relative_accuracy_over_the_whole_float_range():
    # silu(g) / g = sigmoid(g) = 1 / (1 + exp(-g)): exp from e^-88.6 (near the smallest normal) to e^88.6 (near
    # the largest float, where 2^n alone would overflow in the AVX2 build's two-factor scaling)
    g = torch.linspace(-88.6, 88.6, 8192)
    g = g[g.abs() > 1e-3]
    gu = torch.cat([g, torch.ones_like(g)]).reshape(1, -1)
    out = torch.ops.dspark_cpu.silu_mul(gu)[0]
    torch.testing.assert_close(out / g, torch.sigmoid(g), rtol=2e-6, atol=2e-45)
    huge = torch.ops.dspark_cpu.silu_mul(torch.tensor([[-1e4, 1e4, -89.0, 89.0] + [0.0] * 12 + [1.0] * 16]))[0, :4]
    assert torch.equal(huge, torch.tensor([-0.0, 1e4, -0.0, 89.0]))  # exp underflows to 0, overflows to inf


@pytest.mark.parametrize("d", [64, 16])  # vector lanes, and the one-lane path of small heads
def test_rope_split_is_bitwise_the_lean_decoders_rope(d):
    from dspark_core.fast_decoder import _rope

    torch.manual_seed(4)
    n, q, h, kvh = 2, 3, 9, 3
    qkv = torch.randn(n * q, (h + 2 * kvh) * d)
    cos, sin = torch.randn(n, q, d), torch.randn(n, q, d)
    qs, ks, vs = torch.ops.dspark_cpu.rope_split(qkv, cos, sin, n, h, kvh)
    heads = qkv.view(n, q, h + 2 * kvh, d)
    qk = _rope(heads[:, :, : h + kvh].transpose(1, 2), cos[:, None], sin[:, None])
    assert torch.equal(qs, qk[:, :h]) and torch.equal(ks, qk[:, h:])
    assert torch.equal(vs, heads[:, :, h + kvh:].transpose(1, 2))
    with pytest.raises(RuntimeError, match="does not split"):
        torch.ops.dspark_cpu.rope_split(qkv, cos, sin, 4, h, kvh)
