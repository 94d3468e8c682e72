"""The tokenizer alone, for the API process: it tokenizes and detokenizes but never loads weights."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gguf import GGUFReader

from servelm.models.default_model import default_model_path
from servelm.models.gguf_loader import _field, load_gguf_tokenizer
from servelm.models.hf_loader import load_hf_tokenizer


def load_tokenizer(path: str | Path | None = None) -> Any:
    """The checkpoint's tokenizer (with its chat template); None means the default model."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if resolved.is_dir():
        return load_hf_tokenizer(resolved)
    if resolved.is_file() and resolved.suffix.lower() == ".gguf":
        # The reader memory-maps the file; only metadata is touched here.
        template = _field(GGUFReader(resolved), "tokenizer.chat_template", None)
        return load_gguf_tokenizer(resolved, chat_template=template)
    raise FileNotFoundError(f"no tokenizer at {resolved}: expected a Hugging Face model directory or a .gguf file")
