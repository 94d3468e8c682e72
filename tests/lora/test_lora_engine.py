"""LoRA adapters served over a base model by the real engine (issue 42): one batch mixing the base
model and four adapters of ranks 8, 16, 32 and 64 gives each request the greedy tokens of its own
merged-weight transformers reference, and the same tokens as when it runs alone; with fewer slots
than adapters the slots change hands and nothing changes; prefix caching never shares KV across
adapters; what cannot be served is refused by name."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from servelm.engine.llm import LLM, RequestFailedError
from servelm.lora.adapter import LoRAAdapterError
from servelm.models.hf_loader import read_hf_config
from servelm.sampling_params import SamplingParams
from servelm.testing.lora_adapters import merge_into, write_peft_adapter
from servelm.testing.tiny_model import write_tiny_checkpoint

RANKS = {"r8": 8, "r16": 16, "r32": 32, "r64": 64}
MAX_TOKENS = 10


@pytest.fixture(scope="module")
def served(tmp_path_factory) -> tuple[Path, dict[str, Path]]:
    root = tmp_path_factory.mktemp("lora")
    base = write_tiny_checkpoint(root / "base", "llama", seed=5, num_hidden_layers=3)
    arch = read_hf_config(base)
    adapters = {name: write_peft_adapter(root / name, arch, rank, seed=rank, use_rslora=(name == "r32"),
                                         targets=("q_proj", "v_proj", "down_proj") if name == "r8" else
                                         ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
                for name, rank in RANKS.items()}  # fmt: skip
    return base, adapters


@pytest.fixture(scope="module")
def workload(served) -> tuple[list[list[int]], list[str | None], list[list[int]]]:
    """(prompts, each one's adapter, the merged reference's greedy tokens for each)."""
    base, adapters = served
    rng = random.Random(3)
    names: list[str | None] = [None, "r8", "r16", "r32", "r64", "r16", None, "r64"]
    prompts = [[rng.randrange(1000, 20000) for _ in range(rng.randint(4, 40))] for _ in names]
    expected = []
    for prompt, name in zip(prompts, names, strict=True):
        reference = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
        if name is not None:
            merge_into(reference, adapters[name])
        with torch.no_grad():
            out = reference.generate(torch.tensor([prompt]), max_new_tokens=MAX_TOKENS, do_sample=False,
                                     eos_token_id=None, pad_token_id=0)  # fmt: skip
        expected.append(out[0, len(prompt) :].tolist())
    return prompts, names, expected


def _llm(served, max_loras: int, **overrides) -> LLM:
    base, adapters = served
    settings = {"max_num_batched_tokens": 48, **overrides}
    return LLM(str(base), enable_lora=True, lora_modules=[f"{name}={path}" for name, path in adapters.items()],
               max_loras=max_loras, max_lora_rank=64, num_blocks=64, block_size=4, max_step_ms=0, **settings)  # fmt: skip


def _greedy(llm: LLM, prompts: list[list[int]], names: list[str | None]) -> list[list[int]]:
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    return [r.outputs[0].token_ids for r in llm.generate(prompts, params, lora_name=names)]


@pytest.mark.parametrize(("max_loras", "step_tokens"), [(4, 48), (2, 48), (4, 256)])
def test_a_mixed_batch_gives_each_request_its_merged_references_tokens(served, workload, max_loras, step_tokens) -> None:
    """Four slots: every adapter resident at once. Two: the scheduler runs at most two adapters at a
    time and the slots change hands; the tokens are the same. Steps of up to 48 rows add the adapters
    all slots at once (masked); 256 puts several prompts' rows in one forward, segment by segment."""
    prompts, names, expected = workload
    with _llm(served, max_loras, max_num_batched_tokens=step_tokens) as llm:
        together = _greedy(llm, prompts, names)
        alone = [_greedy(llm, [prompt], [name])[0] for prompt, name in zip(prompts, names, strict=True)]
        loads = llm.engine.core.runner.lora.loads
        base_model = _greedy(llm, prompts, [None] * len(prompts))
    assert together == expected
    assert alone == expected
    assert loads >= (len(RANKS) if max_loras == 4 else len(RANKS) + 1)  # two slots for four adapters: reloads
    # The adapters matter: each adapter request's tokens differ from the base model's.
    assert all(mine != base for mine, base, name in zip(together, base_model, names, strict=True) if name is not None)


def test_adapters_beyond_the_host_cache_are_read_again_when_named(served, workload) -> None:
    """--max-cpu-loras 2 for four adapters: the least recently used leave host memory, and a request
    naming one waits while the background thread reads it again; the tokens are the same."""
    prompts, names, expected = workload
    with _llm(served, 2, max_cpu_loras=2) as llm:
        registry = llm.engine.core.lora.registry
        assert len(registry.host) == 2
        together = _greedy(llm, prompts, names)
        alone = [_greedy(llm, [prompt], [name])[0] for prompt, name in zip(prompts, names, strict=True)]
        assert len(registry.host) <= 2
        reads = registry.reads
    assert together == expected and alone == expected
    assert reads > len(RANKS) + 2  # start-up read all four; evicted ones were read again, more than once


def test_an_evicted_adapter_whose_files_are_gone_fails_its_requests_alone(served, workload, tmp_path) -> None:
    """An adapter that left host memory and cannot be read again (its directory removed since it was
    loaded): its request fails naming why; the engine goes on serving the base model and the others."""
    import shutil

    base, adapters = served
    prompts, names, expected = workload
    doomed = tmp_path / "doomed"
    shutil.copytree(adapters["r16"], doomed)
    with LLM(str(base), enable_lora=True, lora_modules=[f"doomed={doomed}", f"r64={adapters['r64']}"],
             max_loras=1, max_cpu_loras=1, max_lora_rank=64, num_blocks=64, block_size=4, max_step_ms=0) as llm:  # fmt: skip
        assert list(llm.engine.core.lora.registry.host) == ["r64"]  # "doomed" was read first, then evicted
        shutil.rmtree(doomed)
        with pytest.raises(RequestFailedError, match="'doomed' could not be read"):
            _greedy(llm, [prompts[2]], ["doomed"])
        assert _greedy(llm, [prompts[4], prompts[0]], ["r64", None]) == [expected[4], expected[0]]


def test_ngram_speculation_keeps_every_adapters_greedy_tokens(served, workload) -> None:
    """N-gram drafts (proposed from the request's own tokens, verified by the model with the
    request's adapter) change no token of a mixed batch; repetitive prompts, so drafts are accepted."""
    prompts, names, expected = workload
    repetitive = [(prompt[:6] * 6)[:36] for prompt in prompts]
    # Not adaptive: the controller's measured costs (a busy host) could turn drafting off.
    spec = json.dumps({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1, "prompt_lookup_max": 3,
                       "adaptive": False})  # fmt: skip
    with _llm(served, 4) as llm:
        plain = _greedy(llm, repetitive, names)
    with _llm(served, 4, speculative_config=spec) as llm:
        speculated = _greedy(llm, repetitive, names)
        accepted = llm.engine.core.scheduler.spec_counters.num_accepted_tokens
    assert speculated == plain and accepted > 0


def test_prefix_caching_never_shares_kv_across_adapters(served, workload) -> None:
    """The same long prompt under the base model, then two adapters: no hit from another's blocks,
    a hit from its own; each output its reference's."""
    prompts, names, expected = workload
    prompt = prompts[2] * 3
    with _llm(served, 2) as llm:
        params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
        runs = {name: llm.generate([prompt], params, lora_name=name)[0] for name in (None, "r16", "r64")}
        again = llm.generate([prompt], params, lora_name="r16")[0]
    assert all(run.num_cached_tokens == 0 for run in runs.values())
    assert again.num_cached_tokens > 0 and again.outputs[0].token_ids == runs["r16"].outputs[0].token_ids
    assert len({tuple(run.outputs[0].token_ids) for run in runs.values()}) == 3


def test_an_unknown_adapter_is_refused_before_anything_runs(served) -> None:
    with _llm(served, 1) as llm, pytest.raises(ValueError, match="'nope' is not served"):
        llm.generate([[5, 6, 7]], SamplingParams(max_tokens=2), lora_name="nope")


@pytest.mark.parametrize(
    ("change", "match"),
    [
        ({"r": 128}, "rank 128, over --max-lora-rank 64"),
        ({"use_dora": True}, "DoRA"),
        ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
        ({"bias": "lora_only"}, "trained biases"),
    ],
)
def test_an_adapter_it_cannot_serve_fails_the_start_naming_why(served, tmp_path, change, match) -> None:
    base, adapters = served
    bad = tmp_path / "bad"
    bad.mkdir()
    for file in adapters["r16"].iterdir():
        (bad / file.name).write_bytes(file.read_bytes())
    config = json.loads((bad / "adapter_config.json").read_text())
    (bad / "adapter_config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(LoRAAdapterError, match=match):
        LLM(str(base), enable_lora=True, lora_modules=[f"bad={bad}"], max_lora_rank=64, num_blocks=16, max_step_ms=0)


def test_an_adapter_of_another_base_is_refused_by_its_shapes(served, tmp_path) -> None:
    base, _ = served
    other = read_hf_config(write_tiny_checkpoint(tmp_path / "other", "llama", seed=1, hidden_size=96,
                                                 intermediate_size=160, num_hidden_layers=3))  # fmt: skip
    adapter = write_peft_adapter(tmp_path / "foreign", other, 8)
    with pytest.raises(LoRAAdapterError, match="needs"):
        LLM(str(base), enable_lora=True, lora_modules=[f"foreign={adapter}"], num_blocks=16, max_step_ms=0)
