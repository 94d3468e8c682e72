"""servelm's compiled CPU kernels behind typed, checked wrappers; None where they are off.

Callers, on every layer of every step in the engine core process:
- `attention/torch_backend.py`: `decode_attention`, paged decode attention for float32 queries on
  CPU over a float32 pool or an int8 one with per-(token, head) scales (source: `csrc/paged_decode_attention.c`);
  and `chunk_attention`, a prompt chunk after cached context attended straight from a float32 pool,
  flash-style (source: `csrc/chunk_attention.c`; AVX2 + FMA builds only, `has_chunk_attention`);
- `models/linear_methods.py` (BlockLinearMethod): `block_gemm_prepared`, a few rows times GGUF
  Q4_0 / Q4_1 / Q8_0 blocks as the file stores them (source: `csrc/block_gemm.c`);
- `models/fused_decode.py`: `decode_layers`, every decoder layer of a small decode step in one call
  (source: `csrc/decode_layers.c`, composing the two above; arguments: `kernels/decode_layers.py`).
All treat `load()` returning None as "take the pure-torch path", which gives the same results
within float32 rounding. `load()` decides once per process (until `reset()`):

    SERVELM_KERNELS=torch          -> None; said once in the log (INFO)
    no compiler / the build fails  -> None; said once in the log (WARNING), with the reason
    otherwise                      -> CpuKernels over the library `kernels.build` built

Every argument is checked (dtype, device, contiguity, shapes against each other, and the block
tables' entries against the pool) before a pointer reaches C: bad input raises
`KernelArgumentError` naming the argument, never reads memory outside the tensors.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import torch

from servelm import envs
from servelm.kernels.arguments import KernelArgumentError, check_int, check_shape, check_tensor
from servelm.kernels.build import BuiltLibrary, KernelBuildError, build
from servelm.kernels.decided_once import DecidedOnce

if TYPE_CHECKING:
    from servelm.kernels.decode_layers import DecodeLayersCall, PreparedLayers

logger = logging.getLogger(__name__)

BLOCK = 32  # weights per GGUF block
# The GGUF block types the block matmul reads, by ggml type id (csrc/block_gemm.c's `type`), and
# their bytes per block: Q4_0 d + 16 nibble bytes, Q4_1 d + m + 16, Q8_0 d + 32 int8 codes.
BLOCK_BYTES: dict[int, int] = {2: 18, 3: 20, 8: 34}


def load() -> CpuKernels | None:
    """The kernels (built on the first call of the process), or None where they are off or cannot
    be built. Cheap after the first call; thread-safe; every call returns the same answer until
    `reset()`. Raises ValueError for an invalid SERVELM_KERNELS value."""
    return _decided.get()


def reset() -> None:
    """Forget `load()`'s answer, so the next call reads SERVELM_KERNELS again (tests, tools).

    Safe to call twice. A CpuKernels already handed out keeps working (its library stays loaded).
    """
    _decided.reset()


def _decide() -> CpuKernels | None:
    if envs.kernels_mode() is envs.KernelsMode.TORCH:
        logger.info("%s=torch: compiled CPU kernels off, using the pure-torch paths", envs.KERNELS)
        return None
    try:
        return CpuKernels(build())
    except (KernelBuildError, OSError) as exc:  # OSError: the built library does not load
        logger.warning("compiled CPU kernels unavailable, using the pure-torch paths: %s", exc)
        return None


_decided: DecidedOnce[CpuKernels | None] = DecidedOnce(_decide)


class CpuKernels:
    """ctypes bindings of one built library. Holds no state besides the library; thread-safe."""

    def __init__(self, library: BuiltLibrary) -> None:
        lib = ctypes.CDLL(str(library.path))
        ptr, i64, c_int = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
        lib.decode_scores.argtypes = [ptr] * 6 + [i64] * 8 + [ctypes.c_float, c_int]
        lib.decode_scores.restype = i64
        lib.decode_pv.argtypes = [ptr] * 6 + [i64] * 7 + [c_int]
        lib.decode_pv.restype = None
        lib.block_gemm_small.argtypes = [ptr] * 3 + [i64] * 3 + [c_int, c_int]
        lib.block_gemm_small.restype = None
        lib.decode_layers.argtypes = [ptr, ptr, i64, ptr, ptr, i64]
        lib.decode_layers.restype = i64
        f32 = ctypes.c_float
        lib.rms_norm_rows.argtypes = [ptr] * 5 + [i64, i64, f32, c_int]
        lib.rms_norm_rows.restype = None
        lib.silu_mul_rows.argtypes = [ptr, ptr, i64, i64, c_int]
        lib.silu_mul_rows.restype = None
        lib.rotate_rows.argtypes = [ptr, i64, i64, i64, i64, ptr, ptr, c_int]
        lib.rotate_rows.restype = None
        lib.lora_bgmv.argtypes = [ptr] * 7 + [i64] * 4 + [c_int]
        lib.lora_bgmv.restype = None
        lib.moe_experts.argtypes = [ptr] * 9 + [i64] * 4 + [c_int]
        lib.moe_experts.restype = i64
        lib.chunk_attention.argtypes = [ptr] * 5 + [i64] * 8 + [ctypes.c_float, c_int]
        lib.chunk_attention.restype = i64
        lib.chunk_attention_supported.argtypes = []
        lib.chunk_attention_supported.restype = c_int
        lib.block_gemm_simd_level.argtypes = []
        lib.block_gemm_simd_level.restype = c_int
        self._lib = lib
        self.library = library
        # Which loops the block matmul was built with: 2 AVX-512, 1 AVX2 + FMA, 0 plain C.
        self.block_gemm_simd_level: int = lib.block_gemm_simd_level()
        # Whether `chunk_attention` was built (it needs AVX2 + FMA); the torch path otherwise.
        self.has_chunk_attention: bool = bool(lib.chunk_attention_supported())

    def decode_attention(
        self,
        query: torch.Tensor,  # [B, H, D] float32, one new token per request
        k_pool: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32, one layer's K
        v_pool: torch.Tensor,  # same shape, the layer's V
        block_tables: torch.Tensor,  # [B, max_blocks] int32; only the blocks seq_lens reach are read
        seq_lens: torch.Tensor,  # [B] int32, keys per request (cached + the new one)
        max_len: int,  # >= every seq_len: the width of the scores
        scale: float,
        pool_scales: tuple[torch.Tensor, torch.Tensor] | None = None,  # see decode_prepared
    ) -> torch.Tensor:  # [B, H, D] float32
        """softmax(scale * q . K) . V over each request's own K/V rows, read from its blocks."""
        batch = self.prepare_decode(block_tables, seq_lens, max_len)
        return self.decode_prepared(query, k_pool, v_pool, batch, scale, pool_scales)

    def prepare_decode(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int) -> DecodeBatch:
        """A step's decode batch checked once, for the `decode_prepared` call of every layer (the
        tables and lengths are the same for all of them; checking them per layer was a measurable
        part of a small decode step)."""
        check_tensor("block_tables", block_tables, torch.int32, 2)
        check_tensor("seq_lens", seq_lens, torch.int32, 1)
        max_len = check_int("max_len", max_len, minimum=1)
        check_shape("seq_lens", seq_lens, (block_tables.shape[0],), "[batch], batch as in block_tables")
        return DecodeBatch(block_tables, seq_lens, max_len)

    def decode_prepared(
        self,
        query: torch.Tensor,  # [B, H, D] float32
        k_pool: torch.Tensor,  # [num_blocks, block_size, KVH, D]: float32, or int8 codes with pool_scales
        v_pool: torch.Tensor,
        batch: DecodeBatch,
        scale: float,
        # None: the pools hold float32 values. Else the K and V codes' scales, [num_blocks, block_size, KVH]
        # float32 each: value = code * scale (servelm.attention.kv_storage.QuantizedKV).
        pool_scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:  # [B, H, D] float32
        """`decode_attention` for a batch from `prepare_decode`: only the query and this layer's pools are checked."""
        check_tensor("query", query, torch.float32, 3)
        pool_dtype = torch.float32 if pool_scales is None else torch.int8
        check_tensor("k_pool", k_pool, pool_dtype, 4)
        check_tensor("v_pool", v_pool, pool_dtype, 4)
        num_requests, heads, head_dim = query.shape
        num_blocks, block_size, kv_heads, pool_head_dim = k_pool.shape
        if pool_head_dim != head_dim or block_size < 1 or kv_heads < 1 or heads % kv_heads:
            raise KernelArgumentError(
                f"k_pool: expected [num_blocks, block_size >= 1, kv_heads dividing query's {heads} heads, "
                f"head_dim {head_dim} as in query], found {tuple(k_pool.shape)}"
            )
        check_shape("v_pool", v_pool, tuple(k_pool.shape), "k_pool's")
        k_scales_ptr = v_scales_ptr = None
        if pool_scales is not None:
            for name, scales in zip(("k_scales", "v_scales"), pool_scales):
                check_tensor(name, scales, torch.float32, 3)
                check_shape(name, scales, tuple(k_pool.shape[:3]), "k_pool's without head_dim")
            k_scales_ptr, v_scales_ptr = pool_scales[0].data_ptr(), pool_scales[1].data_ptr()
        if num_requests != batch.batch:
            raise KernelArgumentError(
                f"block_tables: expected [batch, max_blocks] with batch {num_requests} as in query, "
                f"found {tuple(batch.block_tables.shape)}"
            )
        max_len, max_blocks = batch.max_len, batch.max_blocks
        threads = torch.get_num_threads()
        scores = torch.empty(num_requests, heads, max_len, dtype=torch.float32)
        bad = self._lib.decode_scores(  # checks seq_lens and the used table entries before any read
            query.data_ptr(), k_pool.data_ptr(), k_scales_ptr, batch.tables_ptr, batch.lens_ptr, scores.data_ptr(),
            num_requests, heads, kv_heads, head_dim, block_size, max_blocks, max_len, num_blocks, float(scale),
            threads,
        )  # fmt: skip
        if bad >= 0:
            raise KernelArgumentError(
                f"request {bad}: seq_len {int(batch.seq_lens[bad])} must lie in [1, min(max_len={max_len}, "
                f"max_blocks * block_size={max_blocks * block_size})] and the block ids it reads in "
                f"[0, {num_blocks}); its block table row is {batch.block_tables[bad].tolist()}"
            )
        probs = torch.softmax(scores, dim=-1)  # [B, H, max_len]; positions past a seq_len hold -inf -> 0
        out = torch.empty(num_requests, heads, head_dim, dtype=torch.float32)
        self._lib.decode_pv(
            probs.data_ptr(), v_pool.data_ptr(), v_scales_ptr, batch.tables_ptr, batch.lens_ptr, out.data_ptr(),
            num_requests, heads, kv_heads, head_dim, block_size, max_blocks, max_len, threads,
        )  # fmt: skip
        return out

    def chunk_attention(
        self,
        query: torch.Tensor,  # [Q, H, D] float32: a prompt chunk's queries, positions context..context + Q - 1
        k_pool: torch.Tensor,  # [num_blocks, block_size, KVH, D] float32, one layer's K (the chunk's own written)
        v_pool: torch.Tensor,  # same shape, the layer's V
        blocks: torch.Tensor,  # [n] int32: the request's blocks in order, covering context + Q positions
        context: int,  # cached positions before the chunk
        scale: float,
    ) -> torch.Tensor:  # [Q, H, D] float32
        """softmax(scale * q . K) . V of each query over keys 0..its own position, read from the request's
        blocks (csrc/chunk_attention.c). Needs `has_chunk_attention`, D a multiple of 8 up to 256 and at
        most 48 query heads per KV head."""
        check_tensor("query", query, torch.float32, 3)
        check_tensor("k_pool", k_pool, torch.float32, 4)
        check_tensor("v_pool", v_pool, torch.float32, 4)
        check_tensor("blocks", blocks, torch.int32, 1)
        check_shape("v_pool", v_pool, tuple(k_pool.shape), "k_pool's")
        num_queries, heads, head_dim = query.shape
        num_blocks, block_size, kv_heads, pool_head_dim = k_pool.shape
        context = check_int("context", context, minimum=0)
        check_int("query rows", num_queries, minimum=1)
        if pool_head_dim != head_dim or heads % kv_heads:
            raise KernelArgumentError(
                f"k_pool: expected [num_blocks, block_size, kv_heads dividing query's {heads} heads, head_dim "
                f"{head_dim} as in query], found {tuple(k_pool.shape)}"
            )
        out = torch.empty_like(query)
        bad = self._lib.chunk_attention(
            query.data_ptr(), k_pool.data_ptr(), v_pool.data_ptr(), blocks.data_ptr(), out.data_ptr(), blocks.numel(),
            num_blocks, num_queries, context, heads, kv_heads, head_dim, block_size, float(scale),
            torch.get_num_threads(),
        )  # fmt: skip
        if bad == -2:  # the table: which way it failed, said from here (nothing was read)
            raise KernelArgumentError(_chunk_table_error(blocks, block_size, num_blocks, context, num_queries))
        if bad != -1:
            raise KernelArgumentError(
                f"chunk_attention: not built for this CPU, or head_dim {head_dim} / {heads // kv_heads} query "
                "heads per KV head unsupported" if bad == -3 else "chunk_attention: out of memory"
            )  # fmt: skip
        return out

    def block_gemm(self, x: torch.Tensor, blocks: torch.Tensor, block_type: int) -> torch.Tensor:  # [M, N] float32
        """x [M, K] float32 @ W^T, W [N, K] given as GGUF blocks [N, K / 32, bytes] uint8 of `block_type`."""
        return self.block_gemm_prepared(x, self.prepare_block_weight(blocks, block_type))

    def prepare_block_weight(self, blocks: torch.Tensor, block_type: int) -> PreparedBlocks:
        """The weight checked once, for `block_gemm_prepared` calls that then check only their input
        (a layer's weight does not change between steps; checking it on every call of every layer
        was ~1 ms of a 25 ms decode step)."""
        check_block_weight("blocks", blocks, block_type)
        return PreparedBlocks(blocks, block_type)

    def block_gemm_prepared(self, x: torch.Tensor, weight: PreparedBlocks) -> torch.Tensor:  # [M, N] float32
        """x [M, K] float32 @ W^T for a weight from `prepare_block_weight`."""
        check_tensor("x", x, torch.float32, 2)
        rows, k = x.shape
        if k != weight.in_features:
            raise KernelArgumentError(f"x: expected [M, {weight.in_features}] (K as in blocks), found {tuple(x.shape)}")
        out = torch.empty(rows, weight.out_features, dtype=torch.float32)
        self._lib.block_gemm_small(
            x.data_ptr(), weight.blocks_ptr, out.data_ptr(), rows, weight.out_features, k, weight.block_type,
            torch.get_num_threads(),
        )  # fmt: skip
        return out

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, residual: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(rmsnorm(x + residual) * weight, x + residual) for x [T, n] (residual None: of x itself,
        and x returned as the sum), float32 (csrc/row_ops.c)."""
        check_tensor("x", x, torch.float32, 2)
        rows, n = x.shape
        check_shape("weight", check_tensor("weight", weight, torch.float32, 1), (n,), "[n], n as in x")
        total = x
        if residual is not None:
            check_shape("residual", check_tensor("residual", residual, torch.float32, 2), (rows, n), "x's")
            total = torch.empty_like(x)
        out = torch.empty_like(x)
        residual_ptr = None if residual is None else residual.data_ptr()
        self._lib.rms_norm_rows(x.data_ptr(), residual_ptr, weight.data_ptr(), out.data_ptr(), total.data_ptr(),
                                rows, n, float(eps), torch.get_num_threads())  # fmt: skip
        return out, total

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """silu(gate) * up for gate_up [T, 2I] float32 (gate | up) -> [T, I] (csrc/row_ops.c)."""
        check_tensor("gate_up", gate_up, torch.float32, 2)
        rows, width = gate_up.shape
        if width % 2:
            raise KernelArgumentError(f"gate_up: expected [T, 2 I], found {tuple(gate_up.shape)}")
        act = gate_up.new_empty(rows, width // 2)
        self._lib.silu_mul_rows(gate_up.data_ptr(), act.data_ptr(), rows, width // 2, torch.get_num_threads())
        return act

    def lora_bgmv_(self, out: torch.Tensor, x: torch.Tensor, a: torch.Tensor, bt: torch.Tensor,
                   row_slots: torch.Tensor, widths: torch.Tensor) -> None:  # fmt: skip
        """out[t] += (A[s, :w] . x[t]) . Bt[s, :w] for each row t of slot s = row_slots[t] >= 0, w =
        widths[s] (csrc/lora.c). x [T, in], out [T, out] float32; A [S, W, in], Bt [S, W, out] float32;
        row_slots [T], widths [S] int64; all contiguous."""
        check_tensor("x", x, torch.float32, 2)
        check_tensor("out", out, torch.float32, 2)
        check_tensor("a", a, torch.float32, 3)
        check_tensor("bt", bt, torch.float32, 3)
        rows, in_features = x.shape
        num_slots, width, _ = a.shape
        if out.shape[0] != rows or a.shape[2] != in_features or bt.shape != (num_slots, width, out.shape[1]):
            raise KernelArgumentError(f"lora_bgmv: x {tuple(x.shape)}, out {tuple(out.shape)}, a {tuple(a.shape)}, "
                                      f"bt {tuple(bt.shape)} do not fit")  # fmt: skip
        if row_slots.dtype != torch.int64 or widths.dtype != torch.int64 or row_slots.numel() != rows:
            raise KernelArgumentError("lora_bgmv: row_slots [T] and widths [S] must be int64")
        h = x.new_empty(rows, width)
        self._lib.lora_bgmv(x.data_ptr(), out.data_ptr(), a.data_ptr(), bt.data_ptr(), row_slots.data_ptr(),
                            widths.data_ptr(), h.data_ptr(), rows, in_features, out.shape[1], width,
                            torch.get_num_threads())  # fmt: skip

    def moe_experts_(self, out: torch.Tensor, x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                     pair_token: torch.Tensor, pair_weight: torch.Tensor, offsets: torch.Tensor) -> None:  # fmt: skip
        """out[t] += w_p * down_e(silu(gate_e x[t]) * up_e x[t]) over the (token, expert) pairs, sorted by
        expert: local expert e's pairs are [offsets[e], offsets[e + 1]) (csrc/moe.c). x, out [T, H];
        gate_up [E, 2I, H] (gate rows, then up rows); down [E, H, I]; pair_weight [P] float32;
        pair_token [P], offsets [E + 1] int64; all contiguous."""
        check_tensor("x", x, torch.float32, 2)
        check_tensor("out", out, torch.float32, 2)
        check_tensor("gate_up", gate_up, torch.float32, 3)
        check_tensor("down", down, torch.float32, 3)
        check_tensor("pair_token", pair_token, torch.int64, 1)
        check_tensor("pair_weight", pair_weight, torch.float32, 1)
        check_tensor("offsets", offsets, torch.int64, 1)
        rows, hidden = x.shape
        experts, width = down.shape[0], down.shape[2]
        pairs = pair_token.numel()
        if (out.shape != x.shape or gate_up.shape != (experts, 2 * width, hidden) or down.shape[1] != hidden
                or pair_weight.numel() != pairs or offsets.numel() != experts + 1 or int(offsets[-1]) != pairs):  # fmt: skip
            raise KernelArgumentError(f"moe_experts: x {tuple(x.shape)}, out {tuple(out.shape)}, gate_up "
                                      f"{tuple(gate_up.shape)}, down {tuple(down.shape)}, {pairs} pairs, offsets "
                                      f"{offsets.tolist()} do not fit")  # fmt: skip
        scratch = x.new_empty(max(pairs, 1), 3 * width)
        bad = self._lib.moe_experts(x.data_ptr(), gate_up.data_ptr(), down.data_ptr(), pair_token.data_ptr(),
                                    pair_weight.data_ptr(), offsets.data_ptr(), out.data_ptr(), scratch.data_ptr(),
                                    scratch.data_ptr() + max(pairs, 1) * 2 * width * 4, rows, hidden, width, experts,
                                    torch.get_num_threads())  # fmt: skip
        if bad != -1:
            raise KernelArgumentError(f"moe_experts: pair {bad}'s token is outside the {rows} rows" if bad >= 0 else
                                      "moe_experts: offsets must start at 0 and never fall" if bad == -2 else
                                      "moe_experts: out of memory")  # fmt: skip

    def rotate_(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """x [T, N, D] float32 rotated in place by cos / sin [T, 1, D/2] (HF rotate-half, apply_rotary's
        roundings); x's heads contiguous within a row (a q|k column view of a fused qkv is fine)."""
        if not (isinstance(x, torch.Tensor) and x.dtype == torch.float32 and x.is_cpu and x.dim() == 3):
            raise KernelArgumentError(f"x: expected a float32 CPU tensor [T, N, D], found {type(x).__name__}")
        rows, heads, dim = x.shape
        if dim % 2 or x.stride(2) != 1 or x.stride(1) != dim or (rows > 1 and x.stride(0) < heads * dim):
            raise KernelArgumentError(f"x: expected [T, N, even D] with each row's heads contiguous, found shape "
                                      f"{tuple(x.shape)} strides {x.stride()}")  # fmt: skip
        for name, angles in (("cos", cos), ("sin", sin)):
            check_shape(name, check_tensor(name, angles, torch.float32, 3), (rows, 1, dim // 2), "[T, 1, D/2]")
        self._lib.rotate_rows(x.data_ptr(), rows, heads, dim, x.stride(0), cos.data_ptr(), sin.data_ptr(),
                              torch.get_num_threads())  # fmt: skip
        return x

    def decode_layers(self, prepared: PreparedLayers, call: DecodeLayersCall, num_layers: int) -> torch.Tensor:
        """The first `num_layers` layers of `prepared` over `call`'s rows (csrc/decode_layers.c): returns
        the last layer's MLP output; `call.residual` then holds the sum before it. Writes each row's
        new K/V into every layer's pool."""
        if not 0 < num_layers <= len(prepared.layers):
            raise KernelArgumentError(f"num_layers: expected 1..{len(prepared.layers)}, found {num_layers}")
        bad = self._lib.decode_layers(
            ctypes.byref(call.step), prepared.array, num_layers, call.hidden.data_ptr(), call.residual.data_ptr(),
            int(call.has_residual),
        )  # fmt: skip
        if bad >= 0:
            raise KernelArgumentError(
                f"row {bad}: its seq_len, block ids or slot fall outside the pool, or its LoRA slot is not one of the "
                f"{prepared.lora_slots} ({prepared.num_blocks} blocks of "
                f"{prepared.block_size}); seq_len {int(call.seq_lens[bad])}, slot {int(call.slots[bad])}, "
                f"block table row {call.block_tables[bad].tolist()}"
            )
        return call.hidden


def _chunk_table_error(blocks: torch.Tensor, block_size: int, num_blocks: int, context: int, num_queries: int) -> str:
    """What is wrong with a chunk's block table the kernel refused: too short, or an entry it uses outside the pool."""
    needed = -(-(context + num_queries) // block_size)
    if blocks.numel() < needed:
        return f"blocks: {blocks.numel()} blocks of {block_size} cannot hold context {context} + {num_queries} queries"
    used = blocks[:needed]
    outside = torch.nonzero((used < 0) | (used >= num_blocks)).flatten()
    if outside.numel() == 0:
        return f"context {context} + {num_queries} queries: more positions than the kernel indexes (2^31 - 1)"
    bad = int(outside[0])
    return f"blocks: entry {bad} ({int(blocks[bad])}) is outside the pool's {num_blocks} blocks"


def check_block_weight(name: str, blocks: torch.Tensor, block_type: int) -> None:
    """`blocks` must be [N, K / 32, bytes] uint8 of a ggml type id the block matmul reads, with that
    type's bytes per block; KernelArgumentError naming `name` (and its block_type) otherwise."""
    check_tensor(name, blocks, torch.uint8, 3)
    if block_type not in BLOCK_BYTES:
        raise KernelArgumentError(
            f"block_type of {name}: expected a ggml type id in {sorted(BLOCK_BYTES)}, found {block_type!r}"
        )
    if blocks.shape[2] != BLOCK_BYTES[block_type]:
        raise KernelArgumentError(
            f"{name}: expected [N, K / {BLOCK}, {BLOCK_BYTES[block_type]}] for ggml type {block_type}, "
            f"found {tuple(blocks.shape)}"
        )


class PreparedBlocks:
    """A GGUF-block weight that passed the kernel's checks, with its pointer read once.

    Holds the tensor itself, so the memory the pointer names stays alive; a caller whose layer
    gets a new tensor (e.g. moved or reloaded) prepares a new one (see BlockLinearMethod).
    """

    __slots__ = ("blocks", "block_type", "blocks_ptr", "out_features", "in_features")

    def __init__(self, blocks: torch.Tensor, block_type: int) -> None:
        self.blocks, self.block_type = blocks, block_type
        self.blocks_ptr = blocks.data_ptr()
        self.out_features, self.in_features = blocks.shape[0], blocks.shape[1] * BLOCK


class DecodeBatch:
    """One step's decode block tables and lengths, checked, with their pointers read once.
    Holds the tensors, so the memory the pointers name stays alive while the batch does."""

    __slots__ = ("block_tables", "seq_lens", "max_len", "tables_ptr", "lens_ptr", "batch", "max_blocks")

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, max_len: int) -> None:
        self.block_tables, self.seq_lens, self.max_len = block_tables, seq_lens, max_len
        self.tables_ptr, self.lens_ptr = block_tables.data_ptr(), seq_lens.data_ptr()
        self.batch, self.max_blocks = block_tables.shape
