"""The kernel build: its cache key follows sources, flags and compiler; its flags follow the CPU;
it runs ahead of time from the command line; a missing compiler leaves servelm on the pure-torch
paths, said once in the log."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

from servelm import envs
from servelm.kernels import build, cpu

GCC = build.Toolchain(compiler="/usr/bin/gcc-12", version="gcc (Debian 12.2.0-14) 12.2.0")


def _copy_sources(tmp_path: Path) -> tuple[Path, ...]:
    for source in build.source_files():
        shutil.copy(source, tmp_path / source.name)
    return tuple(sorted(tmp_path.iterdir()))


def test_the_cache_key_changes_with_sources_flags_and_compiler(tmp_path):
    sources = _copy_sources(tmp_path)
    flags = build.compile_flags(frozenset({"avx2", "fma"}))
    key = build.cache_key(sources, flags, GCC)
    assert key == build.cache_key(sources, flags, GCC)  # deterministic
    assert key == build.cache_key(build.source_files(), flags, GCC)  # the bytes count, not where they sit
    assert key != build.cache_key(sources, build.compile_flags(frozenset()), GCC)
    assert key != build.cache_key(sources, flags, build.Toolchain("/usr/bin/clang", GCC.version))
    assert key != build.cache_key(sources, flags, build.Toolchain(GCC.compiler, "gcc (Debian 12.3.0) 12.3.0"))
    header = next(s for s in sources if s.suffix == ".h")
    header.write_bytes(header.read_bytes() + b"\n")
    assert key != build.cache_key(sources, flags, GCC)


def test_flags_follow_the_cpu_features_and_never_assume_the_build_machine(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu sse2 avx avx2 fma f16c avx512f avx512bw\n")
    assert build.cpu_features(cpuinfo) == {"avx2", "fma", "f16c", "avx512f"}
    assert build.cpu_features(tmp_path / "missing") == frozenset()
    with_avx2 = build.compile_flags(frozenset({"avx2", "fma"}))
    assert {"-mavx2", "-mfma"} <= set(with_avx2) and not {"-mf16c", "-mavx512f"} & set(with_avx2)
    assert not {"-mavx2", "-mfma"} & set(build.compile_flags(frozenset({"avx2"})))  # AVX2 without FMA: scalar
    with_avx512 = build.compile_flags(frozenset({"avx2", "fma", "f16c", "avx512f"}))
    assert {"-mavx2", "-mfma", "-mf16c", "-mavx512f"} <= set(with_avx512)
    assert build.compile_flags(frozenset({"avx512f", "f16c"})) == build.BASE_FLAGS  # only above AVX2 + FMA
    assert not any(flag.startswith("-march") for flag in (*with_avx2, *with_avx512))


def test_a_missing_compiler_leaves_the_torch_paths_and_says_so_once(kernel_env, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger=cpu.__name__)
    missing = str(tmp_path / "no-such-cc")
    kernel_env(envs.C_COMPILER, missing)
    assert cpu.load() is None
    assert cpu.load() is None
    said = [r for r in caplog.records if r.name == cpu.__name__]
    assert len(said) == 1 and said[0].levelno == logging.WARNING and missing in said[0].getMessage()


def _run_build(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "servelm.kernels.build"], env={**os.environ, **env},
        capture_output=True, text=True, timeout=300,
    )


def test_building_ahead_of_time_prints_where_and_the_key(compiled_kernels, tmp_path):
    result = _run_build({envs.XDG_CACHE_HOME: str(tmp_path)})
    assert result.returncode == 0, result.stderr
    built = sorted((tmp_path / "servelm" / "kernels").iterdir())
    assert len(built) == 1 and built[0].suffix == ".so"  # the temporary build directory is gone
    assert str(built[0]) in result.stdout and f"cache key {built[0].stem.split('-')[-1]}" in result.stdout
    again = _run_build({envs.XDG_CACHE_HOME: str(tmp_path)})  # safe twice: the cached file is reused
    assert again.returncode == 0 and again.stdout == result.stdout
    assert sorted((tmp_path / "servelm" / "kernels").iterdir()) == built


def test_building_ahead_of_time_without_a_compiler_fails_with_the_reason(tmp_path):
    result = _run_build({envs.C_COMPILER: str(tmp_path / "no-such-cc"), envs.XDG_CACHE_HOME: str(tmp_path)})
    assert result.returncode == 1
    assert "no-such-cc" in result.stderr and "pure-torch" in result.stderr
