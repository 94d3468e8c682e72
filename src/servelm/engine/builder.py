"""Wires an EngineCore from an EngineConfig: checkpoint → model → KV pool → runner + scheduler.

The one place that knows every component; each component receives only its own
config slice. It also times the start-up phases (servelm.obs.startup) as they run:

    kernel_build  the compiled CPU kernels built or found in their cache (not on the first request)
    load          checkpoint read + model built (a draft model's checkpoint: a second interval)
    kv_sizing     on CUDA a worst-case step profiled (worker/memory_profile.py), blocks counted, the pool allocated
    warmup        a short prefill and a decode step through the runner (worker/warmup.py)
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import torch

from servelm.attention.kv_storage import LayerKVCache, block_tensors
from servelm.config import DEFAULT_CPU_KV_CACHE_BYTES, EngineConfig, LoRAModule, SpeculativeConfig
from servelm.engine.core import EngineCore
from servelm.engine.remote_model import open_model
from servelm.kernels import cpu as cpu_kernels
from servelm.kv.disk_store import DiskBlockStore
from servelm.kv.fingerprint import kv_fingerprint, weights_identity
from servelm.kv.kv_cache_manager import KVCacheManager
from servelm.kv.tiers import KVTiers
from servelm.lora.adapter import LoRAAdapter, load_lora_adapter
from servelm.lora.layers import attach_lora
from servelm.lora.registry import AdapterRegistry
from servelm.lora.slots import LoRASlots
from servelm.models.arch import ModelArchConfig
from servelm.models.factory import build_model, resolve_device, resolve_dtype
from servelm.models.llama import LlamaForCausalLM
from servelm.models.loader import load_checkpoint
from servelm.models.sharding import local_num_kv_heads
from servelm.obs.startup import StartupTimeline
from servelm.parallel.groups import GroupMember
from servelm.scheduler.scheduler import Scheduler
from servelm.scheduler.step_cost import StepShape
from servelm.spec.proposer import Proposer, build_proposer
from servelm.structured.backends import make_backend
from servelm.structured.grammars import GrammarCompiler
from servelm.structured.masks import MaskFiller
from servelm.worker.block_table import BlockTable
from servelm.worker.cuda_graphs import DecodeGraphMode, DecodeGraphRunner, decode_graph_mode, resolve_capture_sizes
from servelm.worker.draft_model import DraftModel, load_draft_model
from servelm.worker.draft_proposer import DraftModelProposer
from servelm.worker.host_residency import KV_POOL_WARM_FACTOR, HostResidency, model_tensors
from servelm.worker.kv_cache import (
    DEVICE_MEMORY_RESERVE_BYTES,
    allocate_kv_caches,
    blocks_in_budget,
    bytes_per_block,
    kv_blocks_for_device,
    resolve_kv_dtype,
)
from servelm.worker.kv_offload import KVOffloader
from servelm.worker.memory_profile import profile_device_memory
from servelm.worker.model_runner import ModelRunner, attention_backend_of
from servelm.worker.multi_rank import (
    StepBroadcaster,
    build_shard,
    check_supported,
    join_world,
    layout_of,
    rank_device,
)
from servelm.worker.warmup import TimedStep, calibrate, warm_up

logger = logging.getLogger(__name__)
# A producer's host tier when --kv-offloading-size is not given: exports wait for their pull there.
PRODUCER_HOST_TIER_BYTES = 1 << 30
# Fault injection for end-to-end tests: the transfer server corrupts every Nth block it sends.
FAULT_KV_CORRUPT_ENV = "SERVELM_FAULT_KV_CORRUPT_EVERY"
# Fault injection for end-to-end tests: seconds slept at the start of the load phase (a slow start-up).
FAULT_STARTUP_DELAY_ENV = "SERVELM_FAULT_STARTUP_DELAY_S"
# Fault injection for end-to-end tests: while the file this names exists, start-up fails in the load
# phase (a core that crashes on every restart: create the file once the first core is up).
FAULT_FAIL_START_ENV = "SERVELM_FAULT_FAIL_START_IF_EXISTS"


@dataclass
class BuiltEngine:
    core: EngineCore
    tokenizer: Any
    arch: ModelArchConfig
    max_model_len: int
    num_blocks: int
    source: str  # where the weights came from
    kv_transfer_address: str | None = None  # a producer's transfer server (--kv-role prefill|both)


def eos_token_ids(arch: ModelArchConfig, tokenizer: Any) -> tuple[int, ...]:
    """EOS ids from the checkpoint's config and its tokenizer, merged (chat models often differ)."""
    ids = set(arch.eos_token_ids)
    if getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return tuple(sorted(ids))


def build_engine(
    config: EngineConfig, proposer: Proposer | None = None, startup: StartupTimeline | None = None
) -> BuiltEngine:
    """`proposer`: with config.speculative set, one to use in place of the one its method names
    (a custom proposer; the tests' scripted ones). `startup`: where the phases are recorded as they
    run (a phase that raises is recorded too); a throwaway timeline when None."""
    startup = startup if startup is not None else StartupTimeline()
    if config.parallel.world_size > 1:
        return _build_multi_rank_engine(config, startup)
    if config.model.num_threads:
        torch.set_num_threads(config.model.num_threads)
    device = resolve_device(config.model.device)
    dtype = resolve_dtype(config.model.dtype, device)
    with startup.phase("kernel_build"):  # first: loading a GGUF's block layers asks for the kernels
        build_kernels(device, dtype)
    opened = open_model(config.model, startup)  # a remote model: pulled while it loads (the `fetch` phase)
    with startup.phase("load"):
        _injected_startup_faults()
        checkpoint = load_checkpoint(opened.path, config.model.hf_overrides, opened.before_read)
        model = build_model(checkpoint.arch, checkpoint.weights, dtype, device, config.model.attention_backend,
                            gemm_precision=config.model.gemm_precision)  # fmt: skip
        del checkpoint.weights  # the model holds its own copies now
    opened.finish()
    return assemble_engine(config, model, checkpoint.arch, checkpoint.tokenizer, checkpoint.source, proposer, startup)


def build_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """The compiled CPU kernels, built now (or found in their per-user cache, servelm.kernels.build)
    where they run, float32 on CPU: else the first request's first step would build them. Elsewhere
    there is nothing to build ahead: Triton compiles on a kernel's first call, in the warm-up."""
    if device.type == "cpu" and dtype == torch.float32:
        cpu_kernels.load()


def _injected_startup_faults() -> None:
    delay_s = float(os.environ.get(FAULT_STARTUP_DELAY_ENV, "0") or 0)
    if delay_s > 0:
        logger.warning("%s: sleeping %.1f s in the load phase", FAULT_STARTUP_DELAY_ENV, delay_s)
        time.sleep(delay_s)
    marker = os.environ.get(FAULT_FAIL_START_ENV)
    if marker and os.path.exists(marker):
        raise RuntimeError(f"{FAULT_FAIL_START_ENV}: {marker} exists, so this start-up fails (fault injection)")


@dataclass
class RankZero:
    """What the engine is assembled around on the process that schedules (rank 0): its model and KV
    pool, already sized and allocated. One rank, or rank 0 of a multi-rank worker (`followers`
    then mirror every step on the other ranks; `block_size` is the scheduler's logical block)."""

    model: LlamaForCausalLM
    kv_caches: list[LayerKVCache]
    num_blocks: int
    block_size: int  # tokens per scheduler block (under context parallelism: block_size x cp)
    max_model_len: int
    followers: StepBroadcaster | None = None
    draft_model: LlamaForCausalLM | None = None  # a separate draft checkpoint (one rank only)
    graph_mode: DecodeGraphMode = DecodeGraphMode.OFF  # CUDA decode graphs (one rank only)


def assemble_engine(config: EngineConfig, model: LlamaForCausalLM, arch: ModelArchConfig, tokenizer: Any,
                    source: str, proposer: Proposer | None = None,
                    startup: StartupTimeline | None = None) -> BuiltEngine:  # fmt: skip
    """KV pool, runner, scheduler and core around a built model (a checkpoint's, or random
    weights of a shape no file exists for, as benchmarks/gpu_checks.py builds), warmed up.
    `startup`: as in build_engine (here: a draft model's load, kv_sizing, warmup)."""
    startup = startup if startup is not None else StartupTimeline()
    device, dtype = model.embed_tokens.weight.device, model.embed_tokens.weight.dtype
    max_model_len = min(config.model.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings)

    # A separate draft model is loaded first: device memory is profiled with its weights in, and
    # each block then holds its K/V too.
    draft_model = None
    if proposer is None and _has_draft_checkpoint(config):
        with startup.phase("load"):
            draft_model = _load_draft_checkpoint(config, model, tokenizer)
    kv_archs = [arch] if draft_model is None else [arch, draft_model.arch]
    block_size = config.cache.block_size
    with startup.phase("kv_sizing"):
        kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, device)  # what the pool stores
        num_blocks = _num_kv_blocks(config, kv_archs, kv_dtype, model, max_model_len)
        if num_blocks * block_size < max_model_len:
            logger.warning(
                "KV pool holds %d tokens, fewer than max_model_len %d: capping max_model_len",
                num_blocks * block_size,
                max_model_len,
            )
            max_model_len = num_blocks * block_size
        # The MoE layer reads its per-expert token counts on the host each step, and a LoRA step's
        # segments change its matmuls: neither is capturable (yet).
        graph_mode = (DecodeGraphMode.OFF if model.arch.moe is not None or config.lora.enable_lora
                      else decode_graph_mode(config.cuda_graphs, device, attention_backend_of(model)))  # fmt: skip
        # The decode graphs' padding rows write to one more block, id num_blocks: the scheduler's pool
        # (num_blocks) never hands it out.
        kv_caches = allocate_kv_caches(arch, num_blocks, block_size, kv_dtype, device,
                                       padding_block=graph_mode is not DecodeGraphMode.OFF)  # fmt: skip
    rank_zero = RankZero(model, kv_caches, num_blocks, block_size, max_model_len, draft_model=draft_model,
                         graph_mode=graph_mode)  # fmt: skip
    return _assemble(config, rank_zero, arch, tokenizer, source, proposer, startup)


def _assemble(config: EngineConfig, rank_zero: RankZero, arch: ModelArchConfig, tokenizer: Any, source: str,
              proposer: Proposer | None, startup: StartupTimeline) -> BuiltEngine:  # fmt: skip
    """The one assembly of every engine, one rank or many: proposer, KV tiers, decode graphs,
    runner, warm-up and calibration, KV manager, scheduler, core. What a rank count does not
    support is refused before this (multi_rank.check_supported); a failure here stops the
    other ranks too."""
    try:
        return _assemble_around(config, rank_zero, arch, tokenizer, source, proposer, startup)
    except BaseException:
        if rank_zero.followers is not None:
            rank_zero.followers.close()
        raise


def _grammar_compiler(config: EngineConfig, tokenizer: Any, vocab_size: int,
                      eos_ids: tuple[int, ...]) -> GrammarCompiler | None:  # fmt: skip
    """Structured outputs over the model's tokenizer (None without one: such requests are refused).
    The backend itself is built by the first structured request (grammars.py says why)."""
    if tokenizer is None:
        return None
    name = config.structured.structured_outputs_backend
    return GrammarCompiler(lambda: make_backend(name, tokenizer, vocab_size, eos_ids))


def _assemble_around(config: EngineConfig, rank_zero: RankZero, arch: ModelArchConfig, tokenizer: Any, source: str,
                     proposer: Proposer | None, startup: StartupTimeline) -> BuiltEngine:  # fmt: skip
    model, kv_caches, num_blocks = rank_zero.model, rank_zero.kv_caches, rank_zero.num_blocks
    block_size, max_model_len, draft_model = rank_zero.block_size, rank_zero.max_model_len, rank_zero.draft_model
    device = model.embed_tokens.weight.device
    eos_ids = eos_token_ids(arch, tokenizer)
    # One table for the runner and a draft-model proposer: the draft's K/V sit in the same blocks.
    block_table = BlockTable.for_requests(config.scheduler.max_num_seqs, max_model_len, block_size)
    speculative = config.speculative
    if speculative is not None and proposer is None:
        if speculative.method == "draft":
            proposer = _draft_model_proposer(
                config, speculative, model, kv_caches, draft_model, num_blocks, block_table
            )
        else:
            proposer = build_proposer(speculative)
    # A separate draft model's K/V sit in the same block ids: a block moved to a tier takes them too.
    separate_draft = isinstance(proposer, DraftModelProposer) and not proposer.draft.shares_target_kv
    draft_kv = proposer.draft.kv_caches if isinstance(proposer, DraftModelProposer) and separate_draft else []
    tiers: KVTiers | None = None
    offloader: KVOffloader | None = None
    if config.kv_tiers.enabled or config.kv_transfer.kv_role is not None:
        if not config.cache.enable_prefix_caching:
            raise ValueError(
                "KV tiers (--kv-offloading-size, --kv-disk-path) and --kv-role need prefix caching: "
                "drop --no-prefix-caching"
            )
        tiers, offloader = _kv_tiers(config, arch, source, block_tensors([*kv_caches, *draft_kv]))
    decode_graphs = None
    if rank_zero.graph_mode is not DecodeGraphMode.OFF:
        sizes = resolve_capture_sizes(config.cuda_graphs, config.scheduler.max_num_seqs)
        decode_graphs = DecodeGraphRunner(model, kv_caches, rank_zero.graph_mode, sizes,
                                          block_table.max_blocks_per_request, block_size,
                                          padding_block_id=num_blocks)  # fmt: skip
    lora = _lora_slots(config, model) if config.lora.enable_lora else None
    runner = ModelRunner(
        model, kv_caches, block_size, eos_ids, device,
        max_num_seqs=config.scheduler.max_num_seqs, max_model_len=max_model_len,
        proposer=proposer if speculative is not None else None,
        max_draft_tokens=speculative.num_speculative_tokens if speculative is not None else 0,
        block_table=block_table, kv_offloader=offloader,
        decode_graphs=decode_graphs, followers=rank_zero.followers, lora=lora,
    )  # fmt: skip
    with startup.phase("warmup"):
        warm_up(runner)
        calibration = calibrate(runner) if _timings_describe_hardware(model, device) else []
    kv_manager = KVCacheManager(num_blocks, block_size, config.cache.enable_prefix_caching, config.kv_events.enabled)
    grammars = _grammar_compiler(config, tokenizer, arch.vocab_size, eos_ids)
    scheduler = Scheduler(
        config.scheduler_for(max_model_len), kv_manager, eos_token_ids=eos_ids, speculative=speculative,
        kv_tiers=tiers, kv_transfer=config.kv_transfer, num_layers=_layered_prefill_layers(runner),
        grammars=grammars, max_loras=config.lora.max_loras if lora is not None else 0,
        adapter_ready=lora.registry.ready if lora is not None else None,
    )  # fmt: skip
    _seed_step_cost(scheduler, calibration)
    residencies: list[HostResidency] = []
    if device.type == "cpu" and config.model.keep_warm_s > 0:
        draft_weights = list(model_tensors(draft_model)) if draft_model is not None else []
        residencies = [
            HostResidency([*model_tensors(model), *draft_weights], config.model.keep_warm_s),
            HostResidency(block_tensors([*kv_caches, *draft_kv]), KV_POOL_WARM_FACTOR * config.model.keep_warm_s),
        ]
    return BuiltEngine(
        core=EngineCore(scheduler, runner, kv_manager, residencies,
                        mask_filler=MaskFiller(arch.vocab_size) if grammars is not None else None,
                        lora=lora),  # fmt: skip
        tokenizer=tokenizer,
        arch=arch,
        max_model_len=max_model_len,
        num_blocks=num_blocks,
        source=source,
        kv_transfer_address=offloader.transfer_address if offloader is not None else None,
    )


def _lora_slots(config: EngineConfig, model: LlamaForCausalLM) -> LoRASlots:
    """The adapters of --lora-modules read and checked against the model, and its LoRA slots."""
    lora = config.lora
    arch = model.arch

    def read_adapter(module: LoRAModule) -> LoRAAdapter:
        return load_lora_adapter(module.name, module.path, arch, lora.max_lora_rank)

    registry = AdapterRegistry.at_start(lora.lora_modules, read_adapter, lora.max_cpu_loras)
    logger.info("LoRA: %d adapter(s) (%s), %d slot(s) of rank <= %d, %s in host memory", len(registry.served),
                ", ".join(sorted(registry.served)) or "none", lora.max_loras, lora.max_lora_rank,
                "all" if lora.max_cpu_loras is None else f"at most {lora.max_cpu_loras}")  # fmt: skip
    return LoRASlots(attach_lora(model, lora.max_loras, lora.max_lora_rank), registry, lora.max_loras)


def _build_multi_rank_engine(config: EngineConfig, startup: StartupTimeline) -> BuiltEngine:
    """Rank 0 of a multi-rank worker (worker/multi_rank.py): it sizes the KV pool, starts the
    other ranks, joins them, and builds its own shard; then the one assembly (_assemble) wires
    the single scheduler and runner around that shard, as for one rank.

    Under context parallelism the scheduler's blocks are logical blocks of block_size x cp
    tokens, each rank storing block_size of them (every cp-th position) in its physical block
    of the same id: the same number of blocks holds cp times the tokens.

    Phases: kernel_build; load twice (the checkpoint's header, then joining the other ranks and
    reading this rank's shard, which also allocates its KV pool); kv_sizing between them (the
    block count every rank then allocates); warmup (its steps reach every rank)."""
    check_supported(config)
    # A remote model is pulled whole first: every rank then reads its shard from the same directory.
    opened = open_model(config.model, startup, stream=False)
    config = dataclasses.replace(config, model=dataclasses.replace(config.model, model=opened.path))
    device = rank_device(config, 0)
    dtype = resolve_dtype(config.model.dtype, device)
    with startup.phase("kernel_build"):
        build_kernels(device, dtype)
    with startup.phase("load"):
        _injected_startup_faults()
        checkpoint = load_checkpoint(config.model.model, config.model.hf_overrides)  # lazy: rank 0 reads its shard
    arch, tokenizer, source = checkpoint.arch, checkpoint.tokenizer, checkpoint.source
    layout = layout_of(config)
    if (arch.moe is not None or arch.mla is not None) and layout.context_parallel_size > 1:
        # Known only once the config is read: check_supported sees flags alone.
        raise ValueError(f"{arch.architecture}: context parallelism does not run mixtures of experts or latent "
                         "attention yet; use -tp (experts are split whole over its ranks: expert parallelism)")  # fmt: skip
    logical_block_size = config.cache.block_size * layout.context_parallel_size
    # Every rank allocates the same number of blocks: as many as the budget holds on the rank with the
    # most KV heads (the budget is per rank: each has its own memory, or its share of this machine's).
    tp_size = layout.tensor_parallel_size
    widest = max(local_num_kv_heads(arch, GroupMember(rank, tp_size)) for rank in range(tp_size))
    with startup.phase("kv_sizing"):
        kv_dtype = resolve_kv_dtype(config.cache.kv_cache_dtype, dtype, device)
        block_bytes = bytes_per_block(arch, config.cache.block_size, kv_dtype, num_kv_heads=widest)
        num_blocks = config.cache.num_blocks or blocks_in_budget(block_bytes, _kv_budget_bytes(config, device))
    max_model_len = min(config.model.max_model_len or arch.max_position_embeddings, arch.max_position_embeddings,
                        num_blocks * logical_block_size)  # fmt: skip
    followers = StepBroadcaster(config, num_blocks, max_model_len)
    try:
        with startup.phase("load"):
            groups = join_world(config, 0, followers.init_method, device)
            shard = build_shard(config, checkpoint, groups, num_blocks, device)
    except BaseException:
        followers.close()
        raise
    logger.info(
        "multi-rank worker: tp %d x cp %d ranks (pids %s), %d blocks of %d tokens per rank",
        layout.tensor_parallel_size, layout.context_parallel_size, followers.pids, num_blocks, config.cache.block_size,
    )  # fmt: skip
    rank_zero = RankZero(shard.model, shard.kv_caches, num_blocks, logical_block_size, max_model_len, followers)
    return _assemble(config, rank_zero, arch, tokenizer, source, None, startup)


def _layered_prefill_layers(runner: ModelRunner) -> int:
    """The layers the scheduler may slice a chunk by: the model's, where the runner runs layered
    chunks (not under context parallelism); 0 elsewhere."""
    return len(runner.model.decoder_layers) if runner.layered_chunks is not None else 0


def _timings_describe_hardware(model: LlamaForCausalLM, device: torch.device) -> bool:
    """False for Triton attention on a CPU: only Triton's interpreter runs it there (tests, kernel
    debugging), and its times describe no hardware (calibrating took 16 s of a tiny model's
    start-up). Without the prior the cost model learns from real steps, as it did before calibration."""
    return not (device.type == "cpu" and attention_backend_of(model).name == "triton")


def _seed_step_cost(scheduler: Scheduler, steps: list[TimedStep]) -> None:
    """The calibration's timed steps into the scheduler's step-cost model as its prior, so that
    steps are priced right on this machine from the first request (worker/warmup.py says why);
    the step-time target it implies when max_step_ms is unset is logged."""
    shapes = []
    for step in steps:
        if step.is_prompt:
            shape = StepShape(dense_passes=step.layer_share)
            shape = shape + StepShape.chunk(step.num_tokens, step.num_computed, step.layer_share)
        else:
            shape = StepShape(decode_tokens=step.num_requests * step.num_tokens,
                              decode_context=step.num_requests * step.num_tokens * step.num_computed)  # fmt: skip
        shapes.append((shape, step.seconds))
    scheduler.step_cost.calibrate(shapes)
    target_s = scheduler.step_target_s()
    parts = scheduler.step_cost.calibrated_parts_s
    logger.info(
        "step-time target %s (every step: %s, a pass over the weights: %s)",
        "none" if target_s is None else f"{target_s * 1000:.0f} ms"
        + (" (auto)" if scheduler.config.max_step_ms is None else ""),
        *(("unknown", "unknown") if parts is None else (f"{parts[0] * 1000:.1f} ms", f"{parts[1] * 1000:.1f} ms")),
    )


def _kv_tiers(
    config: EngineConfig, arch: ModelArchConfig, source: str, block_tensors: list[torch.Tensor]
) -> tuple[KVTiers, KVOffloader]:
    """The scheduler's and the runner's halves of the host/disk KV tiers, over one disk store
    namespaced by the model fingerprint, and of a disaggregation role (a producer serves its
    exports from the host tier: it gets one when none is configured)."""
    tier_config, block_size, transfer = config.kv_tiers, config.cache.block_size, config.kv_transfer
    if transfer.is_producer and tier_config.host_bytes == 0:
        tier_config = dataclasses.replace(tier_config, host_bytes=PRODUCER_HOST_TIER_BYTES)
        logger.info("--kv-role %s: a %d MiB host tier holds exports", transfer.kv_role, PRODUCER_HOST_TIER_BYTES >> 20)
    layout = {
        "block_size": block_size,
        "kv_cache_dtype": config.cache.kv_cache_dtype,
        "gemm_precision": config.model.gemm_precision,  # a narrower prefill computes other K/V values
        "tensors": [(str(t.dtype), list(t[:, 0].shape)) for t in block_tensors],
    }
    fingerprint = kv_fingerprint(dataclasses.asdict(arch), weights_identity(source), layout)
    disk = DiskBlockStore(tier_config.disk_path, fingerprint) if tier_config.disk_path is not None else None
    corrupt_every = int(os.environ.get(FAULT_KV_CORRUPT_ENV, "0") or 0)
    offloader = KVOffloader(block_tensors, disk_store=disk, transfer=transfer, corrupt_every=corrupt_every)
    tiers = KVTiers(
        tier_config, block_size, offloader.codec.block_bytes, disk, config.kv_events.enabled,
        remote=transfer.is_consumer,
    )  # fmt: skip
    if offloader.transfer_address is not None:
        logger.info("KV transfer server (--kv-role %s) at %s", transfer.kv_role, offloader.transfer_address)
    capacities = {medium.value: index.capacity_blocks for medium, index in tiers.indexes.items()}
    logger.info("KV tiers (blocks each holds): %s; fingerprint %s", capacities, fingerprint)
    return tiers, offloader


def _has_draft_checkpoint(config: EngineConfig) -> bool:
    """Method "draft" with `model` set: a second checkpoint to load."""
    speculative = config.speculative
    return speculative is not None and speculative.method == "draft" and speculative.model is not None


def _load_draft_checkpoint(config: EngineConfig, target: LlamaForCausalLM, tokenizer: Any) -> LlamaForCausalLM:
    speculative = config.speculative
    assert speculative is not None and speculative.model is not None  # _has_draft_checkpoint
    return load_draft_model(speculative.model, target, tokenizer, config.model.attention_backend)


def _draft_model_proposer(
    config: EngineConfig,
    speculative: SpeculativeConfig,
    target: LlamaForCausalLM,
    target_kv_caches: list[LayerKVCache],
    draft_model: LlamaForCausalLM | None,
    num_blocks: int,
    block_table: BlockTable,
) -> DraftModelProposer:
    """method "draft": `draft_model` (the checkpoint at speculative.model) with a KV pool of the
    target's block count, or the target's first draft_num_layers layers."""
    block_size = config.cache.block_size
    if draft_model is not None:
        draft = DraftModel.separate(draft_model, num_blocks, block_size, target_kv_caches[0].dtype)
    else:
        assert speculative.draft_num_layers is not None  # SpeculativeConfig: exactly one of the two
        draft = DraftModel.first_layers_of(target, target_kv_caches, speculative.draft_num_layers)
    # A prompt's catch-up through the draft takes at most a step's token budget per step.
    return DraftModelProposer(draft, block_table, block_size, config.scheduler.max_num_batched_tokens)


def _num_kv_blocks(config: EngineConfig, archs: list[ModelArchConfig], kv_dtype: torch.dtype,
                   model: LlamaForCausalLM, max_model_len: int) -> int:  # fmt: skip
    """Blocks of the KV pool, with the K/V of every model in `archs` per block stored as `kv_dtype`:
    --num-blocks; else what --kv-cache-memory holds (it covers a draft model's pool too); else on
    CUDA what --gpu-memory-utilization leaves after the weights and a profiled worst-case step
    (an error naming the numbers when not even one max_model_len request fits); on CPU a default."""
    cache = config.cache
    if cache.num_blocks:
        return cache.num_blocks
    block_bytes = sum(bytes_per_block(arch, cache.block_size, kv_dtype) for arch in archs)
    device = model.embed_tokens.weight.device
    if cache.kv_cache_memory_bytes is not None or device.type != "cuda":
        return blocks_in_budget(block_bytes, _kv_budget_bytes(config, device))
    scheduler, speculative = config.scheduler, config.speculative
    sample_rows = scheduler.max_num_seqs * (1 + (speculative.num_speculative_tokens if speculative else 0))
    profile = profile_device_memory(model, scheduler.max_num_batched_tokens, max_model_len, sample_rows)
    num_blocks = kv_blocks_for_device(profile, cache.gpu_memory_utilization, block_bytes, cache.block_size,
                                      max_model_len)  # fmt: skip
    logger.info(
        "KV cache: %d blocks (%.2f GiB) = %.2f GiB x gpu_memory_utilization %.2f - weights %.2f GiB - peak "
        "activation %.2f GiB - outside torch %.2f GiB - reserve %.2f GiB",
        num_blocks, num_blocks * block_bytes / 2**30, profile.total / 2**30, cache.gpu_memory_utilization,
        profile.weights / 2**30, profile.peak_activation / 2**30, profile.non_torch / 2**30,
        DEVICE_MEMORY_RESERVE_BYTES / 2**30,
    )  # fmt: skip
    return num_blocks


def _kv_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes for KV without a profile: --kv-cache-memory, else on CPU a fixed default. A CUDA
    multi-rank worker needs --kv-cache-memory: its pool is sized before any rank holds weights."""
    if config.cache.kv_cache_memory_bytes is not None:
        return config.cache.kv_cache_memory_bytes
    if device.type == "cuda":
        raise ValueError(
            "-tp/-cp > 1 on CUDA: give --kv-cache-memory (GiB per rank) or --num-blocks; the KV pool is sized "
            "before the ranks load their weights, so --gpu-memory-utilization cannot be profiled"
        )
    return DEFAULT_CPU_KV_CACHE_BYTES
