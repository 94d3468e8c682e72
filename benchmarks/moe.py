"""Mixtures of experts and latent attention on this host (issue 41): what a decode step costs against
the dense model of the same active parameters, and how many tokens a KV budget holds under MLA.

cost      Two random float32 checkpoints with one attention and embedding shape: a Qwen3-MoE of 64
          experts, top-2 (each expert `--expert-width` wide), and the dense Qwen3 whose MLP is twice
          that width (the same active parameters per token). The real engine (paging, the default
          CPU paths) decodes `--batches` requests at once; each engine step in which every request
          decoded one token is timed (median). Targets: MoE / dense <= 1.5x at batch 1, <= 2.5x at 16.
capacity  The KV pool the allocator builds for a fixed budget (`--kv-mib`, bfloat16) under DeepSeek-V3's
          real config (tests/models/data/deepseek_v3_config.json: a latent of 512 + a RoPE key of 64 per token
          and layer) against the same model with full heads (128 heads, K and V of 128 each: 32,768
          elements per token and layer, the issue's figure). Target: >= 50x the tokens.

    PYTHONPATH=src .venv/bin/python benchmarks/moe.py [--parts cost,capacity]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from gpu_checks import decode_step_times

from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.models.arch import ModelArchConfig
from servelm.testing.tiny_model import write_random_checkpoint
from servelm.worker.kv_cache import allocate_kv_caches, num_blocks_for_budget

REPO = Path(__file__).resolve().parents[1]
V3_CONFIG = REPO / "tests" / "models" / "data" / "deepseek_v3_config.json"
# The shared shape: attention and embedding as a ~1B-class model's, narrowed to what this host holds.
BASE = {"hidden_size": 1024, "num_hidden_layers": 8, "num_attention_heads": 16, "num_key_value_heads": 4,
        "head_dim": 64, "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 4096}  # fmt: skip


def cost(args: argparse.Namespace) -> list[dict]:
    width = args.expert_width
    models = {
        "moe": {"architectures": ["Qwen3MoeForCausalLM"], "intermediate_size": 2 * width, "num_experts": 64,
                "num_experts_per_tok": 2, "moe_intermediate_size": width, "norm_topk_prob": True},  # fmt: skip
        "dense": {"architectures": ["Qwen3ForCausalLM"], "intermediate_size": 2 * width},
    }
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name, overrides in models.items():
            path = write_random_checkpoint(Path(tmp) / name, torch.float32, **{**BASE, **overrides})
            built = build_engine(EngineConfig.from_flat(model=str(path), num_blocks=512, block_size=16, max_step_ms=0,
                                                        max_num_seqs=max(args.batches)))  # fmt: skip
            try:
                for batch in args.batches:
                    decode_step_times(built, batch, "cpu", f"warm-{name}-{batch}", steps=4)
                    times = decode_step_times(built, batch, "cpu", f"{name}-{batch}", steps=args.steps)
                    rows.append({"model": name, "batch": batch, "step_ms": 1e3 * statistics.median(times)})
                    print(json.dumps(rows[-1]), flush=True)
            finally:
                built.core.close()
    return rows


def capacity(args: argparse.Namespace) -> dict:
    latent = ModelArchConfig.from_hf_config(json.loads(V3_CONFIG.read_text()))
    assert latent.mla is not None
    full = dataclasses.replace(latent, mla=None, num_key_value_heads=latent.num_attention_heads, head_dim=128)
    budget = args.kv_mib << 20
    tokens = {}
    for name, arch in (("latent", latent), ("full heads", full)):
        num_blocks = num_blocks_for_budget([arch], 16, torch.bfloat16, budget)
        caches = allocate_kv_caches(arch, num_blocks, 16, torch.bfloat16, torch.device("cpu"))
        held = sum(cache.nbytes for cache in caches)  # what the allocator actually made
        tokens[name] = {"blocks": num_blocks, "tokens": num_blocks * 16, "bytes": held,
                        "elements_per_token_layer": arch.kv_planes * arch.kv_cache_heads * arch.kv_cache_head_dim}  # fmt: skip
        del caches
    ratio = tokens["latent"]["tokens"] / tokens["full heads"]["tokens"]
    return {**tokens, "ratio": ratio, "budget_mib": args.kv_mib}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--parts", default="cost,capacity")
    parser.add_argument("--batches", type=lambda s: [int(b) for b in s.split(",")], default=[1, 16])
    parser.add_argument("--steps", type=int, default=24)
    parser.add_argument("--expert-width", type=int, default=512)
    parser.add_argument("--kv-mib", type=int, default=1024)
    args = parser.parse_args()
    parts = set(args.parts.split(","))
    if "cost" in parts:
        rows = cost(args)
        step = {(r["model"], r["batch"]): r["step_ms"] for r in rows}
        print("\n| batch | dense step (ms) | MoE 64 experts top-2 step (ms) | MoE / dense | target |")
        print("|---:|---:|---:|---:|---|")
        for batch in args.batches:
            ratio = step["moe", batch] / step["dense", batch]
            limit = 1.5 if batch == 1 else 2.5
            print(f"| {batch} | {step['dense', batch]:.1f} | {step['moe', batch]:.1f} | {ratio:.2f}x | "
                  f"<= {limit}x: {'met' if ratio <= limit else 'not met'} |")  # fmt: skip
    if "capacity" in parts:
        c = capacity(args)
        print(f"\n| KV budget {c['budget_mib']} MiB, bfloat16, DeepSeek-V3 (61 layers) | elements / token / layer | "
              "blocks of 16 | tokens |")  # fmt: skip
        print("|---|---:|---:|---:|")
        for name in ("latent", "full heads"):
            t = c[name]
            print(f"| {name} | {t['elements_per_token_layer']} | {t['blocks']} | {t['tokens']} |")
        print(f"\nlatent / full heads: {c['ratio']:.1f}x the tokens (target >= 50x: {'met' if c['ratio'] >= 50 else 'not met'})")


if __name__ == "__main__":
    main()
