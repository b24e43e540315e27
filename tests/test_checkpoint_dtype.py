"""``dtype`` like the ecosystem: names, aliases and Paddle dtypes; ``"auto"`` is the config dtype where
the device computes it, else float32 with an info line; a stored dtype other than the config's is
shown in the load report."""

from __future__ import annotations

import logging
import pathlib

import numpy as np
import paddle
import pytest

from paddleformers_glm.checkpoint.loader import normalize_dtype
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
Q = "model.layers.0.self_attn.q_b_proj.weight"


def test_dtype_names_and_paddle_dtypes():
    assert [normalize_dtype(d) for d in (paddle.bfloat16, "bf16", "BFloat16", paddle.float32, "fp32", "half")] == [
        "bfloat16",
        "bfloat16",
        "bfloat16",
        "float32",
        "float32",
        "float16",
    ]
    with pytest.raises(ValueError, match="int8"):
        normalize_dtype("int8")
    m = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype=paddle.bfloat16)
    assert str(dict(m.named_parameters())[Q].dtype) == "paddle.bfloat16"


def test_auto_on_cpu_is_float32_with_an_info_line(caplog):
    assert paddle.device.get_device() == "cpu"
    caplog.set_level(logging.INFO)
    m = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE)  # dtype="auto"; the config says bfloat16
    assert str(dict(m.named_parameters())[Q].dtype) == "paddle.float32"
    msgs = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert any("dtype='auto'" in x and "bfloat16" in x and "float32" in x for x in msgs), msgs


def test_f16_checkpoint_where_bf16_is_expected_is_reported(tmp_path):
    from paddleformers_glm.cli import main

    f16 = tmp_path / "f16"
    assert main(["convert", str(FIXTURE), str(f16), "--to", "hf", "--dtype", "float16"]) == 0
    # convert's config says float16 (as transformers writes); a file whose config disagrees with its weights:
    cfg = f16 / "config.json"
    cfg.write_text(cfg.read_text().replace('"dtype": "float16"', '"dtype": "bfloat16"'))
    m, rep = GlmMoeDsaForCausalLM.from_pretrained(f16, dtype="bfloat16", output_loading_info=True)
    assert rep.dtype_changes[Q] == "F16 where bfloat16 is expected"
    assert "model.layers.3.mlp.gate.e_score_correction_bias" not in rep.dtype_changes  # F32 as the contract says
    assert any("F16 where bfloat16 is expected" in w for w in rep.warnings)
    ref = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype="bfloat16")
    a = dict(m.named_parameters())[Q].astype("float32").numpy()
    b = dict(ref.named_parameters())[Q].astype("float32").numpy()
    assert np.abs(a - b).max() <= np.abs(b).max() * 2.0**-8  # bf16 -> f16 -> bf16 loses at most bf16 rounding


def test_save_accepts_paddle_dtypes_and_aliases(tmp_path):
    import json

    m = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype="float32")
    m.save_pretrained(tmp_path / "a", dtype=paddle.float32)
    m.save_pretrained(tmp_path / "b", dtype="fp32")
    for d in ("a", "b"):
        f = tmp_path / d / "model.safetensors.index.json"
        shard = (
            tmp_path / d / json.loads(f.read_text())["weight_map"][Q]
            if f.exists()
            else tmp_path / d / "model.safetensors"
        )
        n = int.from_bytes(shard.read_bytes()[:8], "little")
        assert json.loads(shard.read_bytes()[8 : 8 + n])[Q]["dtype"] == "F32"


def _st_dtypes(folder: pathlib.Path) -> set[str]:
    import json

    out = set()
    for shard in folder.glob("*.safetensors"):
        n = int.from_bytes(shard.read_bytes()[:8], "little")
        head = json.loads(shard.read_bytes()[8 : 8 + n])
        head.pop("__metadata__", None)
        out |= {v["dtype"] for k, v in head.items() if not k.endswith("e_score_correction_bias")}
    return out


def test_saved_config_states_the_dtype_of_the_weights(tmp_path):
    """transformers 5.23 ``save_pretrained`` of a float32 / float16 model writes ``"dtype": "float32"`` /
    ``"float16"`` (measured), and its ``from_pretrained(dtype="auto")`` builds the model in that dtype: a
    config saying bfloat16 beside F32 weights (what ``save_pretrained(dtype="float32")`` and ``glm52
    convert --dtype float32`` wrote) made transformers load the export in bf16 and our own re-save
    write BF16, losing the precision the export was asked for."""
    import json
    import shutil

    from paddleformers_glm.checkpoint.distributed import save_pretrained_distributed
    from paddleformers_glm.cli import main

    source = json.loads((FIXTURE / "config.json").read_text())
    m = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype="float32")
    for dt, st in (("float32", "F32"), ("float16", "F16"), ("bfloat16", "BF16")):
        m.save_pretrained(tmp_path / dt, dtype=dt)
        cfg = json.loads((tmp_path / dt / "config.json").read_text())
        assert _st_dtypes(tmp_path / dt) == {st}
        assert cfg == {**source, "dtype": dt}, dt  # nothing else changes
    assert (tmp_path / "bfloat16" / "config.json").read_bytes() == (FIXTURE / "config.json").read_bytes()
    save_pretrained_distributed(m, tmp_path / "dist", dtype="float32")  # the trainer's export writer
    assert json.loads((tmp_path / "dist" / "config.json").read_text())["dtype"] == "float32"
    assert main(["convert", str(FIXTURE), str(tmp_path / "conv"), "--to", "hf", "--dtype", "float32", "--quiet"]) == 0
    assert json.loads((tmp_path / "conv" / "config.json").read_text())["dtype"] == "float32"
    # a re-save of the float32 export keeps float32 (it wrote BF16 before)
    GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "float32").save_pretrained(tmp_path / "again")
    assert _st_dtypes(tmp_path / "again") == {"F32"}
    # a file spelling it torch_dtype keeps that spelling
    old = tmp_path / "old"
    shutil.copytree(FIXTURE, old)
    (old / "config.json").write_text(json.dumps({("torch_dtype" if k == "dtype" else k): v for k, v in source.items()}))
    GlmMoeDsaForCausalLM.from_pretrained(old, dtype="float32").save_pretrained(tmp_path / "old32", dtype="float32")
    cfg = json.loads((tmp_path / "old32" / "config.json").read_text())
    assert cfg["torch_dtype"] == "float32" and "dtype" not in cfg


def test_save_pretrained_writes_the_models_dtype_as_transformers(tmp_path):
    """transformers 5.23: a model loaded with ``dtype=float32`` from a BF16 checkpoint and trained
    saves ``"dtype": "float32"`` and F32 tensors (measured). Ours wrote the config's BF16, rounding
    the trained weights silently (up to 1e-3 after one AdamW step, logits 3.6 apart on reload).
    ``dtype="auto"`` writes the dtype config.json states, the source's bytes again."""
    import json

    m = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype="float32")
    p = dict(m.named_parameters())[Q]
    p.set_value(p + 1e-4)  # a trained value bf16 cannot hold
    m.save_pretrained(tmp_path / "default")
    assert _st_dtypes(tmp_path / "default") == {"F32"}
    assert json.loads((tmp_path / "default" / "config.json").read_text())["dtype"] == "float32"
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "default", dtype="float32")
    for k, v in back.state_dict().items():
        assert np.array_equal(v.numpy(), m.state_dict()[k].numpy()), k
    m.save_pretrained(tmp_path / "auto", dtype="auto")
    assert _st_dtypes(tmp_path / "auto") == {"BF16"}
    assert (tmp_path / "auto" / "config.json").read_bytes() == (FIXTURE / "config.json").read_bytes()
    b16 = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype="bfloat16")
    b16.save_pretrained(tmp_path / "bf16")
    assert _st_dtypes(tmp_path / "bf16") == {"BF16"}


def test_a_config_without_a_dtype_key_gains_the_one_the_weights_were_written_in(tmp_path):
    """A config.json stating no dtype (the key is optional; the model then takes BF16): a save
    writes BF16 with ``dtype="auto"`` and must say so, as transformers 5.23's ``save_pretrained``
    always writes ``dtype`` (measured: a float32 model saves ``"dtype": "float32"``).  The saved
    config.json lacked the key, so a reader of the file alone could not tell the weights' dtype."""
    import json
    import shutil

    bare = tmp_path / "bare"
    shutil.copytree(FIXTURE, bare)
    cfg = json.loads((bare / "config.json").read_text())
    cfg.pop("dtype", None), cfg.pop("torch_dtype", None)
    (bare / "config.json").write_text(json.dumps(cfg))
    m = GlmMoeDsaForCausalLM.from_pretrained(bare, dtype="float32")
    m.save_pretrained(tmp_path / "auto", dtype="auto")
    assert _st_dtypes(tmp_path / "auto") == {"BF16"}
    assert json.loads((tmp_path / "auto" / "config.json").read_text()) == {**cfg, "dtype": "bfloat16"}
    m.save_pretrained(tmp_path / "f32")
    assert _st_dtypes(tmp_path / "f32") == {"F32"}
    assert json.loads((tmp_path / "f32" / "config.json").read_text()) == {**cfg, "dtype": "float32"}


def test_save_in_a_dtype_no_checkpoint_states_is_refused_before_writing(tmp_path):
    """``save_pretrained(dtype="float64")`` passed the name check and failed inside the AOA engine
    ("Unsupported cast dtype: float64"); now one line up front, nothing written."""
    m = GlmMoeDsaForCausalLM.from_pretrained(FIXTURE, dtype="float32")
    with pytest.raises(ValueError, match="'float64' is not a checkpoint dtype"):
        m.save_pretrained(tmp_path / "out", dtype="float64")
    assert not (tmp_path / "out").exists()
