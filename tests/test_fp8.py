"""Block-FP8 checkpoints (official release format) in and out.

The fixture tests/fixtures/tiny_fp8 was made with torch (``float8_e4m3fn``) by tools/make_reference.py:
the FP8 bytes and scales, the sha256 of torch's dequantization ``q.float() * scale_inv`` of every
FP8 tensor, and HF transformers' logits on the dequantized weights. Expected values come from
there or from the source files read with the ``safetensors`` library.
"""

from __future__ import annotations

import hashlib
import json
import math
import pathlib
import shutil

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import CheckpointError, fleet_param_specs, load_pretrained_state
from paddleformers_glm.checkpoint.fp8 import E4M3_TABLE, Fp8Source, decode_e4m3, encode_e4m3, fp8_pairs, quantization_of
from paddleformers_glm.checkpoint.safetensors_io import Checkpoint

ROOT = pathlib.Path(__file__).resolve().parents[1]
CASE = ROOT / "tests" / "fixtures" / "tiny_fp8"
FIXTURE = CASE / "checkpoint"
META = json.loads((CASE / "meta.json").read_text())


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    shutil.copytree(FIXTURE, d)
    return d


def _read_all(folder) -> dict[str, tuple[str, tuple, bytes]]:
    """Every tensor via the safetensors library (numpy has no float8: F8 bytes read as raw u8)."""
    from safetensors import safe_open

    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            data = fh.read()
        header.pop("__metadata__", None)
        with safe_open(str(f), framework="numpy") as h:
            assert set(h.keys()) == set(header)
        for k, e in header.items():
            b, end = e["data_offsets"]
            out[k] = (e["dtype"], tuple(e["shape"]), data[b:end])
    return out


def test_e4m3_table_spec_values():
    # e4m3fn: bias 7, 3 mantissa bits, no infinities, S.1111.111 is NaN
    assert E4M3_TABLE[0x7E] == 448.0 and E4M3_TABLE[0xFE] == -448.0
    assert E4M3_TABLE[0x38] == 1.0 and E4M3_TABLE[0x01] == 2.0**-9 and E4M3_TABLE[0x08] == 2.0**-6
    assert E4M3_TABLE[0x07] == 7 * 2.0**-9
    assert np.isnan(E4M3_TABLE[0x7F]) and np.isnan(E4M3_TABLE[0xFF])
    assert np.signbit(E4M3_TABLE[0x80]) and E4M3_TABLE[0x80] == 0
    assert np.isnan(E4M3_TABLE).sum() == 2
    finite = E4M3_TABLE[:127]
    assert np.all(np.diff(finite) > 0)  # codes 0x00..0x7E increase
    codes = np.arange(256, dtype=np.uint8)
    ok = ~np.isnan(E4M3_TABLE)
    assert np.array_equal(encode_e4m3(decode_e4m3(codes))[ok], codes[ok])
    # ties to even; 464 (halfway to the NaN code) rounds to 448, beyond saturates to NaN like torch
    assert encode_e4m3(np.float32([1.0625, 1.1875, 464.0, 470.0]))[:3].tolist() == [0x38, 0x3A, 0x7E]
    assert encode_e4m3(np.float32([470.0]))[0] == 0x7F


def test_fp32_dequantization_is_bitwise_torch_reference(src):
    """Every FP8 tensor read whole equals torch's ``q.float() * scale_inv`` bit for bit."""
    want = META["dequantized_sha256"]
    with Checkpoint(src) as ckpt:
        block = quantization_of(str(src))
        assert block == (128, 128)
        pairs = fp8_pairs(ckpt, block)
        assert sorted(pairs) == sorted(want)
        assert any(k.startswith("model.layers.8.") for k in pairs)  # the MTP layer is FP8 too
        source = Fp8Source(ckpt, pairs=pairs, block=block)
        for k in sorted(pairs):
            shape = ckpt.info(k).shape
            arr = source.read_numpy(k, (0, 0), shape)
            assert arr.dtype == np.float32
            assert hashlib.sha256(arr.tobytes()).hexdigest() == want[k], k
    # several blocks and partial ones are exercised: 192 rows = one full + one partial row block
    assert (192, 48) in {ckpt.info(k).shape for k in pairs}


def test_model_loads_fp8_bitwise_and_matches_hf_logits(src, tmp_path):
    import paddle
    from safetensors.numpy import load_file

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32")
    ref = load_file(str(CASE / "reference.safetensors"))
    model.eval()
    out = model(paddle.to_tensor(ref["input_ids"]), labels=paddle.to_tensor(ref["labels"]))
    assert float(np.abs(out.logits.numpy().astype(np.float64) - ref["logits"]).max()) <= 1e-5
    assert float(np.abs(out.mtp_logits[0].numpy().astype(np.float64) - ref["mtp_logits"]).max()) <= 2e-5
    # the parameters themselves: written back unquantized in fp32 (official layout), every FP8
    # tensor has torch's dequantized bytes
    model.save_pretrained(tmp_path / "fp32", dtype="float32")
    got = _read_all(tmp_path / "fp32")
    for k, h in META["dequantized_sha256"].items():
        assert got[k][0] == "F32" and hashlib.sha256(got[k][2]).hexdigest() == h, k
    assert not any(k.endswith("_scale_inv") for k in got)
    assert "quantization_config" not in json.loads((tmp_path / "fp32" / "config.json").read_text())


def test_fp8_reexport_is_byte_identical(src, tmp_path):
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    model = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32")
    out = tmp_path / "fp8"
    model.save_pretrained(out, quantization="fp8", max_shard_size="300KB")
    a, b = _read_all(src), _read_all(out)
    assert set(a) == set(b)
    for k in sorted(a):
        assert a[k][:2] == b[k][:2], k
        assert a[k][2] == b[k][2], k
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc == json.loads((src / "config.json").read_text())["quantization_config"]


def test_tp_rank_reads_only_its_blocks(src):
    """Rank 1 of 2 of a column-parallel q_b_proj (Fleet [48, 192] <- HF [192, 48] FP8): it reads its
    96 rows of FP8 bytes and the scales of the two row blocks they overlap, nothing else."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    cfg = GlmMoeDsaConfig.from_pretrained(src)
    state = {k: paddle.zeros(list(s), dtype="float32") for k, (s, _) in fleet_param_specs(cfg).items()}
    qk = "model.layers.0.self_attn.q_b_proj.weight"
    state[qk] = ShardedWeight(qk, paddle.zeros([48, 96]), (48, 96), (48, 192), (0, 96))
    rep = load_pretrained_state(state, src, config=cfg, keys=[qk], dtype="float32")
    assert rep.bytes_read == 96 * 48 * 1 + 2 * 1 * 4
    full = paddle.zeros([48, 192])
    state2 = dict(state, **{qk: full})
    rep2 = load_pretrained_state(state2, src, config=cfg, keys=[qk], dtype="float32")
    assert rep2.bytes_read == 192 * 48 + 2 * 4
    np.testing.assert_array_equal(state[qk].local_tensor.numpy(), full.numpy()[:, 96:])
    # rows 128..191 alone: one row block of scales
    state[qk] = ShardedWeight(qk, paddle.zeros([48, 64]), (48, 64), (48, 192), (0, 128))
    rep3 = load_pretrained_state(state, src, config=cfg, keys=[qk], dtype="float32")
    assert rep3.bytes_read == 64 * 48 + 4
    np.testing.assert_array_equal(state[qk].local_tensor.numpy(), full.numpy()[:, 128:])
    # rows 0..127, ending on the block edge: row block 0's scale only, not the next one's too
    state[qk] = ShardedWeight(qk, paddle.zeros([48, 128]), (48, 128), (48, 192), (0, 0))
    rep4 = load_pretrained_state(state, src, config=cfg, keys=[qk], dtype="float32")
    assert rep4.bytes_read == 128 * 48 + 4
    np.testing.assert_array_equal(state[qk].local_tensor.numpy(), full.numpy()[:, :128])


def test_bf16_load_of_fp8_is_dequantize_then_round(src):
    import paddle

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    m32 = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32")
    m16 = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="bfloat16")
    k = "model.layers.1.self_attn.kv_b_proj.weight"
    a = dict(m32.named_parameters())[k]
    b = dict(m16.named_parameters())[k]
    assert str(b.dtype) == "paddle.bfloat16"
    assert np.array_equal(a.astype(paddle.bfloat16).astype("float32").numpy(), b.astype("float32").numpy())


def _edit_config(folder, **kv):
    p = pathlib.Path(folder) / "config.json"
    cfg = json.loads(p.read_text())
    cfg.update(kv)
    p.write_text(json.dumps(cfg))


def test_other_quantization_method_refused_by_name(src):
    _edit_config(src, quantization_config={"quant_method": "gptq", "bits": 4})
    with pytest.raises(CheckpointError, match="'gptq'"):
        load_pretrained_state(_spec_state(src), src, config=GlmMoeDsaConfig.from_pretrained(src))


def test_fp8_without_scale_or_config_refused(src, tmp_path):
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsWriter

    cfg = GlmMoeDsaConfig.from_pretrained(src)
    # a scale with the wrong block grid
    _edit_config(src, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [64, 64]})
    with pytest.raises(CheckpointError, match="scale tensor does not match") as e:
        load_pretrained_state(_spec_state(src), src, config=cfg)
    assert e.value.key.endswith("_scale_inv")
    # booleans are no block sizes (measured before: [true, true] was taken as 1 x 1 blocks)
    _edit_config(src, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [True, True]})
    with pytest.raises(CheckpointError, match="weight_block_size must be two positive integers"):
        load_pretrained_state(_spec_state(src), src, config=cfg)
    _edit_config(src, quantization_config=None)
    with pytest.raises(CheckpointError, match="no quantization_config"):
        load_pretrained_state(_spec_state(src), src, config=GlmMoeDsaConfig.from_pretrained(src))
    # an FP8 weight whose scale is missing
    one = tmp_path / "one"
    one.mkdir()
    shutil.copy(src / "config.json", one / "config.json")
    _edit_config(one, quantization_config={"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128]})
    w = SafetensorsWriter(str(one / "model.safetensors"), [("a.weight", "F8_E4M3", (4, 4))])
    w.write("a.weight", np.zeros((4, 4), np.uint8), "F8_E4M3")
    w.close()
    with Checkpoint(one) as ckpt, pytest.raises(CheckpointError, match="without its scale"):
        fp8_pairs(ckpt, quantization_of(str(one)))


def _qc(**kv):
    return {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": [128, 128], **kv}


_BAD_QC = [
    # a block size other than two positive ints: without the check, [0, 128] divides by zero, [128]
    # is an IndexError, and [128, 128, 128] is read as 128 x 128 blocks without a word
    *[
        (_qc(weight_block_size=bs), "quantization_config.weight_block_size", "two positive integers")
        for bs in ([0, 128], [128, 0], [128], [128, 128, 128], [], "128", [128.0, 128])
    ],
    # a format other than E4M3 (or a misspelt one) describes weights this loader does not read: said
    # at the config, by its field, before any tensor is looked at
    *[(_qc(fmt=f), "quantization_config.fmt", "FP8 format") for f in ("e5m2", "E4M3", None)],
    # not an object: without the check, `.get` on it is an AttributeError naming no file
    *[(qc, None, "quantization_config must be an object") for qc in ("fp8", [], 1, True)],
]


def _bad_qc_id(case) -> str:
    qc, key, _ = case
    field = key.split(".")[-1] if key else None
    return f"{field}={json.dumps(qc[field])}" if field else f"quantization_config={json.dumps(qc)}"


@pytest.mark.parametrize("qc, key, says", _BAD_QC, ids=[_bad_qc_id(c) for c in _BAD_QC])
def test_a_quantization_config_other_than_block_fp8_e4m3_is_refused_naming_config_json(tmp_path, qc, key, says):
    """Each refusal names config.json and the field, so the user knows what to fix in which file."""
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    with pytest.raises(CheckpointError, match=says) as e:
        quantization_of(str(tmp_path))
    assert e.value.key == key and e.value.file == str(tmp_path / "config.json")
    if key == "quantization_config.fmt":
        assert e.value.expected == "e4m3" and e.value.actual == qc["fmt"]


def test_a_quantization_config_without_fmt_means_e4m3(tmp_path):
    """transformers' FP8 configs may leave ``fmt`` out; E4M3 is what such a checkpoint holds."""
    qc = _qc()
    del qc["fmt"]
    (tmp_path / "config.json").write_text(json.dumps({"quantization_config": qc}))
    assert quantization_of(str(tmp_path)) == (128, 128)


def test_fp8_weights_in_a_folder_without_config_json_use_the_given_configs_quantization(src):
    """A folder of weights alone, loaded with ``config=`` of the FP8 model: the config's own
    ``quantization_config`` describes the weights, and they load as with the folder's config.json
    (not refused as FP8 tensors without a quantization_config)."""
    cfg = GlmMoeDsaConfig.from_pretrained(src)
    assert getattr(cfg, "quantization_config", None)
    a = _spec_state(src)
    load_pretrained_state(a, src, config=cfg)
    (src / "config.json").unlink()
    b = _spec_state(src, cfg)
    load_pretrained_state(b, src, config=cfg)
    for k in a:
        assert np.array_equal(a[k].numpy(), b[k].numpy()), k


def _one_pair(folder, wshape, sshape, sdtype="F32", scale_first=False):
    """A folder holding the FP8 ``a.weight`` and its ``a.weight_scale_inv`` (ones), in that header
    order or the scale first (the safetensors library writes larger dtypes first: F32 before F8, measured)."""
    from paddleformers_glm.checkpoint.fp8 import FP8_CONFIG
    from paddleformers_glm.checkpoint.safetensors_io import ST_DTYPES, SafetensorsWriter

    (folder / "config.json").write_text(json.dumps({"quantization_config": FP8_CONFIG}))
    ents = [("a.weight", "F8_E4M3", wshape), ("a.weight_scale_inv", sdtype, sshape)]
    w = SafetensorsWriter(str(folder / "model.safetensors"), ents[::-1] if scale_first else ents)
    w.write("a.weight", np.zeros(wshape, np.uint8), "F8_E4M3")
    w.write("a.weight_scale_inv", np.ones(sshape, ST_DTYPES[sdtype][1]), sdtype)
    w.close()


@pytest.mark.parametrize("wshape, sshape", [((256,), (2,)), ((2, 128, 128), (2, 1, 1)), ((4, 256, 128), (4, 2))])
def test_an_fp8_tensor_that_is_not_2d_is_refused_as_such(tmp_path, wshape, sshape):
    """Block scales are defined for matrices; a 1-D or 3-D FP8 tensor (the stacked experts of newer
    HF saves) is refused by what it is, not as a scale grid that does not match."""
    _one_pair(tmp_path, wshape, sshape)
    with Checkpoint(tmp_path) as ck, pytest.raises(CheckpointError, match="FP8 tensor is not 2-D") as e:
        fp8_pairs(ck, quantization_of(str(tmp_path)))
    assert e.value.key == "a.weight" and e.value.actual == wshape
    assert e.value.file == str(tmp_path / "model.safetensors")


@pytest.mark.parametrize("scale_first", [False, True], ids=["weight_first", "scale_first"])
@pytest.mark.parametrize("sdtype", ["I32", "U8", "I64", "BOOL", "U16", "F8_E8M0", "F8_E4M3"])
def test_a_scale_of_a_dtype_that_is_no_float_is_refused_as_a_scale_whatever_the_header_order(
    tmp_path, sdtype, scale_first
):
    """Integer scales would be read as raw numbers where transformers 5.23 reads U8 (and F8_E8M0)
    scales as UE8M0 exponents, ``2 ** (b - 127)`` (measured: ``Fp8Dequantize._dequantize_one`` of E4M3
    ones with a U8 or F8_E8M0 scale byte of 128 gives 2.0): silently other weights, so they are refused, naming the
    scale key, the float dtypes and the dtype found. Measured before: an FP8-dtype scale listed before
    its weight in the header was checked as an FP8 weight of its own, refused as "FP8 variant not
    supported" (F8_E8M0) or as an FP8 tensor without its scale ``a.weight_scale_inv_scale_inv``."""
    from paddleformers_glm.checkpoint.fp8 import SCALE_DTYPES

    _one_pair(tmp_path, (128, 128), (1, 1), sdtype, scale_first)
    with Checkpoint(tmp_path) as ck, pytest.raises(CheckpointError) as e:
        fp8_pairs(ck, quantization_of(str(tmp_path)))
    assert str(e.value).startswith("scale tensor of a dtype that is no float"), str(e.value)
    assert e.value.key == "a.weight_scale_inv" and e.value.actual == sdtype and e.value.expected == SCALE_DTYPES
    assert e.value.file == str(tmp_path / "model.safetensors")
    assert ("UE8M0 scales" in str(e.value)) == (sdtype == "F8_E8M0"), str(e.value)


def _poke_scale(folder, key: str, value: float) -> None:
    """Overwrite the first element of the F32 tensor ``key`` (a scale) with ``value``, in place."""
    import struct

    file = folder / json.loads((folder / "model.safetensors.index.json").read_text())["weight_map"][key]
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    at = 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]
    raw[at : at + 4] = struct.pack("<f", value)
    file.write_bytes(bytes(raw))


def test_a_finite_scale_that_overflows_float32_is_refused_naming_the_overflow(src):
    """A finite scale of 1e38 makes ``q x scale_inv`` Inf in float32 (as in transformers' product) for
    every non-zero byte of its block. Measured before: a bare numpy "overflow encountered in multiply"
    RuntimeWarning reached the user, and the refusal blamed a NaN/Inf scale_inv, which there is none
    of. The refusal names the weight and the overflow now, with no numpy warning; a checkpoint
    without FP8 tensors is not told about scales it does not have."""
    import warnings

    from paddleformers_glm.checkpoint.finite import NonFiniteError, check_finite_state
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    key = "model.layers.0.self_attn.q_b_proj.weight"
    _poke_scale(src, key + "_scale_inv", 1e38)
    with warnings.catch_warnings(record=True) as caught, pytest.raises(NonFiniteError) as e:
        warnings.simplefilter("always")
        GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32")
    assert not [w for w in caught if issubclass(w.category, RuntimeWarning)], [str(w.message) for w in caught]
    msg = str(e.value)
    assert e.value.key == key and "a scale that overflows float32 in q x scale_inv" in msg, msg
    # the same state said of a checkpoint without FP8 tensors: no scale is named
    import paddle

    bad = {key: paddle.to_tensor(np.float32([1.0, np.inf]))}
    plain = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
    with pytest.raises(NonFiniteError) as e:
        check_finite_state(bad, str(plain))
    assert "scale" not in str(e.value) and "hold NaN or Inf" in str(e.value), str(e.value)
    with pytest.raises(NonFiniteError) as e:
        check_finite_state(bad, "the model's init")
    assert "scale" not in str(e.value)


def test_a_nonfinite_refusal_lists_the_first_five_names_sorted_and_counts_the_rest():
    """The names a user reads first are the same on every run (sorted, not in state order) and the
    message stays one line at any number of bad tensors."""
    import paddle

    from paddleformers_glm.checkpoint.finite import NonFiniteError, check_finite_state

    names = ["w.f", "w.e", "w.d", "w.c", "w.b", "w.a"]
    state = {n: paddle.to_tensor(np.float32([0, np.nan, 0])) for n in names}
    state["ok"] = paddle.to_tensor(np.zeros(3, np.float32))
    with pytest.raises(NonFiniteError) as e:
        check_finite_state(state, "/ckpt")
    msg = str(e.value)
    assert "w.a (1 values), w.b (1 values), w.c (1 values), w.d (1 values), w.e (1 values), ... (+1 more)" in msg
    assert e.value.key == "w.a" and e.value.counts == dict.fromkeys(names, 1)


@pytest.mark.parametrize("dtype, nan", [("F32", np.float32(np.inf)), ("F8_E4M3", np.uint8(0x7F))])
@pytest.mark.parametrize("where", [0, -1, 1, 2, 3])
def test_a_nonfinite_value_anywhere_in_a_multi_chunk_tensor_is_counted_once(dtype, nan, where):
    """``count_nonfinite_raw`` tests a tensor chunk by chunk; a value at a chunk's first or last
    element (here each side of the first boundary, and the tensor's last) counts, exactly once."""
    from paddleformers_glm.checkpoint import finite

    a = np.zeros(2 * finite._CHUNK_BYTES // np.dtype(type(nan)).itemsize, type(nan))
    step = a.size // 2
    at = {0: 0, -1: a.size - 1, 1: step - 1, 2: step, 3: step + 1}[where]
    a[at] = nan
    assert finite.count_nonfinite_raw(a, dtype) == 1
    a[:] = nan
    assert finite.count_nonfinite_raw(a, dtype) == a.size


def _rewrite_scales(folder, dtype: str) -> None:
    """Every ``*_scale_inv`` of ``folder`` truncated to a bf16 value (exact in BF16, F16 here and F32)
    and stored as ``dtype``; the other tensors as they were, in the same files."""
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsWriter

    with Checkpoint(folder) as ckpt:
        files: dict[str, dict] = {}
        for k in ckpt.keys():
            info = ckpt.info(k)
            files.setdefault(info.file, {})[k] = (info.dtype, tuple(info.shape), np.array(ckpt.numpy(k)))
    for f, tensors in files.items():
        specs = [(k, dtype if k.endswith("_scale_inv") else d, shape) for k, (d, shape, _) in tensors.items()]
        w = SafetensorsWriter(str(f) + ".new", specs)
        for k, (d, _, a) in tensors.items():
            if k.endswith("_scale_inv"):
                bits = a.view(np.uint32) & np.uint32(0xFFFF0000)
                a, d = (
                    {"BF16": (bits >> 16).astype(np.uint16), "F16": bits.view(np.float32).astype(np.float16)}.get(
                        dtype, bits.view(np.float32)
                    ),
                    dtype,
                )
            w.write(k, a, d)
        w.close()
        pathlib.Path(str(f) + ".new").replace(f)


def test_scales_stored_in_bf16_or_f16_load_as_their_float32_values(src, tmp_path):
    """transformers 5.23 multiplies by the scale cast to float32 whatever its stored dtype (measured:
    a tiny FP8 folder with BF16 scales loads there); ours refused any scale but F32 ("scale tensor
    does not match the blocks", with the right shape). The same scale values stored as BF16, F16 or
    F32 now load to the same weights, bit for bit."""
    import paddle

    got = {}
    for dtype in ("F32", "BF16", "F16"):
        d = tmp_path / dtype
        shutil.copytree(src, d)
        _rewrite_scales(d, dtype)
        state = _spec_state(d)
        load_pretrained_state(state, d, config=GlmMoeDsaConfig.from_pretrained(d))
        got[dtype] = {k: v.numpy() for k, v in state.items()}
        assert isinstance(state[next(iter(state))], paddle.Tensor)
    for dtype in ("BF16", "F16"):
        for k, v in got["F32"].items():
            assert np.array_equal(got[dtype][k].view(np.uint32), v.view(np.uint32)), (dtype, k)


def _spec_state(folder, cfg=None):
    import paddle

    cfg = cfg or GlmMoeDsaConfig.from_pretrained(folder)
    return {k: paddle.zeros(list(s), dtype="float32") for k, (s, _) in fleet_param_specs(cfg).items()}


def test_quantize_fresh_weights_scale_is_amax_over_448():
    from paddleformers_glm.checkpoint.fp8 import dequantize, quantize_blocks

    rng = np.random.default_rng(0)
    w = rng.standard_normal((130, 200)).astype(np.float32)
    q, s = quantize_blocks(w, (128, 128))
    assert q.dtype == np.uint8 and s.shape == (2, 2) and s.dtype == np.float32
    for i in range(2):
        for j in range(2):
            blk = w[i * 128 : (i + 1) * 128, j * 128 : (j + 1) * 128]
            amax = np.float32(np.abs(blk).max())
            # amax / 448, or its fp32 neighbour when that one represents the block exactly (not here)
            assert s[i, j] == amax / np.float32(448), (i, j)
    deq = dequantize(q, s, (128, 128))
    # E4M3 has 3 mantissa bits: relative error <= 2^-4 for normal values
    big = np.abs(w) > 0.1
    assert np.all(np.abs(deq - w)[big] <= np.abs(w)[big] * 2.0**-4 * (1 + 1e-6))
    assert math.isclose(float(np.abs(deq).max()), float(np.abs(w).max()), rel_tol=1e-6)


def test_a_block_whose_amax_over_448_underflows_gets_a_positive_scale():
    """amax below 448 x the smallest float32 makes amax / 448 zero; the quantizer then tried its
    fp32 neighbour below, -1.4e-45, and wrote that negative scale (measured on a block of 5e-43).
    The scale is the smallest positive float32 now, and the values come back within E4M3. No scale
    tried is 0 either (a block of 3 and 5 x the smallest subnormal, whose amax / 448 rounds to 0):
    that showed as numpy "divide by zero" warnings to the user."""
    import warnings

    from paddleformers_glm.checkpoint.fp8 import dequantize, quantize_blocks

    w = np.zeros((4, 4), np.float32)
    w[0, 0], w[1, 1], w[2:, 2:] = np.float32(5e-43), np.float32(-2e-44), 1.0
    q, s = quantize_blocks(w, (2, 2))
    assert (s > 0).all() and s[0, 0] == np.nextafter(np.float32(0), np.float32(1))
    back = dequantize(q, s, (2, 2))
    assert np.all(np.abs(back[:2, :2] - w[:2, :2]) <= np.abs(w[:2, :2]) * 2.0**-3)
    tiny = np.nextafter(np.float32(0), np.float32(1))
    w = np.zeros((4, 4), np.float32)
    w[0, 0], w[1, 1] = tiny * 3, tiny * 5
    with warnings.catch_warnings(), np.errstate(divide="raise", invalid="raise"):
        warnings.simplefilter("error")
        _, s = quantize_blocks(w, (4, 4))
    assert s[0, 0] > 0


def test_convert_keeps_an_fp8_sources_own_blocks(src, tmp_path, monkeypatch):
    """``convert --quantization fp8`` of an FP8 source whose ``weight_block_size`` is not the
    official 128 x 128: measured before, the output was re-blocked to 128 x 128 without a word (78%
    of values changed on a random-byte source). It keeps the source's blocks now, byte for byte."""
    from paddleformers_glm.checkpoint import fp8
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    small = tmp_path / "blocks16"
    monkeypatch.setitem(fp8.FP8_CONFIG, "weight_block_size", [16, 16])  # a save in 16 x 16 blocks
    GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32").save_pretrained(small, quantization="fp8")
    monkeypatch.undo()
    assert json.loads((small / "config.json").read_text())["quantization_config"]["weight_block_size"] == [16, 16]
    again = tmp_path / "again"
    assert _cli("convert", small, again, "--to", "hf", "--quantization", "fp8") == 0
    qc = json.loads((again / "config.json").read_text())["quantization_config"]
    assert qc["weight_block_size"] == [16, 16]
    a, b = _read_all(small), _read_all(again)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)


def test_requantizing_returns_the_source_bytes_for_any_fp32_scale():
    """Scales made as ``amax / 448`` in fp32 come back as is; a source whose scales are arbitrary fp32
    values (about one in ten is not ``fl(fl(448 s) / 448)``) still comes back byte for byte: the
    neighbouring scale that reproduces the block exactly is taken."""
    from paddleformers_glm.checkpoint.fp8 import dequantize, quantize_blocks

    rng = np.random.default_rng(1)
    rows, cols, b = 203, 130, 8  # partial last blocks both ways
    q = rng.integers(0, 0x7E, size=(rows, cols), dtype=np.uint8) | (rng.integers(0, 2, (rows, cols)) << 7).astype(
        np.uint8
    )
    q[::b, ::b] = 0x7E  # each block's amax is 448 * scale
    s = rng.uniform(1e-3, 1e-2, size=(math.ceil(rows / b), math.ceil(cols / b))).astype(np.float32)
    deq = dequantize(q, s, (b, b))
    naive = (deq[::b, ::b] / np.float32(448)).astype(np.float32)
    assert (naive != s).sum() > 10  # the case exists here
    q2, s2 = quantize_blocks(deq, (b, b))
    assert np.array_equal(s2.view(np.uint32), s.view(np.uint32))
    assert np.array_equal(q2, q)


def _cli(*args) -> int:
    from paddleformers_glm.cli import main

    return main([str(a) for a in args])


def test_convert_both_ways_and_check_ckpt_by_dequantized_value(src, tmp_path, capsys):
    from paddleformers_glm.parity.ckpt_check import check_checkpoints

    bf16, back = tmp_path / "bf16", tmp_path / "back"
    assert _cli("convert", src, bf16, "--to", "hf", "--quantization", "none", "--max-shard-size", "600KB") == 0
    got = _read_all(bf16)
    assert not any(k.endswith("_scale_inv") for k in got)
    assert {d for d, _, _ in got.values()} == {"BF16", "F32"}
    assert "quantization_config" not in json.loads((bf16 / "config.json").read_text())
    # FP8 -> FP8 keeps every byte
    assert _cli("convert", src, back, "--to", "hf", "--quantization", "fp8") == 0
    a, b = _read_all(src), _read_all(back)
    assert a.keys() == b.keys() and all(a[k] == b[k] for k in a)
    # FP8 vs BF16: compared by dequantized value, reported as their own class
    rep = check_checkpoints(str(src), str(bf16))
    assert rep["exit_code"] == 0, rep["differences"][:3]
    q = [d for d in rep["differences"] if d["class"] == "quantization"]
    assert len(q) == 1 and q[0]["tensors"] == len(META["dequantized_sha256"]) == q[0]["equal_after_rounding"]
    assert q[0]["fp8_side"] == "ref" and q[0]["max_abs_diff"] > 0  # bf16 rounding of the fp8 values
    assert rep["counts"]["quantization"] == q[0]["tensors"]
    # a changed bf16 value in one FP8-class tensor is a difference of that class
    k = "model.layers.2.mlp.down_proj.weight"
    f = bf16 / json.loads((bf16 / "model.safetensors.index.json").read_text())["weight_map"][k]
    n = int.from_bytes(f.read_bytes()[:8], "little")
    off = json.loads(f.read_bytes()[8 : 8 + n])[k]["data_offsets"][0] + 8 + n
    raw = bytearray(f.read_bytes())
    raw[off + 1] ^= 0x01  # the high byte of the first bf16 value: a real value change
    f.write_bytes(bytes(raw))
    rep = check_checkpoints(str(src), str(bf16))
    assert rep["exit_code"] == 1
    q = [d for d in rep["differences"] if d["class"] == "quantization"][0]
    assert [d["key"] for d in q["differing"]] == [k] and q["max_abs_diff"] > 0
    # fp8 output is the official layout only: one line, exit 2
    capsys.readouterr()
    assert _cli("convert", src, tmp_path / "fl", "--to", "fleet", "--quantization", "fp8") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "official layout" in err[0]


def test_paddle_file_backend_refuses_fp8(src):
    with pytest.raises(CheckpointError, match="backend='paddle' cannot read block-FP8"):
        load_pretrained_state(_spec_state(src), src, config=GlmMoeDsaConfig.from_pretrained(src), backend="paddle")


@pytest.mark.parametrize("leftover", ["scale tensor", "quantization_config"])
def test_check_ckpt_unquantized_side_keeping_fp8_leftovers_differs(src, tmp_path, leftover):
    """An FP8 checkpoint against its dequantized copy: the FP8 side's scale tensors and
    quantization_config are expected to have no counterpart, but an unquantized copy that kept one
    (a scale_inv tensor, or a config.json still declaring fp8 -- loaders would build FP8 layers for
    bf16 weights) is not the clean copy. Measured before the fix: exit 0 both ways, both cases."""
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsFile, SafetensorsWriter
    from paddleformers_glm.parity.ckpt_check import check_checkpoints

    bf16 = tmp_path / "bf16"
    assert _cli("convert", src, bf16, "--to", "hf", "--quantization", "none", "--max-shard-size", "600KB") == 0
    assert check_checkpoints(str(src), str(bf16))["exit_code"] == 0  # the clean copy
    if leftover == "scale tensor":
        idx_p, src_idx = bf16 / "model.safetensors.index.json", src / "model.safetensors.index.json"
        idx, src_map = json.loads(idx_p.read_text()), json.loads(src_idx.read_text())["weight_map"]
        scale = next(k for k in sorted(src_map) if k.endswith("_scale_inv"))
        shard = bf16 / sorted(set(idx["weight_map"].values()))[0]
        tensors = {}  # name -> (safetensors dtype, raw values; bf16 as its bits): no torch needed
        for file, names in ((shard, None), (src / src_map[scale], [scale])):
            with SafetensorsFile(file) as f:
                tensors |= {k: (f.tensors[k].dtype, f.numpy(k).copy()) for k in names or f.keys()}
        writer = SafetensorsWriter(str(shard), [(k, d, a.shape) for k, (d, a) in tensors.items()], {"format": "pt"})
        for k, (d, a) in tensors.items():
            writer.write(k, a, d)
        writer.close()
        idx["weight_map"][scale] = shard.name
        idx["metadata"].pop("total_size", None)
        idx_p.write_text(json.dumps(idx))
    else:
        cfg = json.loads((bf16 / "config.json").read_text())
        cfg["quantization_config"] = json.loads((src / "config.json").read_text())["quantization_config"]
        (bf16 / "config.json").write_text(json.dumps(cfg))
    for ref, cand in ((src, bf16), (bf16, src)):
        rep = check_checkpoints(str(ref), str(cand))
        assert rep["exit_code"] == 1, (leftover, ref.name, rep["counts"], rep["differences"][:2])
        if leftover == "scale tensor":
            (d,) = [d for d in rep["differences"] if d["class"] == "structural"]
            assert d["key"] == scale and "unquantized" in d["what"]
        else:
            assert rep["config_match"] is False
            assert {"class": "config", "keys": ["quantization_config"]} in rep["differences"]


# --- the fast quantizer is byte for byte the one before it (tests/_fp8_oracle.py) -------------------------


def _boundary_float32s() -> np.ndarray:
    """Every float32 whose low 16 bits are 0, 1, 0x7FFF, 0x8000 or 0xFFFF (every rounding boundary of
    E4M3 and both sides of it, the whole range: subnormals, 448 .. 480, Inf, NaN of both signs and many
    payloads), and a million random bit patterns."""
    high = np.arange(1 << 16, dtype=np.uint32) << 16
    rnd = np.random.default_rng(7).integers(0, 1 << 32, size=1 << 20, dtype=np.uint64).astype(np.uint32)
    return np.concatenate([high | low for low in (0, 1, 0x7FFF, 0x8000, 0xFFFF)] + [rnd]).view(np.float32)


def test_encode_e4m3_is_the_search_encoder_byte_for_byte():
    from paddleformers_glm.checkpoint.fp8 import _encode_search

    from ._fp8_oracle import encode_e4m3 as oracle

    x = _boundary_float32s()
    with np.errstate(invalid="ignore"):
        want = oracle(x)
    got = encode_e4m3(x)
    assert got.dtype == np.uint8 and got.shape == x.shape
    assert np.array_equal(got, want), int((got != want).sum())
    assert np.array_equal(_encode_search(x), want)
    # shapes, strides and dtypes as before: 2-D, a transposed view, float64 and bf16-valued input
    m = x[: 600 * 700].reshape(600, 700)
    with np.errstate(invalid="ignore", over="ignore"):
        m64 = m.astype(np.float64)
    for arr in (m, m.T, m[::3, 1::2], m64):
        with np.errstate(invalid="ignore", over="ignore"):
            assert np.array_equal(encode_e4m3(arr), oracle(arr))
    assert encode_e4m3(np.zeros((0, 3), np.float32)).shape == (0, 3)


@pytest.mark.reference
def test_encode_e4m3_is_torchs_float8_e4m3fn_cast():
    torch = pytest.importorskip("torch")
    x = _boundary_float32s()
    want = torch.from_numpy(x).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
    # beyond 464 in magnitude (Inf too) torch 2.13 saturates to +-448 where the encoder gives the NaN
    # code: quantize_blocks meets that only for an Inf weight (its w / scale is at most ~448 otherwise)
    within = ~(np.abs(x) > 464)  # NaN included
    got = encode_e4m3(x)
    assert np.array_equal(got[within], want[within]), int((got != want)[within].sum())


def _bf16(a: np.ndarray) -> np.ndarray:
    """float32 rounded to bfloat16 (nearest, ties to even) and back, as a bf16 model's weights are."""
    b = a.astype(np.float32).view(np.uint32).astype(np.uint64)
    b = (b + 0x7FFF + ((b >> 16) & 1)) >> 16 << 16
    return b.astype(np.uint32).view(np.float32)


def _requant_inputs(rng, shape, block):
    """Weights of the kinds the quantizer meets: fresh (normal, bf16-rounded, tiny down to float32
    subnormals, huge up to float32 max), sparse and all-zero blocks, and dequantized FP8 at fp32 scales
    of three makings (``amax / 448``, arbitrary, and transformers' ``1 / (448 / amax)``)."""
    rows, cols = shape
    R, C = math.ceil(rows / block[0]), math.ceil(cols / block[1])
    normal = rng.standard_normal(shape).astype(np.float32)
    out = {
        "normal": normal * np.float32(0.02),
        "bf16": _bf16(normal * np.float32(0.02)),
        "tiny": normal * np.float32(1e-41),  # float32 subnormals; some scales underflow to 0
        "small": normal * np.float32(1e-36),
        "huge": np.clip(normal, -3, 3) * np.float32(1e38),
        "max": np.where(normal > 0, np.float32(3.4028235e38), normal),
        "sparse": np.where(rng.random(shape) < 0.9, np.float32(0), normal),
        "zeros": np.zeros(shape, np.float32),
        "neg_zeros": np.full(shape, -0.0, np.float32),
    }
    z = normal.copy()
    z[: block[0]] = 0  # first row blocks all zero (the all-zero block's scale 1), first rows of others
    z[block[0] :: block[0]] = 0
    out["zero_first_rows"] = z
    q = rng.integers(0, 256, size=shape, dtype=np.uint8)
    q[(q & 0x7F) == 0x7F] ^= 1  # no NaN codes
    q[:: block[0], :: block[1]] = 0x7E  # 448 in each block: amax = 448 * scale
    amax = rng.uniform(1e-3, 8, size=(R, C)).astype(np.float32)
    for name, s in (
        ("fp8_amax448", (amax / np.float32(448)).astype(np.float32)),
        ("fp8_any_scale", rng.uniform(1e-4, 1e-1, size=(R, C)).astype(np.float32)),
        ("fp8_hf_scale", (np.float32(1) / (np.float32(448) / amax)).astype(np.float32)),
    ):
        out[name] = dequantize(q, s, block)
    # transformers' own quantizer (integrations/finegrained_fp8.py, _quantize_one): codes of
    # clamp(w * (448 / amax), +-448), scale_inv 1 / (448 / amax); padded here for the partial blocks
    pad = np.pad(out["normal"], ((0, R * block[0] - rows), (0, C * block[1] - cols)))
    tiles = pad.reshape(R, block[0], C, block[1])
    mult = (np.float32(448) / np.abs(tiles).max(axis=(1, 3))).astype(np.float32)
    qt = encode_e4m3(np.clip(tiles * mult[:, None, :, None], -448, 448)).reshape(pad.shape)[:rows, :cols]
    out["fp8_hf_made"] = dequantize(qt, (np.float32(1) / mult).astype(np.float32), block)
    qr = q.copy()
    qr[::3] = rng.integers(0, 0x30, size=qr[::3].shape, dtype=np.uint8)  # no 448 in some blocks
    out["fp8_no_448"] = dequantize(qr, rng.uniform(1e-4, 1e-1, size=(R, C)).astype(np.float32), block)
    # Inf, NaN (several payloads and signs in one block), and values beyond 448 * scale
    special = normal.copy()
    nan = np.array([0x7FC00000, 0xFFC00000, 0x7F800001, 0x7FC12345], np.uint32).view(np.float32)
    special.flat[rng.integers(0, special.size, 8)] = np.repeat(nan, 2)
    special.flat[rng.integers(0, special.size, 3)] = [np.inf, -np.inf, np.float32(500)]
    out["nan_inf"] = special
    return out


from paddleformers_glm.checkpoint.fp8 import dequantize  # noqa: E402


@pytest.mark.parametrize(
    ("shape", "block", "chunk"),
    [
        ((130, 200), (128, 128), None),
        ((203, 130), (8, 8), None),
        ((203, 130), (8, 8), 4096),  # many chunks, partial last ones both ways
        ((256, 384), (128, 128), 1 << 17),  # one block a chunk
        ((300, 17), (16, 4), 2048),
        ((17, 300), (4, 16), None),
        ((1, 1), (128, 128), None),
        ((5, 7), (1, 1), None),
        ((64, 96), (32, 32), 8192),
    ],
)
def test_quantize_blocks_is_byte_identical_to_the_old_quantizer(shape, block, chunk, monkeypatch):
    from paddleformers_glm.checkpoint import fp8

    from ._fp8_oracle import quantize_blocks as oracle

    if chunk is not None:
        monkeypatch.setattr(fp8, "_CHUNK_BYTES", chunk)
    rng = np.random.default_rng(hash((shape, block)) % 2**32)
    kinds = _requant_inputs(rng, shape, block)
    moved = 0  # blocks of dequantized FP8 whose scale is not amax / 448: the neighbour searches ran
    for name, w in kinds.items():
        for arr in (w, w.T.copy().T) if name == "normal" else (w,):  # C- and Fortran-ordered
            want_q, want_s = oracle(arr, block)
            with np.errstate(all="ignore"):
                q, s = fp8.quantize_blocks(arr, block)
            assert q.dtype == np.uint8 and s.dtype == np.float32 and q.shape == shape, name
            assert np.array_equal(q, want_q), (name, int((q != want_q).sum()))
            assert np.array_equal(s.view(np.uint32), want_s.view(np.uint32)), name
        if name.startswith("fp8"):
            amax = np.abs(np.pad(w, [(0, -d % b) for d, b in zip(shape, block)]))
            amax = amax.reshape(s.shape[0], block[0], s.shape[1], block[1]).max(axis=(1, 3))
            moved += int((s != (amax / np.float32(448)).astype(np.float32)).sum())
    if shape[0] * shape[1] >= 4096:
        assert moved > 0  # the one-ulp neighbours were needed somewhere


def test_quantize_blocks_empty_and_float64():
    from paddleformers_glm.checkpoint.fp8 import quantize_blocks

    from ._fp8_oracle import quantize_blocks as oracle

    for shape in ((0, 5), (5, 0), (0, 0)):
        q, s = quantize_blocks(np.zeros(shape, np.float32), (4, 4))
        wq, ws = oracle(np.zeros(shape, np.float32), (4, 4))
        assert q.shape == wq.shape and s.shape == ws.shape and q.dtype == wq.dtype and s.dtype == ws.dtype
    w = np.random.default_rng(3).standard_normal((40, 50))
    for a, b in zip(quantize_blocks(w, (16, 16)), oracle(w, (16, 16))):
        assert np.array_equal(a.view(np.uint8), b.view(np.uint8))
