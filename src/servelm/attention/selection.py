"""Which attention backend a model gets: a registered name, with "auto" resolved for its device.

    auto    "triton" on CUDA when triton imports (unless SERVELM_KERNELS=torch), else "torch"
    torch   the reference backend (torch_backend.py): any device
    triton  the Triton kernels (triton_backend.py): CUDA, or CPU under TRITON_INTERPRET=1 (tests)

Resolved once per model, where it is built (`models.factory.build_model`: the engine's model, a
draft model, every rank's shard), so every caller passes the configured name through unchanged.

"triton" registers here, lazily: importing its module imports triton (an optional dependency,
the `gpu` extra), whose @triton.jit decides compiled vs interpreted when a kernel is defined, so
nothing imports it before a model asks for it.
"""

from __future__ import annotations

import importlib
import logging

import torch

import servelm.attention.torch_backend  # noqa: F401  (registers "torch")
from servelm import envs
from servelm.attention.backend import AttentionBackend, register_backend

logger = logging.getLogger(__name__)

AUTO = "auto"


def _triton_backend() -> AttentionBackend:
    from servelm.attention.triton_backend import TritonAttentionBackend

    return TritonAttentionBackend()


register_backend("triton", _triton_backend)


def triton_importable() -> bool:
    try:
        importlib.import_module("triton")
    except ImportError:
        return False
    return True


def resolve_backend_name(name: str, device: torch.device) -> str:
    """The registered backend `name` stands for on `device` ("auto" resolved; others as given).

    Raises ValueError for "triton" where it cannot run: triton not installed, or a device other
    than CUDA without TRITON_INTERPRET=1 (the interpreter: correct, slow; for tests)."""
    if name == AUTO:
        use_triton = device.type == "cuda" and envs.kernels_mode() is not envs.KernelsMode.TORCH and triton_importable()
        resolved = "triton" if use_triton else "torch"
        logger.info("attention backend: %s (auto on %s)", resolved, device)
        return resolved
    if name == "triton":
        if not triton_importable():
            raise ValueError("--attention-backend triton needs triton installed (pip install 'servelm[gpu]')")
        if device.type != "cuda" and not envs.triton_interpret():
            raise ValueError(
                f"--attention-backend triton runs on CUDA; on {device} only under Triton's interpreter "
                f"({envs.TRITON_INTERPRET}=1 in the environment, slow: for tests). Use --attention-backend auto or torch"
            )
    return name
