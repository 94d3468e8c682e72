"""Fixtures for the kernel tests: switch SERVELM_KERNELS for one test and forget load()'s answer; the
compiled library in each build a kernel test runs against (`kernels`: plain C, AVX2 + FMA, this CPU's)."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from servelm import envs
from servelm.kernels import build, cpu, mkl_gemm, onednn_gemm


@pytest.fixture
def kernel_env(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[[str, str], None]]:
    """set(name, value): set an environment variable the kernels read, so the next load() sees it.

    On teardown load()'s answer is forgotten again (before monkeypatch restores the environment),
    so later tests decide afresh and get the kernels back."""

    def set_variable(name: str, value: str) -> None:
        monkeypatch.setenv(name, value)
        cpu.reset()
        mkl_gemm.reset()
        onednn_gemm.reset()

    cpu.reset()
    mkl_gemm.reset()
    onednn_gemm.reset()
    yield set_variable
    cpu.reset()
    mkl_gemm.reset()
    onednn_gemm.reset()


@pytest.fixture
def compiled_kernels(kernel_env: Callable[[str, str], None]) -> cpu.CpuKernels:
    """The real compiled kernels (SERVELM_KERNELS=auto); the test is skipped where they cannot be built."""
    kernel_env(envs.KERNELS, "auto")
    kernels = cpu.load()
    if kernels is None:
        pytest.skip("no C compiler, or the build failed: the compiled kernels cannot be tested here")
    return kernels


VARIANTS = {"plain C": frozenset(), "AVX2 + FMA": frozenset({"avx2", "fma"}), "this CPU": None}


@pytest.fixture(scope="module", params=list(VARIANTS))
def kernels(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> cpu.CpuKernels:
    """The library built for one variant (module-scoped: built once per test module and variant)."""
    features = VARIANTS[request.param]
    if features is None:
        found = cpu.load()
        assert found is not None
        return found
    if not features <= build.cpu_features():
        pytest.skip(f"this CPU lacks {sorted(features - build.cpu_features())}")
    return cpu.CpuKernels(build.build(tmp_path_factory.mktemp("kernels"), features=features))
