"""Compile the RMSNorm and rotary Triton kernels for a GPU target (Triton's compiler and ptxas run on
any machine), so that code the interpreter accepts but the GPU compiler rejects fails on CPU too,
and check in the PTX that the rotary keeps torch's roundings (no fused multiply-add).
Run by test_triton_norm_rotary.py in a subprocess with TRITON_INTERPRET=0 (triton decides when a
kernel is defined whether it is compiled or interpreted).

    python tests/kernels/triton_norm_rotary_compile.py [capability]   (default 90: H100/H200)

Prints one line per variant; exits 1 if any failed.
"""

from __future__ import annotations

import re
import sys
import traceback

import triton
from triton.backends.compiler import GPUTarget

from servelm.kernels.triton import norm, rotary

DTYPES = ("fp32", "bf16", "fp16")


def compile_ptx(kernel: triton.JITFunction, dtype: str, constexprs: dict, num_warps: int, capability: int,
                **options: object) -> str:  # fmt: skip
    """Every pointer a `dtype` tensor, `eps` float32, every other runtime argument int32 (the
    launchers' strides and sizes)."""
    signature = {}
    for param in kernel.params:
        if param.is_constexpr:
            signature[param.name] = "constexpr"
        else:
            signature[param.name] = (
                f"*{dtype}" if param.name.endswith("_ptr") else "fp32" if param.name == "eps" else "i32"
            )
    source = triton.compiler.ASTSource(fn=kernel, signature=signature, constexprs=constexprs)
    compiled = triton.compile(
        source, target=GPUTarget("cuda", capability, 32), options={"num_warps": num_warps, **options}
    )
    return compiled.asm["ptx"]


def variants(capability: int) -> dict[str, object]:
    """name -> a thunk compiling it (and checking its PTX), raising on failure."""

    def norm_variant(dtype: str, residual: bool) -> None:
        compile_ptx(norm._rms_norm_kernel, dtype, {"HAS_RESIDUAL": residual, "BLOCK": 1024}, 2, capability)

    def rotary_variant(dtype: str) -> None:
        ptx = compile_ptx(
            rotary._rotary_kernel, dtype, {"BLOCK_HEADS": 16, "BLOCK_HALF": 32}, 4, capability, enable_fp_fusion=False
        )  # fp fusion off, as rotate_ launches it
        if re.search(r"^\s*fma\.", ptx, re.M):
            raise AssertionError("the rotary PTX fuses a multiply-add: one product is not rounded as torch rounds it")

    built = {}
    for dtype in DTYPES:
        for residual in (True, False):
            built[f"rms_norm {dtype} residual={residual}"] = lambda d=dtype, r=residual: norm_variant(d, r)
        built[f"rotary {dtype}"] = lambda d=dtype: rotary_variant(d)
    return built


def main() -> int:
    capability = int(sys.argv[1]) if len(sys.argv) > 1 else 90
    failed = 0
    for name, build in variants(capability).items():
        try:
            build()
            print(f"ok   sm_{capability} {name}")
        except Exception:  # noqa: BLE001  (every failure is reported, then the exit status says so)
            failed += 1
            print(f"FAIL sm_{capability} {name}\n{traceback.format_exc()}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
