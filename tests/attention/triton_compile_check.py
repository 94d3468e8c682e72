"""Compile every Triton kernel, with the exact arguments its launcher passes, for a GPU target:
Triton's compiler and ptxas run on any machine, so a kernel that the interpreter accepts but the
GPU compiler rejects (a loop-carried value changing type, a shape tl.dot refuses, an unsupported
cast) fails here, on CPU. Run by test_triton_gpu_compile.py in a subprocess with the interpreter
off (it decides, when a kernel is defined, whether it is compiled or interpreted).

    python tests/attention/triton_compile_check.py [--only NAME,NAME] [capability ...]   (default: 90, H100/H200)

Prints one line per kernel variant (all of them, or the named ones) and exits 1 if any failed.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch
import triton
from triton.backends.compiler import GPUTarget

from servelm.kernels.triton.decode_attention import decode_launches
from servelm.kernels.triton.fp8_gemm import fp8_block_gemm_launch
from servelm.kernels.triton.kv_write import write_kv_launch
from servelm.kernels.triton.launch import KernelLaunch
from servelm.kernels.triton.pool import KVPool
from servelm.kernels.triton.prefill_attention import fresh_kv, plan_tiles, prefill_launch

_POINTER_TYPES = {
    torch.float32: "*fp32",
    torch.bfloat16: "*bf16",
    torch.float16: "*fp16",
    torch.int32: "*i32",
    torch.int64: "*i64",
    torch.int8: "*i8",
    torch.float8_e4m3fn: "*fp8e4nv",
}


def _type_of(value: object) -> str | tuple:
    """A runtime argument's type in Triton's signature notation (a tuple's, element by element)."""
    if isinstance(value, tuple):
        return tuple(_type_of(item) for item in value)
    if isinstance(value, torch.Tensor):
        return _POINTER_TYPES[value.dtype]
    if isinstance(value, float):
        return "fp32"
    assert isinstance(value, int), f"no signature type for {value!r}"
    return "i32" if -(2**31) <= value < 2**31 else "i64"


def compile_launch(launch: KernelLaunch, capability: int) -> None:
    signature: dict[str, str | tuple] = {}
    constexprs: dict[str, object] = {}
    for param in launch.kernel.params:
        value = launch.args[param.name]
        if param.is_constexpr:
            signature[param.name], constexprs[param.name] = "constexpr", value
        else:
            signature[param.name] = _type_of(value)
    source = triton.compiler.ASTSource(fn=launch.kernel, signature=signature, constexprs=constexprs)
    triton.compile(source, target=GPUTarget("cuda", capability, 32), options={"num_warps": launch.num_warps})


def _pool(dtype: torch.dtype, block_size: int = 16, kv_heads: int = 2, head_dim: int = 128) -> KVPool:
    data = torch.zeros(2, 4, block_size, kv_heads, head_dim, dtype=dtype)
    if dtype in (torch.int8, torch.float8_e4m3fn):
        scales = torch.zeros(2, 4, block_size, kv_heads)
        return KVPool(data[0], data[1], scales[0], scales[1])
    return KVPool(data[0], data[1])


def launches() -> dict[str, KernelLaunch]:
    """One launch per kernel variant worth compiling (the dtypes and modes a deployment uses)."""
    table, seq_lens = torch.zeros(3, 4, dtype=torch.int32), torch.ones(3, dtype=torch.int32)
    query_start_loc = torch.arange(4, dtype=torch.int32)
    tiles = plan_tiles(torch.ones(3, dtype=torch.int32), torch.arange(3))
    rows = torch.zeros(2, dtype=torch.int32)
    built: dict[str, KernelLaunch] = {}
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        kv = torch.zeros(3, 2, 128, dtype=dtype)
        query, out = torch.zeros(3, 8, 128, dtype=dtype), torch.zeros(3, 8, 128, dtype=dtype)
        name = str(dtype).removeprefix("torch.")
        built[f"write {name}"] = write_kv_launch(kv, kv, _pool(dtype), torch.zeros(3, dtype=torch.long))
        built[f"decode {name}"] = decode_launches(out, query, _pool(dtype), table, seq_lens, 0.1)[0]
        split = decode_launches(out, query, _pool(dtype, 12), table, seq_lens, 0.1, requests=rows, token_rows=rows,
                                num_splits=4)  # fmt: skip
        built[f"decode {name} indexed split block12"], built[f"merge {name}"] = split
        built[f"prefill {name}"] = prefill_launch(
            out, query, _pool(dtype), table, query_start_loc, seq_lens, *tiles, 0.1
        )
        built[f"prefill {name} fresh"] = prefill_launch(out, query, fresh_kv(kv, kv), None, query_start_loc, seq_lens,
                                                        *tiles, 0.1)  # fmt: skip
    codes, scales = torch.zeros(256, 384, dtype=torch.float8_e4m3fn), torch.ones(2, 3)
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        name = str(dtype).removeprefix("torch.")
        for rows in (3, 100):  # decode tiles and prefill tiles
            x, out = torch.zeros(rows, 384, dtype=dtype), torch.zeros(rows, 256, dtype=dtype)
            built[f"fp8 gemm {name} rows{rows}"] = fp8_block_gemm_launch(x, codes, scales, 128, 128, out)
    for codes in (torch.int8, torch.float8_e4m3fn):
        kv = torch.zeros(3, 2, 128, dtype=torch.bfloat16)
        query, out = torch.zeros(3, 8, 128, dtype=torch.bfloat16), torch.zeros(3, 8, 128, dtype=torch.bfloat16)
        name = str(codes).removeprefix("torch.")
        built[f"write {name}"] = write_kv_launch(kv, kv, _pool(codes), torch.zeros(3, dtype=torch.long))
        built[f"decode {name}"] = decode_launches(out, query, _pool(codes), table, seq_lens, 0.1)[0]
        built[f"prefill {name}"] = prefill_launch(
            out, query, _pool(codes), table, query_start_loc, seq_lens, *tiles, 0.1
        )
    return built


def main(capabilities: list[int], only: set[str] | None = None) -> int:
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        print("run with TRITON_INTERPRET=0: interpreted kernels cannot be compiled")
        return 2
    failed = 0
    for capability in capabilities:
        for name, launch in launches().items():
            if only is not None and name not in only:
                continue
            try:
                compile_launch(launch, capability)
            except Exception:  # noqa: BLE001 - report every variant, then fail
                failed += 1
                print(f"FAIL sm_{capability} {name}\n{traceback.format_exc()}")
            else:
                print(f"ok   sm_{capability} {name}")
    return 1 if failed else 0


if __name__ == "__main__":
    arguments = sys.argv[1:]
    names = None
    if arguments[:1] == ["--only"]:
        names, arguments = set(arguments[1].split(",")), arguments[2:]
    sys.exit(main([int(arg) for arg in arguments] or [90], names))
