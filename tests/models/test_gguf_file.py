"""servelm's GGUF header reader against the `gguf` package's reader: the same metadata values and
the same tensor views, on the default model (vocabulary, merges, chat template, Q4_1 blocks) and
on files written with every metadata value type and several tensor types; clear errors for files
it cannot read."""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest

from servelm.default_model import default_model_path
from servelm.gguf_file import read_gguf
from servelm.testing.tiny_model import write_tiny_checkpoint, write_tiny_gguf

Q = gguf.GGMLQuantizationType


def assert_same_as_gguf_reader(path: Path) -> None:
    ours, theirs = read_gguf(path), gguf.GGUFReader(path)
    fields = {key: field for key, field in theirs.fields.items() if not key.startswith("GGUF.")}
    assert list(ours.metadata) == list(fields)
    for key, field in fields.items():
        expected = field.contents()
        if isinstance(expected, float):  # gguf widens float32 values through numpy; both are the stored bits
            assert np.float32(ours.metadata[key]) == np.float32(expected), key
        else:
            assert ours.metadata[key] == expected, key
    assert ours.data_offset == theirs.data_offset
    assert [t.name for t in ours.tensors] == [t.name for t in theirs.tensors]
    for mine, reference in zip(ours.tensors, theirs.tensors, strict=True):
        assert (mine.tensor_type, list(mine.shape), mine.n_elements) == (
            reference.tensor_type, list(reference.shape), reference.n_elements
        ), mine.name  # fmt: skip
        assert (mine.n_bytes, mine.data_offset) == (reference.n_bytes, reference.data_offset), mine.name
        assert mine.data.shape == reference.data.shape and mine.data.dtype == reference.data.dtype, mine.name
        assert np.array_equal(mine.data, np.asarray(reference.data)), mine.name


def test_default_model_header_matches_the_gguf_package():
    assert_same_as_gguf_reader(default_model_path())
    metadata = read_gguf(default_model_path()).metadata
    assert (
        len(metadata["tokenizer.ggml.tokens"]) == 49152
        and "{% for message in messages %}" in metadata["tokenizer.chat_template"]
    )


@pytest.mark.parametrize("tensor_type", [Q.F32, Q.F16, Q.Q4_1, Q.Q8_0])
def test_tensor_types_match_the_gguf_package(tmp_path: Path, tensor_type: Q):
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", seed=1)
    # One tensor in a type servelm only dequantises (zero bytes: the header is what is compared).
    overrides = {"blk.1.ffn_up.weight": Q.IQ4_NL}
    path = write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir, tensor_type=tensor_type, override_types=overrides)
    assert_same_as_gguf_reader(path)


def test_every_metadata_value_type(tmp_path: Path):
    path = tmp_path / "values.gguf"
    writer = gguf.GGUFWriter(str(path), arch="llama")
    writer.add_uint8("t.u8", 200)
    writer.add_int8("t.i8", -100)
    writer.add_uint16("t.u16", 60000)
    writer.add_int16("t.i16", -30000)
    writer.add_uint32("t.u32", 4_000_000_000)
    writer.add_int32("t.i32", -2_000_000_000)
    writer.add_float32("t.f32", 0.1)
    writer.add_uint64("t.u64", 2**63 + 5)
    writer.add_int64("t.i64", -(2**62))
    writer.add_float64("t.f64", 0.1)
    writer.add_bool("t.bool", True)
    writer.add_string("t.str", "héllo ✓")
    writer.add_array("t.ints", [1, 2, 3])
    writer.add_array("t.floats", [0.5, -1.25])
    writer.add_array("t.strs", ["a", "", "ü"])
    writer.add_array("t.nested", [[1, 2], [3]])
    writer.add_tensor("w", np.arange(12, dtype=np.float32).reshape(3, 4))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    metadata = read_gguf(path).metadata
    assert metadata["t.u64"] == 2**63 + 5 and metadata["t.f64"] == 0.1 and metadata["t.bool"] is True
    assert metadata["t.str"] == "héllo ✓" and metadata["t.strs"] == ["a", "", "ü"]
    assert metadata["t.nested"] == [[1, 2], [3]]
    tensor = read_gguf(path).tensors[0]
    assert np.array_equal(tensor.data, np.arange(12, dtype=np.float32).reshape(3, 4))
    # The gguf package flattens nested arrays (its own FIXME); everything else must agree with it.
    theirs = gguf.GGUFReader(path)
    for key in metadata:
        if key != "t.nested" and not isinstance(metadata[key], float):
            assert metadata[key] == theirs.fields[key].contents(), key


def test_unreadable_files_are_named(tmp_path: Path):
    not_gguf = tmp_path / "model.gguf"
    not_gguf.write_bytes(b"<html>not found</html>")
    with pytest.raises(ValueError, match="is not a readable GGUF file: magic"):
        read_gguf(not_gguf)
    hf_dir = write_tiny_checkpoint(tmp_path / "hf", seed=1)
    whole = write_tiny_gguf(tmp_path / "tiny.gguf", hf_dir).read_bytes()
    for cut in (40, len(whole) - 100):  # inside the header; inside the last tensor's data
        truncated = tmp_path / f"cut-{cut}.gguf"
        truncated.write_bytes(whole[:cut])
        with pytest.raises(ValueError, match=f"{truncated}.*(truncated|past the end)"):
            read_gguf(truncated)
