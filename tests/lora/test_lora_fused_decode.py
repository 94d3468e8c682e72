"""LoRA adapter rows inside the fused decode call (csrc/decode_layers.c adds each row's adapter delta
after every matmul) against the op-by-op path (SERVELM_KERNELS=unfused, csrc/lora.c after each
matmul): a batch mixing the base model and two adapters gets the same greedy tokens and top
logprobs, and its decode steps with adapter rows do take the fused call."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from servelm.config import EngineConfig
from servelm.default_model import default_model_path
from servelm.engine.builder import assemble_engine
from servelm.engine.core import EngineCore
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.fused_decode import FusedDecodeLayers
from servelm.models.gguf_loader import gguf_hf_config, load_gguf_weights, open_gguf
from servelm.models.hf_loader import read_hf_config
from servelm.models.linear_methods import small_batch_kernel
from servelm.obs.startup import StartupTimeline
from servelm.testing.engine_run import EngineRun, assert_same_run, greedy_requests, run_requests
from servelm.testing.lora_adapters import write_peft_adapter
from servelm.testing.tiny_model import write_tiny_checkpoint, write_tiny_gguf
from servelm.tokenization.loading import load_gguf_tokenizer

pytestmark = pytest.mark.skipif(small_batch_kernel() is None, reason="no C compiler: the kernels cannot be built here")


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, dict[str, Path]]:
    """A tiny Q4_1 Llama and two adapters: rank 8 on every projection, rank 16 on q, v and down only."""
    root = tmp_path_factory.mktemp("lora-fused")
    hf_dir = write_tiny_checkpoint(root / "hf", arch="llama", seed=5, init_std=0.3)
    arch = read_hf_config(hf_dir)
    adapters = {"all8": write_peft_adapter(root / "all8", arch, 8, seed=8, std=0.2),
                "qvd16": write_peft_adapter(root / "qvd16", arch, 16, seed=16, std=0.2,
                                            targets=("q_proj", "v_proj", "down_proj"))}  # fmt: skip
    return write_tiny_gguf(root / "tiny.gguf", hf_dir, tensor_type=Q.Q4_1), adapters


def _engine(served: tuple[Path, dict[str, Path]]) -> EngineCore:
    path, adapters = served
    config = EngineConfig.from_flat(model=str(path), num_blocks=96, block_size=4, max_num_seqs=8, max_num_batched_tokens=64,
                                    max_step_ms=0, enable_lora=True, max_loras=2, max_lora_rank=16,
                                    lora_modules=[f"{name}={adapter}" for name, adapter in adapters.items()])  # fmt: skip
    reader = open_gguf(path)
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    model = build_model(arch, load_gguf_weights(reader, arch, source=str(path)), torch.float32, "cpu")
    return assemble_engine(config, model, arch, load_gguf_tokenizer(default_model_path()), str(path), None,
                           StartupTimeline()).core  # fmt: skip


def _run(core: EngineCore, names: list[str | None]) -> EngineRun:
    gen = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, 250, (n,), generator=gen).tolist() for n in (5, 12, 9, 20, 7, 3)]
    requests = greedy_requests(prompts, [24, 18, 30, 12, 26, 20])
    for request, name in zip(requests, names, strict=True):
        request.lora_name = name
        request.sampling_params.logprobs = 5
    return run_requests(core, requests, [0, 0, 1, 3, 3, 6])


def test_adapter_rows_in_the_fused_call_match_the_op_by_op_path(served, monkeypatch: pytest.MonkeyPatch) -> None:
    names: list[str | None] = [None, "all8", "qvd16", "all8", None, "qvd16"]
    core = _engine(served)
    fused = core.runner.model.fused_decode
    assert isinstance(fused, FusedDecodeLayers)
    adapter_rows_per_call: list[int] = []
    original_run = fused.run
    original_rows = fused._lora_rows
    assert original_rows is not None

    def counted(*args, **kwargs):
        rows = original_rows()
        adapter_rows_per_call.append(0 if rows is None else int((rows >= 0).sum()))
        return original_run(*args, **kwargs)

    fused.run = counted  # type: ignore[method-assign]
    got = _run(core, names)
    monkeypatch.setenv("SERVELM_KERNELS", "unfused")
    unfused = _engine(served)
    assert unfused.runner.model.fused_decode is None
    want = _run(unfused, names)
    assert_same_run(got, want)
    assert sum(1 for rows in adapter_rows_per_call if rows >= 2) > 20  # adapter rows went through the fused call
    base_only = _run(_engine(served), [None] * 6)
    assert base_only.tokens != got.tokens  # the adapters change the output: the comparison above has teeth
