"""Import a script of benchmarks/ as a module (benchmarks/ is not a package), for tests of its pure parts."""

from __future__ import annotations

import importlib.util
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
