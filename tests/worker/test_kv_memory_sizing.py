"""KV pool sizing on an accelerator (--gpu-memory-utilization) as arithmetic, its error, the worst-case
step it profiles, and what a request that runs out of device memory is told.

The profiling itself (torch.cuda peak statistics around the worst-case step) runs on CUDA only;
here the step runs on CPU, which catches its shape and metadata mistakes, and the arithmetic is
checked with numbers.
"""

from __future__ import annotations

import pytest
import torch

from servelm.cli import build_parser, engine_config_from_args
from servelm.engine.core import step_error
from servelm.models.factory import build_model
from servelm.models.loader import load_checkpoint
from servelm.worker.kv_cache import (
    DEVICE_MEMORY_RESERVE_BYTES,
    DeviceMemoryProfile,
    InsufficientKVMemoryError,
    kv_blocks_for_device,
)
from servelm.worker.memory_profile import worst_case_step

GIB, MIB = 2**30, 2**20
# An 80 GiB device with an 8B-class model in bf16: 16 GiB of weights, 2 GiB of activations at the
# profiled 8192-token step, 0.5 GiB of CUDA context and workspaces.
H100 = DeviceMemoryProfile(total=80 * GIB, weights=16 * GIB, peak_activation=2 * GIB, non_torch=GIB // 2,
                           profiled_tokens=8192)  # fmt: skip
BLOCK_BYTES = 2 * MIB  # 16 tokens x 32 layers x 8 KV heads x 128 x 2 (K, V) x 2 bytes


def test_kv_gets_what_utilization_leaves_after_weights_activation_and_reserve() -> None:
    blocks = kv_blocks_for_device(H100, 0.9, BLOCK_BYTES, block_size=16, max_model_len=8192, reserve=GIB // 2)
    # 80 x 0.9 = 72 GiB; 72 - 16 - 2 - 0.5 - 0.5 = 53 GiB of 2 MiB blocks.
    assert blocks == 53 * 512
    # The default reserve is the stated one; every term is subtracted once.
    assert kv_blocks_for_device(H100, 0.9, BLOCK_BYTES, 16, 8192) == (
        int(72 * GIB) - 16 * GIB - 2 * GIB - GIB // 2 - DEVICE_MEMORY_RESERVE_BYTES
    ) // BLOCK_BYTES
    # A whole device, and a partial block rounds down.
    assert kv_blocks_for_device(H100, 1.0, 3 * MIB, 16, 8192, reserve=0) == (61 * GIB + GIB // 2) // (3 * MIB)


def test_too_little_memory_for_one_max_model_len_request_names_every_number() -> None:
    # 0.3 x 80 = 24 GiB; 24 - 18.5 - 0.5 = 5 GiB = 2560 blocks = 40960 tokens < 131072.
    with pytest.raises(InsufficientKVMemoryError) as error:
        kv_blocks_for_device(H100, 0.3, BLOCK_BYTES, block_size=16, max_model_len=131072, reserve=GIB // 2)
    message = str(error.value)
    for part in ("max_model_len 131072", "8192 blocks of 2.00 MiB", "80.00 GiB x --gpu-memory-utilization 0.3",
                 "weights take 16.00 GiB", "8192-token step 2.00 GiB", "outside torch", "0.50 GiB",
                 "reserve for CUDA graphs 0.50 GiB", "leaving 5.00 GiB", "Raise --gpu-memory-utilization",
                 "--max-model-len (to 40960 at most)", "--max-num-batched-tokens"):  # fmt: skip
        assert part in message, (part, message)
    # The weights alone exceed the share: nothing is left, and the message says so (negative).
    with pytest.raises(InsufficientKVMemoryError, match="leaving -3.00 GiB") as error:
        kv_blocks_for_device(H100, 0.2, BLOCK_BYTES, 16, 16, reserve=GIB // 2)
    assert "--max-model-len" not in str(error.value)  # no shorter context would fit either
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        kv_blocks_for_device(H100, 1.5, BLOCK_BYTES, 16, 16)


def test_the_flag_reaches_the_cache_config_and_is_validated() -> None:
    config = engine_config_from_args(build_parser().parse_args(["serve", "--gpu-memory-utilization", "0.75"]))
    assert config.cache.gpu_memory_utilization == 0.75
    assert engine_config_from_args(build_parser().parse_args(["serve"])).cache.gpu_memory_utilization == 0.9
    for bad in ("0", "1.2"):
        with pytest.raises(ValueError, match="gpu_memory_utilization must be in"):
            engine_config_from_args(build_parser().parse_args(["serve", "--gpu-memory-utilization", bad]))


@pytest.mark.parametrize("num_tokens, max_model_len, rows", [(100, 32, 8), (64, 64, 128), (7, 1024, 3)])
def test_the_profiled_worst_case_step_runs(tiny_dir, num_tokens: int, max_model_len: int, rows: int) -> None:
    """Several full-length prompts and a remainder, more sample rows than tokens, a short step."""
    checkpoint = load_checkpoint(tiny_dir)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    worst_case_step(model, num_tokens, max_model_len, rows)


def test_a_request_out_of_device_memory_is_told_so() -> None:
    message = step_error(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    assert "OutOfMemoryError" in message and "even alone" in message and "--max-num-batched-tokens" in message
    assert "Tried to allocate" not in message  # internals stay in the log
    assert step_error(IndexError("index 49159 is out of bounds")) == "the engine step failed: IndexError"
