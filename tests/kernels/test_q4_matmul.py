"""The GGUF block matmul (csrc/block_gemm.c) against a float64 reference, in every build this CPU can
run (plain C, AVX2 + FMA with and without F16C, AVX-512F): Q4_0 / Q4_1 / Q8_0 blocks drawn at random,
1..8 rows, K a multiple of 32, N odd (tails of the per-thread tasks); results that do not depend on
the thread count; and the default model, on its blocks, greedy-decoding the tokens it decoded before
the block kernel replaced the int8-code one."""

from __future__ import annotations

import pytest
import torch

from servelm.kernels import build, cpu
from servelm.models.factory import build_model
from servelm.models.gguf_blocks import BlockType
from servelm.models.linear_methods import BlockLinearMethod
from servelm.models.loader import load_checkpoint
from servelm.testing.batch_decode import batch_greedy_decode
from servelm.testing.random_blocks import dequantize_float64, random_block_weight

# name -> (the CPU features it is built for, the simd level it must report)
VARIANTS = {
    "plain C": (frozenset(), 0),
    "AVX2 + FMA, halves in C": (frozenset({"avx2", "fma"}), 1),
    "AVX2 + FMA + F16C": (frozenset({"avx2", "fma", "f16c"}), 1),
    "AVX-512F": (frozenset({"avx2", "fma", "f16c", "avx512f"}), 2),
}
SHAPES = [(32, 1), (96, 7), (576, 65), (1536, 131)]  # (K, N): N odd, past one 32-row task and not a multiple of it


@pytest.fixture(scope="module", params=list(VARIANTS))
def variant(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> cpu.CpuKernels:
    features, level = VARIANTS[request.param]
    if not features <= build.cpu_features():
        pytest.skip(f"this CPU lacks {sorted(features - build.cpu_features())}")
    try:
        build.find_toolchain()
    except build.KernelBuildError as exc:
        pytest.skip(f"no C compiler here: {exc}")
    kernels = cpu.CpuKernels(build.build(tmp_path_factory.mktemp("kernels"), features=features))  # must compile
    assert kernels.block_gemm_simd_level == level  # the build runs the loops it was made for
    return kernels


@pytest.mark.parametrize("block_type", list(BlockType), ids=lambda t: t.name)
def test_block_matmul_matches_the_float64_reference(variant: cpu.CpuKernels, block_type: BlockType):
    gen = torch.Generator().manual_seed(block_type.value)
    for k, n in SHAPES:
        weight = random_block_weight(block_type, n, k, gen)
        reference_w = dequantize_float64(weight)  # [N, K]
        prepared = variant.prepare_block_weight(weight.blocks, block_type.value)
        x = torch.randn(8, k, generator=gen)
        for rows in range(1, 9):
            got = variant.block_gemm_prepared(x[:rows].contiguous(), prepared)
            want = x[:rows].double() @ reference_w.T
            # float32 sums of K products: within K unit roundings of the sum of |products|.
            bound = k * 2.0**-24 * (x[:rows].double().abs() @ reference_w.abs().T) + 1e-30
            error = (got.double() - want).abs()
            assert (error <= bound).all(), (block_type.name, k, n, rows, float((error / bound).max()))


def test_results_do_not_depend_on_the_thread_count(variant: cpu.CpuKernels):
    gen = torch.Generator().manual_seed(7)
    weight = random_block_weight(BlockType.Q4_1, 331, 576, gen)  # 11 tasks: split unevenly over 2 threads
    x = torch.randn(3, 576, generator=gen)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2, 3):
            torch.set_num_threads(count)
            results.append(variant.block_gemm(x, weight.blocks, BlockType.Q4_1.value))
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(results[0], r) for r in results[1:])


def test_no_rows_and_no_outputs(variant: cpu.CpuKernels):
    weight = random_block_weight(BlockType.Q8_0, 0, 64, torch.Generator().manual_seed(0))
    assert variant.block_gemm(torch.randn(2, 64), weight.blocks, BlockType.Q8_0.value).shape == (2, 0)
    weight = random_block_weight(BlockType.Q8_0, 5, 64, torch.Generator().manual_seed(0))
    assert variant.block_gemm(torch.empty(0, 64), weight.blocks, BlockType.Q8_0.value).shape == (0, 5)


# The default model's chat prompts (as token ids: the chat template applied to six questions) and the
# 24 greedy tokens each got from one batched decode, recorded with the int8-code kernel (qgemm_small)
# that the block kernel replaced. Every step's top-two logit margin was >= 0.027 there, far above the
# ~1e-4 a different summation order moves a logit.
_SYSTEM = [1, 9690, 198, 2683, 359, 253, 5356, 5646, 11173, 3365, 3511, 308, 34519, 28, 7018, 411, 407, 19712, 8182, 2,
           198, 1, 4093, 198]  # fmt: skip
_ASSISTANT = [2, 198, 1, 520, 9531, 198]
QUESTIONS = [
    [1780, 314, 260, 3575, 282, 4649, 47], [19161, 582, 6330, 563, 260, 5065, 30],
    [26533, 549, 1296, 5608, 327, 9286, 2458, 30], [36971, 732, 253, 2583, 1072, 28, 13099, 30],
    [1780, 7302, 314, 260, 6376, 335, 253, 2437, 1194, 47], [5820, 253, 4354, 338, 314, 5724, 30],
]  # fmt: skip
GREEDY_BEFORE = [
    [504, 3575, 282, 4649, 314, 7042, 30, 2, 198, 2, 1, 9690, 198, 2, 198, 1, 4093, 198, 57, 5248, 3946, 288, 7198, 253],
    [504, 5065, 314, 253, 4749, 28, 11965, 28, 284, 27456, 29, 22846, 3166, 1248, 282, 913, 338, 26553, 260, 3925, 284,
     314, 1478, 288],
    [33, 30, 13138, 22892, 42, 26883, 7568, 282, 913, 28, 2117, 981, 260, 2817, 30, 216, 34, 30, 16478, 253, 8609, 2714,
     42, 330],
    [49, 2583, 314, 253, 3476, 338, 3078, 1096, 1015, 7688, 284, 45438, 6388, 30, 657, 416, 1477, 4381, 28, 4249, 940,
     28, 284, 5865],
    [504, 6376, 335, 253, 2437, 1194, 314, 1129, 3873, 347, 253, 2276, 28, 3428, 28, 284, 8685, 11615, 282, 4461, 30,
     669, 314, 1568],
    [504, 4354, 339, 4415, 3685, 314, 260, 13578, 46192, 28, 4170, 260, 13578, 46192, 426, 1333, 30, 2, 198, 2, 1, 9690,
     198, 2],
]  # fmt: skip


@pytest.mark.slow
def test_the_default_model_on_its_blocks_decodes_what_it_decoded_before():
    if cpu.load() is None:
        pytest.skip("no compiled kernels here: the model would be all dense")
    checkpoint = load_checkpoint(None)
    model = build_model(checkpoint.arch, checkpoint.weights, torch.float32, "cpu")
    head, down = model.lm_head.method, model.decoder_layers[0].mlp.down_proj.method
    assert isinstance(head, BlockLinearMethod) and head.block_type is BlockType.Q8_0  # the tied embedding's blocks
    assert isinstance(down, BlockLinearMethod) and down.block_type is BlockType.Q4_1
    prompts = [_SYSTEM + question + _ASSISTANT for question in QUESTIONS]
    # Six rows per decode step: the kernel's batched loops; the prefill takes the dense GEMM.
    assert batch_greedy_decode(model, prompts, 24, block_size=16).tokens == GREEDY_BEFORE
