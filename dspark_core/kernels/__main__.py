"""`python -m dspark_core.kernels`: build (once) and check the CPU kernels; exits 0 either way (they are optional)."""

from . import build_dir, kernel_isa, q8dot_unavailable

why = q8dot_unavailable()
print(f"q8dot kernels: {f'ready ({kernel_isa()}) in ' + str(build_dir(kernel_isa())) if why is None else 'not used (' + why + ')'}")
