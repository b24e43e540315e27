"""`glm52 check-ckpt` holds about a tensor (a mapping unit across layouts), not the model, when every
tensor differs: the documented use, a trained export against its source.

Before, a candidate in the other layout kept every differing tensor it mapped until the end (for its
max abs diff) and the same-layout and FP8 comparisons left every tensor they read mapped in the
process: comparing a 66.5 MB bf16 checkpoint of 12 layers with a perturbed copy of it, the peak RSS
rose 133.3 MB (same layout: both sides' pages), 81.7 MB (a PaddleFleet copy: the mapped candidate
tensors) and 100.8 MB (an FP8 copy): at 744B, 1.5 TB and more. Now 2.3, 1.5 and 2.1 MB. Measured as
tests/test_memory_budget.py does (VmHWM reset through /proc/self/clear_refs, after a first check
that sets Paddle up); the receipts did not change (tests/test_parity_ckpt.py and the others pin them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from tests._dist.runner import ROOT, env

_MEASURE = textwrap.dedent(
    """
    import gc, json, sys
    import numpy as np
    import paddle
    from paddleformers_glm.checkpoint import fleet_param_specs, save_pretrained_state
    from paddleformers_glm.checkpoint.convert import convert_checkpoint
    from paddleformers_glm.parity.ckpt_check import check_checkpoints
    from paddleformers_glm.tiny import tiny_config

    def rss():
        out = {}
        for line in open("/proc/self/status"):
            k, _, v = line.partition(":")
            out[k] = int(v.split()[0]) * 1024 if k in ("VmRSS", "VmHWM") else None
        return out

    tmp, tiny = sys.argv[1], sys.argv[2]
    n = 12
    config = tiny_config(hidden_size=256, n_routed_experts=16, moe_intermediate_size=192, intermediate_size=1024,
        num_hidden_layers=n, mlp_layer_types=["dense"] + ["sparse"] * (n - 1), first_k_dense_replace=1,
        indexer_types=None, vocab_size=2048)
    rng = np.random.default_rng(0)
    base = {k: rng.standard_normal(shape, dtype=np.float32) * np.float32(0.02) if len(shape) == 2
            else np.ones(shape, np.float32) for k, (shape, _) in fleet_param_specs(config).items()}
    save_pretrained_state({k: paddle.to_tensor(v).astype("bfloat16") for k, v in base.items()}, config,
                          tmp + "/ref", max_shard_size="20MB")
    trained = {k: paddle.to_tensor(v * np.float32(1.01) + np.float32(0.001)).astype("bfloat16") for k, v in base.items()}
    save_pretrained_state(trained, config, tmp + "/same", max_shard_size="20MB")
    save_pretrained_state(trained, config, tmp + "/fleet", layout="fleet", max_shard_size="20MB")
    save_pretrained_state(trained, config, tmp + "/fp8", max_shard_size="20MB", quantization="fp8")
    del base, trained
    convert_checkpoint(tiny, tmp + "/warm", layout="fleet")
    check_checkpoints(tiny, tmp + "/warm", "fleet")  # Paddle's first-use setup, not the model
    res = {}
    for name, layout in (("same", None), ("fleet", "fleet"), ("fp8", None)):
        gc.collect()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # the peak mark back to the current RSS
        before = rss()["VmRSS"]
        r = check_checkpoints(tmp + "/ref", tmp + "/" + name, layout)
        res[name] = rss()["VmHWM"] - before
        res[name + "_value"] = r["counts"]["value"]
    res["model_bytes"] = sum(f["bytes"] for f in r["ref"]["files"] if f["file"].endswith(".safetensors"))
    print(json.dumps(res))
    """
)


@pytest.mark.skipif(not os.path.exists("/proc/self/clear_refs"), reason="needs Linux's peak-RSS reset")
def test_check_ckpt_of_a_trained_export_holds_a_tensor_not_the_model(tmp_path):
    p = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(tmp_path), str(ROOT / "tests/fixtures/tiny/checkpoint")],
        env={**env(), "GLM52_QUIET": "1"},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    assert res["same_value"] == res["fleet_value"] == res["fp8_value"] == 793, res  # every tensor differs
    for case in ("same", "fleet", "fp8"):  # measured 2.3, 1.5, 2.1 MB; before 133.3, 81.7, 100.8 MB
        assert res[case] < res["model_bytes"] / 3, (case, res)
