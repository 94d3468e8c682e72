"""A checkpoint's tokenizer alone, for every process that tokenizes (API server, router, engine
loaders): it reads tokenizer files and GGUF metadata, never weights, and imports no torch.

    HF directory  ─▶ tokenizer.json / tokenizer_config.json / tokenizer.model ─▶ AutoTokenizer
    .gguf file    ─▶ transformers' GGUF conversion, cached under $SERVELM_CACHE_DIR/tokenizers
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import transformers
from gguf import GGUFReader

from servelm import envs
from servelm.default_model import default_model_path

# Any one of these means the directory carries a tokenizer AutoTokenizer can build.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path | None = None) -> Any:
    """The checkpoint's tokenizer (with its chat template); None means the default model."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if resolved.is_dir():
        return load_hf_tokenizer(resolved)
    if resolved.is_file() and resolved.suffix.lower() == ".gguf":
        # The reader memory-maps the file; only metadata is touched here.
        field = GGUFReader(resolved).fields.get("tokenizer.chat_template")
        return load_gguf_tokenizer(resolved, chat_template=field.contents() if field is not None else None)
    raise FileNotFoundError(f"no tokenizer at {resolved}: expected a Hugging Face model directory or a .gguf file")


def load_hf_tokenizer(path: Path) -> Any:
    """The directory's own tokenizer; never reaches for the hub."""
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing" if path.is_dir() else "no such directory"
        raise FileNotFoundError(f"no tokenizer in {path}: expected one of {list(TOKENIZER_FILES)}, found {found}")
    return transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)


def load_gguf_tokenizer(path: Path, chat_template: str | None = None) -> Any:
    """The tokenizer the GGUF metadata describes, carrying the file's chat template.

    transformers' GGUF conversion re-reads the file and rebuilds the BPE (about 9 s for the
    default model on 2 shared cores), so the result is saved once under the cache dir and
    reloaded from there (well under a second). `chat_template`, when given, is the file's
    `tokenizer.chat_template`, enforced in case the conversion dropped it.
    """
    cached = tokenizer_cache_path(path)
    if cached.is_dir():
        return transformers.AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    started = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    if chat_template and tokenizer.chat_template != chat_template:
        tokenizer.chat_template = chat_template
    logger.info("converted the tokenizer of %s in %.1f s", path.name, time.perf_counter() - started)
    _save_atomically(tokenizer, cached)
    return tokenizer


def tokenizer_cache_path(path: Path) -> Path:
    """Keyed by size and mtime (a replaced file gets a new entry) and the converter's version."""
    stat = path.stat()
    key = f"{path.stem}-{stat.st_size}-{stat.st_mtime_ns}-transformers-{transformers.__version__}"
    return envs.cache_dir() / "tokenizers" / key


def _save_atomically(tokenizer: Any, target: Path) -> None:
    # Write beside the target and rename, so a concurrent or interrupted load never sees half a tokenizer.
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(partial))
        os.rename(partial, target)
    except OSError as exc:  # read-only home, or another process won the rename: the load still succeeds
        logger.warning("could not cache the converted tokenizer at %s: %s", target, exc)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
