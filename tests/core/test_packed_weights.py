"""Packed target weights (`--weights`): GGUF blocks keep their codes, the kernels are batch-invariant, and every
format's speculative greedy output equals its own autoregressive output."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from dspark_core.engine import Engine, EngineConfig
from dspark_core.errors import InvalidArgument, ModelLoadError
from dspark_core import packed_weights
from dspark_core.kernels import amx_rows, q8dot_unavailable, quantize_activations
from dspark_core.packed_weights import (WEIGHT_FORMATS, Q8DotLinear, gguf_dequantize, gguf_linear, make_linear,
                                        packed_kernels_available)
from dspark_core.sampling import SamplingParams
from dspark_core.target import TargetConfig, TargetRuntime

from drafter_doubles import OracleDrafter

pytestmark = [pytest.mark.usefixtures("one_torch_thread"),
              pytest.mark.skipif(not packed_kernels_available(), reason="no int8/int4 CPU weight kernels")]
gguf = pytest.importorskip("gguf")
Q = gguf.GGMLQuantizationType
PROMPTS = [[5, 9, 12, 30, 41], [7, 7, 8], [100, 3, 19, 22, 23, 24, 60, 61, 90], [2]]
PACKED = ("bfloat16", "int8", "int4")
# `gguf` blocks through each kernel: ours (q8dot, int8 activations) where the CPU has AVX512-VNNI, PyTorch's int4
NO_Q8DOT = q8dot_unavailable()
KERNELS = [pytest.param("q8dot", marks=pytest.mark.skipif(NO_Q8DOT is not None, reason=f"q8dot: {NO_Q8DOT}")),
           "torch"]
GGUF = [pytest.param("gguf-q8dot", marks=pytest.mark.skipif(NO_Q8DOT is not None, reason=f"q8dot: {NO_Q8DOT}")),
        "gguf-torch"]


def _blocks(w: torch.Tensor, qtype) -> torch.Tensor:
    return torch.from_numpy(gguf.quants.quantize(w.numpy(), qtype))


# -- the blocks and the kernels

@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_gguf_blocks_keep_their_codes(qtype, kernel):
    torch.manual_seed(0)
    w = torch.randn(32, 128) * 0.1
    raw = _blocks(w, Q[qtype])
    ggml = torch.from_numpy(gguf.quants.dequantize(raw.numpy(), Q[qtype]))
    # our reading of the blocks is ggml's (what `dspark models import-gguf` stored as float32)
    assert torch.equal(gguf_dequantize(raw, qtype, (32, 128)), ggml)
    lin = gguf_linear(raw, qtype, (32, 128), kernel=kernel)
    served = lin.dequantized()
    if kernel == "q8dot":  # codes, fp16 scales and mins exactly the file's
        assert isinstance(lin, Q8DotLinear) and torch.equal(served, ggml)
        return
    # the codes are the file's; only the fp16 block scales (and mins) are rounded to the kernel's bf16
    b = raw.reshape(32, 4, -1)
    d = b[..., :2].contiguous().view(torch.float16).float()  # [32, 4, 1]
    d_bf = d.bfloat16().float()
    if qtype == "Q8_0":
        q = b[..., 2:].contiguous().view(torch.int8).float()
        assert torch.equal(served, (d_bf * q).reshape(32, 128))  # the nibble split is exact
    else:
        scale_err = (d - d_bf).abs() * (16 if qtype == "Q4_1" else 8)
        m_err = 0 if qtype == "Q4_0" else (b[..., 2:4].contiguous().view(torch.float16).float() + 8 * d).abs() / 256
        bound = (scale_err + m_err + 1e-7).expand(32, 4, 32).reshape(32, 128)
        assert ((served - ggml).abs() <= bound).all()
    assert (served - ggml).abs().max() > 0 or qtype == "Q4_0"  # bf16 scales are not free: say so, see docstring


@pytest.mark.skipif(NO_Q8DOT is not None, reason=f"q8dot: {NO_Q8DOT}")
@pytest.mark.parametrize("qtype", ["Q4_0", "Q4_1", "Q8_0"])
def test_q8dot_products_are_exact_integer_dots_of_block_quantized_activations(qtype):
    """What the integer kernels compute: the file's weights times the activations quantized per row and block
    of 32 (symmetric int8, the llama.cpp way), up to float32 rounding of the per-block sums; shapes the decoder
    does not use (several tiles, K of 1,536, rows past one 4-row block, zero and huge rows) included."""
    torch.manual_seed(2)
    n, k = 48, 1536
    raw = _blocks(torch.randn(n, k) * 0.05, Q[qtype])
    lin = gguf_linear(raw, qtype, (n, k), kernel="q8dot")
    x = torch.randn(11, k)
    x[3] = 0.0
    x[5] *= 1e4
    x[6, :32] = 0.0  # one all-zero block inside a row
    got = lin(x)
    ref = quantize_activations(x).double() @ gguf_dequantize(raw, qtype, (n, k)).double().t()
    assert got.dtype == torch.float32 and got.shape == (11, n)
    assert torch.equal(got[3], torch.zeros(n))
    err = (got.double() - ref).abs() / ref.abs().amax(-1, keepdim=True).clamp(min=1e-30)
    assert err.max() < 1e-5
    plain = x.double() @ gguf_dequantize(raw, qtype, (n, k)).double().t()  # and close to unquantized products
    assert ((got.double() - plain).abs().amax(-1) <= 0.02 * plain.abs().amax(-1)).all()
    with pytest.raises(RuntimeError, match="K must be a multiple of 32"):
        torch.ops.dspark_cpu.q4_mm(torch.randn(1, 40), lin.packed, n)


AMX = NO_Q8DOT is None and amx_rows(16)


# one test (one skip on a CPU without AMX, not one per case): 3 GGUF types x 3 shapes
@pytest.mark.skipif(not AMX, reason="needs our kernels' AMX tile path (an Intel CPU with AMX, Linux granting it)")
def test_the_amx_tile_path_gives_every_row_the_one_row_kernels_bits():
    """Products of 8 rows or more run on the tile unit where the CPU has one; each row's output must be the bits
    the one-row (vpdpbusd) kernel gives it, at row counts inside one 16-row tile, at its edge and past it (the
    zero-padded last tile), with zero rows, a zero block and a huge row among them."""
    assert amx_rows(8) and not amx_rows(1)  # the reference below is the other path
    for qtype in ("Q4_0", "Q4_1", "Q8_0"):
        for n, k in ((48, 96), (960, 576), (576, 1536)):
            torch.manual_seed(3)
            raw = _blocks(torch.randn(n, k) * 0.05, Q[qtype])
            lin = gguf_linear(raw, qtype, (n, k), kernel="q8dot")
            for rows in (8, 15, 16, 17, 40):
                x = torch.randn(rows, k) * 3
                x[1] = 0.0
                x[2, 32:64] = 0.0
                x[-1] *= 1e4
                alone = torch.cat([lin(x[i:i + 1].contiguous()) for i in range(rows)])
                assert torch.equal(lin(x), alone), (qtype, n, k, rows, (lin(x) - alone).abs().max())


@pytest.mark.skipif(NO_Q8DOT is not None, reason=f"q8dot: {NO_Q8DOT}")
def test_q8dot_products_split_between_threads_keep_their_one_thread_bits():
    """Built with OpenMP, a large product splits its output columns between threads (kernels/parallel.h): every
    row must keep the bits it gets on one thread and alone, below and above the threshold, split or not."""
    from dspark_core.kernels import parallel_min_work

    for qtype in ("Q4_1", "Q8_0"):
        torch.manual_seed(5)
        n, k = 576, 1536
        lin = gguf_linear(_blocks(torch.randn(n, k) * 0.05, Q[qtype]), qtype, (n, k), kernel="q8dot")
        x = torch.randn(40, k) * 3
        one = lin(x)
        alone = torch.cat([lin(x[i:i + 1].contiguous()) for i in range(3)])
        torch.set_num_threads(2)
        try:
            for work in (0, 10 * n * k, 1 << 60):  # every call split, from 10 rows on, never
                with parallel_min_work(work):
                    for rows in (1, 3, 17, 40):
                        assert torch.equal(lin(x[:rows]), one[:rows]), (qtype, work, rows)
                    assert torch.equal(lin(x[:3]), alone), (qtype, work)
        finally:
            torch.set_num_threads(1)


@pytest.mark.parametrize("fmt", [*PACKED, *(f"gguf-{q}-{k}" for q in ("Q4_0", "Q4_1", "Q8_0")
                                               for k in ("q8dot", "torch"))])
def test_packed_products_are_batch_invariant(fmt):
    torch.manual_seed(1)
    w = torch.randn(64, 128) * 0.1
    if fmt.endswith("q8dot") and NO_Q8DOT is not None:
        pytest.skip(f"q8dot: {NO_Q8DOT}")
    lin = gguf_linear(_blocks(w, Q[fmt[5:9]]), fmt[5:9], (64, 128), kernel=fmt[10:]) if fmt.startswith("gguf") \
        else make_linear(w, torch.randn(64), fmt)
    x = torch.randn(40, 128)
    full = lin(x)
    for rows in (1, 2, 3, 5, 8, 17, 33):
        assert torch.equal(lin(x[:rows]), full[:rows]), rows  # a row's value never depends on its batch
    ref = x @ lin.dequantized().t() + (0 if lin.bias is None else lin.bias)
    assert (full - ref).abs().max() < 0.02 * ref.abs().max()  # bf16 activations and outputs


def test_shapes_the_int4_kernel_cannot_take_stay_int8():
    w = torch.randn(24, 64)
    assert make_linear(w, None, "int4").fmt == "int8"
    assert make_linear(torch.randn(32, 64), None, "int4").fmt == "int4"
    with pytest.raises(ValueError, match="N % 16"):
        gguf_linear(_blocks(w, Q.Q4_1), "Q4_1", (24, 64))


def test_flag_choices_match_the_core():
    from dspark_core.stack import WEIGHT_FORMATS as PARSED  # what --weights offers, importable without torch

    assert PARSED == WEIGHT_FORMATS


# -- a GGUF file of the tiny llama, imported the way `dspark models import-gguf` leaves it

def _to_gguf_order(w: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row permutation (HF -> GGUF), the inverse of what transformers undoes at import."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def _from_gguf_order(w: np.ndarray, n_head: int) -> np.ndarray:
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


# layer 0 all Q4_1; layer 1 mixes Q4_0 and Q4_1 inside the fused q/k/v; layer 2's down projection is Q8_0
_TYPES = {(1, "attn_q"): "Q4_0", (1, "attn_output"): "Q4_0", (1, "ffn_gate"): "Q4_0", (1, "ffn_up"): "Q4_0",
          (2, "ffn_down"): "Q8_0"}
_NAMES = {"attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
          "attn_output": "self_attn.o_proj", "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj",
          "ffn_down": "mlp.down_proj"}


@pytest.fixture(scope="module")
def tiny_gguf_dir(tiny_llama_dir, tmp_path_factory) -> Path:
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("tiny-gguf")
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    cfg = model.config
    sd = model.state_dict()
    writer = gguf.GGUFWriter(str(root / "tiny.gguf"), "llama")

    def put(gname: str, hf: str, qtype: str, heads: int | None = None):
        w = sd[hf].numpy()
        if heads:
            w = _to_gguf_order(w, heads)
        raw = gguf.quants.quantize(w, Q[qtype])
        writer.add_tensor(gname, raw, raw_dtype=Q[qtype])
        deq = gguf.quants.dequantize(raw, Q[qtype])
        sd[hf] = torch.from_numpy(_from_gguf_order(deq, heads) if heads else deq)

    put("token_embd.weight", "model.embed_tokens.weight", "Q8_0")
    put("output.weight", "lm_head.weight", "Q8_0")
    for i in range(cfg.num_hidden_layers):
        for g, hf in _NAMES.items():
            heads = {"attn_q": cfg.num_attention_heads, "attn_k": cfg.num_key_value_heads}.get(g)
            put(f"blk.{i}.{g}.weight", f"model.layers.{i}.{hf}.weight", _TYPES.get((i, g), "Q4_1"), heads)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    model.load_state_dict(sd)
    out = root / "model"
    model.save_pretrained(out)
    for f in Path(tiny_llama_dir).iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, out / f.name)
    src = root / "tiny.gguf"
    (out / "gguf_source.json").write_text(json.dumps({"file": src.name, "path": str(src),
                                                      "bytes": src.stat().st_size}))
    return out


def _target(path, weights, **kw):
    """`gguf-q8dot` / `gguf-torch`: --weights gguf through that kernel."""
    weights, _, kernel = weights.partition("-")
    old, packed_weights.GGUF_KERNEL = packed_weights.GGUF_KERNEL, kernel or None
    try:
        return TargetRuntime(TargetConfig(str(path), device="cpu", dtype="float32", weights=weights, **kw))
    finally:
        packed_weights.GGUF_KERNEL = old


def test_imported_gguf_serves_its_own_blocks_by_default(tiny_gguf_dir):
    auto, dense = _target(tiny_gguf_dir, "auto"), _target(tiny_gguf_dir, "float32")
    assert auto.weights == "gguf" and dense.weights == "float32"
    assert auto.weight_bytes < dense.weight_bytes / 4  # 4-bit codes + bf16 scales against float32
    seq_a, seq_d = auto.new_sequence(), dense.new_sequence()
    la = auto.forward([(seq_a, PROMPTS[2])]).logits
    ld = dense.forward([(seq_d, PROMPTS[2])]).logits
    # the same model: the file's values, up to bf16 block scales and bf16 activations in the kernel
    assert (la - ld).abs().max() < 0.03 * ld.abs().max()


def test_gguf_that_does_not_match_the_directory_is_refused(tiny_gguf_dir, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = tmp_path / "bad"
    shutil.copytree(tiny_gguf_dir, bad)
    sd = load_file(bad / "model.safetensors")
    sd["model.layers.1.mlp.up_proj.weight"][0, 0] += 0.5
    save_file(sd, bad / "model.safetensors", metadata={"format": "pt"})
    with pytest.raises(ModelLoadError, match="up_proj does not match"):
        _target(bad, "gguf")
    assert _target(bad, "auto").weights == "float32"  # auto falls back to the directory's own weights


def test_gguf_file_gone(tiny_gguf_dir, tmp_path):
    moved = tmp_path / "moved"
    shutil.copytree(tiny_gguf_dir, moved)
    rec = json.loads((moved / "gguf_source.json").read_text())
    rec["path"] = str(tmp_path / "nowhere.gguf")
    (moved / "gguf_source.json").write_text(json.dumps(rec))
    with pytest.raises(ModelLoadError, match="does not exist"):
        _target(moved, "gguf")
    assert _target(moved, "auto").weights == "float32"


def test_weights_that_cannot_run_are_refused_by_name(tiny_target_dir):
    with pytest.raises(InvalidArgument, match="weights"):
        TargetConfig(str(tiny_target_dir), weights="int3")
    with pytest.raises(InvalidArgument, match="gguf_source.json"):
        _target(tiny_target_dir, "gguf")
    with pytest.raises(InvalidArgument, match="float32 activations"):
        TargetRuntime(TargetConfig(str(tiny_target_dir), device="cpu", dtype="bfloat16", weights="int4"))
    assert _target(tiny_target_dir, "auto").weights == "float32"  # not imported from a GGUF file


# -- lossless: every format's speculative output is its own autoregressive output

def _greedy_runs(target, drafter_dir):
    params = SamplingParams(temperature=0, max_new_tokens=12)

    def run(drafter, policy):
        engine = Engine(target, drafter, EngineConfig(policy=policy))
        rids = []
        for p in PROMPTS:  # staggered: the batch mix changes every step
            rids.append(engine.add_request(p, params))
            engine.step()
        engine.run()
        return [engine.pop(r) for r in rids]

    ar = run(None, "ar")
    spec = run(OracleDrafter(drafter_dir, block_size=4, corrupt=0.3), "fixed")
    return ar, spec


@pytest.mark.parametrize("weights", [*PACKED, *GGUF])
def test_speculative_greedy_equals_own_autoregressive(tiny_llama_dir, tiny_gguf_dir, weights):
    path = tiny_gguf_dir if weights.startswith("gguf") else tiny_llama_dir
    target = _target(path, weights)
    assert target.weights == weights.split("-")[0]
    ar, spec = _greedy_runs(target, path)
    assert [o.output_ids for o in spec] == [o.output_ids for o in ar]
    assert sum(sum(o.accepted_per_round) for o in spec) > 0
    assert target.num_active == 0


@pytest.mark.parametrize("weights", ["int8", "int4", *GGUF])
def test_a_verify_pass_computes_each_row_bitwise_as_the_one_row_step(tiny_llama_dir, tiny_gguf_dir, weights):
    """Packed projections are batch-invariant, and attention then runs row by row over exactly the keys
    each row sees: row j of a k-row pass equals the one-row step at its position bit for bit, whatever the
    other rows and whatever else shares the batch. (With one batched attention over a masked, padded
    softmax the rows differed in the last bits, which bf16 activations magnify: on SmolLM2 Q4_1, 3 of 6
    greedy mbpp decodes left the target's own at position 1 to 39.)"""
    target = _target(tiny_gguf_dir if weights.startswith("gguf") else tiny_llama_dir, weights)
    assert target._lean.row_invariant
    prompt, more = PROMPTS[2], [5, 6, 7, 8, 9]

    def rows(tokens, company=None):
        seq = target.new_sequence()
        target.forward([(seq, prompt)])
        batch = [(seq, tokens)]
        if company is not None:
            other = target.new_sequence()
            target.forward([(other, company)])
            batch.append((other, [3, 4, 5, 6, 7, 8, 9, 10]))
        out = target.forward(batch).logits_of(0).clone()
        target.release(seq)
        if company is not None:
            target.release(other)
        return out

    steps = []
    for j in range(len(more)):  # one-row steps, position by position
        steps.append(rows(more[: j + 1])[-1])
    joined = rows(more)
    for j in range(len(more)):
        assert torch.equal(joined[j], steps[j]), j
    assert torch.equal(rows(more, company=PROMPTS[0] * 3), joined)  # a longer neighbour in the batch


@pytest.mark.parametrize("weights", ["int4", *GGUF])
def test_a_prefill_computes_each_position_bitwise_as_the_one_row_steps_beside_any_prompts(tiny_llama_dir,
                                                                                         tiny_gguf_dir, weights):
    """On packed weights a prompt's prefill (longer than any verify block, beside a prompt of another length)
    gives every position the logits of decoding it one row at a time, so a request resumed by re-prefilling
    prompt + generated tokens continues exactly as it would have (SmolLM2's load test found resumed and
    differently batched greedy outputs that left the target's own before this)."""
    target = _target(tiny_gguf_dir if weights.startswith("gguf") else tiny_llama_dir, weights)
    prompt = (PROMPTS[2] * 20)[:120]  # past the 16-row verify blocks; long enough that batched attention differs

    def prefill(batch):
        seqs = [target.new_sequence() for _ in batch]
        out = target.forward(list(zip(seqs, batch)))
        logits = out.logits_of(0).clone()
        for s in seqs:
            target.release(s)
        return logits

    seq = target.new_sequence()
    steps = [target.forward([(seq, [tok])]).logits_of(0)[-1].clone() for tok in prompt]
    target.release(seq)
    alone = prefill([prompt])
    beside = prefill([prompt, PROMPTS[0] * 2, [3]])
    for j in range(len(prompt)):
        assert torch.equal(alone[j], steps[j]), j
    assert torch.equal(beside, alone)


def test_the_verifier_prefills_each_prompt_alone_on_packed_weights_with_the_batched_bits(tiny_gguf_dir,
                                                                                          tiny_llama_dir):
    """Where a prompt's positions do not depend on what shares the pass (packed weights on the CPU), the verifier
    prefills one prompt a pass (a batch would pad every prompt to the longest) and gets the batched pass's bits;
    dense weights keep one batched pass."""
    from dspark_core.verifier import PrefillItem, Verifier

    prompts = [(PROMPTS[2] * 20)[:120], PROMPTS[0] * 2, [3]]
    for path, weights, passes in ((tiny_gguf_dir, "gguf", len(prompts)), (tiny_llama_dir, "float32", 1)):
        target = _target(path, weights)
        assert target.prefills_alone == (passes > 1)
        seqs = [target.new_sequence() for _ in prompts]
        batched = target.forward(list(zip(seqs, prompts)), last_logits_only=True)
        want = [(batched.logits_of(i).clone(), batched.taps_of(i).clone()) for i in range(len(prompts))]
        for s in seqs:
            target.release(s)
        calls = []
        forward = target.forward
        target.forward = lambda batch, **kw: calls.append(len(batch)) or forward(batch, **kw)
        verifier = Verifier(target)
        got = verifier.prefill([PrefillItem(f"r{i}", tuple(p), SamplingParams(temperature=0.0, max_new_tokens=4))
                                for i, p in enumerate(prompts)])
        assert len(calls) == passes
        for (logits, taps), res, p in zip(want, got, prompts):
            assert torch.equal(res.features, taps) and res.tokens == [int(logits[-1].argmax())], (weights, p)


def test_seeded_sampled_requests_share_passes_where_passes_are_batch_invariant(tiny_gguf_dir, tiny_llama_dir):
    """A seeded sampled request must decode the same whatever runs beside it. Dense weights get that by a pass of
    its own each step; packed weights on the CPU compute each row as alone, so there seeded requests share the
    pass (c seeded users: one pass a step, not c) and still decode exactly what they decode alone."""
    params = [SamplingParams(temperature=1.0, seed=s, max_new_tokens=12) for s in (11, 12, 13)]

    def run(target, which):
        calls = []
        forward = target.forward
        target.forward = lambda batch, **kw: calls.append((len(batch), kw.get("last_logits_only", False))) or \
            forward(batch, **kw)
        try:
            engine = Engine(target, None, EngineConfig(policy="ar"))
            ids = [engine.add_request(PROMPTS[i], params[i]) for i in which]
            engine.run()
            return [engine.pop(r).output_ids for r in ids], calls
        finally:
            del target.forward

    for path, weights, shared in ((tiny_gguf_dir, "gguf", True), (tiny_llama_dir, "int8", True),
                                  (tiny_llama_dir, "int4", True), (tiny_llama_dir, "float32", False)):
        target = _target(path, weights)
        assert target.batch_invariant(8) == shared
        if shared:  # the premise, bitwise: a 3-token pass of one sequence alone and beside two others
            seqs = [target.new_sequence() for _ in range(3)]
            for s, p in zip(seqs, PROMPTS):
                target.forward([(s, p)])
            before = [s.length for s in seqs]
            lone = target.forward([(seqs[0], [4, 5, 6])])
            want = (lone.logits_of(0).clone(), lone.taps_of(0).clone())
            for s, n in zip(seqs, before):
                target.truncate(s, n)
            beside = target.forward([(seqs[0], [4, 5, 6]), (seqs[1], [7]), (seqs[2], [8, 9])])
            assert torch.equal(beside.logits_of(0), want[0]) and torch.equal(beside.taps_of(0), want[1]), weights
            for s in seqs:
                target.release(s)
        alone = [run(target, [i])[0][0] for i in range(3)]
        together, calls = run(target, [0, 1, 2])
        assert together == alone and all(len(a) == 12 for a in alone), weights
        steps = [n for n, prefill in calls if not prefill]
        assert max(steps) == (3 if shared else 1), (weights, steps)


@pytest.mark.parametrize("weights,tolerance", [("bfloat16", 0.02), ("int8", 0.03), ("int4", 0.3)])
def test_logits_close_to_float32(tiny_llama_dir, weights, tolerance):
    ref, packed = _target(tiny_llama_dir, "float32"), _target(tiny_llama_dir, weights)
    lr = ref.forward([(ref.new_sequence(), PROMPTS[2])]).logits
    lp = packed.forward([(packed.new_sequence(), PROMPTS[2])]).logits
    # relative to the largest logit; a random model is the worst case for 4 bits (Gaussian weights, no
    # structure), 3 layers deep: SmolLM2 figures in docs/results/weights/README.md
    assert (lp - lr).abs().max() < tolerance * lr.abs().max()
    assert packed.weight_bytes < ref.weight_bytes


# -- the installed SmolLM2 (optional)

def _smollm2():
    from dspark_cli.models import target_dirs

    p = target_dirs()["smollm2"]
    if not (p / "gguf_source.json").is_file():
        pytest.skip("SmolLM2 is not installed (dspark models install smollm2)")
    return p


@pytest.mark.slow
def test_smollm2_gguf_verify_rows_equal_its_autoregressive_steps():
    """A verify pass over perfect drafts commits exactly the autoregressive tokens (what greedy speculative
    decoding needs), on the real GGUF's own blocks, with the checked file."""
    target = _target(_smollm2(), "auto")
    assert target.weights == "gguf"
    prompt = [1, 504, 3458, 282, 260, 1345, 30, 2986, 314, 253]
    seq = target.new_sequence()
    tok = int(target.forward([(seq, prompt)], last_logits_only=True).logits[-1].argmax())
    ar = [tok]
    for _ in range(23):
        ar.append(int(target.forward([(seq, [ar[-1]])]).logits[-1].argmax()))
    target.release(seq)
    seq = target.new_sequence()
    target.forward([(seq, prompt)], last_logits_only=True)
    for start in range(0, 24 - 7, 7):  # anchor + 7 drafts per pass
        block = ar[start : start + 8]
        got = target.forward([(seq, block)]).logits.argmax(-1).tolist()
        assert got[:-1] == block[1:]
        target.truncate(seq, seq.length - 1)  # the last draft is the next pass's anchor
