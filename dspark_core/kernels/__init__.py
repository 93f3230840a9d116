"""Our own CPU kernels, compiled once per machine with the system's C++ compiler (torch.utils.cpp_extension).

`q8dot`: GGUF-style block-quantized matmuls (Q4_0 / Q4_1 / Q8_0 weights) as exact integer dot products with
AVX512-VNNI (or AVX2's multiply-add pairs on CPUs without AVX512: the same integers and the same outputs),
activations quantized per row and per block of 32 to int8 the way llama.cpp does for these formats
(see q8dot.cpp). Why our own: PyTorch's int4 kernel dequantizes every weight to float for every few rows, so its
cost grows ~1.3 ms a row on SmolLM2 past two rows (compute-bound), and a verify pass of 8 rows cost 2.4 one-row
steps; the integer kernel loads a weight block once for 4 rows and multiplies 64 pairs per instruction
(docs/results/weights/README.md has the measurements). oneDNN's int8 matmul (`qlinear_pointwise`) is flat in the
row count but ~1.6x slower at one row and quantizes activations per tensor (not batch-invariant);
`torch._int_mm` re-packs the weight on every call.

On Intel CPUs with AMX the AVX512 build also has a tile path for products of 8 rows or more (prefill, batched
verify passes): the same exact integer sums and the same float32 operations per row, so the same bits
(q8dot.cpp; docs/results/weights/README.md, "Intel AMX"). `DSPARK_AMX=0` builds without it.

Built on first use into `$DSPARK_HOME/kernels` (default ~/.cache/dspark/kernels; `make setup` builds it), keyed
by the source's hash and the instruction set. Built for AVX512-VNNI where the CPU has it, else for AVX2 + FMA +
F16C (`DSPARK_KERNEL_ISA=avx2` forces the AVX2 build, for tests); `DSPARK_Q8DOT=0` turns the kernels off (then
`gguf` serves through PyTorch's int4 kernel with bf16 activations, a different rounding of the same codes).

Threads: built with OpenMP, a call splits between torch's intra-op threads (whole output columns, whole attention
rows: the same bits) once its work reaches 2^23 multiply-adds (parallel.h; smaller calls stay on the calling
thread, where a thread wake-up would cost more than it saves). `DSPARK_PARALLEL_MIN_WORK` or
`parallel_min_work()` moves that threshold.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import logging
import os
import subprocess
import sys
from pathlib import Path

import torch

_log = logging.getLogger(__name__)
_SOURCES = [Path(__file__).with_name(f) for f in ("q8dot.cpp", "attention.cpp", "glue.cpp", "markov.cpp")]
# the instruction sets we build for, best first: (name, the /proc/cpuinfo flags it needs, compiler flags)
_ISAS = (
    ("avx512", ("avx512f", "avx512bw", "avx512vl", "avx512_vnni"),
     ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512vnni", "-mf16c", "-mfma"]),
    ("avx2", ("avx2", "fma", "f16c"), ["-mavx2", "-mfma", "-mf16c"]),
)
# The AVX512 build also carries the AMX tile path of the block-quantized matmuls where the CPU has Intel's tile unit
# and the compiler knows it (q8dot.cpp; the same outputs bit for bit, from 8 rows on); DSPARK_AMX=0 builds without.
_AMX_FLAGS = {"amx_tile", "amx_int8"}
_AMX_CFLAGS = ["-mamx-tile", "-mamx-int8"]
# every build: OpenMP, so that at::parallel_for in the kernels really splits the large calls between threads
# (without it the pragma compiles away and every kernel ran on one thread whatever torch's thread count);
# kernels/parallel.h says from which size on
_COMMON_CFLAGS = ["-O3", "-ffp-contract=off", "-fopenmp"]
_state: dict[str, object] = {}
BLOCK = 32


def _cpu_flags() -> set[str]:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def isa() -> tuple[str, list[str]] | str:
    """The instruction set the kernels are built for here and its compiler flags, or why none fits."""
    flags, forced = _cpu_flags(), os.environ.get("DSPARK_KERNEL_ISA", "")
    candidates = [entry for entry in _ISAS if not forced or entry[0] == forced]
    if not candidates:
        return f"DSPARK_KERNEL_ISA={forced!r} is not one of {', '.join(name for name, _, _ in _ISAS)}"
    for name, needs, cflags in candidates:
        missing = [f for f in needs if f not in flags]
        if not missing:
            if name == "avx512" and _AMX_FLAGS <= flags and os.environ.get("DSPARK_AMX", "1") != "0" \
                    and _compiler_takes(tuple(_AMX_CFLAGS)):
                cflags = cflags + _AMX_CFLAGS
            return name, cflags
    return f"the CPU lacks {', '.join(missing)} (for {name})"


@functools.lru_cache(maxsize=None)
def _compiler_takes(cflags: tuple[str, ...]) -> bool:
    """Whether the C++ compiler the build uses ($CXX, else c++) compiles AMX intrinsics with these flags (gcc < 11 does
    not know them: the kernels are then built without the tile path rather than not at all)."""
    src = "#include <immintrin.h>\nvoid f() { _tile_release(); }\n"
    try:
        done = subprocess.run([os.environ.get("CXX", "c++"), *cflags, "-x", "c++", "-fsyntax-only", "-"], input=src,
                              capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError):
        return False
    return done.returncode == 0


def build_dir(name: str) -> Path:
    """Where the kernels for instruction set `name` are built (keyed by the sources, torch's version and, for the
    instruction set chosen here, its compiler flags: a build with the AMX path is another build)."""
    home = Path(os.environ.get("DSPARK_HOME", Path.home() / ".cache" / "dspark"))
    parts = _SOURCES + [Path(__file__).with_name(h) for h in ("vec_math.h", "parallel.h")]
    chosen = isa()
    flags = " ".join(_COMMON_CFLAGS + (chosen[1] if not isinstance(chosen, str) and chosen[0] == name else []))
    digest = hashlib.sha256(b"".join(p.read_bytes() for p in parts) + torch.__version__.encode()
                            + flags.encode()).hexdigest()
    return home / "kernels" / f"cpu-{name}-{digest[:12]}"


def q8dot_unavailable() -> str | None:
    """Why the q8dot kernels cannot run here (None: they can; built or loaded on first call)."""
    if "why" in _state:
        return _state["why"]  # type: ignore[return-value]
    why = None
    if os.environ.get("DSPARK_Q8DOT", "1") == "0":
        why = "turned off by DSPARK_Q8DOT=0"
    else:
        chosen = isa()
        why = chosen if isinstance(chosen, str) else _load(*chosen)
        if why is None:
            _state["isa"] = chosen[0]
    _state["why"] = why
    return why


def build_id() -> str | None:
    """The build of our kernels this process runs (its build directory's name: instruction set and a digest of the
    sources and torch version), None where they do not run. Cost tables record it (`SpsTable.kernels`)."""
    if q8dot_unavailable() is not None:
        return None
    return build_dir(_state["isa"]).name  # type: ignore[arg-type]


def loaded() -> bool:
    """Whether the kernels are loaded in this process already (never builds or loads them)."""
    return "why" in _state and _state["why"] is None


def amx_rows(rows: int) -> bool:
    """Whether the block-quantized matmuls of `rows` rows run on the AMX tile unit here (False where the kernels do
    not run, were built without it, or Linux does not grant it)."""
    return q8dot_unavailable() is None and bool(torch.ops.dspark_cpu.q8dot_amx(int(rows)))


@contextlib.contextmanager
def parallel_min_work(work: int):
    """Within the block, our kernels split a call between threads from `work` multiply-adds on (0: every call
    torch's thread count allows), e.g. so that tests reach the threaded path with small tensors. The kernels must
    run here."""
    if q8dot_unavailable() is not None:
        raise RuntimeError(f"our CPU kernels do not run here: {q8dot_unavailable()}")
    previous = torch.ops.dspark_cpu.set_parallel_min_work(int(work))
    try:
        yield
    finally:
        torch.ops.dspark_cpu.set_parallel_min_work(previous)


def kernel_isa() -> str | None:
    """The instruction set our kernels run with here ("avx512" / "avx2"), None where they do not run."""
    return _state.get("isa") if q8dot_unavailable() is None else None  # type: ignore[return-value]


def _load(name: str, cflags: list[str]) -> str | None:
    out = build_dir(name)
    lib = out / "dspark_cpu.so"
    try:
        if lib.is_file() and not (out / "lock").exists():  # built, and no build in progress (torch's file baton)
            torch.ops.load_library(str(lib))
            return None
        from torch.utils.cpp_extension import load

        # torch looks for `ninja` on PATH: the environment's own (the `ninja` package) when no system one exists
        here = str(Path(sys.executable).parent)
        if here not in os.environ.get("PATH", "").split(os.pathsep):
            os.environ["PATH"] = here + os.pathsep + os.environ.get("PATH", "")
        out.mkdir(parents=True, exist_ok=True)
        _log.warning("building the q8dot CPU kernels (%s) into %s (once per machine, ~30 s)", name, out)
        load(name="dspark_cpu", sources=[str(p) for p in _SOURCES], build_directory=str(out), is_python_module=False,
             extra_cflags=[*_COMMON_CFLAGS, *cflags], verbose=False)
        return None
    except Exception as exc:  # no compiler, no ninja, a failed build: serve through PyTorch's kernels
        _log.warning("q8dot kernels unavailable (%s): gguf weights use PyTorch's int4 kernel", exc)
        return f"build failed: {exc}"


def _tiles(t: torch.Tensor, n: int, g: int) -> torch.Tensor:
    """[N, G] per-block values (2 bytes each) -> the kernel's [N / 16, G, 32] bytes."""
    return t.reshape(n // 16, 16, g).permute(0, 2, 1).contiguous().view(torch.uint8)


def pack_q4(codes: torch.Tensor, d: torch.Tensor, o: torch.Tensor) -> torch.Tensor:
    """4-bit codes [N, K] (0..15) with a scale d and offset o per block of 32 [N, K / 32] (w = d q + o; both
    rounded to fp16) -> the q4_mm layout, uint8 [N / 16, K / 32, 320] (q8dot.cpp)."""
    n, k = codes.shape
    g = k // BLOCK
    c = codes.to(torch.uint8).reshape(n // 16, 16, g, 4, 2, 4).permute(0, 2, 3, 4, 1, 5)  # T, G, v, lo/hi, col, j
    nibbles = (c[:, :, :, 0] | (c[:, :, :, 1] << 4)).reshape(n // 16, g, 256)
    return torch.cat([nibbles, _tiles(d.to(torch.float16), n, g), _tiles(o.to(torch.float16), n, g)], -1)


def pack_q8(q: torch.Tensor, d: torch.Tensor) -> torch.Tensor:
    """8-bit signed codes [N, K] with a scale d per block of 32 [N, K / 32] (w = d q; d rounded to fp16) -> the
    q8_mm layout, uint8 [N / 16, K / 32, 576] (q8dot.cpp)."""
    n, k = q.shape
    g = k // BLOCK
    codes = q.to(torch.int8).reshape(n // 16, 16, g, 8, 4).permute(0, 2, 3, 1, 4).reshape(n // 16, g, 512)
    sums = q.to(torch.int32).reshape(n, g, BLOCK).sum(-1).to(torch.int16)
    return torch.cat([codes.view(torch.uint8), _tiles(d.to(torch.float16), n, g), _tiles(sums, n, g)], -1)


def quantize_activations(x: torch.Tensor) -> torch.Tensor:
    """What the kernels multiply by: x [M, K] quantized per row and block of 32 (symmetric int8, round half to
    even), dequantized back to float32. Reference for tests."""
    m, k = x.shape
    xb = x.float().reshape(m, k // BLOCK, BLOCK)
    amax = xb.abs().amax(-1, keepdim=True)
    inv = torch.where(amax > 0, 127.0 / amax, torch.zeros_like(amax))
    return (torch.round(xb * inv).clamp_(-127, 127) * (amax / 127.0)).reshape(m, k)
