"""The torch reference trainer's own step rules, pinned without the Paddle trainer, so that a change
in parity/reference/train.py that both sides of ``glm52 align`` would not notice, or that align's
tolerances swallow, fails here: the learning-rate schedule is Paddle's; the step-1 dump is exactly
one clipped, bias-corrected, decoupled-decay AdamW step of the checkpoint with the dumped (pre-clip)
gradient, the router biases moved by exactly +-rate (idle experts: +rate); in bf16 the weights the
forward uses are the fp32 masters rounded after every update, and the micro-batches' gradients are
summed; and the settings glm52 train refuses are refused here too.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest

from tests._reference import missing_reference_extra
from tests.test_align import _bf16, assert_one_adamw_step


@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra()))
@pytest.mark.parametrize("warmup,total", [(0, 5), (1, 3), (3, 10), (10, 10), (12, 10), (4, 5)])
def test_reference_lr_at_is_the_trainers_schedule(warmup, total):
    """Every update's rate, warm-up and cosine phase alike, equals Paddle's LinearWarmup(Cosine)
    (train/optim.py) to the last few ulps, whatever the runs' length: the align tests mostly run
    inside the warm-up (10 of 10 steps), where a wrong cosine would not show."""
    from paddleformers_glm.parity.reference.train import lr_at as ref_lr_at
    from paddleformers_glm.train.optim import lr_at as pd_lr_at

    for step in range(1, total + 1):
        a, b = ref_lr_at(step, 1e-3, 1e-4, warmup, total), pd_lr_at(step, 1e-3, 1e-4, warmup, total)
        assert math.isclose(a, b, rel_tol=1e-12, abs_tol=1e-18), (step, a, b)


@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra()))
def test_reference_step1_dump_is_one_clipped_adamw_step_and_a_bias_update_of_rate(tmp_path):
    from safetensors.numpy import load_file

    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint
    from paddleformers_glm.parity.reference.train import lr_at, main
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    wd, clip, lr_max, rate = 0.1, 0.5, 1e-3, 0.01
    dump, out = tmp_path / "dump", tmp_path / "out"
    argv = ["--model", str(ckpt), "--out", str(out), "--steps", "3", "--seq-len", "16", "--global-batch-size", "2"]
    argv += ["--lr", str(lr_max), "--warmup-steps", "0", "--weight-decay", str(wd), "--clip-grad", str(clip)]
    argv += ["--seed", "3", "--moe-bias-update-rate", str(rate), "--dump-step", str(dump), "1"]
    assert main(argv) == 0
    res = json.loads((out / "loss.json").read_text())
    # the schedule recorded is the one stepped (cosine from update 1: warm-up 0)
    assert res["lrs"] == [lr_at(s, lr_max, lr_max / 10, 0, 3) for s in (1, 2, 3)]
    lr = res["lrs"][0]
    with Checkpoint(str(ckpt), strict=True) as ck:
        w0 = {k: ck.numpy(k) for k in ck.keys()}
    w0 = {k: (_bf16(v) if v.dtype == np.uint16 else v.astype(np.float32)) for k, v in w0.items()}
    d = {k: load_file(str(dump / k / "model.safetensors")) for k in ("grads", "exp_avg", "exp_avg_sq", "weights")}
    g = d["grads"]
    # the dumped gradients are the pre-clip ones whose norm loss.json records
    gnorm = math.sqrt(sum(float((v.astype(np.float64) ** 2).sum()) for v in g.values()))
    assert math.isclose(gnorm, res["grad_norms"][0], rel_tol=1e-9), (gnorm, res["grad_norms"][0])
    coef = min(1.0, clip / (gnorm + 1e-6))
    assert coef < 0.5  # the clip is active
    # the router biases: buffers, moved after the update by exactly +-rate or 0, idle experts +rate
    biases = [k for k in g if k.endswith("e_score_correction_bias")]
    assert biases
    moved = 0
    for k in biases:
        delta = d["weights"][k].astype(np.float64) - w0[k]
        assert np.all(np.isin(np.round(delta / rate, 5), (-1.0, 0.0, 1.0))), (k, delta)
        moved += int(np.count_nonzero(delta))
        assert not np.any(g[k]) and not np.any(d["exp_avg"][k])
    assert moved > 0
    idle = res["expert_load"]["idle_experts"][0]
    assert idle  # sequence 16: some expert got no token at step 1
    for layer, experts in idle.items():
        k = f"model.layers.{layer}.mlp.gate.e_score_correction_bias"
        np.testing.assert_allclose(d["weights"][k][experts] - w0[k][experts], rate, rtol=1e-5)
    # every trained tensor: one AdamW step, betas (0.9, 0.95), eps 1e-8, decay on >= 2-D only
    untouched = [k for k in g if ".indexer." in k or k in biases]
    for k in untouched:
        assert not np.any(g[k]) and not np.any(d["exp_avg"][k]) and not np.any(d["exp_avg_sq"][k]), k
        if k not in biases:
            assert np.array_equal(d["weights"][k], w0[k]), k
    assert_one_adamw_step(d, w0, sorted(set(g) - set(untouched)), coef, lr, wd)


BF16_ARGS = ["--seq-len", "16", "--global-batch-size", "4", "--lr", "1e-3", "--warmup-steps", "0", "--seed", "1"]
BF16_ARGS += ["--dtype", "bfloat16"]


@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra()))
def test_reference_bf16_weights_are_the_masters_rounded_after_each_update(tmp_path, monkeypatch):
    import torch
    from safetensors.torch import load_file

    import paddleformers_glm.parity.reference.train as rt
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    made = []

    class Spy(rt.Reference):
        def __init__(self, args):
            super().__init__(args)
            made.append(self)

    monkeypatch.setattr(rt, "Reference", Spy)
    dump = tmp_path / "d2"
    args = rt.parse_args(
        ["--model", str(ckpt), "--out", str(tmp_path / "o"), "--steps", "2", *BF16_ARGS, "--dump-step", str(dump), "2"]
    )
    rt.train(args)
    ref = made[0]
    master = load_file(str(dump / "weights" / "model.safetensors"))
    checked = 0
    for n, p in ref.named_parameters():
        if p.dtype != torch.bfloat16:
            continue
        for key, view in ref.official(n, p.detach()):
            want = master[key].to(torch.bfloat16)
            assert torch.equal(view.to(torch.bfloat16), want), key
            checked += 1
    assert checked > 50


@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra()))
def test_reference_bf16_micro_batches_sum_their_gradients(tmp_path):
    """One micro-batch of 4 rows vs 4 micro-batches of 1: the same step-1 gradient up to bf16
    rounding (measured well under 5%); keeping only the last micro-batch's gradient is ~50%+ off."""
    from safetensors.numpy import load_file

    from paddleformers_glm.parity.reference.train import main
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    grads = {}
    for mbs in (4, 1):
        d = tmp_path / f"d{mbs}"
        argv = ["--model", str(ckpt), "--out", str(tmp_path / f"o{mbs}"), "--steps", "1", *BF16_ARGS]
        assert main([*argv, "--micro-batch-size", str(mbs), "--dump-step", str(d), "1"]) == 0
        grads[mbs] = load_file(str(d / "grads" / "model.safetensors"))
    a, b = grads[4], grads[1]
    for k in ("model.embed_tokens.weight", "lm_head.weight", "model.layers.0.self_attn.q_a_proj.weight"):
        scale = float(np.abs(a[k]).max())
        assert scale > 0
        assert float(np.abs(a[k] - b[k]).max()) <= 0.05 * scale, k


def test_steps_below_one_and_attention_dropout_are_refused_before_the_model_loads(tmp_path, capsys):
    """``--steps 0`` ended in an UnboundLocalError after loading the model (glm52 train --steps 0
    evaluates only; align refuses it); ``attention_dropout: 0.1`` was trained with dropout, as
    transformers applies it in training mode (measured step-1 loss 5.575511 against 5.583435 at
    0.0), while glm52 train refuses it: the two runs would train different models."""
    from paddleformers_glm.parity.reference.train import config_error, parse_args
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = Path(make_tiny_checkpoint(tmp_path / "ckpt"))
    base = ["--model", str(ckpt), "--out", str(tmp_path / "o"), "--seq-len", "16", "--global-batch-size", "2"]
    with pytest.raises(SystemExit) as e:
        parse_args([*base, "--steps", "0"])
    assert e.value.code == 2 and "--steps must be at least 1" in capsys.readouterr().err
    assert config_error(parse_args([*base, "--steps", "1"])) is None
    cfg = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    (ckpt / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.1}), encoding="utf-8")
    why = config_error(parse_args([*base, "--steps", "1"]))
    assert why is not None and "`attention_dropout`: 0.1 is not applied in training" in why, why


@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra()))
def test_the_reference_command_refuses_attention_dropout_in_one_line_and_trains_nothing(tmp_path, capsys, monkeypatch):
    """The command itself (``main``), not only :func:`config_error`: one line, exit 2, no output folder,
    and the training never started."""
    import paddleformers_glm.parity.reference.train as rt
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = Path(make_tiny_checkpoint(tmp_path / "ckpt"))
    cfg = json.loads((ckpt / "config.json").read_text(encoding="utf-8"))
    (ckpt / "config.json").write_text(json.dumps({**cfg, "attention_dropout": 0.1}), encoding="utf-8")
    monkeypatch.setattr(rt, "train", lambda args: pytest.fail("the reference trained a model with dropout"))
    argv = ["--model", str(ckpt), "--out", str(tmp_path / "o"), "--steps", "1", "--seq-len", "16"]
    assert rt.main([*argv, "--global-batch-size", "2"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "`attention_dropout`: 0.1 is not applied in training" in err[0], err
    assert not (tmp_path / "o").exists()
