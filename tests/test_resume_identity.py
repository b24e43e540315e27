"""A resume continues the saved run's *model*, its loss.json keeps the saved run's non-finite flags,
and glm52 train names ``--seq-len`` when it refuses one token.

Before: a state resumed with ``--model`` pointing at a copy whose config.json differed (routed_scaling_factor,
rms_norm_eps, rope_theta) ran with exit 0 and other losses (steps 3-4: 5.559081 / 5.543530 for the
uninterrupted 5.571789 / 5.545512) and ``--export`` shipped the other config; a toy state resumed with a
checkpoint ``--model`` was refused as other *data*, and with ``--resume-override data`` failed in the
worker with a KeyError; a resumed loss.json wrote the saved run's skipped-step nulls without listing them
under ``nonfinite``; ``--seq-len 1`` was refused as "seq_len must be >= 2", and only at the inputs.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from paddleformers_glm.train.command import main as train_main
from paddleformers_glm.train.command import train_line_error
from paddleformers_glm.train.loop import TrainConfig, run_training

STEP2 = "step_00000002"


def _run(out: Path, **kw) -> dict:
    base = dict(steps=3, seq_len=16, global_batch_size=2, micro_batch_size=1, progress=False, save_every=2)
    return run_training(TrainConfig(**{"model": "toy", **base, "out": str(out), **kw}))


def _errors(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if "error" in ln]


@pytest.fixture(scope="module")
def toy_state(tmp_path_factory) -> Path:
    """The step-2 state of a three-step toy run (in process)."""
    out = tmp_path_factory.mktemp("toy")
    _run(out)
    return out / "checkpoints" / STEP2


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory) -> tuple[Path, Path, Path]:
    """(tiny checkpoint, a copy with another routed_scaling_factor / rms_norm_eps / rope_theta, the
    step-2 state of a three-step run of the first)."""
    from paddleformers_glm.tiny import make_tiny_checkpoint

    root = tmp_path_factory.mktemp("tiny")
    ckpt = Path(make_tiny_checkpoint(root / "ckpt"))
    other = root / "other"
    shutil.copytree(ckpt, other)
    cfg = json.loads((other / "config.json").read_text())
    cfg.update(routed_scaling_factor=1.0, rms_norm_eps=1e-2)
    cfg["rope_parameters"]["rope_theta"] = 10000
    (other / "config.json").write_text(json.dumps(cfg, indent=1))
    _run(root / "out", model="glm", model_args={"model_dir": str(ckpt)})
    return ckpt, other, root / "out" / "checkpoints" / STEP2


def test_a_resume_with_another_model_config_is_refused_before_launch(tiny_pair, tmp_path, capsys):
    """Exit 2, one line naming the state, each differing key with its saved and new value, and the
    override; ``--resume-override model`` lets it through, the same model resumes as before."""
    from paddleformers_glm.train.settings import check_resume_run
    from paddleformers_glm.train.state_files import read_meta

    ckpt, other, state = tiny_pair
    meta = read_meta(str(state))
    assert meta["model"]["kind"] == "glm" and len(meta["model"]["sha256"]) == 64
    line = ["--seq-len", "16", "--steps", "3", "--global-batch-size", "2", "--no-progress", "--resume", str(state)]
    assert train_main([*line, "--model", str(other), "--out", str(tmp_path / "o")]) == 2
    (err,) = _errors(capsys)
    assert f"--resume {state}: this run's --model {other} differs" in err, err
    for said in ("rms_norm_eps saved 1e-05, now 0.01", "rope_parameters.rope_theta saved 8000000, now 10000",
                 "routed_scaling_factor saved 2.5, now 1.0", "--resume-override model"):  # fmt: skip
        assert said in err, (said, err)
    assert not (tmp_path / "o").exists()  # refused before anything was made

    def cfg(model_dir: Path, override: list[str]) -> TrainConfig:
        return TrainConfig(model="glm", model_args={"model_dir": str(model_dir)}, steps=3, seq_len=16,
                           global_batch_size=2, resume=str(state), resume_override=override)  # fmt: skip

    check_resume_run(cfg(other, ["model"]), str(state), meta)  # overridden on purpose
    check_resume_run(cfg(ckpt, []), str(state), meta)  # the saved run's model


def test_a_toy_state_resumed_with_a_checkpoint_is_refused_naming_the_model(toy_state, tiny_pair, tmp_path, capsys):
    """Refused before launch as another model, not as other data, and not overridable (its tensors are
    another model's): before, ``--resume-override data`` let it fail in the worker with a KeyError."""
    ckpt = tiny_pair[0]
    line = ["--model", str(ckpt), "--seq-len", "16", "--steps", "3", "--global-batch-size", "2", "--no-progress"]
    for override in ([], ["--resume-override", "data"], ["--resume-override", "data,model"]):
        rc = train_main([*line, "--resume", str(toy_state), *override, "--out", str(tmp_path / "o")])
        (err,) = _errors(capsys)
        assert rc == 2 and f"--resume {toy_state}: the state is of the toy model, this run's --model is" in err, err
        assert "other samples" not in err


def test_a_toy_state_with_another_toy_config_is_refused(toy_state):
    err = train_line_error(
        ["--model", "toy", "--model-config", '{"rms_eps": 0.001}', "--seq-len", "16", "--steps", "3",
         "--global-batch-size", "2", "--resume", str(toy_state)]
    )  # fmt: skip
    assert err is not None and "rms_eps saved 1e-06, now 0.001" in err, err


def test_a_state_saved_before_the_model_was_recorded_still_resumes_with_a_note(toy_state, tmp_path, capsys):
    old = tmp_path / STEP2
    shutil.copytree(toy_state, old)
    meta = json.loads((old / "meta.json").read_text())
    del meta["model"]
    (old / "meta.json").write_text(json.dumps(meta))
    got = _run(tmp_path / "out", save_every=0, resume=str(old))
    assert got["run"]["resumed_from_step"] == 2 and len(got["losses"]) == 3
    assert "the state records no model identity" in capsys.readouterr().out


def test_a_resumed_loss_json_lists_the_saved_runs_nonfinite_entries(tmp_path):
    """Step 2 skipped for a NaN gradient (its grad norm written as null, listed in meta.json), resumed:
    loss.json lists the null of the resumed history too (docs/failure-modes.md, "Strict JSON")."""
    _run(tmp_path / "a", fault="rank=0,step=2,kind=nan", skip_nonfinite_steps=1)
    state = tmp_path / "a" / "checkpoints" / STEP2
    saved = json.loads((state / "meta.json").read_text())["nonfinite"]
    assert "history.grad_norms[1]" in saved, saved
    _run(tmp_path / "b", save_every=0, resume=str(state), skip_nonfinite_steps=1)
    doc = json.loads((tmp_path / "b" / "loss.json").read_text())
    assert doc["grad_norms"][1] is None and doc["skipped_steps"] == [2]
    nulls = {f"{k}[{i}]" for k in ("losses", "mtp_losses", "grad_norms") for i, v in enumerate(doc[k]) if v is None}
    assert nulls and nulls <= set(doc["nonfinite"]), (nulls, doc["nonfinite"])
    assert {p.removeprefix("history.") for p in saved} <= set(doc["nonfinite"])


def test_seq_len_1_is_refused_naming_the_flag():
    """Before any file is read (train_line_error reads none), in the flag's name."""
    err = train_line_error(["--model", "toy", "--seq-len", "1"])
    assert err is not None and err.startswith("--seq-len must be >= 2"), err
    assert train_line_error(["--model", "toy", "--seq-len", "0"]) == "--seq-len must be >= 1, got 0"


def test_the_same_model_rewritten_by_transformers_is_the_same_model():
    """transformers' save_pretrained of the tiny checkpoint (measured: the same logits here, max diff
    0.0) writes keys this package does not read or reads the same way: ``head_dim`` as the rope
    width, ``layer_types``, ``mlp_bias``, ``output_router_logits``, ``bos_token_id``. A resume with
    that copy was refused naming them; compared as this package reads them, it is the model. A
    setting the model computes with still differs."""
    import json

    from paddleformers_glm.train.state_files import model_differences

    raw = json.loads((Path(__file__).parent / "fixtures" / "tiny" / "checkpoint" / "config.json").read_text())
    hf = dict(raw, head_dim=raw["qk_rope_head_dim"], mlp_bias=False, output_router_logits=False, bos_token_id=7)
    hf["layer_types"] = ["full_attention"] * raw["num_hidden_layers"]
    saved, now = {"kind": "glm", "config": raw}, {"kind": "glm", "config": hf}
    assert model_differences(saved, now) == {}
    other = {"kind": "glm", "config": dict(raw, rms_norm_eps=0.01)}
    assert model_differences(saved, other) == {"rms_norm_eps": (raw["rms_norm_eps"], 0.01)}
