"""The model a draft-model proposer runs: a smaller checkpoint, or the target's own first layers.

    separate checkpoint    its own modules and its own KV pool, with the target's num_blocks and
                           block_size: addressed by the same block ids, so the target's block
                           tables serve both (the scheduler allocates for the two at once)
    self-speculative (N)   the target's first N decoder layers + its final norm and lm_head (no new
                           weights), reading and writing the target's first N KV caches

Why a self-speculative draft may write into the target's KV: at every position the target has
computed, its first N layers' K/V are exactly what the draft would compute there (same modules,
same tokens), so the draft needs no catch-up; and it only writes positions the target has not
computed yet (the request's last token and the guesses after it), which the target always
rewrites before it reads them. Those positions lie past the request's prefix-cached blocks, so no
other request reads them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch

from servelm.attention.kv_storage import LayerKVCache
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.llama import LlamaForCausalLM
from servelm.models.loader import load_checkpoint
from servelm.worker.kv_cache import allocate_kv_caches, bytes_per_block

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class DraftModel:
    model: LlamaForCausalLM
    num_layers: int  # decoder layers each draft forward runs (all of a separate model's)
    kv_caches: list[LayerKVCache]  # one per layer run: [2, num_blocks, block_size, KVH, D] (kv_storage.py)
    # True for the target's first layers: its K/V at the target's computed positions are the target's.
    shares_target_kv: bool

    @classmethod
    def first_layers_of(
        cls, target: LlamaForCausalLM, target_kv_caches: list[LayerKVCache], num_layers: int
    ) -> DraftModel:
        """A self-speculative draft: the target's first `num_layers` layers with its norm and head."""
        num_target_layers = target.arch.num_hidden_layers
        if not 1 <= num_layers <= num_target_layers:
            raise ValueError(
                f"draft_num_layers must be in 1..{num_target_layers} (the target's layers), got {num_layers}"
            )
        return cls(target, num_layers, target_kv_caches[:num_layers], shares_target_kv=True)

    @classmethod
    def separate(cls, model: LlamaForCausalLM, num_blocks: int, block_size: int, kv_dtype: torch.dtype) -> DraftModel:
        """A model of its own, with a KV pool of its own of `num_blocks` blocks (the target's count),
        storing `kv_dtype` as the target's pool does (the pool's budget was sized for that)."""
        weight = model.embed_tokens.weight
        kv_caches = allocate_kv_caches(model.arch, num_blocks, block_size, kv_dtype, weight.device)
        logger.info(
            "draft model: %d layers; its KV pool takes %.1f MiB next to the target's (%d blocks)",
            model.arch.num_hidden_layers,
            bytes_per_block(model.arch, block_size, kv_dtype) * num_blocks / 2**20,
            num_blocks,
        )
        return cls(model, model.arch.num_hidden_layers, kv_caches, shares_target_kv=False)


def load_draft_model(
    path: str, target: LlamaForCausalLM, target_tokenizer: Any, attention_backend: str
) -> LlamaForCausalLM:
    """Load a draft checkpoint in the target's dtype on its device (its KV pool comes later, with
    `DraftModel.separate`, once the pool's size is known).

    Raises ValueError when its vocabulary is not the target's (see `check_same_vocabulary`), and what
    `load_checkpoint` raises for a path it cannot load.
    """
    checkpoint = load_checkpoint(path)
    check_same_vocabulary(checkpoint.arch, checkpoint.tokenizer, target.arch, target_tokenizer, checkpoint.source)
    weight = target.embed_tokens.weight
    model = build_model(checkpoint.arch, checkpoint.weights, weight.dtype, weight.device, attention_backend)
    del checkpoint.weights  # the model holds its own copies now
    logger.info("draft model %s loaded (%d layers)", checkpoint.source, checkpoint.arch.num_hidden_layers)
    return model


def check_same_vocabulary(
    draft_arch: ModelArchConfig, draft_tokenizer: Any, target_arch: ModelArchConfig, target_tokenizer: Any, source: str
) -> None:
    """A draft's token ids must mean the target's: same vocab_size, and the same tokenizer
    vocabulary when both checkpoints carry one. Raises ValueError naming the difference."""
    if draft_arch.vocab_size != target_arch.vocab_size:
        raise ValueError(
            f"draft model {source} has vocab_size {draft_arch.vocab_size}, the target {target_arch.vocab_size}: "
            "a draft model must share the target's tokenizer"
        )
    if draft_tokenizer is None or target_tokenizer is None:
        return
    draft_vocab, target_vocab = draft_tokenizer.get_vocab(), target_tokenizer.get_vocab()
    if draft_vocab != target_vocab:
        differing = sorted(set(draft_vocab.items()) ^ set(target_vocab.items()), key=str)[:3]
        raise ValueError(
            f"draft model {source} has a different tokenizer from the target's (e.g. {differing}): "
            "a draft model must share the target's tokenizer"
        )
