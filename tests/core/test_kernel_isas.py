"""The AVX2 build of our CPU kernels against the AVX512 build, on a CPU that runs both: every kernel's output
bit for bit the same (the AVX2 build forms the same integers and the same float operations lane for lane; see
vec_math.h and q8dot.cpp). On an AVX2-only CPU there is one build to run and this test is skipped; the other
kernel tests (test_kernels.py, test_packed_weights.py, tests/drafters/test_fast_paths.py) run on that build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from dspark_core.kernels import _cpu_flags, isa, kernel_isa

# Each process computes every kernel on the same seeded inputs and saves the outputs.
SCRIPT = r"""
import sys, torch
from dspark_core import kernels
assert kernels.q8dot_unavailable() is None, kernels.q8dot_unavailable()
torch.manual_seed(0)
torch.set_num_threads(1)
ops, out = torch.ops.dspark_cpu, {"isa": kernels.kernel_isa()}
n, k = 64, 96
x = torch.randn(7, k) * 3
x[2, 5] = 0.0
x[3] = 0.0  # a zero row: scale 0
codes4 = torch.randint(0, 16, (n, k))
d, o = torch.rand(n, k // 32) * 0.1, torch.randn(n, k // 32) * 0.05
out["q4"] = ops.q4_mm(x, kernels.pack_q4(codes4, d, o), n)
codes8 = torch.randint(-128, 128, (n, k))  # -128 too: the AVX2 sign trick's edge
codes8[0, :32] = -128
out["q8"] = ops.q8_mm(x, kernels.pack_q8(codes8, d), n)
x20 = torch.randn(20, k) * 3  # 20 rows: the AMX tile path where the AVX512 build has it (a padded second tile)
out["q4_20"] = ops.q4_mm(x20, kernels.pack_q4(codes4, d, o), n)
out["q8_20"] = ops.q8_mm(x20, kernels.pack_q8(codes8, d), n)
h = torch.randn(5, 576) * 4
out["rms"] = ops.rms_norm(h, torch.randn(576), 1e-5)
gu = torch.randn(3, 2 * 1536) * 30
out["silu"] = ops.silu_mul(gu)
q, kk, v = torch.randn(2, 9, 4, 64), torch.randn(2, 3, 50, 64) * 3, torch.randn(2, 3, 50, 64)
out["attn"] = ops.row_attention(q, kk, v, torch.tensor([[47, 48, 49, 50], [1, 20, 0, 33]]), 0.125)
qkv, cos, sin = torch.randn(6, 15 * 64), torch.randn(2, 3, 64), torch.randn(2, 3, 64)
out["rope"] = ops.rope_split(qkv, cos, sin, 2, 9, 3)
base, w1 = torch.randn(2, 7, 128) * 5, torch.randn(300, 64)
w2 = kernels.pack_q8(torch.randint(-127, 128, (128, 64)), torch.rand(128, 2) * 0.02)
anchors, ids = torch.tensor([3, 299]), torch.randperm(300)[:128]
out["markov_greedy"] = ops.markov_greedy(base, w1, w2, 128, anchors, ids)
out["markov_sample"] = ops.markov_sample(base, w1, w2, 128, anchors, ids, torch.tensor([1.0, 0.7]),
                                         torch.rand(2, 7), 32)
torch.save(out, sys.argv[1])
"""


def _run(tmp_path: Path, forced: str | None) -> dict:
    env = dict(os.environ)
    env.pop("DSPARK_KERNEL_ISA", None)
    if forced:
        env["DSPARK_KERNEL_ISA"] = forced
    dest = tmp_path / f"{forced or 'default'}.pt"
    done = subprocess.run([sys.executable, "-c", SCRIPT, str(dest)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    return torch.load(dest)


@pytest.mark.skipif(kernel_isa() != "avx512", reason=f"needs a CPU with both builds (here: {kernel_isa() or isa()})")
def test_the_avx2_build_gives_every_kernels_outputs_bit_for_bit_as_the_avx512_build(tmp_path):
    wide, narrow = _run(tmp_path, None), _run(tmp_path, "avx2")
    assert (wide.pop("isa"), narrow.pop("isa")) == ("avx512", "avx2")
    for name, ref in wide.items():
        got = narrow[name]
        refs, gots = (ref, got) if isinstance(ref, (list, tuple)) else ([ref], [got])
        for i, (a, b) in enumerate(zip(refs, gots)):
            assert torch.equal(a, b), (name, i, (a.float() - b.float()).abs().max())


def test_a_forced_instruction_set_is_checked_by_name(monkeypatch):
    monkeypatch.setenv("DSPARK_KERNEL_ISA", "sse2")
    assert "DSPARK_KERNEL_ISA='sse2' is not one of avx512, avx2" == isa()
    monkeypatch.setenv("DSPARK_KERNEL_ISA", "avx2")
    has = {"avx2", "fma", "f16c"} <= _cpu_flags()
    assert isa() == ("avx2", ["-mavx2", "-mfma", "-mf16c"]) if has else isa().startswith("the CPU lacks")


def test_amx_flags_only_where_the_cpu_and_the_compiler_take_them(monkeypatch, tmp_path):
    """The AVX512 build adds the AMX tile path's flags only on a CPU with AMX and a compiler that knows them (an
    older gcc would fail the whole build, and the kernels with it); DSPARK_AMX=0 leaves them out."""
    from dspark_core import kernels

    flags = _cpu_flags()
    chosen = isa()
    if isinstance(chosen, str) or chosen[0] != "avx512":
        pytest.skip(f"needs the AVX512 build (here: {chosen})")
    amx_cpu = {"amx_tile", "amx_int8"} <= flags
    assert ("-mamx-tile" in chosen[1]) == (amx_cpu and kernels._compiler_takes(("-mamx-tile", "-mamx-int8")))
    monkeypatch.setenv("DSPARK_AMX", "0")
    assert "-mamx-tile" not in isa()[1]
    monkeypatch.delenv("DSPARK_AMX")
    refusing = tmp_path / "old-c++"  # a compiler that does not know the flags
    refusing.write_text("#!/bin/sh\necho \"unrecognized command-line option '-mamx-tile'\" >&2\nexit 1\n")
    refusing.chmod(0o755)
    monkeypatch.setenv("CXX", str(refusing))
    kernels._compiler_takes.cache_clear()
    try:
        assert "-mamx-tile" not in isa()[1]
    finally:
        monkeypatch.delenv("CXX")
        kernels._compiler_takes.cache_clear()
