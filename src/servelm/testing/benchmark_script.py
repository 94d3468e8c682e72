"""benchmarks/ scripts in tests: imported as a module (benchmarks/ is not a package) for their pure
parts, or run end to end at a tiny size."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from types import ModuleType


def load_benchmark_script(path: Path, module_name: str) -> ModuleType:
    """Execute the script at `path` as module `module_name` (registered in sys.modules, where
    dataclasses resolve their annotations); its `if __name__ == "__main__"` block does not run."""
    spec = importlib.util.spec_from_file_location(module_name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path} as a module")
    module = importlib.util.module_from_spec(spec)
    sys.modules[module_name] = module
    spec.loader.exec_module(module)
    return module


def run_benchmark_script(script: Path, args: list[str], timeout_s: float) -> subprocess.CompletedProcess[str]:
    """Run a benchmarks/ script as its user would (a fresh interpreter, this one's import path),
    output captured: the smoke tests' way of showing a script still runs end to end."""
    environment = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    return subprocess.run([sys.executable, str(script), *args], capture_output=True, text=True,
                          timeout=timeout_s, env=environment)  # fmt: skip
