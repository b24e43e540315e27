"""A step whose loss or gradients are not finite stops the run before the optimizer step (or is
skipped, on request): in one process here; with two ranks in test_train_dist.py.

Measured before the guard: ``--lr 1e10`` made the grad norm NaN from step 2 while the run went
on, exited 0 and exported NaN weights, and loss.json held bare ``NaN`` tokens."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paddleformers_glm.train.command import main as train_main
from paddleformers_glm.train.loop import TrainConfig, run_training
from paddleformers_glm.train.nonfinite import NonFiniteStep

TOY = ["--model", "toy", "--steps", "4", "--seq-len", "16", "--no-progress"]


def strict(path):
    """Parse with a parser that refuses NaN / Infinity, as strict JSON readers do."""

    def refuse(token):
        raise ValueError(f"{path}: not strict JSON: {token}")

    return json.loads(open(path, encoding="utf-8").read(), parse_constant=refuse)


@pytest.mark.parametrize(
    "flag, value",
    [
        ("--lr", "nan"),
        ("--lr", "inf"),
        ("--lr", "-1e-4"),
        ("--min-lr", "nan"),
        ("--clip-grad", "nan"),
        ("--weight-decay", "-inf"),
        ("--moe-bias-update-rate", "inf"),
        ("--moe-aux-loss-coeff", "nan"),
        ("--job-timeout", "nan"),
        ("--comm-timeout", "inf"),
        ("--comm-timeout", "0.0004"),  # PADDLE_PG_TIMEOUT is in whole ms: 0 there
    ],
)
def test_nonfinite_or_negative_float_flags_are_refused_with_one_line(tmp_path, capsys, flag, value):
    assert train_main([*TOY, "--out", str(tmp_path), f"{flag}={value}"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and err.startswith(f"glm52 train: error: {flag} must be"), err
    assert not (tmp_path / "loss.json").exists()


def test_lr_1e10_stops_before_the_update_with_a_failure_record_and_no_export(tmp_path, capsys):
    """The headline probe: exit non-zero at step 2, failure.json naming step, rank, quantity and
    the first non-finite gradient; no export; the step-1 checkpoint kept."""
    out = tmp_path / "out"
    rc = train_main([*TOY, "--out", str(out), "--lr", "1e10", "--save-every", "1", "--export"])
    assert rc == 1
    err = capsys.readouterr().err
    assert "glm52 train: step 2: non-finite" in err and "stopped before the optimizer step" in err, err
    rec = strict(out / "logs" / "failure.json")
    assert (rec["cause"], rec["step"], rec["rank"]) == ("nonfinite", 2, 0), rec
    assert rec["quantity"] and rec["first_nonfinite_grad"]["name"] and rec["first_nonfinite_grad"]["rank"] == 0
    assert rec["last_checkpoint"].endswith("step_00000001")
    assert not (out / "export").exists()
    assert (out / "checkpoints" / "latest").read_text().strip() == "step_00000001"
    assert not (out / "checkpoints" / "step_00000002").exists()
    assert strict(out / "loss.json")["steps"] == 1  # the last good step's record stays


def _cfg(out, **kw):
    base = dict(model="toy", steps=3, seq_len=16, global_batch_size=4, micro_batch_size=2, lr=2e-3, seed=3,
                progress=False, out=str(out), export=True, min_lr=2e-3)  # fmt: skip
    return TrainConfig(**{**base, **kw})


def _export(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "export" / "model.safetensors"))


def test_skipped_step_leaves_the_weights_untouched_and_is_flagged_in_strict_json(tmp_path):
    """Step 2's gradients are NaN (fault); with one skip allowed, a 2-step run ends with exactly
    the weights of a 1-step run (constant lr), and loss.json says what happened in strict JSON."""
    skip = run_training(_cfg(tmp_path / "skip", steps=2, skip_nonfinite_steps=1, fault="rank=0,step=2,kind=nan"))
    rec = strict(tmp_path / "skip" / "loss.json")
    assert rec["skipped_steps"] == [2] and rec["grad_norms"][1] is None and rec["nonfinite"] == ["grad_norms[1]"]
    assert all(x is not None for x in rec["losses"])  # the fault poisons gradients, not the reported loss
    assert np.isnan(skip["grad_norms"][1])  # in memory it stays what it was
    one = run_training(_cfg(tmp_path / "one", steps=1))
    assert one["losses"][0] == rec["losses"][0]
    a, b = _export(tmp_path / "skip"), _export(tmp_path / "one")
    assert set(a) == set(b)
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_the_step_after_the_allowed_skips_stops_the_run(tmp_path):
    with pytest.raises(NonFiniteStep, match=r"step 3: non-finite grad norm .* 1 earlier step\(s\) skipped: \[2\]"):
        run_training(_cfg(tmp_path, skip_nonfinite_steps=1, fault="rank=0,step=2,kind=nan;rank=0,step=3,kind=nan"))
    assert not (tmp_path / "export").exists()
