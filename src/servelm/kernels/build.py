"""Builds servelm's CPU kernels (`csrc/*.c`) into one shared library in a per-user cache.

Called by `servelm.kernels.cpu.load()` on first use, and ahead of time by `make setup`
through `python -m servelm.kernels.build` (prints where it built and the cache key).

Why plain C + ctypes and not a torch C++ extension (`torch.utils.cpp_extension`): the
kernels need no torch headers (they take raw float/int8/int32 pointers), so the system C
compiler builds them in about a second, where a torch extension takes about a minute per
machine, needs ninja and a C++ toolchain matching torch's ABI, and is rebuilt on every torch
upgrade. ctypes releases the GIL during the call. The library's OpenMP calls bind to the
libgomp torch has already loaded (same soname, libgomp.so.1), so kernels and torch share one
thread pool. What it costs: about a microsecond of ctypes overhead per call, and the argument
checks live in Python (`servelm.kernels.cpu`) instead of in a C++ wrapper.

Flags follow the CPU found at run time: `-mavx2 -mfma` where /proc/cpuinfo reports both (plus
`-mf16c` and `-mavx512f` where it reports those too), nothing extra elsewhere (the C sources then
take their scalar loops). Never `-march=native`:
the cache may be shared by machines with different CPUs (a home directory on NFS, a CI
cache), so the features a build assumes are spelled out in its flags, and the flags are in
the key:

    key = sha256(source names and bytes, flags, compiler path, `compiler --version`, machine)
    file = <cache>/servelm_cpu_kernels-<key>.so

A build compiles in a temporary directory beside the target and renames the result into
place (atomic), so concurrent builders (several engine processes, `make -j`) all end with
one whole file. Building twice is safe: an existing target is reused as is.
"""

from __future__ import annotations

import hashlib
import os
import platform
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from servelm import envs

SOURCE_DIR = Path(__file__).parent / "csrc"
LIBRARY_STEM = "servelm_cpu_kernels"
BASE_FLAGS = ("-O3", "-fPIC", "-shared", "-fopenmp", "-ffp-contract=off")
COMPILER_CANDIDATES = ("cc", "gcc", "clang")
COMPILE_TIMEOUT_S = 120


class KernelBuildError(RuntimeError):
    """The kernels cannot be built here (no compiler, a compile error, an unwritable cache)."""


@dataclass(frozen=True)
class Toolchain:
    compiler: str  # absolute path of the C compiler
    version: str  # its `--version` output: the same path may hold another compiler tomorrow


@dataclass(frozen=True)
class BuiltLibrary:
    path: Path  # the shared library, inside the cache directory
    key: str  # the cache key it was built under
    flags: tuple[str, ...]
    toolchain: Toolchain


def source_files() -> tuple[Path, ...]:
    """The C sources and headers the library is built from, in a stable order."""
    return tuple(sorted([*SOURCE_DIR.glob("*.c"), *SOURCE_DIR.glob("*.h")]))


def find_toolchain(compiler: str | None = None) -> Toolchain:
    """The compiler to build with: `compiler`, else $CC, else the first of cc, gcc, clang on PATH."""
    wanted = compiler or envs.c_compiler()
    if wanted is not None:
        path = shutil.which(wanted)
        if path is None:
            raise KernelBuildError(f"C compiler {wanted!r} not found (from {'the caller' if compiler else '$CC'})")
    else:
        path = next((p for p in map(shutil.which, COMPILER_CANDIDATES) if p is not None), None)
        if path is None:
            raise KernelBuildError(f"no C compiler on PATH (looked for {', '.join(COMPILER_CANDIDATES)}; set $CC)")
    try:
        result = subprocess.run([path, "--version"], capture_output=True, text=True, timeout=30, check=True)
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"C compiler {path!r} does not run: {exc}") from exc
    return Toolchain(compiler=os.path.realpath(path), version=result.stdout.strip())


# The /proc/cpuinfo flags the kernels use; each tier's flags go on only above the AVX2 + FMA base.
KERNEL_FEATURES = frozenset({"avx2", "fma", "f16c", "avx512f"})
_EXTRA_FLAGS = (("f16c", "-mf16c"), ("avx512f", "-mavx512f"))


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> frozenset[str]:
    """The x86 feature flags of this machine's CPU that the kernels can use ({} when unknown)."""
    try:
        text = cpuinfo.read_text()
    except OSError:
        return frozenset()
    line = next((ln for ln in text.splitlines() if ln.startswith("flags")), "")
    return frozenset(line.partition(":")[2].split()) & KERNEL_FEATURES


def compile_flags(features: frozenset[str]) -> tuple[str, ...]:
    """Flags for a CPU with `features`: SIMD code only where both AVX2 and FMA are there, and F16C /
    AVX-512F code on top of those where the CPU has them too."""
    if not {"avx2", "fma"} <= features:
        return BASE_FLAGS
    return (*BASE_FLAGS, "-mavx2", "-mfma", *(flag for feature, flag in _EXTRA_FLAGS if feature in features))


def cache_key(sources: tuple[Path, ...], flags: tuple[str, ...], toolchain: Toolchain) -> str:
    """Changes whenever the bytes built, the flags, or the compiler (path or version) change."""
    digest = hashlib.sha256()
    for part in (*flags, toolchain.compiler, toolchain.version, platform.machine()):
        digest.update(part.encode() + b"\0")
    for source in sources:
        digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return digest.hexdigest()[:16]


def default_cache_dir() -> Path:
    return envs.cache_dir() / "kernels"


def build(
    cache_dir: Path | None = None, compiler: str | None = None, features: frozenset[str] | None = None
) -> BuiltLibrary:
    """The library for this machine, compiled unless the cache already holds it.

    `features`: build for a CPU with only these (a subset of this one's: the tests build the AVX2
    and plain-C loops on an AVX-512 machine); None: this machine's `cpu_features()`.
    Raises KernelBuildError when it cannot be built; never leaves a partial file at the target.
    """
    toolchain = find_toolchain(compiler)
    flags = compile_flags(cpu_features() if features is None else features)
    sources = source_files()
    key = cache_key(sources, flags, toolchain)
    directory = cache_dir or default_cache_dir()
    target = directory / f"{LIBRARY_STEM}-{key}.so"
    if not target.exists():
        _compile(toolchain, flags, [s for s in sources if s.suffix == ".c"], target)
    return BuiltLibrary(path=target, key=key, flags=flags, toolchain=toolchain)


def _compile(toolchain: Toolchain, flags: tuple[str, ...], sources: list[Path], target: Path) -> None:
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent, prefix=".build-") as tmp:
            built = Path(tmp) / target.name
            command = [toolchain.compiler, *flags, *map(str, sources), "-o", str(built)]
            subprocess.run(command, check=True, capture_output=True, text=True, timeout=COMPILE_TIMEOUT_S)
            os.replace(built, target)  # atomic: a concurrent builder's rename only swaps equal files
    except subprocess.CalledProcessError as exc:
        raise KernelBuildError(f"{toolchain.compiler} failed:\n{exc.stderr[-2000:]}") from exc
    except (OSError, subprocess.SubprocessError) as exc:
        raise KernelBuildError(f"cannot build into {target.parent}: {exc}") from exc


def main() -> int:
    """`python -m servelm.kernels.build`: build now (or find the cached build); 1 if it cannot."""
    try:
        library = build()
    except KernelBuildError as exc:
        print(f"servelm CPU kernels not built, the pure-torch paths will be used: {exc}", file=sys.stderr)
        return 1
    print(f"servelm CPU kernels: {library.path}")
    print(f"cache key {library.key} ({library.toolchain.compiler} {' '.join(library.flags)})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
