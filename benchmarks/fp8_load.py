"""Loading an FP8 block-scaled checkpoint on CPU: peak host memory against the converted weights (issue 41).

A random DeepSeek-V3-shaped checkpoint (latent attention, routed and shared experts, a dense first
layer; decoder linear weights FP8 e4m3 with a float32 scale per 128 x 128 block, the rest bfloat16)
is written in shards with an index, as published. A fresh interpreter then loads it the way the
engine does (`load_hf_directory` + `build_model`, dequantizing tensor by tensor at load) and reports:

    converted   bytes of the built model's parameters and buffers (what the weights take once loaded)
    growth      peak RSS during the load - RSS before it (VmHWM, after imports and a tokenizer warm-up)
    target      growth <= 1.3 x converted (issue 41: "peak RSS at most 1.3x the converted weights")

    PYTHONPATH=src .venv/bin/python benchmarks/fp8_load.py                       # ~2.4 GB float32 model
    PYTHONPATH=src .venv/bin/python benchmarks/fp8_load.py --dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from servelm.testing.tiny_model import write_random_checkpoint

# DeepSeek-V3's structure at ~1/7 of its width and 1/15 of its depth: ~600M parameters.
V3_SHAPED: dict[str, object] = {
    "architectures": ["DeepseekV3ForCausalLM"], "vocab_size": 32000, "hidden_size": 1024, "intermediate_size": 2816,
    "num_hidden_layers": 4, "num_attention_heads": 16, "num_key_value_heads": 16, "q_lora_rank": 384,
    "kv_lora_rank": 256, "qk_nope_head_dim": 64, "qk_rope_head_dim": 32, "v_head_dim": 64,
    "moe_intermediate_size": 512, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_group": 8, "topk_group": 4,
    "n_shared_experts": 1, "first_k_dense_replace": 1, "routed_scaling_factor": 2.5, "norm_topk_prob": True,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "max_position_embeddings": 4096,
}  # fmt: skip

_MEASURE = r"""
import json, sys
from pathlib import Path

import torch

from servelm.models.factory import DTYPES, build_model
from servelm.models.hf_loader import load_hf_directory
from servelm.tokenization.loading import load_hf_tokenizer

def rss() -> int:
    return int(open("/proc/self/statm").read().split()[1]) * 4096

path, dtype = Path(sys.argv[1]), DTYPES[sys.argv[2]]
load_hf_tokenizer(path)  # its import and first-use cost is not the weights'
before = rss()
arch, weights, _ = load_hf_directory(path)
model = build_model(arch, weights, dtype, "cpu")
peak = next(int(line.split()[1]) * 1024 for line in open("/proc/self/status") if line.startswith("VmHWM:"))
converted = sum(t.numel() * t.element_size() for t in [*model.parameters(), *model.buffers()])
print(json.dumps({"rss_before": before, "peak_rss": peak, "rss_after": rss(), "converted": converted}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--shard-mb", type=int, default=256)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        path = write_random_checkpoint(Path(tmp) / "v3-shaped-fp8", max_shard_bytes=args.shard_mb << 20,
                                       fp8_block=(128, 128), **V3_SHAPED)  # fmt: skip
        files = sorted(path.glob("*.safetensors"))
        on_disk = sum(f.stat().st_size for f in files)
        result = subprocess.run([sys.executable, "-c", _MEASURE, str(path), args.dtype], capture_output=True,
                                text=True, timeout=1800)  # fmt: skip
        if result.returncode != 0:
            raise SystemExit(result.stderr[-3000:])
        m = json.loads(result.stdout.strip().splitlines()[-1])
    growth = m["peak_rss"] - m["rss_before"]
    ratio = growth / m["converted"]
    print(f"| checkpoint | shards | on disk MB | converted ({args.dtype}) MB | RSS before MB | peak RSS MB | "
          "growth MB | growth / converted | target <= 1.3x |")  # fmt: skip
    print("|---|---:|---:|---:|---:|---:|---:|---:|---|")
    print(f"| DeepSeek-V3-shaped, FP8 128x128 | {len(files)} | {on_disk / 1e6:.0f} | {m['converted'] / 1e6:.0f} | "
          f"{m['rss_before'] / 1e6:.0f} | {m['peak_rss'] / 1e6:.0f} | {growth / 1e6:.0f} | {ratio:.2f}x | "
          f"{'met' if ratio <= 1.3 else 'not met'} |")  # fmt: skip


if __name__ == "__main__":
    main()
