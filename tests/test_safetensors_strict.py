"""Strict safetensors reading: every header rule, index consistency, lazy slices, bf16 without torch.

Files here are built byte by byte (``_raw``) or with the ``safetensors`` library, never with the
writer under test, so a bug in our writer cannot hide a bug in our reader.
"""

from __future__ import annotations

import json
import os
import shutil
import struct

import numpy as np
import pytest

from paddleformers_glm.checkpoint.errors import CheckpointError
from paddleformers_glm.checkpoint.safetensors_io import (
    Checkpoint,
    SafetensorsFile,
    SafetensorsWriter,
    bf16_bits_to_float32,
    parse_header,
)


def _raw(header: dict | bytes, data: bytes, pad: bool = True) -> bytes:
    text = header if isinstance(header, bytes) else json.dumps(header).encode()
    if pad:
        text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text + data


def _write(path, blob: bytes) -> str:
    path = str(path)
    with open(path, "wb") as f:
        f.write(blob)
    return path


def _ok_header():
    return {"__metadata__": {"format": "pt"}, "a": {"dtype": "F32", "shape": [2, 2], "data_offsets": [0, 16]}}


def test_valid_file_and_values(tmp_path):
    data = np.arange(4, dtype=np.float32).tobytes()
    f = _write(tmp_path / "ok.safetensors", _raw(_ok_header(), data))
    infos, meta, start = parse_header(f)
    assert meta == {"format": "pt"}
    assert infos["a"].shape == (2, 2) and infos["a"].dtype == "F32" and infos["a"].nbytes == 16
    with SafetensorsFile(f) as sf:
        np.testing.assert_array_equal(sf.numpy("a"), np.arange(4, dtype=np.float32).reshape(2, 2))


@pytest.mark.parametrize(
    "blob, needle",
    [
        (b"\x05\x00\x00", "shorter than the 8-byte header length"),
        (struct.pack("<Q", 1000) + b"{}", "header length exceeds the file size"),
        # the index (or config.json) given as the checkpoint: was "header length is implausibly large"
        (b'{"metadata": {"total_size": 4}, "weight_map": {}}', "not a safetensors file: it starts with JSON text"),
        (struct.pack("<Q", 2**40) + b"{}", "header length is implausibly large"),
        (_raw(b"{not json", b""), "not valid JSON"),
        (_raw(b"[1, 2]", b""), "does not start with '{'"),
        (_raw(b'{"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}, "a": {}}', b"\0" * 4), "duplicate key"),
        (_raw({"a": {"dtype": "F31", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4), "unknown dtype name"),
        # not a string: measured before, a bare TypeError (unhashable type: 'list')
        (_raw({"a": {"dtype": ["BF16"], "shape": [1], "data_offsets": [0, 2]}}, b"\0" * 2), "unknown dtype name"),
        (_raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}}, b"\0" * 4), "byte length does not match"),
        (_raw({"a": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4), "shape must be a list"),
        (_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 0]}}, b"\0" * 4), "data_offsets must be"),
        (_raw({"a": {"dtype": "F32", "shape": [1]}}, b"\0" * 4), "exactly dtype, shape, data_offsets"),
        # a field beside the three: refused as a header this reader does not know (safetensors 0.8
        # reads such a file, ignoring the field: measured)
        (
            _raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4], "extra": 1}}, b"\0" * 4),
            "exactly dtype, shape, data_offsets",
        ),
        # a negative begin (JSON allows it): was reported as overlapping "tensor None"
        (_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [-4, 0]}}, b"\0" * 4), "data_offsets must be"),
        # a byte range longer than shape x dtype, not only a shorter one
        (_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 8]}}, b"\0" * 8), "byte length does not match"),
        # one byte past the end of the file: truncated, not "trailing garbage: -1 bytes"
        (_raw({"a": {"dtype": "U8", "shape": [5], "data_offsets": [0, 5]}}, b"\0" * 4), "beyond the end of the file"),
        (_raw({"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}, b"\0" * 4), "beyond the end of the file"),
        (_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 8), "trailing garbage: 4 bytes"),
        (
            _raw(
                {
                    "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                    "b": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]},
                },
                b"\0" * 8,
            ),
            "overlaps tensor 'a'",
        ),
        (_raw({"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}, b"\0" * 8), "gap in the data area"),
        (_raw({"__metadata__": {"x": 1}}, b""), "__metadata__ must map strings to strings"),
        # falsy non-maps passed as "no metadata" before (safetensors 0.8 refuses each: "expected a map")
        (_raw({"__metadata__": []}, b""), "__metadata__ must map strings to strings"),
        (_raw({"__metadata__": ""}, b""), "__metadata__ must map strings to strings"),
        (_raw({"__metadata__": False}, b""), "__metadata__ must map strings to strings"),
        # zero elements but an axis no array can have: passed before, then numpy's "Maximum allowed
        # dimension exceeded" naming no file on read (safetensors refuses at 2**63 and at 2**70)
        (_raw({"z": {"dtype": "F32", "shape": [0, 2**63], "data_offsets": [0, 0]}}, b""), "shape too large"),
        (_raw({"z": {"dtype": "F32", "shape": [0, 2**62, 4], "data_offsets": [0, 0]}}, b""), "shape too large"),
        (_raw(b'{"a": 1}\xff\xfe', b"", pad=False), "not UTF-8"),
    ],
)
def test_header_rules(tmp_path, blob, needle):
    f = _write(tmp_path / "bad.safetensors", blob)
    with pytest.raises(CheckpointError) as ei:
        parse_header(f)
    assert needle in str(ei.value)
    assert ei.value.file == f  # every error names the file


def test_header_length_limit_is_the_safetensors_packages(tmp_path):
    """safetensors 0.8 reads a 100,000,000-byte header and refuses 100,000,001 ("header too large");
    before, the limit here was 100 MiB (104,857,600) while its comment said it was the package's."""
    from paddleformers_glm.checkpoint.safetensors_io import MAX_HEADER_BYTES

    assert MAX_HEADER_BYTES == 100_000_000
    f = _write(tmp_path / "big.safetensors", struct.pack("<Q", MAX_HEADER_BYTES + 1) + b"{}")
    with pytest.raises(CheckpointError, match="implausibly large"):
        parse_header(f)


def test_zero_size_tensors_at_the_edges_are_read(tmp_path):
    h = {
        "e": {"dtype": "F32", "shape": [0, 3], "data_offsets": [0, 0]},
        "a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
        "z": {"dtype": "BF16", "shape": [4, 0], "data_offsets": [8, 8]},
    }
    f = _write(tmp_path / "z.safetensors", _raw(h, np.ones(2, np.float32).tobytes()))
    with SafetensorsFile(f) as sf:
        assert sf.numpy("e").shape == (0, 3) and sf.numpy("z").shape == (4, 0)
        np.testing.assert_array_equal(sf.numpy("a"), np.ones(2, np.float32))


def test_error_names_key_expected_actual(tmp_path):
    f = _write(
        tmp_path / "bad.safetensors", _raw({"w": {"dtype": "BF16", "shape": [3], "data_offsets": [0, 4]}}, b"\0" * 4)
    )
    with pytest.raises(CheckpointError) as ei:
        parse_header(f)
    e = ei.value
    assert (e.key, e.expected, e.actual) == ("w", 6, 4)
    assert "key='w'" in str(e) and "expected=6, actual=4" in str(e)


def test_bf16_bits_exact_against_paddle():
    import paddle

    x = np.array([1.0, -2.5, 3.140625, 1e-3, 65504.0, -0.0], dtype=np.float32)
    bf = paddle.to_tensor(x).astype("bfloat16")
    bits = bf.numpy()  # paddle hands bf16 out as uint16 bits
    assert bits.dtype == np.uint16
    np.testing.assert_array_equal(bf16_bits_to_float32(bits), bf.astype("float32").numpy())


def test_lazy_slice_reads_right_rows(tmp_path):
    from safetensors.numpy import save_file

    a = np.arange(6 * 5, dtype=np.float32).reshape(6, 5)
    f = str(tmp_path / "model.safetensors")
    save_file({"a": a}, f)
    with Checkpoint(tmp_path) as ck:
        np.testing.assert_array_equal(ck.numpy("a", (slice(2, 4), slice(None))), a[2:4])
        t = ck.paddle("a", (slice(None), slice(1, 3)))
        np.testing.assert_array_equal(t.numpy(), a[:, 1:3])
        assert ck.numpy("a").base is not None  # a view of the map, not a copy


def test_bf16_tensor_to_paddle_bit_exact(tmp_path):
    import paddle
    from safetensors.paddle import save_file

    x = paddle.to_tensor(np.linspace(-3, 3, 12, dtype=np.float32).reshape(3, 4)).astype("bfloat16")
    save_file({"w": x}, str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path) as ck:
        t = ck.paddle("w")
        assert str(t.dtype) == "paddle.bfloat16"
        np.testing.assert_array_equal(t.numpy(), x.numpy())


def _two_shards(tmp_path):
    from safetensors.numpy import save_file

    save_file({"a": np.ones(3, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b": np.zeros(2, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    idx = {
        "metadata": {"total_size": 20},
        "weight_map": {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"},
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    return idx


def test_index_ok(tmp_path):
    _two_shards(tmp_path)
    with Checkpoint(tmp_path) as ck:
        assert sorted(ck.keys()) == ["a", "b"]
        assert ck.info("b").file.endswith("model-00002-of-00002.safetensors")


def test_index_names_missing_file(tmp_path):
    _two_shards(tmp_path)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    with pytest.raises(CheckpointError, match="index names a file that is not there") as ei:
        Checkpoint(tmp_path)
    assert ei.value.file.endswith("model-00002-of-00002.safetensors") and ei.value.key == "b"


def test_missing_shard_in_series(tmp_path):
    idx = _two_shards(tmp_path)
    os.remove(tmp_path / "model-00002-of-00002.safetensors")
    idx["weight_map"].pop("b")
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"missing shard\(s\) \['model-00002-of-00002.safetensors'\]"):
        Checkpoint(tmp_path)


def test_a_shard_numbered_beyond_its_series_is_refused(tmp_path):
    """``model-00002-of-00001``: a series that names itself wrongly, so whether a shard is missing
    cannot be told; refused, not loaded as if the numbers held."""
    from safetensors.numpy import save_file

    wm = {}
    for k, name in (("a", "model-00001-of-00001.safetensors"), ("b", "model-00002-of-00001.safetensors")):
        save_file({k: np.zeros(1, np.float32)}, str(tmp_path / name))
        wm[k] = name
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))
    with pytest.raises(CheckpointError, match="shard number out of range"):
        Checkpoint(tmp_path)


def test_key_in_two_shards(tmp_path):
    from safetensors.numpy import save_file

    _two_shards(tmp_path)
    save_file(
        {"a": np.ones(3, np.float32), "b": np.zeros(2, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    with pytest.raises(CheckpointError, match="key appears in two shards") as ei:
        Checkpoint(tmp_path)
    assert ei.value.key == "a"


def test_key_in_shard_not_in_index(tmp_path):
    from safetensors.numpy import save_file

    _two_shards(tmp_path)
    save_file(
        {"b": np.zeros(2, np.float32), "c": np.zeros(1, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors")
    )
    with pytest.raises(CheckpointError, match="shard holds a key the index does not name") as ei:
        Checkpoint(tmp_path)
    assert ei.value.key == "c"


def test_index_key_absent_from_shard(tmp_path):
    idx = _two_shards(tmp_path)
    idx["weight_map"]["z"] = "model-00001-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="index names a key that its shard does not hold"):
        Checkpoint(tmp_path)


def test_index_wrong_shard_for_key(tmp_path):
    from safetensors.numpy import save_file

    idx = _two_shards(tmp_path)
    save_file(
        {"a": np.ones(3, np.float32), "c": np.ones(1, np.float32)}, str(tmp_path / "model-00001-of-00002.safetensors")
    )
    idx["weight_map"]["c"] = "model-00002-of-00002.safetensors"
    idx["metadata"]["total_size"] = 24
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="index puts the key in another shard") as ei:
        Checkpoint(tmp_path)
    e = ei.value
    assert e.key == "c" and (e.expected, e.actual) == (
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    )


def test_shard_present_but_not_indexed(tmp_path):
    idx = _two_shards(tmp_path)
    idx["weight_map"]["a"] = "model-00002-of-00002.safetensors"
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match=r"in the folder but not named by model.safetensors.index.json"):
        Checkpoint(tmp_path)


def test_total_size_strict_and_lenient(tmp_path):
    idx = _two_shards(tmp_path)
    idx["metadata"]["total_size"] = 21
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(idx))
    with pytest.raises(CheckpointError, match="total_size") as ei:
        Checkpoint(tmp_path)
    assert (ei.value.expected, ei.value.actual) == (20, 21)
    with Checkpoint(tmp_path, strict=False) as ck:
        assert len(ck.warnings) == 1 and "total_size" in ck.warnings[0]


def test_unindexed_extra_file_refused(tmp_path):
    from safetensors.numpy import save_file

    _two_shards(tmp_path)
    save_file({"q": np.zeros(1, np.float32)}, str(tmp_path / "stray.safetensors"))
    with pytest.raises(CheckpointError, match="not named by the index"):
        Checkpoint(tmp_path)


def test_index_not_json(tmp_path):
    _two_shards(tmp_path)
    (tmp_path / "model.safetensors.index.json").write_text("{oops")
    with pytest.raises(CheckpointError, match="index is not valid JSON"):
        Checkpoint(tmp_path)


def test_several_files_without_index(tmp_path):
    _two_shards(tmp_path)
    os.remove(tmp_path / "model.safetensors.index.json")
    with pytest.raises(CheckpointError, match="2 safetensors files and no model.safetensors.index.json"):
        Checkpoint(tmp_path)


def test_writer_output_readable_by_safetensors_library(tmp_path):
    from safetensors import safe_open

    f = str(tmp_path / "w.safetensors")
    w = SafetensorsWriter(f, [("x", "F32", (2, 3)), ("y", "F16", (4,)), ("e", "F32", (0,))], {"format": "pt"})
    x, y = np.arange(6, dtype=np.float32).reshape(2, 3), np.arange(4, dtype=np.float16)
    w.write("y", y, "F16")  # out of order on purpose
    w.write("e", np.zeros((0,), np.float32), "F32")
    w.write("x", x, "F32")
    w.close()
    with safe_open(f, framework="np") as h:
        np.testing.assert_array_equal(h.get_tensor("x"), x)
        np.testing.assert_array_equal(h.get_tensor("y"), y)
        assert h.metadata() == {"format": "pt"}
    parse_header(f)  # and our strict reader accepts it


def test_writer_refuses_incomplete_and_wrong(tmp_path):
    w = SafetensorsWriter(str(tmp_path / "w.safetensors"), [("x", "F32", (2,)), ("y", "F32", (1,))])
    with pytest.raises(CheckpointError, match="does not match the planned dtype/shape"):
        w.write("x", np.zeros(3, np.float32), "F32")
    w.write("x", np.zeros(2, np.float32), "F32")
    with pytest.raises(CheckpointError, match="never written") as ei:
        w.close()
    assert ei.value.key == "y"


# ---------------------------------------------------------------- a file changed after validation
# A load validates every header when the Checkpoint is built and reads the tensors later (minutes, for
# a large model). A save that publishes over the folder meanwhile (a new file renamed over the old, or
# the whole folder exchanged, as save_pretrained_state does) must not make the reader apply the old
# header's offsets to the new file's bytes. Measured before the fix: the values read were the new
# file's header bytes taken as floats (1.28e31, 2.67e20, ... for the tiny model's embedding: all 239
# tensors of a from_pretrained wrong, no error), or FileNotFoundError / "cannot reshape array of size
# 0" naming no file when the new save had other shard names or a shorter file.


def test_file_replaced_after_validation_reads_the_validated_file(tmp_path):
    from safetensors.numpy import save_file

    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    save_file({"w": a}, str(tmp_path / "model.safetensors"))
    with Checkpoint(tmp_path) as ck:
        # another save: more tensors, so a longer header, renamed over the validated file
        save_file({"v": np.full(3, 9.0, np.float64), "w": np.full((4, 4), 7.0, np.float32)}, str(tmp_path / "n.tmp"))
        os.replace(tmp_path / "n.tmp", tmp_path / "model.safetensors")
        np.testing.assert_array_equal(ck.numpy("w"), a)  # was: header bytes as floats


def test_folder_exchanged_after_validation_reads_the_validated_files(tmp_path):
    from safetensors.numpy import save_file

    d = tmp_path / "ckpt"
    d.mkdir()
    _two_shards(d)
    with Checkpoint(d) as ck:
        new = tmp_path / "new"
        new.mkdir()
        save_file({"a": np.full(3, 5.0, np.float32), "b": np.full(2, 5.0, np.float32)}, str(new / "model.safetensors"))
        os.rename(d, tmp_path / "old")
        os.rename(new, d)
        shutil.rmtree(tmp_path / "old")  # the old checkpoint is deleted, as a publish does
        np.testing.assert_array_equal(ck.numpy("a"), np.ones(3, np.float32))  # was: FileNotFoundError
        np.testing.assert_array_equal(ck.numpy("b"), np.zeros(2, np.float32))


def test_file_truncated_in_place_after_validation_is_refused_by_name(tmp_path):
    from safetensors.numpy import save_file

    f = tmp_path / "model.safetensors"
    save_file({"a": np.ones(4, np.float32), "b": np.ones(4, np.float32)}, str(f))
    with Checkpoint(tmp_path) as ck:
        size = f.stat().st_size
        with open(f, "r+b") as g:
            g.truncate(size - 8)  # the same file (inode) made shorter: a map of it would fault on read
        with pytest.raises(CheckpointError) as ei:
            ck.numpy("b")
    assert "changed since it was validated" in str(ei.value) and ei.value.file == str(f)
    assert ei.value.expected[0] == size and ei.value.actual[0] == size - 8


def test_reading_after_close_reopens_the_same_file_only(tmp_path):
    from safetensors.numpy import save_file

    f = str(tmp_path / "model.safetensors")
    save_file({"w": np.ones(4, np.float32)}, f)
    sf = SafetensorsFile(f)
    sf.close()
    np.testing.assert_array_equal(sf.numpy("w"), np.ones(4, np.float32))  # the same file: read again
    sf.close()
    save_file({"w": np.zeros(4, np.float32)}, f + ".tmp")
    os.replace(f + ".tmp", f)
    with pytest.raises(CheckpointError, match="changed since it was validated"):
        sf.numpy("w")


def test_failed_validation_leaves_no_file_open(tmp_path):
    from safetensors.numpy import save_file

    _two_shards(tmp_path)
    save_file({"b": np.zeros(3, np.float32)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(3):
        with pytest.raises(CheckpointError):
            Checkpoint(tmp_path)  # the index's total_size is wrong now: refused after both files are read
    assert len(os.listdir("/proc/self/fd")) == before
