"""A checkpoint's tokenizer alone, for every process that tokenizes (API server, router, engine
loaders): it reads tokenizer files and GGUF metadata, never weights, and imports no torch.

    HF directory  ─▶ tokenizer.json / tokenizer_config.json / tokenizer.model ─▶ AutoTokenizer
    .gguf file    ─▶ transformers' GGUF conversion
    either        ─▶ saved once under $SERVELM_CACHE_DIR/tokenizers, reloaded from there
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import time
from pathlib import Path
from typing import Any

import transformers

from servelm import envs
from servelm.default_model import default_model_path
from servelm.gguf_file import GGUFFile, read_gguf

# Any one of these means the directory carries a tokenizer AutoTokenizer can build.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")

logger = logging.getLogger(__name__)


def load_tokenizer(path: str | Path | None = None) -> Any:
    """The checkpoint's tokenizer (with its chat template); None means the default model."""
    resolved = default_model_path() if path is None else Path(path).expanduser()
    if resolved.is_dir():
        return load_hf_tokenizer(resolved)
    if resolved.is_file() and resolved.suffix.lower() == ".gguf":
        return load_gguf_tokenizer(resolved)
    raise FileNotFoundError(f"no tokenizer at {resolved}: expected a Hugging Face model directory or a .gguf file")


def load_hf_tokenizer(path: Path) -> Any:
    """The directory's own tokenizer; never reaches for the hub.

    AutoTokenizer reads the directory's config.json through AutoConfig, which imports the model
    type's transformers modules and, through them, torch.distributed and sympy: ~3 s of every
    process's start-up (API server, engine core, router) on a 2-core host. The tokenizer saved
    once under the cache dir (no config.json beside it) reloads as the same class from the same
    files in well under a second.
    """
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        found = ", ".join(sorted(p.name for p in path.iterdir())) or "nothing" if path.is_dir() else "no such directory"
        raise FileNotFoundError(f"no tokenizer in {path}: expected one of {list(TOKENIZER_FILES)}, found {found}")
    cached = hf_tokenizer_cache_path(path)
    if cached.is_dir():
        return _load_saved(cached)
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(path), local_files_only=True)
    _save_atomically(tokenizer, cached)
    return tokenizer


# Files that never shape a tokenizer: left out of its cache key.
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf")


def hf_tokenizer_cache_path(path: Path) -> Path:
    """Keyed by the contents of every file of the directory but its weights (tokenizer files,
    config.json, chat template: an edited one gets a new entry) and the transformers version.
    By content, not by path: copies of one checkpoint share an entry."""
    digest = hashlib.sha256()
    for entry in sorted(path.iterdir()):
        if entry.is_file() and not entry.name.endswith(_WEIGHT_SUFFIXES):
            digest.update(f"{entry.name}\0{entry.stat().st_size}\0".encode())
            digest.update(entry.read_bytes())
    return envs.cache_dir() / "tokenizers" / f"hf-{digest.hexdigest()[:24]}-transformers-{transformers.__version__}"


def load_gguf_tokenizer(path: Path, header: GGUFFile | None = None) -> Any:
    """The tokenizer the GGUF metadata describes, carrying the file's chat template.

    transformers' GGUF conversion re-reads the file and rebuilds the BPE (about 9 s for the
    default model on 2 shared cores), so the result is saved once under the cache dir and
    reloaded from there (well under a second). `header`: the file's, when the caller has parsed
    it already (it keys the cache; its `tokenizer.chat_template` is enforced in case the
    conversion dropped it); read here otherwise (memory-mapped, the header only).
    """
    header = header if header is not None else read_gguf(path)
    cached = tokenizer_cache_path(path, header)
    if cached.is_dir():
        return _load_saved(cached)
    started = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(
        str(path.parent), gguf_file=path.name, local_files_only=True
    )
    chat_template = header.metadata.get("tokenizer.chat_template")
    if chat_template and tokenizer.chat_template != chat_template:
        tokenizer.chat_template = chat_template
    logger.info("converted the tokenizer of %s in %.1f s", path.name, time.perf_counter() - started)
    _save_atomically(tokenizer, cached)
    return tokenizer


def _load_saved(cached: Path) -> Any:
    """A tokenizer `_save_atomically` wrote, loaded by the class its tokenizer_config.json names.
    AutoTokenizer resolves the same class through transformers' auto machinery, which imports
    torch for its config utilities: ~2.5 s of an API process or router that needs no torch."""
    try:
        name = json.loads((cached / "tokenizer_config.json").read_text())["tokenizer_class"]
        tokenizer_class = None if name.endswith("Fast") else getattr(transformers, name, None)
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        tokenizer_class = None
    if tokenizer_class is None:  # a legacy "...Fast" name, or one only the auto machinery maps
        return transformers.AutoTokenizer.from_pretrained(str(cached), local_files_only=True)
    return tokenizer_class.from_pretrained(str(cached), local_files_only=True)


def tokenizer_cache_path(path: Path, header: GGUFFile | None = None) -> Path:
    """Keyed by the file's header (every metadata value, the vocabulary and chat template among
    them, and the tensor directory: a few MB, memory-mapped) and the converter's version. By
    content, not by size and mtime: a copy of the file (a peer's pull, a model store's) hits.
    `header`: the file's parsed header, if the caller has it (else it is read)."""
    header = header if header is not None else read_gguf(path)
    with path.open("rb") as file:
        digest = hashlib.sha256(file.read(header.data_offset)).hexdigest()[:24]
    return envs.cache_dir() / "tokenizers" / f"{path.stem}-{digest}-transformers-{transformers.__version__}"


def _save_atomically(tokenizer: Any, target: Path) -> None:
    # Write beside the target and rename, so a concurrent or interrupted load never sees half a tokenizer.
    partial = target.with_name(f"{target.name}.partial-{os.getpid()}")
    try:
        tokenizer.save_pretrained(str(partial))
        os.rename(partial, target)
    except OSError as exc:  # read-only home, or another process won the rename: the load still succeeds
        if not target.is_dir():
            logger.warning("could not cache the tokenizer at %s: %s", target, exc)
    finally:
        shutil.rmtree(partial, ignore_errors=True)
