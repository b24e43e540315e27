"""`glm52 check-ckpt`: match, every mismatch class (naming, structural, value, config), the refusals and the receipt."""

from __future__ import annotations

import hashlib
import json
import os
import pathlib
import shutil
import struct

import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import load_pretrained_state, save_pretrained_state
from paddleformers_glm.cli import main
from paddleformers_glm.testing import SpecModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
MTP_IDX = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    """The HF-written source, its official-layout export (other shard sizes) and its Fleet export."""
    base = tmp_path_factory.mktemp("ckpts")
    src = base / "src"
    shutil.copytree(FIXTURE, src)
    cfg = GlmMoeDsaConfig.from_pretrained(src)
    model = SpecModel(cfg)
    load_pretrained_state(model, src)
    save_pretrained_state(model, cfg, base / "export", max_shard_size="400KB")
    save_pretrained_state(model, cfg, base / "fleet", layout="fleet", max_shard_size="700KB")
    return base


def _copy(ckpts, name, tmp_path):
    d = tmp_path / name
    shutil.copytree(ckpts / name, d)
    return d


def _run(capsys, *args):
    """Exit code and the printed text: the verdict on stdout, or, for unusable input (exit 2), its
    one-line errors on stderr with nothing on stdout (as every glm52 command)."""
    code = main(["check-ckpt", *map(str, args)])
    cap = capsys.readouterr()
    if code == 2:
        assert cap.out == "", cap.out
        return code, cap.err
    return code, cap.out


def _receipt(tmp_path, capsys, *args):
    out = tmp_path / "receipt.json"
    code, text = _run(capsys, *args, "--json", out)
    return code, json.loads(out.read_text()), text


def _tensor_offset(file: pathlib.Path, key: str) -> int:
    """Absolute offset of a tensor's first byte, from the raw header (independent of our reader)."""
    b = file.read_bytes()
    (n,) = struct.unpack("<Q", b[:8])
    return 8 + n + json.loads(b[8 : 8 + n])[key]["data_offsets"][0]


def _drop(folder: pathlib.Path, drop):
    from safetensors import safe_open
    from safetensors.paddle import save_file

    idx_p = folder / "model.safetensors.index.json"
    idx = json.loads(idx_p.read_text())
    for f in sorted(set(idx["weight_map"].values())):
        with safe_open(str(folder / f), framework="paddle") as h:
            keep = {k: h.get_tensor(k) for k in h.keys() if k not in drop}
        save_file(keep, str(folder / f), metadata={"format": "pt"})
    gone = [k for k in idx["weight_map"] if k in drop]
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if k not in drop}
    idx["metadata"].pop("total_size", None)
    idx_p.write_text(json.dumps(idx))
    assert len(gone) == len(drop)


def test_export_matches_source(ckpts, tmp_path, capsys):
    code, r, text = _receipt(tmp_path, capsys, ckpts / "src", ckpts / "export")
    assert code == 0 and r["exit_code"] == 0 and r["result"] == "match"
    assert r["hash_match"] is True and r["config_match"] is True
    assert r["counts"]["ref_tensors"] == r["counts"]["cand_tensors"] == 296
    assert r["counts"]["matched"] == 296 and r["differences"] == []
    # shards differ (2 vs several), the canonical hash does not
    assert len(r["ref"]["files"]) != len(r["cand"]["files"])
    assert r["ref"]["native_hash"] == r["cand"]["native_hash"]
    for side in ("ref", "cand"):
        for f in r[side]["files"]:
            assert f["sha256"] == hashlib.sha256(pathlib.Path(f["file"]).read_bytes()).hexdigest()
    assert {"python", "paddleformers_glm", "numpy", "safetensors", "paddle"} <= set(r["versions"])
    assert "match (exit 0)" in text


def test_one_flipped_bit_is_named(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "export", tmp_path)
    key = "model.layers.5.mlp.experts.3.up_proj.weight"
    index = json.loads((cand / "model.safetensors.index.json").read_text())
    shard = cand / index["weight_map"][key]
    off = _tensor_offset(shard, key)
    b = bytearray(shard.read_bytes())
    b[off] ^= 0x01
    shard.write_bytes(bytes(b))
    code, r, text = _receipt(tmp_path, capsys, ckpts / "src", cand)
    assert code == 1 and r["hash_match"] is False
    assert r["counts"]["value"] == 1 and r["counts"]["structural"] == 0
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["key"] == key and d["what"] == "bytes" and d["differing_elements"] == 1
    assert 0 < d["max_abs_diff"] < 1e-2  # lowest mantissa bit of one bf16 element
    assert key in text


def test_symlinked_shard_refused(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "export", tmp_path)
    shard = sorted(cand.glob("model-*.safetensors"))[1]
    elsewhere = tmp_path / "elsewhere.safetensors"
    shutil.move(shard, elsewhere)
    os.symlink(elsewhere, shard)
    code, r, text = _receipt(tmp_path, capsys, ckpts / "src", cand)
    assert code == 2 and r["result"] == "unusable input"
    assert any("symlink" in e and str(shard) in e for e in r["errors"])
    assert str(shard) in text


def test_hardlinked_shard_refused(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "export", tmp_path)
    shard = sorted(cand.glob("model-*.safetensors"))[0]
    os.link(shard, tmp_path / "second-name.safetensors")
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", cand)
    assert code == 2 and any("hardlink" in e and str(shard) in e for e in r["errors"])


def _st_bytes(header: dict, data_len: int) -> tuple[bytes, int]:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    return struct.pack("<Q", len(text)) + text, data_len


def test_sparse_file_refused(tmp_path, capsys):
    n = 4 << 20  # 4 MiB of zeros: written normally in ref, as a hole in cand
    head, _ = _st_bytes({"w": {"dtype": "F32", "shape": [n // 4], "data_offsets": [0, n]}}, n)
    ref, cand = tmp_path / "ref", tmp_path / "cand"
    ref.mkdir(), cand.mkdir()
    (ref / "model.safetensors").write_bytes(head + bytes(n))
    with open(cand / "model.safetensors", "wb") as f:
        f.write(head)
        f.seek(len(head) + n - 1)
        f.write(b"\0")
    with open(cand / "model.safetensors", "rb") as f:
        if os.lseek(f.fileno(), 0, getattr(os, "SEEK_HOLE", 4)) >= len(head) + n:
            pytest.skip("this filesystem does not keep holes")
    code, r, _ = _receipt(tmp_path, capsys, ref, cand)
    assert code == 2 and any("sparse file" in e and "cand/model.safetensors" in e for e in r["errors"])
    dense = tmp_path / "dense"
    dense.mkdir()
    (dense / "model.safetensors").write_bytes(head + bytes(n))
    code, r, _ = _receipt(tmp_path, capsys, ref, dense)
    assert code == 0  # the same bytes, not sparse: fine


def test_fleet_export_only_naming_differences(ckpts, tmp_path, capsys):
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", ckpts / "fleet", "--layout", "fleet")
    assert code == 0 and r["hash_match"] is True
    c = r["counts"]
    assert c["structural"] == 0 and c["value"] == 0 and c["naming"] > 0
    assert c["ref_tensors"] == 296 and c["cand_tensors"] == 239
    kinds = {k for d in r["differences"] if d["class"] == "naming" for k in d["kinds"]}
    assert {"indexer nesting", "MTP wrapper prefix", "fused up_gate_proj", "transpose", "embedding rename"} <= kinds
    fused = [d for d in r["differences"] if d["cand_keys"] == ["model.layers.3.mlp.experts.2.up_gate_proj.weight"]]
    assert fused and sorted(fused[0]["ref_keys"]) == [
        "model.layers.3.mlp.experts.2.gate_proj.weight",
        "model.layers.3.mlp.experts.2.up_proj.weight",
    ]
    mtp = [d for d in r["differences"] if d["ref_keys"] == ["model.layers.8.shared_head.norm.weight"]]
    assert mtp and mtp[0]["cand_keys"] == ["model.layers.8.norm.weight"]
    # without --layout the candidate must use the reference's names: a mismatch, still none structural
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", ckpts / "fleet")
    assert code == 1 and r["counts"]["structural"] == 0 and r["counts"]["value"] == 0


def test_missing_mtp_indexer_is_structural(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "export", tmp_path)
    drop = {f"model.layers.8.self_attn.indexer.{n}" for n in MTP_IDX}
    _drop(cand, drop)
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", cand)
    assert code == 1 and r["counts"]["structural"] == 5 and r["counts"]["cand_tensors"] == 291
    assert {d["key"] for d in r["differences"] if d["class"] == "structural"} == drop
    assert all(d["what"] == "missing in candidate" for d in r["differences"] if d["class"] == "structural")


def test_fleet_without_mtp_indexer_is_structural_not_naming(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "fleet", tmp_path)
    _drop(cand, {f"model.layers.8.transformer_layer.self_attn.core_attention.indexer.{n}" for n in MTP_IDX})
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", cand, "--layout", "fleet")
    assert code == 1 and r["counts"]["structural"] == 5 and r["counts"]["value"] == 0
    assert {d["key"] for d in r["differences"] if d["class"] == "structural"} == {
        f"model.layers.8.self_attn.indexer.{n}" for n in MTP_IDX
    }


def test_value_difference_through_the_mapping(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "fleet", tmp_path)
    key = "model.layers.2.mlp.up_gate_proj.weight"
    index = json.loads((cand / "model.safetensors.index.json").read_text())
    shard = cand / index["weight_map"][key]
    b = bytearray(shard.read_bytes())
    b[_tensor_offset(shard, key) + 1] ^= 0x40  # a high bit of the first (gate) element
    shard.write_bytes(bytes(b))
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", cand, "--layout", "fleet")
    assert code == 1
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["key"] == "model.layers.2.mlp.gate_proj.weight" and d["cand_keys"] == [key]
    assert d["max_abs_diff"] > 0


def test_config_difference_fails(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "export", tmp_path)
    cfg = json.loads((cand / "config.json").read_text())
    cfg["rms_norm_eps"] = 1e-6
    (cand / "config.json").write_text(json.dumps(cfg))
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", cand)
    assert code == 1 and r["hash_match"] is True and r["config_match"] is False
    assert {"class": "config", "keys": ["rms_norm_eps"]} in r["differences"]


def test_unusable_inputs_exit_2(ckpts, tmp_path, capsys):
    cand = _copy(ckpts, "export", tmp_path)
    shard = sorted(cand.glob("model-*.safetensors"))[0]
    b = bytearray(shard.read_bytes())
    b[8] = ord("X")
    shard.write_bytes(bytes(b))
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", cand)
    assert code == 2 and any("corrupt header" in e and str(shard) in e for e in r["errors"])
    code, _ = _run(capsys, ckpts / "src", tmp_path / "does-not-exist")
    assert code == 2
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", ckpts / "export", "--layout", "fleet")
    assert code == 2 and "declared layout 'fleet'" in r["errors"][0]


def _rewrite(folder: pathlib.Path, change) -> None:
    """Rewrite every shard of a sharded checkpoint with ``change(tensors)`` applied (safetensors.paddle),
    the index's weight map following (total_size dropped)."""
    from safetensors import safe_open
    from safetensors.paddle import save_file

    idx_p = folder / "model.safetensors.index.json"
    idx = json.loads(idx_p.read_text())
    for f in sorted(set(idx["weight_map"].values())):
        with safe_open(str(folder / f), framework="paddle") as h:
            tensors = {k: h.get_tensor(k) for k in h.keys()}
        change(tensors)
        save_file(tensors, str(folder / f), metadata={"format": "pt"})
        idx["weight_map"].update({k: f for k in tensors})
    idx["metadata"].pop("total_size", None)
    idx_p.write_text(json.dumps(idx))


def test_fleet_reference_against_its_official_export_matches(ckpts, tmp_path, capsys):
    """REF in the Fleet layout, CAND in the official one (``--layout hf``): the router unit's sources
    are the bf16 gate weight and the fp32 correction bias; mapping them must not round the bias to
    bf16. Measured before the fix: exit 1, 6 value differences (every e_score_correction_bias, max
    |diff| 4.8e-4) between two exports of the same loaded model."""
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "fleet", ckpts / "export", "--layout", "hf")
    assert code == 0 and r["counts"]["value"] == 0 and r["hash_match"] is True, r["differences"][:3]
    assert r["counts"]["structural"] == 0 and r["counts"]["naming"] > 0


def test_a_bias_rounded_to_bf16_differs_in_either_direction(ckpts, tmp_path, capsys):
    """A Fleet checkpoint whose fp32 router correction biases were rounded to bf16 (REFERENCE.md: they
    stay F32) is not the official export, whichever side is the reference. Measured before the fix:
    REF = that Fleet checkpoint, CAND = the export: exit 0, hash_match True (the checker rounded the
    candidate's fp32 bias to bf16 as well); the other direction: exit 1."""
    bad = _copy(ckpts, "fleet", tmp_path)

    def to_bf16(tensors):
        for k in [k for k in tensors if k.endswith("e_score_correction_bias")]:
            tensors[k] = tensors[k].astype("bfloat16")

    _rewrite(bad, to_bf16)
    for ref, cand, layout in ((bad, ckpts / "export", "hf"), (ckpts / "src", bad, "fleet")):
        code, r, _ = _receipt(tmp_path, capsys, ref, cand, "--layout", layout)
        assert code == 1 and r["counts"]["value"] == 6 and r["hash_match"] is False, (layout, r["counts"])
        values = [d for d in r["differences"] if d["class"] == "value"]
        assert all("e_score_correction_bias" in d["key"] for d in values)


def test_extra_candidate_tensor_under_a_mapped_name_is_structural(ckpts, tmp_path, capsys):
    """An official-layout candidate (``--layout hf``) against a Fleet reference that also holds a tensor
    under a Fleet name the mapping produces from its other tensors (a converter that left
    ``model.lm_head.weight`` behind, here full of 7s): that tensor has no counterpart, it is not
    hidden behind the mapped one. Measured before the fix: structural 0, the tensor named nowhere
    (on the `glm52 make-tiny` checkpoint, whose router biases are bf16-exact: exit 0, hash_match True)."""
    import numpy as np
    import paddle

    cand = _copy(ckpts, "export", tmp_path)
    extra = "model.lm_head.weight"

    def add(tensors):
        if "lm_head.weight" in tensors:
            tensors[extra] = paddle.to_tensor(np.full(tensors["lm_head.weight"].shape, 7.0, np.float32))

    _rewrite(cand, add)
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "fleet", cand, "--layout", "hf")
    assert r["cand"]["tensor_count"] == 297
    assert code == 1 and r["counts"]["structural"] == 1, (code, r["counts"], r["differences"][:8])
    (d,) = [d for d in r["differences"] if d["class"] == "structural"]
    assert d["what"] == "only in candidate" and d["cand_keys"] == [extra] and r["hash_match"] is False


def test_a_fleet_file_of_interleaved_fused_weights_is_not_read_as_plain(ckpts, tmp_path, capsys):
    """``fused_ffn_tp_degree`` (a fused gate/up saved by tensor-parallel shards) makes the loader read the
    same bytes as other weights. Measured before: check-ckpt ignored it, so the Fleet export flagged 2
    was a match (hash_match) against its source while it loaded 18 tensors scrambled, and a truly
    interleaved file was 18 value differences. Across layouts it is now refused (exit 2); in one
    layout a different flag is a structural difference."""
    flagged = _copy(ckpts, "fleet", tmp_path)
    index = flagged / "model.safetensors.index.json"
    doc = json.loads(index.read_text())
    doc["metadata"]["fused_ffn_tp_degree"] = "2"
    index.write_text(json.dumps(doc))
    code, err = _run(capsys, ckpts / "src", flagged, "--layout", "fleet")
    assert code == 2 and "fused_ffn_tp_degree {'ref': 1, 'cand': 2}" in err, err
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "fleet", flagged)
    assert code == 1 and r["counts"]["structural"] == 1 and r["counts"]["value"] == 0
    assert any(d.get("what") == "fused_ffn_tp_degree ref 1, cand 2" for d in r["differences"])


def test_a_candidate_widened_beyond_its_layout_differs_across_layouts_too(ckpts, tmp_path, capsys):
    """PaddleFleet's fp32 router against a bf16 one is no difference when exact (the layouts make it);
    a Fleet candidate that stores a bf16 weight as F32 (its own choice) is. Measured before: a dtype
    difference against the Fleet reference, but a match (hash_match) against the official one."""
    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint, SafetensorsWriter

    widened = _copy(ckpts, "fleet", tmp_path)
    key = "model.layers.0.self_attn.o_proj.weight"
    index = json.loads((widened / "model.safetensors.index.json").read_text())
    file = widened / index["weight_map"][key]
    with Checkpoint(widened) as ck:  # the file's tensors, bf16 as its uint16 bits; the one key widened exactly
        names = [k for k, f in index["weight_map"].items() if f == file.name]
        arrays = {k: ck.numpy(k).copy() for k in names}
        dtypes = {k: ck.info(k).dtype for k in names}
    assert dtypes[key] == "BF16"
    arrays[key], dtypes[key] = (arrays[key].astype("uint32") << 16).view("float32"), "F32"
    writer = SafetensorsWriter(str(file), [(k, dtypes[k], list(arrays[k].shape)) for k in names], {"format": "pt"})
    for k in names:
        writer.write(k, arrays[k], dtypes[k])
    writer.close()
    index["metadata"]["total_size"] += arrays[key].size * 2
    (widened / "model.safetensors.index.json").write_text(json.dumps(index))
    for ref, extra in ((ckpts / "fleet", ()), (ckpts / "src", ("--layout", "fleet"))):
        code, r, _ = _receipt(tmp_path, capsys, ref, widened, *extra)
        assert code == 1 and r["counts"]["value"] >= 1, (ref, r["counts"])
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", ckpts / "fleet", "--layout", "fleet")
    assert code == 0  # the router's fp32 (the layout's) is still no difference


def _set_bf16(folder: pathlib.Path, key: str, bits: int, element: int = 0) -> None:
    index = json.loads((folder / "model.safetensors.index.json").read_text())
    shard = folder / index["weight_map"][key]
    off = _tensor_offset(shard, key) + 2 * element
    b = bytearray(shard.read_bytes())
    b[off : off + 2] = struct.pack("<H", bits)
    shard.write_bytes(bytes(b))


@pytest.mark.parametrize("bits, shown", [(0x7FC0, "nan"), (0x7F80, "inf")])
def test_allow_nonfinite_reports_a_nan_against_a_number_as_a_nonfinite_difference(ckpts, tmp_path, capsys, bits, shown):
    """One element of a tensor changed to NaN (or +inf): the difference is NaN (inf), not 0.
    Before: ``np.nanmax`` dropped the NaN-vs-number difference, so the receipt said
    ``max_abs_diff=0`` for a tensor whose element went from 1.0 to NaN."""
    cand = _copy(ckpts, "export", tmp_path)
    key = "model.norm.weight"
    _set_bf16(cand, key, bits)
    code, r, text = _receipt(tmp_path, capsys, ckpts / "src", cand, "--allow-nonfinite")
    assert code == 1 and r["result"] == "mismatch", text
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["key"] == key and d["differing_elements"] == 1 and d["max_abs_diff"] is None  # strict JSON: null
    i = r["differences"].index(d)
    assert f"differences[{i}].max_abs_diff" in r["nonfinite"] and "value_summary.max_abs_diff" in r["nonfinite"]
    assert r["value_summary"]["max_abs_diff_key"] == key
    assert f"{key} expected=BF16 actual=BF16 max_abs_diff={shown}" in text, text


def test_allow_nonfinite_identical_nan_checkpoints_match_only_saying_they_hold_nan(ckpts, tmp_path, capsys):
    """docs/parity.md: NaN at the same place on both sides (the same bytes) is no difference under
    ``--allow-nonfinite``, but the verdict says the tensors hold non-finite values (before: a plain
    ``match (exit 0)``); without the flag the NaN is refused (exit 2)."""
    a = _copy(ckpts, "export", tmp_path)
    key = "model.layers.0.input_layernorm.weight"
    _set_bf16(a, key, 0x7FC0, element=3)
    b = tmp_path / "copy_of_a"
    shutil.copytree(a, b)
    assert _run(capsys, a, b)[0] == 2
    code, r, text = _receipt(tmp_path, capsys, a, b, "--allow-nonfinite")
    assert code == 0 and r["result"].startswith("match with non-finite values"), r["result"]
    assert "NaN/Inf at the same places on both sides" in r["result"] and "ref 1, cand 1" in r["result"]
    assert text.splitlines()[0].startswith("check-ckpt: match with non-finite values") and key in text, text


def test_diff_stats_counts_nan_pairs_equal_and_nan_against_a_number_as_nan():
    import math

    import numpy as np

    from paddleformers_glm.parity.ckpt_check import _diff_stats

    nan, inf = np.nan, np.inf
    cases = [  # (a, b, max abs diff, differing elements)
        ([1.0, nan, 3.0], [1.0, nan, 3.0], 0.0, 0),  # a NaN pair: equal
        ([1.0, 2.0], [1.0, 2.5], 0.5, 1),
        ([1.0, 2.0], [nan, 2.5], nan, 2),  # a NaN against a number: NaN, whichever comes first
        ([1.0, 2.0], [1.5, nan], nan, 2),
        ([inf, 2.0], [inf, 2.0], 0.0, 0),  # the same infinity: equal
        ([inf, 2.0], [-inf, 2.0], inf, 1),
        ([1.0, 2.0], [1.0, inf], inf, 1),
        ([], [], 0.0, 0),
    ]
    for a, b, mad, n in cases:
        got = _diff_stats(np.float32(a), "F32", np.float32(b), "F32")
        assert got[1] == n and (math.isnan(got[0]) if math.isnan(mad) else got[0] == mad), (a, b, got)
    # across chunks: a NaN in an early chunk is not lost to a larger difference later
    x, y = np.zeros(600_000, np.float32), np.zeros(600_000, np.float32)
    y[0], y[-1] = nan, 5.0
    assert math.isnan(_diff_stats(x, "F32", y, "F32")[0])


# ---------------------------------------------------------------- single files, config.json, reasons, FP8 numbers
def _xor_bf16(file: pathlib.Path, key: str, element: int, mask: int) -> tuple[int, int]:
    """XOR one bf16 element's bits with ``mask`` in a single safetensors file; returns (old, new) bits."""
    off = _tensor_offset(file, key) + 2 * element
    b = bytearray(file.read_bytes())
    (old,) = struct.unpack("<H", b[off : off + 2])
    b[off : off + 2] = struct.pack("<H", old ^ mask)
    file.write_bytes(bytes(b))
    return old, old ^ mask


def _bf16_value(bits: int) -> float:
    return struct.unpack("<f", struct.pack("<I", bits << 16))[0]


def _shard_of(folder: pathlib.Path, key: str) -> pathlib.Path:
    return folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]


def test_two_single_files_in_one_folder_are_compared_not_refused(ckpts, tmp_path, capsys):
    """docs/parity.md step 2: REF and CAND are refused as the same files when a weight file of one side
    is one of the other. Two single ``.safetensors`` files in one folder both read that folder's
    ``config.json``; that shared file does not make their weights one, so they are compared (here: one
    element apart, exit 1, the tensor named). A REF shard given as CAND shares a weight file and is
    still refused (tests/test_checker_receipts.py)."""
    key = "model.layers.0.mlp.down_proj.weight"
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(ckpts / "src" / "config.json", one / "config.json")
    shutil.copy(_shard_of(ckpts / "src", key), one / "before.safetensors")
    shutil.copy(one / "before.safetensors", one / "after.safetensors")
    _xor_bf16(one / "after.safetensors", key, 0, 0x0001)
    code, r, text = _receipt(tmp_path, capsys, one / "before.safetensors", one / "after.safetensors")
    assert code == 1 and r["result"] == "mismatch" and not r["errors"], (code, text)
    assert r["counts"]["value"] == 1 and r["config_match"] is True
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["key"] == key and d["differing_elements"] == 1 and key in text
    code, err = _run(capsys, ckpts / "src", _shard_of(ckpts / "src", key))  # a REF shard as CAND
    assert code == 2 and "are the same files" in err, err


@pytest.mark.parametrize("missing", ["cand", "ref"])
def test_a_side_without_config_json_says_so(ckpts, tmp_path, capsys, missing):
    """docs/parity.md: exit 0 needs equal configs, so a side with no ``config.json`` beside its weights
    is a mismatch (exit 1) whose ``config`` entry says which side has none (``missing_in``), its
    ``reasons`` say ``config.json missing in <side>``, and the printed summary says so instead of
    listing the other side's config keys as differing."""
    key = "model.layers.0.mlp.down_proj.weight"
    with_cfg, without = tmp_path / "with", tmp_path / "without"
    with_cfg.mkdir(), without.mkdir()
    shutil.copy(ckpts / "src" / "config.json", with_cfg / "config.json")
    shutil.copy(_shard_of(ckpts / "src", key), with_cfg / "w.safetensors")
    shutil.copy(with_cfg / "w.safetensors", without / "w.safetensors")
    sides = (with_cfg, without) if missing == "cand" else (without, with_cfg)
    code, r, text = _receipt(tmp_path, capsys, *(s / "w.safetensors" for s in sides))
    assert code == 1 and r["hash_match"] is True and r["config_match"] is False, text
    (d,) = [d for d in r["differences"] if d["class"] == "config"]
    assert d["missing_in"] == missing
    assert f"config.json missing in {missing}" in r["reasons"][0] and len(r["reasons"]) == 1, r["reasons"]
    assert f"config: {missing} has no config.json" in text and "rms_norm_eps" not in text, text
    n = len(json.loads((ckpts / "src" / "config.json").read_text()))  # every key, null-valued ones too
    other = "ref" if missing == "cand" else "cand"
    assert f"({other}'s has {n} keys)" in text, text


def test_a_naming_only_mismatch_says_why_and_how_many_lines_are_not_shown(ckpts, tmp_path, capsys):
    """docs/parity.md: without ``--layout`` the candidate must use the reference's names, so a Fleet
    export of the source is a mismatch (exit 1) though every tensor matches. The receipt's ``reasons``
    and a ``reason:`` line under the counts say why: the naming differences, the layout the candidate's
    keys show and the ``--layout`` that declares it. The printed summary shows the first 20 differences
    and then ``... N more``. With ``--layout fleet`` the same pair matches and ``reasons`` is empty."""
    code, r, text = _receipt(tmp_path, capsys, ckpts / "src", ckpts / "fleet")
    assert code == 1 and r["counts"]["structural"] == r["counts"]["value"] == 0 and r["hash_match"] is True
    (reason,) = r["reasons"]
    n = r["counts"]["naming"]
    assert reason.startswith(f"naming differences: {n} (") and "fleet layout" in reason and "--layout fleet" in reason
    lines = text.splitlines()
    assert f"  reason: {reason}" in lines, text
    shown = [ln for ln in lines if ln.startswith("  naming (")]
    assert len(shown) == 20 and lines[-1] == f"  ... {len(r['differences']) - 20} more", text
    code, r, text = _receipt(tmp_path, capsys, ckpts / "src", ckpts / "fleet", "--layout", "fleet")
    assert code == 0 and r["reasons"] == [] and "reason:" not in text


def test_value_summary_takes_a_nan_difference_over_a_larger_listed_one(ckpts, tmp_path, capsys):
    """docs/parity.md step 3 and 6: under ``--allow-nonfinite`` a NaN against a number is a value
    difference whose ``max_abs_diff`` is NaN, and ``value_summary.max_abs_diff`` is the largest over all
    value differences, NaN winning: with a 1-ulp tensor listed first and a NaN-vs-number tensor after it,
    the summary's ``max_abs_diff`` is NaN (``null``, listed under ``nonfinite``) and names the NaN tensor."""
    cand = _copy(ckpts, "export", tmp_path)
    ulp_key, nan_key = "model.layers.0.mlp.down_proj.weight", "model.norm.weight"
    assert ulp_key < nan_key  # the value differences are listed in key order
    _xor_bf16(_shard_of(cand, ulp_key), ulp_key, 0, 0x0001)
    _set_bf16(cand, nan_key, 0x7FC0)
    code, r, _ = _receipt(tmp_path, capsys, ckpts / "src", cand, "--allow-nonfinite")
    assert code == 1 and r["counts"]["value"] == 2
    vs = r["value_summary"]
    assert vs["max_abs_diff"] is None and vs["max_abs_diff_key"] == nan_key, vs
    assert "value_summary.max_abs_diff" in r["nonfinite"]


def test_a_real_difference_beside_a_signed_zero_is_not_called_bits_only(ckpts, tmp_path, capsys):
    """docs/parity.md step 5: a value entry says ``equal values in other bits only`` (its ``reason``,
    counted by ``value_summary.bits_only``) only when no element's value differs. A tensor with one
    element 1 ulp apart and one +0.0 against -0.0 has ``differing_elements`` 1 and
    ``bits_only_elements`` 1, and no such reason."""
    key = "model.layers.0.mlp.down_proj.weight"
    ref, cand = _copy(ckpts, "export", tmp_path), tmp_path / "cand"
    _set_bf16(ref, key, 0x0000, element=0)
    shutil.copytree(ref, cand)
    _set_bf16(cand, key, 0x8000, element=0)
    _xor_bf16(_shard_of(cand, key), key, 1, 0x0001)
    code, r, text = _receipt(tmp_path, capsys, ref, cand)
    assert code == 1
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["key"] == key and d["differing_elements"] == 1 and d["bits_only_elements"] == 1, d
    assert "reason" not in d and r["value_summary"]["bits_only"] == 0, d
    line = next(ln for ln in text.splitlines() if key in ln and ln.startswith("  value"))
    assert "bits_only_elements=1" in line and "other bits only" not in line, line


FP8_FIXTURE = ROOT / "tests" / "fixtures" / "tiny_fp8" / "checkpoint"


@pytest.fixture(scope="module")
def fp8_pair(tmp_path_factory):
    """The FP8 fixture and its dequantization (``glm52 convert --quantization none``)."""
    if not FP8_FIXTURE.exists():
        pytest.skip("FP8 fixture checkpoint not present")
    base = tmp_path_factory.mktemp("fp8")
    assert (
        main(["convert", str(FP8_FIXTURE), str(base / "bf16"), "--to", "hf", "--quantization", "none", "--quiet"]) == 0
    )
    return FP8_FIXTURE, base / "bf16"


def test_fp8_difference_is_measured_on_the_rounded_values_and_summarised(fp8_pair, tmp_path, capsys):
    """docs/parity.md step 5 (quantization) and 6: an FP8 weight is compared by its dequantized value
    rounded to the other side's dtype, and its numbers are measured the same way: a ``differing`` entry
    has ``differing_elements`` and ``max_abs_diff`` of the rounded values (here one bf16 element 1 ulp
    apart: 1 element, that ulp), ``unrounded_max_abs_diff`` of the values before the rounding. It is a
    ``bytes`` value difference in ``value_summary`` (``quantization`` counts such FP8 ones), whose
    ``max_abs_diff`` and key come from it, and the summary prints its key as a value line. A full match
    reports no value difference; its ``unrounded_max_abs_diff`` (= the entry's ``max_abs_diff``) is the
    rounding the comparison absorbs."""
    fp8, bf16 = fp8_pair
    code, r, _ = _receipt(tmp_path, capsys, fp8, bf16)
    assert code == 0
    (q,) = [d for d in r["differences"] if d["class"] == "quantization"]
    assert q["differing"] == [] and q["unrounded_max_abs_diff"] == q["max_abs_diff"] > 0
    assert r["value_summary"]["quantization"] == 0 and r["value_summary"]["max_abs_diff"] is None
    cand = tmp_path / "bf16ulp"
    shutil.copytree(bf16, cand)
    key = "model.layers.0.mlp.down_proj.weight"
    file = cand / "model.safetensors" if (cand / "model.safetensors").exists() else _shard_of(cand, key)
    old, new = _xor_bf16(file, key, 100, 0x0001)
    ulp = abs(_bf16_value(new) - _bf16_value(old))
    code, r, text = _receipt(tmp_path, capsys, fp8, cand)
    assert code == 1 and r["counts"]["value"] == 1, text
    (q,) = [d for d in r["differences"] if d["class"] == "quantization"]
    (d,) = q["differing"]
    assert d["key"] == key and d["differing_elements"] == 1 and d["max_abs_diff"] == ulp, d
    assert d["unrounded_max_abs_diff"] > 0 and "reason" not in d
    vs = r["value_summary"]
    assert (vs["bytes"], vs["quantization"], vs["max_abs_diff"], vs["max_abs_diff_key"]) == (1, 1, ulp, key), vs
    line = next(ln for ln in text.splitlines() if ln.startswith("  value (") and key in ln)
    assert "differing_elements=1" in line and "rounded to BF16" in line, text
    assert r["reasons"] == [f"value differences: 1 (largest max_abs_diff {ulp:.3g})"], r["reasons"]


def test_fp8_scale_difference_is_in_value_summary(fp8_pair, tmp_path, capsys):
    """docs/parity.md step 6: ``value_summary`` covers every value difference, an FP8 weight that differs
    after dequantize + round included (a doubled ``scale_inv``): ``bytes`` and ``quantization`` 1, its
    key with the largest ``max_abs_diff``, as ``counts.value`` 1 says."""
    fp8, bf16 = fp8_pair
    ref = tmp_path / "fp8x2"
    shutil.copytree(fp8, ref)
    key = "model.layers.0.mlp.down_proj.weight"
    file = _shard_of(ref, key + "_scale_inv")
    off = _tensor_offset(file, key + "_scale_inv")
    b = bytearray(file.read_bytes())
    (scale,) = struct.unpack("<f", b[off : off + 4])
    b[off : off + 4] = struct.pack("<f", scale * 2)  # the first block's scale doubled
    file.write_bytes(bytes(b))
    code, r, text = _receipt(tmp_path, capsys, ref, bf16)
    assert code == 1 and r["counts"]["value"] == 1, text
    vs = r["value_summary"]
    assert (vs["bytes"], vs["quantization"], vs["max_abs_diff_key"]) == (1, 1, key) and vs["max_abs_diff"] > 0, vs
    (q,) = [d for d in r["differences"] if d["class"] == "quantization"]
    assert [d["key"] for d in q["differing"]] == [key] and q["differing"][0]["differing_elements"] > 0


def test_an_fp8_side_without_config_json_is_refused_saying_so(fp8_pair, tmp_path, capsys):
    """docs/parity.md step 5 (quantization): an FP8 checkpoint's weights and scales are told apart by its
    ``config.json`` (``quantization_config``); an FP8 side with no ``config.json`` reads as unquantized in
    an unknown layout, which is refused (exit 2) with a line that says that side has no ``config.json``."""
    fp8, _ = fp8_pair
    cand = tmp_path / "fp8_no_config"
    shutil.copytree(fp8, cand)
    (cand / "config.json").unlink()
    code, err = _run(capsys, fp8, cand)
    assert code == 2 and len(err.splitlines()) == 1 and "cand has no config.json" in err, err


def test_an_fp8_side_without_config_json_against_an_unquantized_one_is_refused(fp8_pair, tmp_path, capsys):
    """Without its ``config.json`` an FP8 side's weights cannot be paired with their scales, and against
    the unquantized side its F8_E4M3 bytes would be compared as numbers (exit 1 with every FP8 weight
    a dtype difference and every scale a structural one): refused, either side, naming the side."""
    fp8, bf16 = fp8_pair
    bare = tmp_path / "fp8_no_config"
    shutil.copytree(fp8, bare)
    (bare / "config.json").unlink()
    for sides, name in (((bf16, bare), "cand"), ((bare, bf16), "ref")):
        code, err = _run(capsys, *sides)
        assert code == 2 and f"{name} holds F8_E4M3 weights but no config.json" in err, err


def test_fp8_against_fp8_compares_values_not_byte_codes(fp8_pair, tmp_path, capsys):
    """Two FP8 checkpoints compare their F8_E4M3 weights by value (docs/parity.md step 5): an element
    whose sign bit is flipped differs by twice its value, not by 128 (the byte codes as numbers); a
    -0.0 against a +0.0 is a difference in other bits only (``bits_only_elements``), no value one."""
    import numpy as np

    from paddleformers_glm.checkpoint.fp8 import decode_e4m3

    fp8, _ = fp8_pair
    key = "model.layers.0.mlp.down_proj.weight"

    def with_byte(name: str, i: int, code: int | None) -> pathlib.Path:
        out = tmp_path / name
        shutil.copytree(fp8, out)
        file = _shard_of(out, key)
        b = bytearray(file.read_bytes())
        off = _tensor_offset(file, key) + i
        b[off] = b[off] ^ 0x80 if code is None else code
        file.write_bytes(bytes(b))
        return out

    file = _shard_of(fp8, key)
    raw = file.read_bytes()[_tensor_offset(file, key) :][:64]
    i = next(j for j, v in enumerate(raw) if 0 < (v & 0x7F) < 0x7F)  # a finite nonzero element
    value = float(decode_e4m3(np.array([raw[i]], np.uint8))[0])
    code, r, text = _receipt(tmp_path, capsys, fp8, with_byte("flipped", i, None))
    assert code == 1, text
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["differing_elements"] == 1 and d["max_abs_diff"] == 2 * abs(value), (d, value)
    code, r, text = _receipt(tmp_path, capsys, with_byte("plus0", i, 0x00), with_byte("minus0", i, 0x80))
    assert code == 1, text
    (d,) = [d for d in r["differences"] if d["class"] == "value"]
    assert d["differing_elements"] == 0 and d["bits_only_elements"] == 1 and "reason" in d, d
