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
