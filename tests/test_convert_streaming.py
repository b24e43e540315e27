"""`glm52 convert` streams a layer at a time and writes exactly what a whole-model pass writes.

The whole-model pass (the convert before it streamed: one dict of every tensor, loaded, then saved,
:func:`_whole_model_convert`) is the reference: every mode (--to fleet per-expert / grouped /
stacked, --to hf, --quantization fp8 and none, --dtype, --max-shard-size, an FP8 or Fleet-layout
source, carried tokenizer files) gives the same bytes, every bad input the same refusal. A failure
part way leaves the old output as it was. And the memory: converting a 66.5 MB bf16 checkpoint of 12
layers, the streaming pass's peak RSS rose 7.5 MB above its start, the whole-model pass's 80 MB (more
than the model; at 744B that is 1.5 TB), measured as tests/test_memory_budget.py does (VmHWM reset
through /proc/self/clear_refs).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from paddleformers_glm.checkpoint import CheckpointError, load_pretrained_state, save_pretrained_state
from paddleformers_glm.checkpoint import convert as convert_mod
from paddleformers_glm.checkpoint.convert import convert_checkpoint, empty_state
from paddleformers_glm.checkpoint.loader import load_config_for
from tests._dist.runner import ROOT, env

TINY = ROOT / "tests/fixtures/tiny/checkpoint"
TINY_FP8 = ROOT / "tests/fixtures/tiny_fp8/checkpoint"


def _whole_model_convert(src, out, layout="fleet", dtype=None, max_shard_size="5GB", quantization=None, **kw):
    """What convert_checkpoint did before it streamed: the whole model loaded, then saved."""
    src = os.fspath(src)
    config = load_config_for(os.path.abspath(src))
    work = "float32" if quantization not in (None, "none") else dtype or config.model_dtype
    state = empty_state(config, work)
    load_pretrained_state(state, src, dtype=work, config=config)
    return save_pretrained_state(
        state,
        config,
        out,
        layout=layout,
        max_shard_size=max_shard_size,
        dtype=dtype or config.model_dtype,
        quantization=quantization,
        carry_from=src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)),
        **kw,
    )


def _files(d: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(d.iterdir())}


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory) -> Path:
    """The tiny fixture with a tokenizer and generation config to carry."""
    d = tmp_path_factory.mktemp("src") / "tiny"
    shutil.copytree(TINY, d)
    (d / "tokenizer_config.json").write_text('{"model_max_length": 128}')
    (d / "generation_config.json").write_text('{"do_sample": false}')
    return d


CASES = {
    "fleet-per-expert-sharded": ("tiny", dict(layout="fleet", max_shard_size="300KB")),
    "fleet-grouped": ("tiny", dict(layout="fleet", expert_layout="grouped")),
    "fleet-stacked-float32": ("tiny", dict(layout="fleet", expert_layout="stacked", dtype="float32")),
    "hf-quantize-fp8-sharded": ("tiny", dict(layout="hf", quantization="fp8", max_shard_size="100KB")),
    "fp8-dequantize-to-hf": ("fp8", dict(layout="hf", quantization="none")),
    "fp8-to-fleet-float16": ("fp8", dict(layout="fleet", dtype="float16", max_shard_size="1MB")),
}


@pytest.mark.parametrize("case", CASES)
def test_streaming_convert_writes_the_bytes_of_a_whole_model_pass(case, tiny_with_tokenizer, tmp_path):
    which, kw = CASES[case]
    src = tiny_with_tokenizer if which == "tiny" else TINY_FP8
    rep = convert_checkpoint(src, tmp_path / "new", **kw)
    ref = _whole_model_convert(src, tmp_path / "old", **kw)
    new, old = _files(tmp_path / "new"), _files(tmp_path / "old")
    assert list(new) == list(old)
    assert [k for k in new if new[k] != old[k]] == []
    assert (rep.tensors, rep.total_size, [Path(f).name for f in rep.files]) == (
        ref.tensors,
        ref.total_size,
        [Path(f).name for f in ref.files],
    )
    if which == "tiny":
        assert {"tokenizer_config.json", "generation_config.json"} <= set(new)


def test_streaming_convert_from_a_fleet_layout_source(tmp_path):
    convert_checkpoint(TINY, tmp_path / "fleet", layout="fleet", expert_layout="grouped", max_shard_size="400KB")
    convert_checkpoint(tmp_path / "fleet", tmp_path / "new", layout="hf", max_shard_size="700KB")
    _whole_model_convert(tmp_path / "fleet", tmp_path / "old", layout="hf", max_shard_size="700KB")
    assert _files(tmp_path / "new") == _files(tmp_path / "old")


def test_a_folder_without_the_mtp_layer_converts_as_a_whole_model_pass(tmp_path, caplog):
    """A transformers-saved folder (no MTP tensors): the MTP layer, initialised as HF does (seeded by
    key name), is the same in the layer it is loaded in. Each warning of the checkpoint is said once,
    though every layer batch is a load of its own: the MTP one (which one batch says) and one every
    batch says (trailing bytes after a shard's last tensor; measured without the filter: 10 times
    here)."""
    import logging

    from tests.test_checkpoint_roundtrip import _read_all, _rewrite

    src = tmp_path / "src"
    shutil.copytree(TINY, src)
    _rewrite(src, drop=[k for k in _read_all(src) if k.startswith("model.layers.8.")])
    with open(sorted(src.glob("*.safetensors"))[0], "ab") as f:
        f.write(b"\0" * 8)
    caplog.set_level(logging.WARNING)
    convert_checkpoint(src, tmp_path / "new", layout="fleet")
    assert sum("has no MTP weights" in r.getMessage() for r in caplog.records) == 1
    assert sum("trailing garbage" in r.getMessage() for r in caplog.records) == 1
    _whole_model_convert(src, tmp_path / "old", layout="fleet")
    assert _files(tmp_path / "new") == _files(tmp_path / "old")


def test_bad_inputs_are_refused_with_the_whole_model_pass_message(tmp_path):
    """Every damaged checkpoint of test_checkpoint_bad_inputs: the same error, nothing written."""
    from tests.test_checkpoint_bad_inputs import CASES as DAMAGES

    for damage in DAMAGES:
        src = tmp_path / damage.__name__ / "src"
        shutil.copytree(TINY, src)
        damage(src)
        messages = []
        for fn in (convert_checkpoint, _whole_model_convert):
            with pytest.raises(CheckpointError) as ei:
                fn(src, src.parent / "out", layout="fleet")
            messages.append(str(ei.value))
        assert messages[0] == messages[1], damage.__name__
        assert sorted(p.name for p in src.parent.iterdir()) == ["src"], damage.__name__


def test_a_failure_part_way_leaves_the_old_output(tmp_path, monkeypatch):
    out = tmp_path / "out"
    convert_checkpoint(TINY, out, layout="fleet", max_shard_size="300KB")
    before = _files(out)
    calls = []
    real = convert_mod.load_pretrained_state

    def failing(state, *a, **kw):
        calls.append(len(state))
        if len(calls) == 4:  # the plan, the global tensors, layers 0 and 1 done: layer 2 fails
            raise OSError(28, "No space left on device")
        return real(state, *a, **kw)

    monkeypatch.setattr(convert_mod, "load_pretrained_state", failing)
    with pytest.raises(OSError):
        convert_checkpoint(TINY, out, layout="hf", quantization="fp8")
    assert len(calls) == 4
    assert _files(out) == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]  # no temporary folder left


_MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    sys.path.insert(0, sys.argv[3])
    from tests.test_convert_streaming import _whole_model_convert
    from paddleformers_glm.checkpoint.convert import convert_checkpoint

    def rss():
        out = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            out[k] = int(v.split()[0]) * 1024 if k in ("VmRSS", "VmHWM") else None
        return out

    src, out = sys.argv[1], sys.argv[2]
    convert_checkpoint(sys.argv[4], out + "-warm", layout="fleet")  # Paddle's first-use setup, not the model
    res = {}
    for name, fn in (("stream", convert_checkpoint), ("whole", _whole_model_convert)):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak mark back to the current RSS
        base = rss()["VmRSS"]
        fn(src, out + "-" + name, layout="fleet")
        res[name] = rss()["VmHWM"] - base
    print(json.dumps(res))
    """
)


@pytest.fixture(scope="module")
def twelve_layer_ckpt(tmp_path_factory) -> Path:
    """~66.5 MB of bf16 weights in 12 layers (11 MoE layers of 16 routed experts), each ~5 MB."""
    import numpy as np
    import paddle

    from paddleformers_glm.checkpoint import fleet_param_specs
    from paddleformers_glm.tiny import tiny_config

    n = 12
    config = tiny_config(
        hidden_size=256,
        n_routed_experts=16,
        moe_intermediate_size=192,
        intermediate_size=1024,
        num_hidden_layers=n,
        mlp_layer_types=["dense"] + ["sparse"] * (n - 1),
        first_k_dense_replace=1,
        indexer_types=None,
        vocab_size=2048,
    )
    rng = np.random.default_rng(0)
    state = {
        k: paddle.to_tensor(
            rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02) if len(shape) == 2 else np.ones(shape)
        ).astype("bfloat16")
        for k, (shape, _) in fleet_param_specs(config).items()
    }
    out = tmp_path_factory.mktemp("twelve") / "ckpt"
    save_pretrained_state(state, config, out, layout="hf", max_shard_size="20MB")
    return out


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_convert_holds_about_a_layer_not_the_model(twelve_layer_ckpt, tmp_path):
    model_bytes = sum(p.stat().st_size for p in twelve_layer_ckpt.glob("*.safetensors"))
    p = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(twelve_layer_ckpt), str(tmp_path / "out"), str(ROOT), str(TINY)],
        env={**env(), "GLM52_QUIET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    # streaming: about one layer (measured 7.5 MB; the whole-model convert it replaced: 81 MB)
    assert res["stream"] < model_bytes / 3, (res, model_bytes)
    # the control: the whole-model pass holds the model -- the measure sees it (measured 64.6 MB of
    # 66.5 MB; 80 MB while a load left the file pages fault-around mapped beside each tensor in RSS,
    # tests/test_load_pages.py)
    assert res["whole"] > model_bytes * 2 / 3, (res, model_bytes)
    assert _files(tmp_path / "out-stream") == _files(tmp_path / "out-whole")


def test_unit_lists_are_built_once_per_conversion(monkeypatch, tmp_path):
    """convert's per-layer loads share one unit list (aoa.memo_units): built once per config and arguments,
    a fresh list each call, nothing kept after."""
    from paddleformers_glm.checkpoint import aoa

    config = load_config_for(str(TINY))
    built = []
    real = aoa._checkpoint_units
    monkeypatch.setattr(aoa, "_checkpoint_units", lambda *a: built.append(a[1:]) or real(*a))
    with aoa.memo_units():
        a, b = aoa.checkpoint_units(config, "hf"), aoa.checkpoint_units(config, "hf")
        aoa.checkpoint_units(config, "fleet", "grouped")
        assert a == b and a is not b and built == [("hf", "per-expert", 1), ("fleet", "grouped", 1)]
    aoa.checkpoint_units(config, "hf")
    assert len(built) == 3
    built.clear()
    convert_checkpoint(TINY, tmp_path / "out", layout="fleet")
    assert built == [("hf", "per-expert", 1), ("fleet", "per-expert", 1)]


def test_a_convert_to_a_link_to_a_folder_writes_into_the_folder(tmp_path):
    """As a save (test_checkpoint_save_safety.py): ``out`` a symlink to a folder elsewhere is written
    through, the link kept. Before (the layer-by-layer convert took the path as it stood): the atomic
    exchange replaced the link by a real folder beside it and left the target as it was."""
    target = tmp_path / "big" / "ckpt"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    (tmp_path / "out").symlink_to(target)
    convert_checkpoint(TINY, tmp_path / "out", layout="fleet")
    assert (tmp_path / "out").is_symlink() and os.readlink(tmp_path / "out") == str(target)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["big", "out"]  # nothing left beside the link
    names = sorted(os.listdir(target))
    assert "notes.txt" in names and "model.safetensors" in names, names
    state = empty_state(load_config_for(str(TINY)), "float32")
    load_pretrained_state(state, tmp_path / "out")


def _poke_bf16(folder: Path, key: str, bits: int) -> None:
    """Overwrite the first element of the bf16 tensor ``key`` with the raw ``bits`` (from the raw header)."""
    import struct

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    file = folder / index["weight_map"][key]
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    at = 8 + n + json.loads(raw[8 : 8 + n])[key]["data_offsets"][0]
    raw[at : at + 2] = struct.pack("<H", bits)
    file.write_bytes(bytes(raw))


def test_a_source_holding_nan_or_a_weight_beyond_float16_is_refused(tmp_path):
    """Measured before: convert wrote a NaN weight through (exit 0; into FP8 the NaN spread over its
    whole 128 x 128 block), which from_pretrained, check-ckpt and train refuse; and ``--dtype float16``
    turned a finite bf16 1e6 into Inf silently, an output from_pretrained then refused. The same with
    ``quantization="none"``, which is no quantization (``None``), not a float32 pass that would let
    the 1e6 through to be written as Inf. A bf16 source is not told about FP8 scales it does not have."""
    key = "model.layers.0.self_attn.o_proj.weight"
    for bits, kw, says in (
        (0x7FC0, {}, "hold NaN or Inf"),  # bf16 NaN
        (0x4974, {"dtype": "float16"}, "beyond 65504"),  # bf16 ~1e6: finite
        (0x4974, {"dtype": "float16", "quantization": "none"}, "beyond 65504"),
    ):
        src = tmp_path / f"src{bits}"
        if not src.exists():
            shutil.copytree(TINY, src)
            _poke_bf16(src, key, bits)
        with pytest.raises(CheckpointError, match=says) as ei:
            convert_checkpoint(src, tmp_path / "out", layout="hf", **kw)
        assert ei.value.key == key and not (tmp_path / "out").exists()
        assert "scale" not in str(ei.value), str(ei.value)
    convert_checkpoint(src, tmp_path / "out", layout="hf")  # the finite 1e6 itself converts in bf16


def test_the_missing_mtp_warning_names_every_mtp_layer(tmp_path):
    """num_nextn_predict_layers=2 in a folder without MTP tensors (as transformers saves it): both
    MTP layers, 8 and 9, are initialised, and the warning said only model.layers.8.*."""
    import json

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from tests.test_checkpoint_roundtrip import _read_all, _rewrite

    src = tmp_path / "src"
    shutil.copytree(TINY, src)
    _rewrite(src, drop=[k for k in _read_all(src) if k.startswith("model.layers.8.")])
    cfg = json.loads((src / "config.json").read_text())
    (src / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 2}))
    _, report = GlmMoeDsaForCausalLM.from_pretrained(src, dtype="float32", output_loading_info=True)
    (msg,) = [w for w in report.warnings if "has no MTP weights" in w]
    assert "model.layers.8.* .. model.layers.9.*" in msg and "the MTP layers are initialised" in msg, msg
    assert {k.split(".")[2] for k in report.initialized} == {"8", "9"}


def test_a_warning_of_the_source_load_reaches_the_caller_once(tmp_path):
    """A Fleet source written with the legacy key spelling: its FutureWarning (convert it once, the
    spelling goes away) reaches the caller of convert exactly once, though every layer batch loads."""
    import warnings

    from paddleformers_glm import GlmMoeDsaConfig
    from paddleformers_glm.testing import SpecModel
    from tests.test_fleet_layouts import SRC, _write

    model = SpecModel(GlmMoeDsaConfig.from_pretrained(SRC), "float32")
    load_pretrained_state(model, SRC)
    _write(tmp_path / "old", dict(model.state_dict()))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        convert_checkpoint(tmp_path / "old", tmp_path / "out", layout="hf")
    legacy = [w for w in caught if issubclass(w.category, FutureWarning) and "model.lm_head.weight" in str(w.message)]
    assert len(legacy) == 1, [str(w.message)[:80] for w in caught]


def test_a_missing_source_path_is_refused_naming_it(tmp_path):
    """Not as a missing config.json of its parent folder (where the config loader looks for a file
    path's config), which sends the user looking in the wrong place."""
    shutil.copy(TINY / "config.json", tmp_path / "config.json")  # a parent that has one
    for missing in (tmp_path / "nope", tmp_path / "nope" / "model.safetensors"):
        with pytest.raises(CheckpointError, match="checkpoint path does not exist") as e:
            convert_checkpoint(missing, tmp_path / "out", layout="hf")
        assert e.value.file == str(missing)


def test_convert_of_an_fp8_source_with_a_nan_scale_names_the_scale_as_a_cause(tmp_path):
    """A NaN ``scale_inv`` of the block-FP8 fixture reaches convert as a NaN dequantized weight: the
    refusal names that weight and says a scale can cause it (the source holds FP8 tensors; a bf16
    source's refusal does not, test_a_source_holding_nan_or_a_weight_beyond_float16_is_refused);
    nothing is written."""
    import struct

    from paddleformers_glm.checkpoint.finite import NonFiniteError

    src = tmp_path / "src"
    shutil.copytree(ROOT / "tests" / "fixtures" / "tiny_fp8" / "checkpoint", src)
    key = "model.layers.0.self_attn.q_b_proj.weight"
    file = src / json.loads((src / "model.safetensors.index.json").read_text())["weight_map"][key + "_scale_inv"]
    raw = bytearray(file.read_bytes())
    (n,) = struct.unpack("<Q", raw[:8])
    at = 8 + n + json.loads(raw[8 : 8 + n])[key + "_scale_inv"]["data_offsets"][0]
    raw[at : at + 4] = struct.pack("<f", float("nan"))
    file.write_bytes(bytes(raw))
    with pytest.raises(NonFiniteError) as e:
        convert_checkpoint(src, tmp_path / "out", layout="hf")
    assert e.value.key == key and "a NaN/Inf scale_inv" in str(e.value), str(e.value)
    assert not (tmp_path / "out").exists()
