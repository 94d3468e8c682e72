"""servelm: an LLM inference server for mixed production traffic."""

from __future__ import annotations

from typing import Any

__all__ = ["LLM", "SamplingParams"]


def __getattr__(name: str) -> Any:
    # Lazy, so `import servelm.kv` (torch-free by design) does not pull in torch.
    if name == "LLM":
        from servelm.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from servelm.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(f"module 'servelm' has no attribute {name!r}")
