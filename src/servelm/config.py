"""Configuration by concern: one frozen dataclass per component, validated on creation.

Each component receives only its own slice. Validation raises ValueError naming the
field (never `assert`, which `python -O` strips).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass, fields, replace
from typing import Any, ClassVar


@dataclass(frozen=True)
class Flag:
    """One command-line flag, declared once, in the config slice whose setting it sets: cli.py adds
    it (grouped by slice in --help) and reads it back into EngineConfig.from_flat by `setting`."""

    names: tuple[str, ...]  # "--tensor-parallel-size", "-tp"
    setting: str  # the from_flat key: a slice's field, or a convenience (_GIB_SETTINGS, kv_disk_path, ...)
    type: Callable[[str], Any] | None = None
    choices: Any = None
    action: str | None = None  # "store_true" / "store_false": a switch
    help: str | None = None
    nargs: str | None = None  # "+": one or more values, each through `type` (a tuple of them is set)


def comma_list(text: str) -> tuple[str, ...]:
    """A flag's comma-separated list: its items, stripped, empty ones dropped."""
    return tuple(item.strip() for item in text.split(",") if item.strip())


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclass(frozen=True)
class CacheConfig:
    """The paged KV cache: block geometry, how many blocks, prefix caching."""

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--block-size",), 'block_size', type=int, help='tokens per KV block'),
        Flag(("--kv-cache-memory",), 'kv_cache_memory_gib', type=float, help='GiB for KV'),
        Flag(("--num-blocks",), 'num_blocks', type=int, help='KV blocks (overrides --kv-cache-memory)'),
        Flag(("--gpu-memory-utilization",), 'gpu_memory_utilization', type=float, help="CUDA: fraction of the device's memory to use in all; the KV cache gets what the weights, a profiled worst-case step and a reserve leave (default 0.9; ignored with --kv-cache-memory or --num-blocks)"),
        Flag(("--no-prefix-caching",), 'enable_prefix_caching', action="store_false"),
        Flag(("--kv-cache-dtype",), 'kv_cache_dtype', choices=["auto", "int8", "fp8"], help="KV cache storage: auto (the model's dtype), int8 or fp8 (scaled per token and head; fewer bytes per block)"),
    )  # fmt: skip


    block_size: int = 16  # tokens per KV block
    # Size the pool by block count or by bytes (the runner converts bytes to blocks from
    # the model's KV geometry). At most one may be set; neither: on CUDA what
    # gpu_memory_utilization leaves, on CPU DEFAULT_CPU_KV_CACHE_BYTES.
    num_blocks: int | None = None
    kv_cache_memory_bytes: int | None = None
    # vLLM's: the fraction of the device's memory servelm may use in all (weights, a profiled
    # worst-case step's activations, a reserve, and the KV pool, which gets the rest). CUDA only.
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    # What the pool stores K/V as: "auto" (the model's dtype), "int8" (symmetric, one float32 scale
    # per token and KV head), "fp8" (float8_e4m3fn where the device has it). Halves KV bytes or better.
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        _require(self.block_size > 0, f"block_size must be positive, got {self.block_size}")
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}",
        )
        _require(self.num_blocks is None or self.num_blocks > 0, f"num_blocks must be positive, got {self.num_blocks}")
        _require(
            self.kv_cache_memory_bytes is None or self.kv_cache_memory_bytes > 0,
            f"kv_cache_memory_bytes must be positive, got {self.kv_cache_memory_bytes}",
        )
        _require(
            self.num_blocks is None or self.kv_cache_memory_bytes is None,
            "set at most one of num_blocks and kv_cache_memory_bytes",
        )
        _require(
            0.0 < self.gpu_memory_utilization <= 1.0,
            f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}",
        )


KV_CACHE_DTYPES = ("auto", "int8", "fp8")
GEMM_PRECISIONS = ("float32", "bfloat16")  # models/gemm_precision.py holds what each means


KV_LOAD_POLICIES = ("cost", "always")


@dataclass(frozen=True)
class KVTierConfig:
    """KV beyond the pool (servelm.kv.tiers): a host-memory tier (L2) and a disk tier (L3).

    Blocks are saved to every configured tier when computed and loaded back into pool slots when a
    prompt's prefix misses the pool but hits a tier. Both off by default. A disk directory may be
    shared by replicas of the same model (the model fingerprint is part of every file's name).
    """

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--kv-offloading-size",), 'kv_offloading_size', type=float, help='GiB of host memory for KV blocks beyond the pool (L2): prefixes evicted from the pool are loaded back, not recomputed'),
        Flag(("--kv-disk-path",), 'kv_disk_path', help='directory for KV blocks on disk (L3): survives restarts; replicas of one model may share it'),
        Flag(("--kv-disk-size",), 'kv_disk_size', type=float, help='GiB of KV on disk at most (default 16)'),
        Flag(("--kv-load-policy",), 'kv_load_policy', choices=["cost", "always"], help="KV found in host memory or on disk: cost (load a block while its tier's measured bandwidth beats computing it; default) or always (load every block found)"),
    )  # fmt: skip


    host_bytes: int = 0  # L2 capacity (vLLM's --kv-offloading-size, in GiB on the CLI); 0: no L2
    disk_path: str | None = None  # L3 directory (created if missing); None: no L3
    disk_bytes: int = 16 * 2**30  # L3 capacity; files beyond it are deleted oldest first
    # A load may take load_timeout_base_s + load_timeout_per_1k_tokens_s per 1,024 tokens loaded
    # (SGLang HiCache's prefetch rule); later, the request computes what has not arrived.
    load_timeout_base_s: float = 0.5
    load_timeout_per_1k_tokens_s: float = 0.25
    # Which found blocks are loaded: "cost" loads a block while reading it from its tier is expected
    # to beat computing it (measured bandwidth vs the step-cost model); "always" loads every block a
    # tier holds (a small model on a fast machine computes a block faster than a disk read, and
    # "cost" then recomputes; "always" is for when a load must happen whatever it costs).
    kv_load_policy: str = "cost"

    def __post_init__(self) -> None:
        _require(
            self.kv_load_policy in KV_LOAD_POLICIES,
            f"kv_load_policy must be one of {', '.join(KV_LOAD_POLICIES)}, got {self.kv_load_policy!r}",
        )
        _require(self.host_bytes >= 0, f"host_bytes must be >= 0, got {self.host_bytes}")
        _require(self.disk_bytes > 0, f"disk_bytes must be positive, got {self.disk_bytes}")
        _require(self.disk_path is None or bool(self.disk_path.strip()), "disk_path must not be empty")
        _require(self.load_timeout_base_s > 0, f"load_timeout_base_s must be positive, got {self.load_timeout_base_s}")
        _require(
            self.load_timeout_per_1k_tokens_s >= 0,
            f"load_timeout_per_1k_tokens_s must be >= 0, got {self.load_timeout_per_1k_tokens_s}",
        )

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0 or self.disk_path is not None


KV_ROLES = ("prefill", "decode", "both")


@dataclass(frozen=True)
class KVTransferConfig:
    """Prefill/decode disaggregation (servelm.disagg): this engine's role and its KV transfer.

    A producer (role prefill or both) computes a prompt sent with `kv_transfer_params`
    {"do_remote_decode": true, ...}, keeps its KV in the host tier (L2; one is added when none
    is configured) for `kv_transfer_hold_s`, and serves it to consumers from a transfer server
    bound at start-up. A consumer (decode or both) pulls the prompt's KV of a request sent with
    {"do_remote_prefill": true, ...} into its pool, then decodes; what does not arrive (a dead
    peer, a timeout, a bad checksum) it computes itself.
    """

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--kv-role",), 'kv_role', choices=["prefill", "decode", "both"], help="prefill/decode disaggregation: prefill (compute prompts, serve their KV), decode (pull it, then decode) or both; the router sends requests' kv_transfer_params (default: no disaggregation)"),
        Flag(("--kv-transfer-port",), 'kv_transfer_port', type=int, help="prefill: the KV transfer server's port (default: any free)"),
        Flag(("--kv-transfer-host",), 'kv_transfer_host', help="prefill: the KV transfer server's address (default 127.0.0.1)"),
        Flag(("--kv-transfer-hold-s",), 'kv_transfer_hold_s', type=float, help="prefill: seconds a prompt's KV waits for its pull after the prefill, then is dropped (default 30)"),
        Flag(("--kv-transfer-wait-s",), 'kv_transfer_wait_s', type=float, help='decode: seconds a pull waits for a silent peer before computing itself (default 5)'),
        Flag(("--kv-transfer-timeout-s",), 'kv_transfer_timeout_s', type=float, help='decode: seconds a whole pull may take, the prefill included (default 120)'),
        Flag(("--kv-transfer-max-reserved-blocks",), 'kv_transfer_max_reserved_blocks', type=int, help='decode: most KV blocks held by pulls in flight (default: half the pool)'),
        Flag(("--kv-transfer-peers",), 'kv_transfer_peers', type=comma_list, help="decode: prefill servers' transfer addresses (tcp://HOST:PORT,...) to connect at start-up"),
    )  # fmt: skip


    kv_role: str | None = None  # None: no disaggregation (requests with kv_transfer_params are refused)
    kv_transfer_host: str = "127.0.0.1"  # the transfer server binds here (producer roles)
    kv_transfer_port: int = 0  # 0: any free port (GET /v1/kv_transfer reports the bound address)
    kv_transfer_hold_s: float = 30.0  # a prefill's KV waits this long for its pull, then is dropped
    # A consumer's pull: how long it waits for the producer's answer or its next heartbeat before
    # it gives the peer up; the whole pull (prefill compute included) ends at kv_transfer_timeout_s.
    # (A producer lets a pull wait kv_transfer_hold_s for a transfer it has not heard of yet: the
    # prefill request may still be queued or on its way.)
    kv_transfer_wait_s: float = 5.0
    kv_transfer_timeout_s: float = 120.0
    # Consumer: most pool blocks held by pulls in flight (None: half the pool), so running streams
    # are never starved by blocks reserved for KV that has not arrived.
    kv_transfer_max_reserved_blocks: int | None = None
    kv_transfer_peers: tuple[str, ...] = ()  # consumer: producers' transfer addresses, connected at start-up

    def __post_init__(self) -> None:
        _require(
            self.kv_role is None or self.kv_role in KV_ROLES,
            f"kv_role must be one of {', '.join(KV_ROLES)}, got {self.kv_role!r}",
        )
        _require(
            0 <= self.kv_transfer_port < 65536, f"kv_transfer_port must be in 0..65535, got {self.kv_transfer_port}"
        )
        for name in ("kv_transfer_hold_s", "kv_transfer_wait_s", "kv_transfer_timeout_s"):
            _require(getattr(self, name) > 0, f"{name} must be positive, got {getattr(self, name)}")
        _require(
            self.kv_transfer_max_reserved_blocks is None or self.kv_transfer_max_reserved_blocks > 0,
            f"kv_transfer_max_reserved_blocks must be positive, got {self.kv_transfer_max_reserved_blocks}",
        )

    @property
    def is_producer(self) -> bool:
        return self.kv_role in ("prefill", "both")

    @property
    def is_consumer(self) -> bool:
        return self.kv_role in ("decode", "both")


@dataclass(frozen=True)
class SchedulerConfig:
    """Token-budget scheduling: how much work one step may take and in what order."""

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--max-num-batched-tokens",), 'max_num_batched_tokens', type=int, help='token budget per step'),
        Flag(("--max-num-seqs",), 'max_num_seqs', type=int, help='requests per step at most'),
        Flag(("--max-num-partial-prefills",), 'max_num_partial_prefills', type=int, help='prompts one step may leave unfinished (several long prompts mid-prefill at once)'),
        Flag(("--max-long-partial-prefills",), 'max_long_partial_prefills', type=int, help='... of them longer than --long-prefill-token-threshold'),
        Flag(("--long-prefill-token-threshold",), 'long_prefill_token_threshold', type=int, help='chunk cap for a prompt while others want the budget (default: budget / max-num-partial-prefills; 0 = none)'),
        Flag(("--aging-s",), 'aging_s', type=float, help="seconds of waiting after which a request's priority improves by one class (0 = no aging)"),
        Flag(('--max-step-ms', '--arrival-wait-ms'), 'max_step_ms', type=float, help="step-time target (ms): every step's work is sized to end within it, so a request arriving mid-step waits at most about that long (default: 15x what chunking repeats, a step's fixed part and a chunk's pass over the weights, measured at start-up; 0 = no bound). --arrival-wait-ms is an older name for it"),
        Flag(("--max-decode-slowdown",), 'max_decode_slowdown', type=float, help="while requests decode, a step carrying prompt work takes at most this many times what their decodes alone would (their token gap grows at most that much beside a long prefill; default 2.5; 0 = no such bound, as does --max-step-ms 0)"),
        Flag(("--no-layered-prefill",), 'layered_prefill', action="store_false", help='cut long prompts into token chunks only (default: a chunk the step-time target would make too small to run efficiently runs a few layers a step instead)'),
    )  # fmt: skip


    max_num_batched_tokens: int = 2048  # token budget per step, prefill and decode together
    max_num_seqs: int = 128  # requests running at once
    # The context window (prompt + output tokens of one request). ModelConfig owns the user's
    # wish; the engine builder resolves it against the model and the KV pool and hands it in
    # through EngineConfig.scheduler_for. None until then: a Scheduler refuses an unresolved slice.
    max_model_len: int | None = None
    # Prompts that may be left unfinished by one step's chunk (vLLM's max_num_partial_prefills).
    # A prompt that finishes in its step takes no slot, so short prompts are never held back by it.
    max_num_partial_prefills: int = 4
    # ... of which longer than long_prefill_token_threshold (vLLM's max_long_partial_prefills):
    # with 1, long prompts prefill one after another per class and the rest of the budget stays
    # with short prompts and decodes.
    max_long_partial_prefills: int = 1
    # A prompt with more tokens left than this is "long": its chunk is capped at this many
    # tokens while other prompts want the budget; budget left over at the end of the step goes
    # back to the capped chunks, so a prompt alone still gets all of it. None: derived,
    # max_num_batched_tokens // max_num_partial_prefills (512 of 2048), so that that many capped
    # chunks fit one step together and a long prompt leaves room for short ones next to it
    # (vLLM derives 4% of max_model_len instead, which ignores the budget). 0: no cap.
    long_prefill_token_threshold: int | None = None
    enable_chunked_prefill: bool = True  # off: a prompt is computed in one step or waits
    # Seconds of waiting after which a request's effective priority improves by one class (and
    # again after each further interval), so batch traffic is never starved. A request that has
    # waited this long is admitted with a first chunk shrunk to the free blocks rather than wait
    # for room for its whole chunk. 0 disables both.
    aging_s: float = 10.0
    # The step-time target (ms): every step's work is sized so that the cost model (step_cost.py,
    # calibrated at start-up and refined by every step) predicts it ends within this time, decodes
    # or not. A step is never interrupted, so this is also how long a request arriving mid-step
    # can wait before it is looked at (step_pricing.py). While requests with a class TBT target
    # decode, TBT_STEP_SHARE of the tightest such target binds instead when smaller. None: chosen
    # at start-up from the calibrated costs chunking repeats (a step's fixed part, a chunk's pass
    # over the weights), so a lone long prompt loses at most ~7% to them (step_pricing.auto_step_target_s:
    # ~180 ms on 2 CPU cores and the default model, tens of ms on a GPU); 0: no bound (steps are
    # held to max_num_batched_tokens alone).
    max_step_ms: float | None = None
    # While requests decode, a step that also carries prompt work is held to this many times the
    # predicted time of their decodes alone (step_pricing.decode_bound_s; only the decodes whose
    # priority is as good as the best waiting or prefilling prompt's), so a stream's token gap
    # grows at most this much while long prompts prefill beside it, on any hardware: the prompts
    # get the rest of every step (layered prefill keeps small slices efficient). A stream whose last
    # tokens are near is paced tighter while that costs the prompts little (step_pricing.FINISH_SLOWDOWN:
    # shortest remaining work first, so a short request is done soon after its first token). 0: no such bound
    # (the step-time target alone, up to ~10x a decode step on a CPU); max_step_ms 0 turns it off too.
    max_decode_slowdown: float = 2.5
    # Layered prefill (worker/layered_chunks.py): where the target would cut a long prompt into
    # chunks too small to run efficiently, one large chunk's forward is spread over several steps
    # by layers instead. Off: token chunks only (and on a context-parallel worker, whose ranks
    # share each chunk's rows).
    layered_prefill: bool = True

    def __post_init__(self) -> None:
        _require(
            self.max_step_ms is None or self.max_step_ms >= 0,
            f"max_step_ms must be >= 0 (or unset: chosen at start-up), got {self.max_step_ms}",
        )
        _require(
            self.max_num_batched_tokens > 0,
            f"max_num_batched_tokens must be positive, got {self.max_num_batched_tokens}",
        )
        _require(self.max_num_seqs > 0, f"max_num_seqs must be positive, got {self.max_num_seqs}")
        _require(
            self.max_model_len is None or self.max_model_len > 1,
            f"max_model_len must be at least 2, got {self.max_model_len}",
        )
        _require(
            self.long_prefill_token_threshold is None or self.long_prefill_token_threshold >= 0,
            f"long_prefill_token_threshold must be >= 0, got {self.long_prefill_token_threshold}",
        )
        _require(
            self.enable_chunked_prefill or not self.long_prefill_token_threshold,
            "long_prefill_token_threshold needs enable_chunked_prefill (a prompt cannot be capped unchunked)",
        )
        _require(
            self.max_num_partial_prefills > 0,
            f"max_num_partial_prefills must be positive, got {self.max_num_partial_prefills}",
        )
        _require(
            0 < self.max_long_partial_prefills <= self.max_num_partial_prefills,
            f"max_long_partial_prefills must be in 1..max_num_partial_prefills ({self.max_num_partial_prefills}), "
            f"got {self.max_long_partial_prefills}",
        )
        # Unchunked, the longest allowed prompt must fit one step's budget or it waits forever.
        # Checked only against the resolved window. Like vLLM (SchedulerConfig.verify_max_model_len),
        # refused rather than silently raised: the budget is a memory and latency decision.
        _require(
            self.enable_chunked_prefill
            or self.max_model_len is None
            or self.max_num_batched_tokens >= self.max_model_len,
            f"without chunked prefill max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= the "
            f"context window max_model_len ({self.max_model_len}), or a longest prompt could never be scheduled: "
            "raise max_num_batched_tokens or lower max_model_len",
        )
        _require(self.aging_s >= 0, f"aging_s must be >= 0, got {self.aging_s}")
        _require(
            self.max_decode_slowdown == 0 or self.max_decode_slowdown > 1,
            f"max_decode_slowdown must be > 1 (or 0: no bound), got {self.max_decode_slowdown}",
        )

    @property
    def prefill_chunk_cap(self) -> int:
        """long_prefill_token_threshold resolved: the derived default, or 0 (no cap) unchunked."""
        if not self.enable_chunked_prefill:
            return 0
        if self.long_prefill_token_threshold is None:
            return max(1, self.max_num_batched_tokens // self.max_num_partial_prefills)
        return self.long_prefill_token_threshold


@dataclass(frozen=True)
class ModelConfig:
    """Which weights, in which dtype, on which device."""

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--model",), 'model', help='HF model directory or .gguf file (default: embedded SmolLM2), or a remote one it is pulled from while loading: http(s)://HOST/PATH/, s3://BUCKET/PREFIX/ or peer://HOST:PORT (a running servelm replica)'),
        Flag(("--download-dir",), 'download_dir', help='where a remote --model is pulled to (default: ~/.cache/servelm/models)'),
        Flag(("--pull-connections",), 'pull_connections', type=int, help='parallel reads of a remote --model (default 8)'),
        Flag(("--dtype",), 'dtype', choices=["auto", "float32", "bfloat16", "float16"]),
        Flag(("--device",), 'device', help='auto | cpu | cuda | cuda:N'),
        Flag(("--attention-backend",), 'attention_backend', choices=["auto", "torch", "triton"], help='attention kernels: auto (triton on CUDA, torch elsewhere), torch (the reference) or triton'),
        Flag(("--max-model-len",), 'max_model_len', type=int, help="context window (default: the model's)"),
        Flag(("--num-threads",), 'num_threads', type=int, help='torch CPU threads for the engine core'),
        Flag(("--gemm-precision",), 'gemm_precision', choices=GEMM_PRECISIONS, help="CPU float32 models: what prefill's matmuls compute in (default float32, exact); bfloat16 is faster where the CPU has AMX / AVX512-BF16, at a measured logit error (benchmarks/RESULTS.md)"),
        Flag(("--keep-warm-s",), 'keep_warm_s', type=float, help="CPU: seconds between reads of every page of the weights (the KV pool: 5x that), keeping them warm where a VM's host lets memory left unread go cold (default 1; 0 = off)"),
        Flag(("--hf-overrides",), 'hf_overrides', type=json.loads, help='JSON of Hugging Face config keys replacing the checkpoint\'s, e.g. \'{"rope_scaling": {"rope_type": "linear", "factor": 2.0}, "max_position_embeddings": 16384}\''),
    )  # fmt: skip


    model: str | None = None  # HF directory or .gguf; None: the embedded default model
    dtype: str = "auto"  # auto | float32 | bfloat16 | float16 (auto: fp32 on CPU, bf16 on CUDA)
    device: str = "auto"  # auto | cpu | cuda | cuda:N
    max_model_len: int | None = None  # None: the model's max_position_embeddings
    # auto | torch | triton (auto: triton on CUDA when it imports, else torch; attention/selection.py)
    attention_backend: str = "auto"
    num_threads: int | None = None  # torch CPU threads in the engine core; None: torch's default
    # Hugging Face config keys replacing the checkpoint's (vLLM's --hf-overrides), e.g. RoPE scaling
    # with a larger max_position_embeddings to run past the trained context.
    hf_overrides: dict[str, Any] | None = None
    # A remote `model` (http(s)://, s3://, peer://HOST:PORT) is pulled here, into a directory named
    # after its source and version; None: <cache dir>/models. Reused by the next start.
    download_dir: str | None = None
    pull_connections: int = 8  # parallel ranged reads of a remote model
    # What a CPU float32 model's decoder layers compute their many-row matmuls (prefill) in:
    # float32 (exact, the default) or bfloat16 (opt-in, faster where the CPU has AMX / AVX512-BF16;
    # its logit error is measured in benchmarks/RESULTS.md). models/gemm_precision.py.
    gemm_precision: str = "float32"
    # CPU: every this many seconds (0 = never), read one byte per page of the weights (and of the KV
    # pool, 5x less often), so memory a virtual machine's host treats as cold after seconds unread is
    # warm when the next prompt comes (a 63-token prompt's first token after 60 s idle: +200 ms
    # without it here; after a 1.4 s decode, +40 ms). worker/host_residency.py.
    keep_warm_s: float = 1.0

    def __post_init__(self) -> None:
        _require(self.keep_warm_s >= 0, f"keep_warm_s must be >= 0 (0 = off), got {self.keep_warm_s}")
        _require(
            self.gemm_precision in GEMM_PRECISIONS,
            f"gemm_precision must be one of {', '.join(GEMM_PRECISIONS)}, got {self.gemm_precision!r}",
        )
        _require(self.pull_connections > 0, f"pull_connections must be positive, got {self.pull_connections}")
        _require(self.dtype in ("auto", "float32", "bfloat16", "float16"), f"unknown dtype {self.dtype!r}")
        _require(
            self.max_model_len is None or self.max_model_len > 1,
            f"max_model_len must be at least 2, got {self.max_model_len}",
        )
        _require(
            self.num_threads is None or self.num_threads > 0, f"num_threads must be positive, got {self.num_threads}"
        )


@dataclass(frozen=True)
class ParallelConfig:
    """Multi-rank workers over torch.distributed (servelm.parallel): tensor parallelism splits the
    weights (heads, MLP columns, vocabulary) across `tensor_parallel_size` ranks; context
    parallelism splits each request's tokens and KV across `context_parallel_size` ranks. The
    engine core is rank 0 and drives the others from its one schedule."""

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(('--tensor-parallel-size', '-tp'), 'tensor_parallel_size', type=int, help='ranks the weights are split over (heads, MLP columns, vocabulary); torch.distributed'),
        Flag(('--context-parallel-size', '-cp'), 'context_parallel_size', type=int, help="ranks each request's tokens and KV are split over (long prompts; ring attention)"),
        Flag(("--distributed-timeout-s",), 'distributed_timeout_s', type=float, help='seconds a collective may take before a silent rank counts as dead (default 60)'),
        Flag(("--threads-per-rank",), 'threads_per_rank', type=int, help='torch threads of each rank with -tp/-cp (default: the cores split over the ranks)'),
        Flag(("--no-shm-collectives",), 'shared_memory_collectives', action="store_false", help='with -tp/-cp on CPU, send every collective over gloo (default: small ones through shared memory)'),
    )  # fmt: skip


    tensor_parallel_size: int = 1
    context_parallel_size: int = 1
    # gloo on CPU, nccl on CUDA ("auto"); collectives (and a rank's start-up) fail after this long
    # instead of hanging when a rank dies.
    distributed_backend: str = "auto"
    distributed_timeout_s: float = 60.0
    # torch threads per rank; None: the machine's cores split evenly over the ranks.
    threads_per_rank: int | None = None
    # gloo groups whose ranks share this host send their small collectives through a shared-memory
    # segment (servelm.parallel.shm_collectives); False: everything over gloo.
    shared_memory_collectives: bool = True

    def __post_init__(self) -> None:
        _require(self.tensor_parallel_size >= 1, f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        _require(
            self.context_parallel_size >= 1, f"context_parallel_size must be >= 1, got {self.context_parallel_size}"
        )
        _require(
            self.distributed_backend in ("auto", "gloo", "nccl"),
            f"distributed_backend must be auto, gloo or nccl, got {self.distributed_backend!r}",
        )
        _require(self.distributed_timeout_s > 0, f"distributed_timeout_s must be > 0, got {self.distributed_timeout_s}")
        _require(
            self.threads_per_rank is None or self.threads_per_rank > 0,
            f"threads_per_rank must be positive, got {self.threads_per_rank}",
        )

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.context_parallel_size


@dataclass(frozen=True)
class KVEventsConfig:
    """KV-cache events for a router: whether the cache records them and where the core publishes them.

    The one switch is `kv_events_port` P: set, the KV cache and the KV tiers record block stored /
    removed events (with the medium: device, host, disk) and the core process publishes them (servelm.engine.kv_events) with PUB on tcp://HOST:P and
    snapshot REP on tcp://HOST:P+1. Unset, nothing is recorded (nobody would drain them).
    """

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--kv-events-port",), 'kv_events_port', type=int, help='publish KV-cache events for a router: PUB on tcp://HOST:P, snapshots on P+1'),
        Flag(("--kv-events-host",), 'kv_events_host', help="address the KV-event sockets bind (default 127.0.0.1; a pod's IP or 0.0.0.0 for a router elsewhere)"),
    )  # fmt: skip


    kv_events_port: int | None = None
    kv_events_host: str = "127.0.0.1"

    def __post_init__(self) -> None:
        _require(
            self.kv_events_port is None or 0 < self.kv_events_port < 65535,
            f"kv_events_port must be in 1..65534 (it uses the next port too), got {self.kv_events_port}",
        )

    @property
    def enabled(self) -> bool:
        return self.kv_events_port is not None


STRUCTURED_OUTPUTS_BACKENDS = ("auto", "guidance", "xgrammar")


@dataclass(frozen=True)
class StructuredOutputsConfig:
    """Structured outputs (servelm.structured): which grammar library holds outputs to a JSON Schema,
    regex, choice or grammar. auto: guidance (servelm/structured/guidance.py says why)."""

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--structured-outputs-backend",), 'structured_outputs_backend', choices=list(STRUCTURED_OUTPUTS_BACKENDS), help='grammar library for response_format / structured_outputs / tool calls: auto (guidance: llguidance, no up-front compile), guidance or xgrammar'),
    )  # fmt: skip

    structured_outputs_backend: str = "auto"

    def __post_init__(self) -> None:
        _require(
            self.structured_outputs_backend in STRUCTURED_OUTPUTS_BACKENDS,
            f"structured_outputs_backend must be one of {', '.join(STRUCTURED_OUTPUTS_BACKENDS)}, "
            f"got {self.structured_outputs_backend!r}",
        )


@dataclass(frozen=True)
class CudaGraphConfig:
    """CUDA graphs for pure-decode steps (servelm.worker.cuda_graphs), single-rank engines.

    Default: on when the model runs on CUDA with a graph-capturable attention backend, else off.
    """

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--enforce-eager",), 'enforce_eager', action="store_true", help='never use CUDA graphs (default: pure-decode steps replay them on CUDA with a graph-capturable backend)'),
        Flag(("--max-cudagraph-capture-size",), 'max_cudagraph_capture_size', type=int, help='largest decode batch a CUDA graph serves; larger ones run eagerly (default: min(--max-num-seqs, 512))'),
    )  # fmt: skip


    enforce_eager: bool = False  # vLLM's --enforce-eager: every step eager, no graphs
    # vLLM's --max-cudagraph-capture-size: the largest decode batch a graph serves (larger ones run
    # eagerly); None: min(max_num_seqs, 512).
    max_cudagraph_capture_size: int | None = None
    # Run pure decodes through the graph runner even where nothing can be captured (CPU, a backend
    # that is not graph_capturable): eagerly, through its persistent buffers, the metadata rebuilt
    # every step. For tests of its bookkeeping on CPU; it buys no speed.
    force_decode_buffers: bool = False

    def __post_init__(self) -> None:
        _require(
            self.max_cudagraph_capture_size is None or self.max_cudagraph_capture_size > 0,
            f"max_cudagraph_capture_size must be positive, got {self.max_cudagraph_capture_size}",
        )
        _require(
            not (self.enforce_eager and self.force_decode_buffers),
            "enforce_eager and force_decode_buffers contradict each other: set at most one",
        )


# -- speculative decoding ----------------------------------------------------------------
# Given as JSON on the command line in vLLM's shape:
#     --speculative-config '{"method": "ngram", "num_speculative_tokens": 5,
#                            "prompt_lookup_min": 2, "prompt_lookup_max": 5}'
# Keys follow vLLM where vLLM has one (method, num_speculative_tokens, prompt_lookup_min/max,
# model); the rest are ours (adaptive, draft_num_layers, suffix_max_cached_requests).

SPEC_METHODS = ("ngram", "suffix", "draft")


class SpeculativeConfigError(ValueError):
    """--speculative-config is malformed; the message names the key."""


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (servelm.spec): which proposer, how many draft tokens at most, its knobs."""

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--speculative-config",), 'speculative_config', help='speculative decoding, JSON in vLLM\'s shape, e.g. \'{"method": "ngram", "num_speculative_tokens": 5}\' (methods: ngram, suffix, draft; off when not given)'),
    )  # fmt: skip


    method: str
    # Most draft tokens verified per request per step (k). The controller picks 0..k each step.
    num_speculative_tokens: int = 5
    # ngram (vLLM semantics): match the last n tokens, n from prompt_lookup_max down to
    # prompt_lookup_min; one given → the other equals it; neither → both 5 (vLLM's default).
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    # draft: a servelm-loadable checkpoint with the target's tokenizer; or None with
    # draft_num_layers = N for a self-speculative draft (the target's first N layers + its norm and head).
    model: str | None = None
    draft_num_layers: int | None = None
    # suffix: how many finished requests' tokens the cross-request index keeps (oldest dropped first).
    suffix_max_cached_requests: int = 256
    # The goodput controller (True) or a fixed k = num_speculative_tokens whenever drafts exist (False).
    adaptive: bool = True

    def __post_init__(self) -> None:
        if self.method not in SPEC_METHODS:
            raise SpeculativeConfigError(f"method {self.method!r} is not one of {', '.join(SPEC_METHODS)}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise SpeculativeConfigError(f"num_speculative_tokens must be in 1..16, got {self.num_speculative_tokens}")
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if lo is None and hi is None:
            lo = hi = 5
        elif lo is None:
            lo = hi
        elif hi is None:
            hi = lo
        assert lo is not None and hi is not None
        if not 1 <= lo <= hi:
            raise SpeculativeConfigError(f"need 1 <= prompt_lookup_min <= prompt_lookup_max, got {lo} and {hi}")
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        if self.method == "draft" and (self.model is None) == (self.draft_num_layers is None):
            raise SpeculativeConfigError("method 'draft' needs exactly one of model (a checkpoint) or draft_num_layers")
        if self.draft_num_layers is not None and self.draft_num_layers < 1:
            raise SpeculativeConfigError(f"draft_num_layers must be >= 1, got {self.draft_num_layers}")
        if self.suffix_max_cached_requests < 0:
            raise SpeculativeConfigError(
                f"suffix_max_cached_requests must be >= 0, got {self.suffix_max_cached_requests}"
            )

    @property
    def lookup_min(self) -> int:
        assert self.prompt_lookup_min is not None  # resolved in __post_init__
        return self.prompt_lookup_min

    @property
    def lookup_max(self) -> int:
        assert self.prompt_lookup_max is not None
        return self.prompt_lookup_max

    @classmethod
    def parse(cls, value: str | dict[str, Any] | SpeculativeConfig) -> SpeculativeConfig:
        """From the flag's JSON text (or an already-decoded dict); unknown keys are errors."""
        if isinstance(value, SpeculativeConfig):
            return value
        if isinstance(value, str):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as exc:
                raise SpeculativeConfigError(f"--speculative-config is not valid JSON: {exc}") from exc
        if not isinstance(value, dict):
            raise SpeculativeConfigError("--speculative-config must be a JSON object")
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(value) - known)
        if unknown:
            raise SpeculativeConfigError(f"unknown key(s) {', '.join(unknown)}; valid: {', '.join(sorted(known))}")
        if "method" not in value:
            raise SpeculativeConfigError(f"'method' is required: one of {', '.join(SPEC_METHODS)}")
        try:
            return cls(**value)
        except TypeError as exc:
            raise SpeculativeConfigError(str(exc)) from exc


@dataclass(frozen=True)
class LoRAModule:
    """An adapter served from start-up: the API's `model` name for it, its PEFT directory, and the
    base model it was trained on (what /v1/models lists as its parent; None: the served model)."""

    name: str
    path: str
    base_model_name: str | None = None


def parse_lora_module(text: str) -> LoRAModule:
    """`name=path`, or vLLM's JSON form {"name": ..., "path": ..., "base_model_name": ...}."""
    if text.lstrip().startswith("{"):
        try:
            spec = json.loads(text)
            return LoRAModule(str(spec["name"]), str(spec["path"]), spec.get("base_model_name"))
        except (json.JSONDecodeError, KeyError, TypeError) as exc:
            raise ValueError(f"--lora-modules JSON needs \"name\" and \"path\": {text!r} ({exc})") from exc
    name, sep, path = text.partition("=")
    if not sep or not name.strip() or not path.strip():
        raise ValueError(f"--lora-modules takes name=path or JSON, got {text!r}")
    return LoRAModule(name.strip(), path.strip())


@dataclass(frozen=True)
class LoRAConfig:
    """LoRA adapters over the served model (servelm.lora): which are served from start-up, how many
    distinct adapters one step may mix (each a slot of stacked weights), and their largest rank."""

    # Its command-line flags (cli.py adds them under this slice's heading in --help).
    FLAGS: ClassVar[tuple[Flag, ...]] = (
        Flag(("--enable-lora",), 'enable_lora', action="store_true", help='serve LoRA adapters (PEFT format) over the base model, the request\'s `model` naming one'),
        Flag(("--lora-modules",), 'lora_modules', type=parse_lora_module, nargs="+", help='adapters served from start-up: name=path ... or JSON {"name": ..., "path": ..., "base_model_name": ...}'),
        Flag(("--max-loras",), 'max_loras', type=int, help='distinct adapters one step may mix (slots of stacked weights; default 1)'),
        Flag(("--max-lora-rank",), 'max_lora_rank', type=int, help='largest adapter rank served (default 16): larger ones are refused at load'),
        Flag(("--max-cpu-loras",), 'max_cpu_loras', type=int, help='adapters kept in host memory, the least recently used dropped first and read again in the background when a request names it (default: all of them; at least --max-loras)'),
        Flag(("--allow-runtime-lora-updating",), 'allow_runtime_lora_updating', action="store_true", help='answer POST /v1/load_lora_adapter and /v1/unload_lora_adapter (under the API key): adapters served from a path on this machine at run time'),
    )  # fmt: skip

    enable_lora: bool = False
    lora_modules: tuple[LoRAModule, ...] = ()
    max_loras: int = 1
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    allow_runtime_lora_updating: bool = False

    def __post_init__(self) -> None:
        # argparse hands a list; LLM(lora_modules=["name=path"]) strings
        modules = tuple(parse_lora_module(m) if isinstance(m, str) else m for m in self.lora_modules)
        object.__setattr__(self, "lora_modules", modules)
        _require(not self.lora_modules or self.enable_lora, "--lora-modules needs --enable-lora")
        _require(not self.allow_runtime_lora_updating or self.enable_lora, "--allow-runtime-lora-updating needs --enable-lora")
        _require(self.max_loras >= 1, f"max_loras must be >= 1, got {self.max_loras}")
        _require(self.max_lora_rank >= 1, f"max_lora_rank must be >= 1, got {self.max_lora_rank}")
        _require(self.max_cpu_loras is None or self.max_cpu_loras >= self.max_loras,
                 f"max_cpu_loras ({self.max_cpu_loras}) must be at least max_loras ({self.max_loras})")  # fmt: skip
        names = [module.name for module in self.lora_modules]
        _require(len(set(names)) == len(names), f"--lora-modules names an adapter twice: {names}")


# Fields the engine builder fills in from other slices: never a user setting of their own.
# The slices whose flags the engine's commands take, in --help's order, each under its heading.
FLAG_SLICES: tuple[tuple[str, Any], ...] = (
    ("model", ModelConfig),
    ("KV cache", CacheConfig),
    ("KV tiers", KVTierConfig),
    ("prefill/decode disaggregation", KVTransferConfig),
    ("KV events", KVEventsConfig),
    ("parallelism", ParallelConfig),
    ("CUDA graphs", CudaGraphConfig),
    ("scheduler", SchedulerConfig),
    ("speculative decoding", SpeculativeConfig),
    ("structured outputs", StructuredOutputsConfig),
    ("LoRA adapters", LoRAConfig),
)


def flag_arguments(settings: Mapping[str, Any]) -> list[str]:
    """The command-line arguments that set `settings` (from_flat keywords, as cli.py reads them
    back from the flags): how a process that has the settings starts `servelm serve` with them."""
    arguments: list[str] = []
    for _, config_slice in FLAG_SLICES:
        for flag in config_slice.FLAGS:
            value = settings.get(flag.setting)
            if value is None:
                continue
            name = flag.names[0]
            if flag.action is not None:  # a switch: given when it sets what its action stores
                if value is (flag.action == "store_true"):
                    arguments.append(name)
            elif flag.nargs is not None and isinstance(value, tuple | list):
                arguments += [name, *map(str, value)]
            else:
                arguments += [name, ",".join(map(str, value)) if isinstance(value, tuple | list) else str(value)]
    return arguments


_RESOLVED_BY_BUILDER: dict[type, set[str]] = {SchedulerConfig: {"max_model_len"}}

# Flat settings given in GiB → the byte fields they set.
_GIB_SETTINGS = {
    "kv_cache_memory_gib": "kv_cache_memory_bytes",
    "kv_offloading_size": "host_bytes",
    "kv_disk_size": "disk_bytes",
}

# KV budget on CPU when neither num_blocks nor kv_cache_memory_bytes is given (CUDA:
# CacheConfig.gpu_memory_utilization).
DEFAULT_CPU_KV_CACHE_BYTES = 2 * 2**30


@dataclass(frozen=True)
class EngineConfig:
    """Every slice an engine core needs; `build_engine` hands each component its own."""

    model: ModelConfig = ModelConfig()
    cache: CacheConfig = CacheConfig()
    scheduler: SchedulerConfig = SchedulerConfig()
    kv_events: KVEventsConfig = KVEventsConfig()
    speculative: SpeculativeConfig | None = None  # None: no speculative decoding
    kv_tiers: KVTierConfig = KVTierConfig()
    kv_transfer: KVTransferConfig = KVTransferConfig()
    parallel: ParallelConfig = ParallelConfig()
    cuda_graphs: CudaGraphConfig = CudaGraphConfig()
    structured: StructuredOutputsConfig = StructuredOutputsConfig()
    lora: LoRAConfig = LoRAConfig()

    def scheduler_for(self, max_model_len: int) -> SchedulerConfig:
        """The scheduler slice with the context window the engine builder resolved from
        ModelConfig.max_model_len, the model and the KV pool; validated (again) with it."""
        return replace(self.scheduler, max_model_len=max_model_len)

    @classmethod
    def from_flat(cls, model: str | None = None, **overrides: Any) -> EngineConfig:
        """Build from flat keyword settings (CLI flags, LLM(**kwargs)); each goes to the slice owning it.

        `max_model_len` goes to ModelConfig, its one owner: the scheduler receives the resolved
        window through `scheduler_for` once the model and the KV pool are known.

        GiB conveniences: `kv_cache_memory_gib` for `kv_cache_memory_bytes`, `kv_offloading_size`
        (vLLM's name) for KVTierConfig.host_bytes, `kv_disk_size` for KVTierConfig.disk_bytes;
        `kv_disk_path` for KVTierConfig.disk_path; `speculative_config` (JSON text, a dict or a
        SpeculativeConfig; None: off) for `speculative`.
        """
        speculative_value = overrides.pop("speculative_config", None)
        speculative = SpeculativeConfig.parse(speculative_value) if speculative_value is not None else None
        for gib_key, bytes_key in _GIB_SETTINGS.items():
            gib = overrides.pop(gib_key, None)
            if gib is not None:
                overrides[bytes_key] = int(gib * 2**30)
        if "kv_disk_path" in overrides:
            overrides["disk_path"] = overrides.pop("kv_disk_path")
        slices: dict[type, dict[str, Any]] = {
            ModelConfig: {"model": model}, CacheConfig: {}, SchedulerConfig: {}, KVEventsConfig: {}, KVTierConfig: {},
            KVTransferConfig: {}, ParallelConfig: {}, CudaGraphConfig: {}, StructuredOutputsConfig: {}, LoRAConfig: {},
        }  # fmt: skip
        settable = {c: {f.name for f in fields(c)} - _RESOLVED_BY_BUILDER.get(c, set()) for c in slices}
        for key, value in overrides.items():
            owner = next((c for c in slices if key in settable[c]), None)
            if owner is None:
                valid = sorted(set().union(*settable.values()) | {*_GIB_SETTINGS, "kv_disk_path", "speculative_config"})
                raise ValueError(f"unknown engine setting {key!r}; valid: {', '.join(valid)}")
            slices[owner][key] = value
        return cls(
            model=ModelConfig(**slices[ModelConfig]),
            cache=CacheConfig(**slices[CacheConfig]),
            scheduler=SchedulerConfig(**slices[SchedulerConfig]),
            kv_events=KVEventsConfig(**slices[KVEventsConfig]),
            speculative=speculative,
            kv_tiers=KVTierConfig(**slices[KVTierConfig]),
            kv_transfer=KVTransferConfig(**slices[KVTransferConfig]),
            parallel=ParallelConfig(**slices[ParallelConfig]),
            cuda_graphs=CudaGraphConfig(**slices[CudaGraphConfig]),
            structured=StructuredOutputsConfig(**slices[StructuredOutputsConfig]),
            lora=LoRAConfig(**slices[LoRAConfig]),
        )
