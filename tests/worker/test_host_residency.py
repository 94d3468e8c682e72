"""Keeping a CPU engine's memory warm: what is touched, when, and huge pages in the engine process."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from gguf import GGMLQuantizationType as Q

from servelm.config import EngineConfig
from servelm.engine.builder import build_engine
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model
from servelm.models.gguf_loader import gguf_hf_config, load_gguf_weights, open_gguf
from servelm.models.linear_methods import small_batch_kernel
from servelm.server.launcher import launch_server
from servelm.testing.process_tree import descendants
from servelm.testing.tiny_model import write_tiny_checkpoint, write_tiny_gguf
from servelm.worker.host_residency import KV_POOL_WARM_FACTOR, PAGE_BYTES, HostResidency, model_tensors


def _storage_bytes(tensors: list[torch.Tensor]) -> int:
    """Bytes of the distinct storages (by address; the larger of two at one address)."""
    sizes: dict[int, int] = {}
    for tensor in tensors:
        storage = tensor.untyped_storage()
        sizes[storage.data_ptr()] = max(sizes.get(storage.data_ptr(), 0), storage.nbytes())
    return sum(sizes.values())


@pytest.mark.skipif(small_batch_kernel() is None, reason="no C compiler: the block kernels cannot be built here")
def test_a_quantised_models_blocks_are_touched_not_only_its_parameters(tmp_path: Path):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", arch="llama", seed=3)
    reader = open_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, tensor_type=Q.Q4_1))
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    model = build_model(arch, load_gguf_weights(reader, arch, source="tiny"), torch.float32, "cpu")
    held = list(model_tensors(model))
    parameters = list(model.parameters()) + list(model.buffers())
    blocks = [t for t in held if t.dtype == torch.uint8]
    assert blocks, "a Q4_1 model's layers keep their GGUF blocks (uint8), which parameters() does not list"
    residency = HostResidency(held, interval_s=5.0)
    assert residency.num_bytes == _storage_bytes([t for t in held if t.untyped_storage().nbytes() >= PAGE_BYTES])
    held_storages = {t.untyped_storage().data_ptr() for t in held}
    assert {t.untyped_storage().data_ptr() for t in parameters} <= held_storages
    pages = [t for t in parameters + blocks if t.untyped_storage().nbytes() >= PAGE_BYTES]  # smaller ones: not kept
    assert residency.num_bytes >= _storage_bytes(pages)


def test_touches_once_per_interval_and_reads_every_storage_once():
    weight = torch.ones(3 * PAGE_BYTES // 4)
    same_storage = weight[PAGE_BYTES // 4 :]
    other = torch.zeros(PAGE_BYTES, dtype=torch.uint8)
    residency = HostResidency([weight, same_storage, other, torch.ones(3)], interval_s=5.0)  # a tiny one: not kept
    assert residency.num_bytes == 3 * PAGE_BYTES + PAGE_BYTES
    start = residency._last_start
    assert not residency.maybe_touch(start + 4.9)
    assert residency.maybe_touch(start + 5.0)
    assert not residency.maybe_touch(start + 9.9)
    assert residency.maybe_touch(start + 10.0)


def test_a_pass_is_read_a_slice_a_call_and_the_next_is_timed_from_its_start():
    first = torch.zeros(5 * PAGE_BYTES, dtype=torch.uint8)
    second = torch.zeros(2 * PAGE_BYTES, dtype=torch.uint8)
    residency = HostResidency([first, second], interval_s=5.0, slice_bytes=3 * PAGE_BYTES)
    start = residency._last_start
    assert not residency.in_pass and not residency.maybe_touch(start + 1.0)
    # 7 pages in slices of 3: pages 0-2 of the first, 3-4 and the second's 0, the second's 1.
    assert residency.maybe_touch(start + 5.0) and residency._cursor == (0, 3 * PAGE_BYTES)
    assert residency.maybe_touch(start + 5.1) and residency._cursor == (1, PAGE_BYTES)
    assert residency.maybe_touch(start + 5.2) and not residency.in_pass  # done
    assert not residency.maybe_touch(start + 9.9)  # 5 s after the pass started, not after it ended
    assert residency.maybe_touch(start + 10.0) and residency.in_pass
    residency.touch()  # finishes the pass in progress at once
    assert not residency.in_pass
    with pytest.raises(ValueError, match="slice_bytes"):
        HostResidency([first], interval_s=1.0, slice_bytes=PAGE_BYTES + 1)


def test_the_engine_reads_one_slice_between_steps_and_says_while_pages_are_due(tiny_dir):
    core = build_engine(EngineConfig.from_flat(str(tiny_dir), num_blocks=64)).core
    weights, pool = core.residencies
    for residency in core.residencies:
        residency.slice_bytes = PAGE_BYTES
        residency._last_start -= 100.0  # both due
    calls_while_due = 0
    while core.keep_warm():
        calls_while_due += 1
        assert not (weights.in_pass and pool.in_pass)  # the weights' pass first, then the pool's
    # A slice of pages a call, or one opaque (oneDNN-reordered) weight read whole; the last call found
    # nothing more due.
    slices = sum(math.ceil(r.num_page_bytes / PAGE_BYTES) + r.num_opaque for r in core.residencies)
    assert calls_while_due + 1 == slices
    assert not core.keep_warm()


def test_the_engine_keeps_warm_on_cpu_unless_turned_off(tiny_dir):
    on = build_engine(EngineConfig.from_flat(str(tiny_dir), num_blocks=64)).core
    weights, pool = on.residencies
    assert (weights.interval_s, pool.interval_s) == (1.0, KV_POOL_WARM_FACTOR * 1.0)
    big = [t for t in on.runner.model.parameters() if t.untyped_storage().nbytes() >= PAGE_BYTES]
    assert weights.num_bytes >= _storage_bytes(big)
    assert pool.num_bytes == _storage_bytes(list(on.runner.kv_block_tensors))
    off = build_engine(EngineConfig.from_flat(str(tiny_dir), num_blocks=64, keep_warm_s=0)).core
    assert off.residencies == []
    off.keep_warm()  # a no-op, not an error


def test_negative_interval_is_refused():
    with pytest.raises(ValueError, match="keep_warm_s"):
        EngineConfig.from_flat(keep_warm_s=-1)


def _thp_mode() -> str:
    try:
        text = Path("/sys/kernel/mm/transparent_hugepage/enabled").read_text()
    except OSError:
        return "never"
    return text.split("[", 1)[1].split("]", 1)[0]


@pytest.mark.skipif(_thp_mode() == "never", reason="transparent huge pages are off on this kernel")
def test_the_engine_process_allocates_huge_pages(tmp_path: Path):
    # A pool of 64 MiB: allocations of 2 MiB and more are what PyTorch asks huge pages for.
    model_dir = write_tiny_checkpoint(tmp_path / "model", seed=3)
    with launch_server(model_dir, ["--num-blocks", "8192", "--num-threads", "1"]) as server:
        engine_pids = [pid for pid, command in descendants(server.process.pid).items() if "multiprocessing" in command]
        assert engine_pids, descendants(server.process.pid)
        rollups = [Path(f"/proc/{pid}/smaps_rollup").read_text() for pid in engine_pids]
        huge_kib = max(int(line.split()[1]) for text in rollups for line in text.splitlines()
                       if line.startswith("AnonHugePages:"))  # fmt: skip
        assert huge_kib >= 2048, rollups
