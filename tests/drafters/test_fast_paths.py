"""The drafter's inference shortcuts compute what the plain path computes: the RoPE table, block keys written
into cache room instead of concatenated, and low-precision matmul copies (close, and never touching weights
or training)."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from dspark_core.drafters import ProposeItem, load_drafter
from dspark_core.drafters import layers
from dspark_core.drafters.config import DrafterConfig
from dspark_core.drafters.checkpoint import cpu_has_native_bf16, resolve_matmul_dtype
from dspark_core.drafters.kv_cache import KVCache, pad_caches
from dspark_core.drafters.layers import RopeTable, matmul_dtype_name, rope_cos_sin, set_matmul_dtype
from dspark_core.errors import InvalidArgument


def test_rope_table_is_bitwise_rope_cos_sin_and_grows():
    table = RopeTable(head_dim=16, theta=10000.0)
    for top in (5, 300, 1000):  # 300 and 1000 force growth past the first 256 rows
        positions = torch.randint(0, top, (3, 7))
        cos, sin = table(positions, torch.float32)
        ref_cos, ref_sin = rope_cos_sin(positions, 16, 10000.0, torch.float32)
        assert torch.equal(cos, ref_cos) and torch.equal(sin, ref_sin)
    cos, _ = table(torch.tensor([3]), torch.bfloat16)  # another dtype rebuilds the table
    assert cos.dtype == torch.bfloat16


def test_fused_rms_norm_is_bitwise_the_reference_formula():
    torch.manual_seed(0)
    for size in (16, 64, 256):
        norm = layers.RMSNorm(size, 1e-6)
        norm.weight.data = torch.randn(size)
        for shape in ((1, 7, size), (3, 4, 5, size)):
            x = torch.randn(*shape) * 3
            assert torch.equal(norm(x), norm.reference(x))
    x = torch.randn(2, 16, dtype=torch.bfloat16)
    norm = layers.RMSNorm(16, 1e-6).to(torch.bfloat16)
    assert torch.equal(norm(x), norm.reference(x))  # other dtypes take the reference path itself


def test_cache_room_is_scratch_until_committed():
    cache = KVCache(1)
    k = torch.arange(2 * 3 * 4, dtype=torch.float32).view(2, 3, 4)
    cache.append(0, k, -k)
    cache.commit(3)
    keys, values = cache.with_room(0, 20, k)  # grows the buffers, keeps the committed rows
    assert keys.shape == (2, 23, 4) and torch.equal(keys[:, :3], k) and torch.equal(values[:, :3], -k)
    keys[:, 3:] = 99.0
    assert cache.length == 3 and torch.equal(cache.layer(0)[0], k)
    cache.append(0, k[:, :1] + 1, k[:, :1])  # the next append overwrites the scratch rows
    cache.commit(1)
    assert torch.equal(cache.layer(0)[0][:, 3], k[:, 0] + 1)


def test_pad_caches_room_matches_concatenation():
    like = torch.zeros(2, 0, 4)
    a, b = KVCache(1), KVCache(1)
    for cache, n in ((a, 3), (b, 5)):
        cache.append(0, torch.randn(2, n, 4), torch.randn(2, n, 4))
        cache.commit(n)
    for caches in ([a], [a, b]):
        plain_k, plain_v, valid = pad_caches(caches, 0, like)
        room_k, room_v, room_valid = pad_caches(caches, 0, like, room=2)
        assert room_k.shape[2] == plain_k.shape[2] + 2
        assert torch.equal(room_k[:, :, :-2], plain_k) and torch.equal(room_v[:, :, :-2], plain_v)
        assert (valid is None) == (room_valid is None)


def test_block_keys_in_cache_room_equal_concatenated_keys(fixtures_dir):
    drafter = load_drafter(fixtures_dir / "dspark", matmul_dtype="float32")
    st = drafter.new_state()
    feats = torch.randn(9, drafter.config.feature_size)
    drafter.extend_contexts([st.cache], [feats], [0])
    anchors, positions = torch.tensor([4]), torch.tensor([9])
    with torch.no_grad():
        got = drafter.forward_block([st.cache], anchors, positions)
        # the plain path: past keys / values concatenated with the block's own
        x = drafter.embed_tokens(drafter.block_input_ids(anchors))
        cos, sin = rope_cos_sin(positions[:, None] + torch.arange(drafter.block_size), drafter.config.head_dim,
                                drafter.config.rope_theta, torch.float32)
        for li, layer in enumerate(drafter.layers):
            past_k, past_v = (t.unsqueeze(0) for t in st.cache.layer(li))
            x, _, _ = layer(x, cos, sin, past_k, past_v, None)
        want = drafter.norm(x)
    assert torch.equal(got, want)
    assert st.cache.length == 9


def test_cli_matmul_choices_are_the_loaders():
    from dspark_cli.models import MATMUL_DTYPES as cli
    from dspark_core.drafters.checkpoint import MATMUL_DTYPES as core

    assert cli == core


def test_resolve_matmul_dtype():
    cpu, f32 = torch.device("cpu"), torch.float32
    assert resolve_matmul_dtype("float32", cpu, f32) is None
    assert resolve_matmul_dtype("bfloat16", cpu, f32) == torch.bfloat16
    assert resolve_matmul_dtype("bfloat16", cpu, torch.bfloat16) is None
    assert resolve_matmul_dtype("auto", torch.device("cuda"), f32) is None  # GPUs run the drafter in bf16 anyway
    assert resolve_matmul_dtype("auto", cpu, torch.bfloat16) is None
    from dspark_core.kernels import q8dot_unavailable

    fast = torch.int8 if layers.int8_matmul_available() else torch.bfloat16
    ours = torch.int8 if q8dot_unavailable() is None else None  # without native bf16: our kernels or nothing
    assert resolve_matmul_dtype("auto", cpu, f32) == (fast if cpu_has_native_bf16() else ours)
    with pytest.raises(InvalidArgument, match="drafter_matmul_dtype.*'fp8'"):
        resolve_matmul_dtype("fp8", cpu, f32)


def test_auto_on_a_cpu_without_native_bf16_is_our_kernels_alone(fixtures_dir, monkeypatch):
    """An AVX2-only CPU emulates bf16: `auto` there runs the drafter's int8 in our integer kernels only (they
    quantize activations to int8), never PyTorch's int8 kernel (bf16 activations) or a bf16 fallback."""
    _kernels_or_skip()
    from dspark_core.drafters import checkpoint

    monkeypatch.setattr(checkpoint, "cpu_has_native_bf16", lambda: False)
    assert resolve_matmul_dtype("auto", torch.device("cpu"), torch.float32) == torch.int8
    monkeypatch.setattr(layers, "MIN_INT8_WEIGHTS", 1)  # the fixture drafter is tiny
    drafter = load_drafter(fixtures_dir / "dspark")
    taken = [m for m in drafter.modules() if m.__dict__.get("matmul_dtype") == torch.int8]
    assert taken and matmul_dtype_name(drafter) == "int8"
    assert all(m.__dict__.get("matmul_q8dot") and m.__dict__.get("matmul_q8dot_only") for m in taken)
    assert not any(m.__dict__.get("matmul_fallback") or m.__dict__.get("matmul_dtype") == torch.bfloat16
                   for m in drafter.modules())
    calls = []
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(a))
    exact = load_drafter(fixtures_dir / "dspark", matmul_dtype="float32")
    feats = torch.randn(8, exact.config.feature_size)
    items = lambda st: [ProposeItem(st, feats, 0, [1] * 8, 3, 8, 0.0, None)]  # noqa: E731
    got, want = drafter.draft(items(drafter.new_state())), exact.draft(items(exact.new_state()))
    assert not calls and not torch.equal(got.logits, want.logits)  # it ran in ours
    torch.testing.assert_close(got.logits, want.logits, atol=0.05 * want.logits.abs().max().item(), rtol=0)
    # a layer our kernel cannot take (N % 16 != 0) stays in float32 rather than in PyTorch's int8
    odd = layers.Linear(256, 300).requires_grad_(False).eval()
    set_matmul_dtype(odd, torch.int8, native_bf16=False)
    assert odd.__dict__.get("matmul_dtype") is None


def test_low_precision_matmuls_are_close_and_leave_weights_alone(fixtures_dir, monkeypatch):
    exact = load_drafter(fixtures_dir / "dspark", matmul_dtype="float32")
    state = {k: v.clone() for k, v in exact.state_dict().items()}
    # the fixture drafter is tiny: below the size threshold nothing would switch, so lower it
    monkeypatch.setattr(layers, "MIN_LOW_PRECISION_WEIGHTS", 1)
    monkeypatch.setattr(layers, "MIN_LOW_PRECISION_REDUCTION", 1)
    low = load_drafter(fixtures_dir / "dspark", matmul_dtype="bfloat16")
    assert matmul_dtype_name(low) == "bfloat16" and matmul_dtype_name(exact) == "float32"
    st_e, st_l = exact.new_state(), low.new_state()
    feats = torch.randn(8, exact.config.feature_size)
    items = lambda st: [ProposeItem(st, feats, 0, [1] * 8, 3, 8, 0.0, None)]  # noqa: E731
    out_e, out_l = exact.draft(items(st_e)), low.draft(items(st_l))
    assert not torch.equal(out_e.logits, out_l.logits)  # it did run in bf16
    torch.testing.assert_close(out_l.logits, out_e.logits, atol=0.1, rtol=0.05)
    torch.testing.assert_close(out_l.confidence_logits, out_e.confidence_logits, atol=0.1, rtol=0.05)
    assert all(torch.equal(v, state[k]) for k, v in low.state_dict().items())
    assert all(v.dtype == torch.float32 for v in low.state_dict().values())
    # training ignores the copies: gradients reach the float32 parameters
    low.train().requires_grad_(True)
    ids = torch.randint(0, low.config.vocab_size, (1, 12))
    out = low.training_forward(ids, torch.randn(1, 12, low.config.feature_size), torch.tensor([[2, 5]]))
    out.logits.sum().backward()
    assert low.lm_head.weight.grad is not None and low.lm_head.weight.grad.dtype == torch.float32
    # and switching back restores the exact numbers
    set_matmul_dtype(low.eval().requires_grad_(False), None)
    st_b = low.new_state()
    assert torch.equal(low.draft(items(st_b)).logits, exact.draft(items(exact.new_state())).logits)


@pytest.mark.skipif(not layers.int8_matmul_available(), reason="this torch has no _weight_int8pack_mm")
def test_int8_matmuls_are_close_for_small_batches_and_fall_back_for_large_ones(monkeypatch):
    torch.manual_seed(0)
    lin = layers.Linear(256, 300).requires_grad_(False).eval()  # 76,800 weights
    set_matmul_dtype(lin, torch.int8)
    assert lin.__dict__["matmul_dtype"] == torch.int8 and "matmul_fallback" not in lin.__dict__
    x = torch.randn(2, 5, 256)
    with torch.no_grad():
        got, want = lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias)
    assert got.shape == want.shape and not torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)
    big = torch.randn(layers.INT8_MAX_ROWS + 1, 256)  # past the int8 row limit: the model dtype (no fallback)
    with torch.no_grad():
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight, lin.bias))
    q, scales = layers.quantize_int8(lin.weight)
    assert q.dtype == torch.int8 and q.abs().max() == 127 and scales.shape == (300,)
    torch.testing.assert_close(q.float() * scales.float()[:, None], lin.weight, atol=1e-2, rtol=0.01)


def test_int8_choice_by_layer_size():
    lm = layers.Linear(256, 4096)  # big: int8, bf16 beyond the row limit
    narrow = layers.Linear(32, 4096)  # a rank-32 Markov W2: the reduction is too short for either
    tiny = layers.Linear(288, 2)  # a confidence head's outputs
    for m in (lm, narrow, tiny):
        set_matmul_dtype(m, torch.int8)
    assert (lm.__dict__.get("matmul_dtype"), lm.__dict__.get("matmul_fallback")) == (torch.int8, torch.bfloat16)
    assert tiny.__dict__.get("matmul_dtype") is None
    from dspark_core.kernels import q8dot_unavailable

    if q8dot_unavailable() is None:  # our kernel takes the short reduction too, and only it (no PyTorch int8)
        assert narrow.__dict__.get("matmul_dtype") == torch.int8 and narrow.__dict__.get("matmul_q8dot_only")
        assert narrow.__dict__.get("matmul_fallback") is None
        narrow.eval()
        x = torch.randn(3, 32)
        with torch.no_grad():
            torch.testing.assert_close(narrow(x), torch.nn.functional.linear(x, narrow.weight, narrow.bias),
                                       atol=0.02, rtol=0.02)
            assert torch.equal(narrow(x[1:2]), narrow(x)[1:2])  # ours: rows batch-invariant (MKL's are not)
            assert not torch.equal(narrow(x), torch.nn.functional.linear(x, narrow.weight, narrow.bias))
    else:
        assert narrow.__dict__.get("matmul_dtype") is None
    assert matmul_dtype_name(lm) == "int8" and matmul_dtype_name(tiny) == "float32"
    set_matmul_dtype(lm, None)
    assert lm.__dict__.get("matmul_dtype") is None and lm.__dict__.get("matmul_fallback") is None


def test_int8_runs_in_our_integer_kernels_where_they_run():
    """On a CPU with AVX512-VNNI the drafter's int8 matmuls use dspark_core.kernels (Q8_0-style blocks of 32,
    int8 activations): close to float32, a row's result independent of its batch, the row limit kept."""
    from dspark_core.kernels import q8dot_unavailable

    if q8dot_unavailable() is not None:
        pytest.skip(f"CPU kernels: {q8dot_unavailable()}")
    torch.manual_seed(0)
    lin = layers.Linear(256, 320).requires_grad_(False).eval()
    set_matmul_dtype(lin, torch.int8)
    assert lin.__dict__.get("matmul_q8dot") is True
    x = torch.randn(7, 256)
    with torch.no_grad():
        got, want = lin(x), torch.nn.functional.linear(x, lin.weight, lin.bias)
        assert torch.equal(lin(x[2:3]), got[2:3])
        # past the kernel's row limit for this CPU (32 with AMX, 4,096 without): the model dtype
        big = torch.randn(layers.Q8DOT_MAX_ROWS + 1, 256)
        assert torch.equal(lin(big), torch.nn.functional.linear(big, lin.weight, lin.bias))
        mid = torch.randn(min(layers.Q8DOT_MAX_ROWS, 64), 256)  # within it: still ours, each row batch-invariant
        assert torch.equal(lin(mid)[5:6], lin(mid[5:6]))
    assert not torch.equal(got, want)
    torch.testing.assert_close(got, want, atol=0.02 * want.abs().max().item(), rtol=0)
    q, d = layers.quantize_q8_blocks(lin.weight)
    assert q.abs().max() == 127 and d.shape == (320, 8) and torch.equal(d, d.half().float())


def _layer_config(hidden: int, inter: int) -> DrafterConfig:
    return DrafterConfig(architecture="Qwen3DSparkModel", vocab_size=256, hidden_size=hidden, intermediate_size=inter,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_hidden_layers=1,
                         target_layer_ids=(0,), block_size=4, mask_token_id=0)


def _kernels_or_skip():
    from dspark_core.kernels import q8dot_unavailable

    if q8dot_unavailable() is not None:
        pytest.skip(f"CPU kernels: {q8dot_unavailable()}")


def test_a_decoder_layer_in_int8_runs_every_matmul_in_our_kernel(monkeypatch):
    """The MLP's children have two reductions (gate / up: hidden, down: intermediate); the fused gate / up
    still runs in our kernel (it once fell to PyTorch's int8 kernel, ~6x slower at 7 rows, because the
    module-level check wanted one reduction for all three)."""
    _kernels_or_skip()
    layer = layers.DecoderLayer(_layer_config(256, 512)).eval().requires_grad_(False)
    set_matmul_dtype(layer, torch.int8)
    assert layer.mlp.__dict__.get("matmul_q8dot")
    calls = []
    monkeypatch.setattr(torch.ops.aten, "_weight_int8pack_mm", lambda *a: calls.append(a))
    x = torch.randn(1, 5, 256)
    with torch.no_grad():
        got = layer.mlp(x)
    assert not calls
    want = layer.mlp.down_proj(torch.nn.functional.silu(x @ layer.mlp.gate_proj.weight.T) * (x @ layer.mlp.up_proj.weight.T))
    torch.testing.assert_close(got, want, atol=0.05 * want.abs().max().item(), rtol=0)


def test_inference_norms_and_full_attention_run_in_our_kernels_close_to_the_reference():
    _kernels_or_skip()
    torch.manual_seed(0)
    norm = layers.RMSNorm(64, 1e-6)
    norm.weight.data = torch.randn(64)
    x = torch.randn(2, 7, 64) * 3
    with torch.no_grad():
        got = norm(x)
        assert torch.equal(norm(x[1:]), got[1:])  # a row's result does not depend on its batch
    torch.testing.assert_close(got, norm.reference(x), atol=1e-5, rtol=1e-5)
    assert torch.equal(norm(x), norm.reference(x))  # with gradients (training): bitwise the reference
    attn = layers.DecoderLayer(_layer_config(64, 128)).eval().requires_grad_(False).self_attn
    q, k, v = torch.randn(2, 4, 7, 16), torch.randn(2, 2, 12, 16), torch.randn(2, 2, 12, 16)
    with torch.no_grad():
        got = attn.attend(q, k, v, None)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1),
                                                               scale=attn.scale)
        want = attn.o_proj(ref.transpose(1, 2).reshape(2, 7, 64))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


def test_the_markov_slot_kernel_gives_the_python_loops_drafts_bit_for_bit(monkeypatch):
    """Greedy rows of a vanilla Markov head with W2 in our int8 kernel: the slot loop runs in one C++ call
    (dspark_core/kernels/markov.cpp); its logits, tokens, previous tokens and confidences equal the loop's."""
    _kernels_or_skip()
    from pathlib import Path

    from dspark_core.drafters import heads

    d = load_drafter(Path(__file__).resolve().parents[2] / "models" / "dspark", matmul_dtype="int8")
    assert d.markov_head.markov_w2.__dict__.get("matmul_q8dot"), "the shipped tiny drafter's W2 should be int8 here"
    torch.manual_seed(0)

    def items():
        out = []
        for n in (5, 9, 12):
            feats = torch.randn(n, d.config.feature_size)
            toks = torch.randint(0, d.config.vocab_size, (n,)).tolist()
            out.append(ProposeItem(d.new_state(), feats, 0, toks, toks[-1], n, 0.0, None))
        return out

    calls = []
    real = heads.markov_slot_kernel

    def spy(*a):
        fn = real(*a)
        calls.append(fn is not None)
        return fn

    monkeypatch.setattr("dspark_core.drafters.dspark.markov_slot_kernel", spy)
    torch.manual_seed(1)
    fast = d.draft(items())
    monkeypatch.setattr("dspark_core.drafters.dspark.markov_slot_kernel", lambda *a: None)
    torch.manual_seed(1)
    slow = d.draft(items())
    assert calls == [True]
    for name in ("logits", "tokens", "prev_tokens", "confidence_logits", "greedy_confidence_logits"):
        a, b = getattr(fast, name), getattr(slow, name)
        assert (a is None) == (b is None) and (a is None or torch.equal(a, b)), name
    # a sampled row takes the sampled kernel; a coupled one (position-keyed race) keeps the Python loop
    calls.clear()
    monkeypatch.setattr("dspark_core.drafters.dspark.markov_slot_kernel", spy)
    sampled = items()
    sampled[0] = dataclasses.replace(sampled[0], temperature=1.0, generator=torch.Generator().manual_seed(0))
    d.draft(sampled)
    assert calls == [True]
    calls.clear()
    sampled = items()
    sampled[0] = dataclasses.replace(sampled[0], temperature=1.0, coupling_seed=5)
    d.draft(sampled)
    assert calls == []


def _markov_op_inputs(b: int, v: int, r: int = 32, seed: int = 0):
    from dspark_core.kernels import pack_q8

    gen = torch.Generator().manual_seed(seed)
    base = (torch.randn(1, 1, v, generator=gen) * 2).expand(b, 1, v).contiguous()
    w1 = torch.randn(v, r, generator=gen)
    w2 = torch.randn(v, r, generator=gen) * 0.1
    return base, w1, w2, pack_q8(*layers.quantize_q8_blocks(w2))


def test_the_sampled_markov_kernel_draws_from_exactly_the_support_it_reports():
    """markov_sample: the support is the top-k of base + W2 W1[prev] (the whole vocabulary when k = V), its
    probabilities the tempered softmax over it, and tokens drawn with the uniforms follow those probabilities;
    greedy rows take the argmax."""
    _kernels_or_skip()
    n, v = 20000, 64
    base, w1, w2, packed = _markov_op_inputs(n, v)
    anchors = torch.full((n,), 3, dtype=torch.long)
    temps = torch.full((n,), 0.8)
    temps[:5] = 0.0  # greedy rows among them
    uniforms = torch.rand(n, 1, generator=torch.Generator().manual_seed(1))
    logits = base[0, 0] + torch.ops.dspark_cpu.q8_mm.default(w1[3:4].contiguous(), packed, v)[0]
    for k in (16, v):
        got, tokens, prevs, ids, probs = torch.ops.dspark_cpu.markov_sample.default(
            base, w1, packed, v, anchors, torch.empty(0, dtype=torch.long), temps, uniforms, k)
        assert torch.equal(got[0, 0], logits) and torch.equal(prevs, anchors[:, None])
        top = logits.topk(k).indices
        assert set(ids[7, 0].tolist()) == set(top.tolist())
        want = torch.softmax(logits[ids[7, 0]] / 0.8, -1)
        torch.testing.assert_close(probs[7, 0], want, atol=1e-6, rtol=1e-5)
        assert torch.equal(tokens[:5, 0], logits.argmax().expand(5))
        sampled = tokens[5:, 0]
        q = dict(zip(ids[7, 0].tolist(), probs[7, 0].tolist()))
        assert all(q.get(t, 0.0) > 0 for t in sampled.unique().tolist())  # never a token outside, or with q = 0
        freq = torch.bincount(sampled, minlength=v).double() / sampled.numel()
        dense = torch.zeros(v, dtype=torch.float64)
        dense[ids[7, 0]] = probs[7, 0].double()
        assert 0.5 * (freq - dense).abs().sum() < 0.02  # TV of 20k draws against the reported q
    # a draft vocabulary: columns map to target ids, and the chosen id is the next slot's previous token
    id_map = torch.arange(v, dtype=torch.long) * 2
    w1_big = torch.randn(2 * v, 32)
    _, tokens, prevs, ids, _ = torch.ops.dspark_cpu.markov_sample.default(
        base[:4].repeat(1, 3, 1).contiguous(), w1_big, packed, v, anchors[:4], id_map, temps[:4] + 1.0,
        torch.rand(4, 3), 8)
    assert bool((tokens % 2 == 0).all()) and torch.equal(prevs[:, 1:], tokens[:, :-1]) and bool((ids % 2 == 0).all())
    with pytest.raises(RuntimeError, match="support must be in"):
        torch.ops.dspark_cpu.markov_sample.default(base[:1], w1, packed, v, anchors[:1], torch.empty(0, dtype=torch.long),
                                                   temps[:1], uniforms[:1], v + 1)
    with pytest.raises(RuntimeError, match="outside the Markov table"):
        torch.ops.dspark_cpu.markov_greedy.default(base[:1], w1, packed, v, torch.tensor([v]), torch.empty(0, dtype=torch.long))


def test_the_sampled_markov_kernels_support_is_the_exact_top_k_at_a_real_vocabulary_size():
    """markov_sample picks its support by a radix pass over the logits' top bits and a partial sort of one bucket:
    the same set as sorting every logit (larger first, NaN largest, ties to the lower column), for supports of
    1 .. V - 1 and logits that crowd into one bucket, tie, or are NaN."""
    _kernels_or_skip()
    from dspark_core.kernels import pack_q8

    v, r = 8192, 32
    gen = torch.Generator().manual_seed(3)
    w1 = torch.zeros(4, r)
    packed = pack_q8(*layers.quantize_q8_blocks(torch.zeros(v, r)))  # no Markov bias: the logits are `base`
    spread = torch.randn(v, generator=gen) * 4
    crowded = 1.0 + torch.rand(v, generator=gen) * 1e-3  # one exponent, nearly one bucket
    ties = torch.randint(0, 5, (v,), generator=gen).float()  # five values, thousands of ties each
    nans = spread.clone()
    nans[torch.randperm(v, generator=gen)[:40]] = float("nan")
    for logits in (spread, crowded, ties, nans):
        base = logits.view(1, 1, v).contiguous()
        order = sorted(range(v), key=lambda c: (0 if logits[c].isnan() else 1, -float(logits[c].nan_to_num()), c))
        for k in (1, 2, 255, 256, 4096, v - 1):
            ids = torch.ops.dspark_cpu.markov_sample.default(
                base, w1, packed, v, torch.tensor([0]), torch.empty(0, dtype=torch.long), torch.tensor([1.0]),
                torch.rand(1, 1, generator=gen), k)[3]
            assert sorted(ids[0, 0].tolist()) == sorted(order[:k]), k


def test_a_sampled_draft_through_the_kernel_reports_the_python_loops_distribution(monkeypatch):
    """The SmolLM2-sized path (a draft vocabulary, top-k < V) on the shipped tiny drafter with a smaller
    support: the kernel's support is the Python loop's as a set, with the same probabilities."""
    _kernels_or_skip()
    from pathlib import Path

    d = load_drafter(Path(__file__).resolve().parents[2] / "models" / "dspark", matmul_dtype="int8")
    d.support_size = 256
    torch.manual_seed(0)

    def items():
        out = []
        for j, n in enumerate((5, 9)):
            feats = torch.randn(n, d.config.feature_size, generator=torch.Generator().manual_seed(j))
            toks = torch.randint(0, d.config.vocab_size, (n,), generator=torch.Generator().manual_seed(j)).tolist()
            out.append(ProposeItem(d.new_state(), feats, 0, toks, toks[-1], n, 1.0, torch.Generator().manual_seed(j)))
        return out

    fast = d.draft(items())
    monkeypatch.setattr("dspark_core.drafters.dspark.markov_slot_kernel", lambda *a: None)
    slow = d.draft(items())
    assert fast.support_ids.shape == slow.support_ids.shape == (2, d.block_size, 256)
    # slot 0 reads the same previous token (the anchor) in both: the same q
    for i in range(2):
        a = dict(zip(fast.support_ids[i, 0].tolist(), fast.support_probs[i, 0].tolist()))
        b = dict(zip(slow.support_ids[i, 0].tolist(), slow.support_probs[i, 0].tolist()))
        assert a.keys() == b.keys() and max(abs(a[t] - b[t]) for t in a) < 1e-5
    for i in range(2):  # every drafted token is in its slot's support with q > 0
        for k in range(d.block_size):
            row = dict(zip(fast.support_ids[i, k].tolist(), fast.support_probs[i, k].tolist()))
            assert row.get(int(fast.tokens[i, k]), 0.0) > 0
