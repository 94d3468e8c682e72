"""Compiled kernels, kept as real source files and built like the ecosystem builds them.

- `csrc/`: the C sources of the CPU kernels (paged decode attention, the GGUF block matmul) and
  the SIMD header they share; shipped as package data.
- `build`: compiles them with the system C compiler for this CPU into a per-user cache
  (`python -m servelm.kernels.build` does it ahead of time).
- `cpu`: `load()` and the checked, typed wrappers the attention backend and the models call.
- `mkl_gemm`: MKL's packed float32 GEMM (the weight's panels made once) for prompts' linear layers,
  called from the MKL that PyTorch's CPU library carries (nothing to build).
- `arguments`: the checks every wrapper runs before a pointer reaches C.

`SERVELM_KERNELS=torch` (see `servelm.envs`) switches them all off: the pure-torch paths run.
Importing this package imports nothing (no torch), so the build runs without it.
"""
