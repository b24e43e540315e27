"""What ``glm52 align --no-run`` must refuse before it re-compares the runs in OUT: the receipt it
writes states that a torch reference run and a Paddle run of this command's steps, model and data
agree, so a record that is not the reference's, runs of another step count, and a model or data
other than the runs' own are each refused (exit 2), naming the file and the difference.

The runs are fabricated (no torch needed): loss records with the fields each trainer writes, as a
real ``glm52 align`` of the tiny model wrote them, and small dumps in the same names on both sides."""

from __future__ import annotations

import hashlib
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from paddleformers_glm.cli import main as cli_main

SEQ, GBS, SEED = 16, 2, 1234
LOSSES = [5.55, 5.53, 5.52]
VERSIONS = {
    "reference": {"torch": "2.13.0+cpu", "transformers": "5.23.0", "numpy": "2.4.6", "python": "3.11.7"},
    "paddle": {"paddleformers_glm": "0.1.0", "paddle": "3.3.1", "numpy": "2.4.6", "python": "3.11.7"},
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def _records(model: Path) -> dict[str, dict]:
    """The two loss.json of a 3-step run, with what each trainer writes beside the curves."""
    common = {"losses": LOSSES, "mtp_losses": [x + 0.01 for x in LOSSES], "grad_norms": [4.0] * 3}
    common.update(lrs=[1e-5, 2e-5, 3e-5], steps=3, seed=SEED)
    data = f"synthetic(seed={SEED})"
    ref = dict(common, indexer_loss_coeff=0.0, dtype="float32", versions=VERSIONS["reference"])
    ref["reference"] = "torch + transformers GlmMoeDsaForCausalLM (eager, float32) + torch MTP"
    ref["run"] = {"data": data, "tokens_per_step": SEQ * GBS, "micro_batch_size": 1}
    ref["checkpoint"] = {"path": str(model)}
    profile = {"tp": 1, "pp": 1, "ep": 1, "etp": 1, "sp": False, "dp": 1, "cp": 1, "world": 1}
    profile.update(micro_batch_size=1, global_batch_size=GBS, seq_len=SEQ, dtype="float32")
    pd = dict(common, profile=profile, versions=VERSIONS["paddle"])
    pd["indexer"] = {"stage": "none", "loss_weight": 0.0, "shared_supervision": False, "layers": []}
    pd["run"] = {"data": data, "tokens_per_step": SEQ * GBS, "sharding": 1, "sharding_stage": 1}
    pd["checkpoint"] = {"path": str(model)}
    return {"reference": ref, "paddle": pd}


def _inputs(model: Path, data: str | None = None) -> dict:
    """OUT/inputs.json as align writes it before the runs: the model's file and canonical hashes,
    the data's description and fingerprint as both trainers open it."""
    from paddleformers_glm.checkpoint.safetensors_io import Checkpoint
    from paddleformers_glm.parity.ckpt_check import checkpoint_hash, tensor_hash
    from paddleformers_glm.train.data import open_data

    files = sorted(p for p in model.iterdir() if p.name.endswith((".safetensors", ".json")))
    with Checkpoint(str(model), strict=True) as ck:
        canonical = checkpoint_hash({k: tensor_hash(i.dtype, i.shape, ck.raw(k)) for k, i in ck.tensors.items()})
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    source = open_data(data, SEQ, vocab, SEED)
    return {
        "model": {
            "path": str(model),
            "files_sha256": {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in files},
            "canonical_hash": canonical,
        },
        "data": {"path": data, "describe": source.describe, "fingerprint": source.fingerprint()},
    }


def _runs(root: Path, model: Path) -> Path:
    from safetensors.numpy import save_file

    rng = np.random.default_rng(0)
    tensors = {"a.weight": rng.standard_normal((4, 3)).astype(np.float32), "b.bias": np.ones(3, np.float32)}
    for side, doc in _records(model).items():
        (root / side).mkdir(parents=True)
        (root / side / "loss.json").write_text(json.dumps(doc))
        for tag, kinds in (("step1", ("grads", "exp_avg", "exp_avg_sq", "weights")), ("final", ("weights",))):
            for kind in kinds:
                d = root / side / f"dump_{tag}" / kind
                d.mkdir(parents=True)
                save_file({k: np.abs(v) + 1.0 for k, v in tensors.items()}, str(d / "model.safetensors"))
                shutil.copyfile(model / "config.json", d / "config.json")
    (root / "inputs.json").write_text(json.dumps(_inputs(model)))
    return root


def _align(model: Path, root: Path, *more: str) -> int:
    args = ["align", "--model", str(model), "--out", str(root), "--steps", "3", "--seq-len", str(SEQ)]
    args += ["--global-batch-size", str(GBS), "--tp", "1", "--pp", "1", "--no-sp", "--dump-step", "1", "--no-run"]
    return cli_main([*args, *more])


def _verdict(root: Path) -> dict:
    return json.loads((root / "receipt" / "verdict.json").read_text())


def _failed(root: Path) -> list[str]:
    """The receipt's comparisons that fail."""
    return sorted(k for k, c in _verdict(root)["comparisons"].items() if not c["pass"])


def test_runs_as_align_made_them_are_compared_and_the_receipt_keeps_each_runs_versions(tiny_model, tmp_path):
    """The receipt's ``versions`` are this command's environment; what each run recorded of its own
    (torch / transformers for the reference, paddle for the Paddle run) is kept beside them, so a
    re-comparison in another environment still says what made the runs."""
    root = _runs(tmp_path / "r", tiny_model)
    assert _align(tiny_model, root) == 0
    v = _verdict(root)
    assert v["result"] == "aligned"
    assert v["run_versions"] == VERSIONS
    assert v["model"]["canonical_hash"] == _inputs(tiny_model)["model"]["canonical_hash"]


@pytest.mark.parametrize(
    "key, rel, fails",
    [("lrs", 1e-10, False), ("lrs", 4e-9, True), ("grad_norms", 4e-5, False), ("grad_norms", 6e-5, True)],
)
def test_each_updates_learning_rate_and_gradient_norm_are_compared(tiny_model, tmp_path, capsys, key, rel, fails):
    """Both trainers record every update's rate from the same closed form (warm-up, then cosine): a
    schedule that differs moves the weights by only a fraction of lr, which the weight tolerance
    (0.1 x the rates) can swallow; float64 noise (1e-10 relative) passes, 4e-9 fails. The pre-clip
    gradient norm, the whole gradient that the dumps compare tensor by tensor (and that scales each
    update), is held to ``--later-rel-tol`` (5e-5) every step, not only at the dumped steps
    (measured: at most 2.9e-7 apart over 10 steps of the headline layout, fp32)."""
    root = _runs(tmp_path / "r", tiny_model)
    doc = json.loads((root / "paddle" / "loss.json").read_text())
    doc[key][1] *= 1 + rel
    (root / "paddle" / "loss.json").write_text(json.dumps(doc))
    code = _align(tiny_model, root)
    c = _verdict(root)["comparisons"][key]
    if not fails:
        assert code == 0 and c["pass"], c
        return
    assert code == 1 and _failed(root) == [key], _failed(root)
    tol = 1e-9 if key == "lrs" else 5e-5
    assert (c["consistent_steps"], c["first_divergent_step"], c["rel_tol"]) == (1, 1, tol), c
    assert f"FAIL {key}: consistent_steps 1/3" in capsys.readouterr().out


def test_a_copy_of_the_paddle_run_as_the_reference_is_refused(tiny_model, tmp_path, capsys):
    """Measured before: OUT/reference replaced by a copy of OUT/paddle gave exit 0, "aligned", every
    difference exactly 0, under a receipt naming the torch reference's command."""
    root = _runs(tmp_path / "r", tiny_model)
    shutil.rmtree(root / "reference")
    shutil.copytree(root / "paddle", root / "reference")
    assert _align(tiny_model, root) == 2
    err = capsys.readouterr().err
    ref_loss = str(root / "reference" / "loss.json")
    assert f"{ref_loss}: not written by the torch reference" in err
    assert "it lacks reference, dtype, versions.torch, versions.transformers" in err
    assert _verdict(root)["exit_code"] == 2


def test_a_reference_record_as_the_paddle_run_is_refused(tiny_model, tmp_path, capsys):
    root = _runs(tmp_path / "r", tiny_model)
    shutil.copyfile(root / "reference" / "loss.json", root / "paddle" / "loss.json")
    assert _align(tiny_model, root) == 2
    err = capsys.readouterr().err
    assert f"{root / 'paddle' / 'loss.json'}: not written by glm52 train: it lacks profile, versions.paddle" in err


def test_runs_of_another_step_count_are_refused(tiny_model, tmp_path, capsys):
    """Measured before: runs of 3 steps with ``--no-run --steps 2``: exit 0, "aligned", the step-3
    loss difference of 0.5 in the receipt's ``diff_per_step`` and the step-3 weights as the final ones."""
    root = _runs(tmp_path / "r", tiny_model)
    doc = json.loads((root / "paddle" / "loss.json").read_text())
    doc["losses"][2] += 0.5
    (root / "paddle" / "loss.json").write_text(json.dumps(doc))
    assert _align(tiny_model, root, "--steps", "2") == 2
    err = capsys.readouterr().err
    for side in ("reference", "paddle"):
        assert f"{root / side / 'loss.json'}: the run recorded 3 steps, --steps asks for 2" in err


def test_a_record_holding_a_key_twice_is_refused(tiny_model, tmp_path, capsys):
    """Python's json keeps a key's last value: a record whose first "losses" is 0.5 off would be
    judged on its second and called aligned."""
    root = _runs(tmp_path / "r", tiny_model)
    text = (root / "paddle" / "loss.json").read_text()
    (root / "paddle" / "loss.json").write_text(text.replace("{", '{"losses": [9.0, 9.0, 9.0], ', 1))
    assert _align(tiny_model, root) == 2
    err = capsys.readouterr().err
    assert f"{root / 'paddle' / 'loss.json'}: the loss record holds the key 'losses' twice" in err
    assert _verdict(root)["result"] == "a run's loss record is unusable"
    (root / "paddle" / "loss.json").write_text(text[:-1])  # a record cut short: was a traceback
    assert _align(tiny_model, root) == 2
    assert "the loss record is not valid JSON" in capsys.readouterr().err


def test_a_record_without_its_step_count_is_refused(tiny_model, tmp_path, capsys):
    from paddleformers_glm.parity.align import record_errors

    docs = _records(tiny_model)
    del docs["reference"]["steps"]
    errors = record_errors("r/loss.json", docs["reference"], "p/loss.json", docs["paddle"], 3)
    assert errors == ["r/loss.json: the run recorded no step count, --steps asks for 3"]
    docs["paddle"]["steps"] = 2  # a run that stopped early though it exited 0: the full run is held to it too
    errors = record_errors("r/loss.json", _records(tiny_model)["reference"], "p/loss.json", docs["paddle"], 3)
    assert errors == ["p/loss.json: the run recorded 2 steps, --steps asks for 3"]


def test_other_data_than_the_runs_is_refused(tiny_model, tmp_path, capsys):
    """Measured before: runs on synthetic data, ``--no-run --data other.npy``: exit 0, the receipt
    saying the runs trained on other.npy."""
    root = _runs(tmp_path / "r", tiny_model)
    other = tmp_path / "other.npy"
    np.save(other, np.arange(500, dtype=np.int64) % 100)
    assert _align(tiny_model, root, "--data", str(other)) == 2
    err = capsys.readouterr().err
    fingerprint = _inputs(tiny_model)["data"]["fingerprint"]
    assert f"--data: the runs were given synthetic (fingerprint {fingerprint}, sha256 None)" in err
    assert f"this command {other}" in err


def test_a_model_folder_whose_weights_changed_since_the_runs_is_refused(tiny_model, tmp_path, capsys):
    """Measured before: the --model folder replaced by another seed's tiny model (same path, same
    config.json): exit 0, the receipt's model hashes those of weights neither run trained."""
    from paddleformers_glm.tiny import make_tiny_checkpoint

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    root = _runs(tmp_path / "r", model)
    shutil.rmtree(model)
    make_tiny_checkpoint(model, seed=2)
    shutil.copyfile(tiny_model / "config.json", model / "config.json")
    assert _align(model, root) == 2
    err = capsys.readouterr().err
    assert f"--model {model}: its weights are not the ones the runs were given" in err
    assert "files changed since the runs: model-" in err


def test_an_out_without_the_runs_inputs_is_refused_with_what_to_do(tiny_model, tmp_path, capsys):
    """An OUT made before align recorded the runs' inputs cannot tell which model and data they used."""
    root = _runs(tmp_path / "r", tiny_model)
    (root / "inputs.json").unlink()
    assert _align(tiny_model, root) == 2
    err = capsys.readouterr().err
    assert f"{root / 'inputs.json'}: missing" in err and "rerun without --no-run" in err


def test_another_indexer_stage_or_weight_than_the_runs_is_refused(tiny_model, tmp_path, capsys):
    """Both runs record the indexer's stage (the Paddle run's ``indexer`` block; the reference writes
    none at stage none) and KL weight; they were compared as recorded and never checked."""
    root = _runs(tmp_path / "r", tiny_model)
    assert _align(tiny_model, root, "--indexer-stage", "sparse", "--indexer-loss-coeff", "0.5") == 2
    err = capsys.readouterr().err
    assert "paddle --indexer-stage: the run recorded 'none', this command says 'sparse'" in err
    assert "reference --indexer-stage: the run recorded 'none', this command says 'sparse'" in err
    assert (
        "reference --indexer-loss-coeff (the indexer KL's weight): the run recorded 0.0, this command says 0.5" in err
    )


def test_runs_on_a_data_file_pass_given_relative_and_a_rewritten_row_is_refused(
    tiny_model, tmp_path, capsys, monkeypatch
):
    """Runs given a data file record it absolute (glm52 train makes the path absolute), so a --no-run
    given it relative was refused as other data ("the run recorded '/.../d.npy', align gave it 'd.npy'");
    align now hands both runs the absolute path. The fingerprint samples three rows of the file: a
    row rewritten elsewhere is caught by the file's sha256, recorded beside it."""
    import argparse

    from paddleformers_glm.parity.align import run_inputs

    data = tmp_path / "d.npy"
    np.save(data, (np.arange(SEQ * GBS * 300) % 50).astype(np.int32))
    root = _runs(tmp_path / "r", tiny_model)
    recorded = run_inputs(argparse.Namespace(model=str(tiny_model), data=str(data), seq_len=SEQ, seed=SEED))
    (root / "inputs.json").write_text(json.dumps(recorded))
    for side in ("reference", "paddle"):
        doc = json.loads((root / side / "loss.json").read_text())
        doc["run"]["data"] = recorded["data"]["describe"]
        (root / side / "loss.json").write_text(json.dumps(doc))
    monkeypatch.chdir(tmp_path)
    assert _align(tiny_model, root, "--data", "d.npy") == 0, capsys.readouterr().err
    tokens = np.load(data)
    tokens[len(tokens) // 3] += 1  # a token of no sampled row
    np.save(data, tokens)
    capsys.readouterr()
    assert _align(tiny_model, root, "--data", "d.npy") == 2
    err = capsys.readouterr().err
    assert f"--data: the runs were given {data} (fingerprint" in err and "sha256" in err, err


def _edit_record(root: Path, side: str, **fields) -> None:
    """Set ``fields`` in ``root/side/loss.json``."""
    doc = json.loads((root / side / "loss.json").read_text())
    doc.update(fields)
    (root / side / "loss.json").write_text(json.dumps(doc))


def test_near_eps_weights_beyond_their_loose_tolerance_fail_and_the_output_names_them(tiny_model, tmp_path, capsys):
    """docs/parity.md, "step-K weights": where the reference's bias-corrected sqrt(v) is below 1e-7 a
    weight is held to 2 x (lr_1 + ... + lr_K), a looser bound, not an exemption. Step-1 weights 1e-3
    apart at every element, all of them near eps (loose tolerance 2 x lr_1 = 2e-5): the comparison
    fails (exit 1), though the other elements' worst difference, 0, is within the step-1 tolerance
    1e-6. A receipt or output that read "aligned" here would pass a weight difference 1000 x the step-1
    tolerance, and a FAIL line stating only "worst 0 ... tolerance 1e-06" would not say what failed:
    the line and ``first_difference`` name the near-eps elements' largest difference, their
    tolerance, their count and the tensor. Elements near eps within that tolerance still pass."""
    from safetensors.numpy import save_file

    root = _runs(tmp_path / "r", tiny_model)
    weights = np.abs(np.random.default_rng(0).standard_normal((4, 3)).astype(np.float32)) + 1.0  # as _runs dumps
    tiny_moment = {"a.weight": np.full((4, 3), 1e-17, np.float32), "b.bias": np.full(3, 2.0, np.float32)}
    for side in ("reference", "paddle"):  # the same second moment on both sides: only the weights differ
        save_file(tiny_moment, str(root / side / "dump_step1" / "exp_avg_sq" / "model.safetensors"))
    paddle_weights = root / "paddle" / "dump_step1" / "weights" / "model.safetensors"
    save_file({"a.weight": weights + np.float32(1e-3), "b.bias": np.full(3, 2.0, np.float32)}, str(paddle_weights))
    capsys.readouterr()
    assert _align(tiny_model, root) == 1
    out = capsys.readouterr().out
    v = _verdict(root)
    c = v["comparisons"]["step1_weights"]
    assert _failed(root) == ["step1_weights"] and v["result"] == "not aligned"
    assert c["worst"]["value"] == 0.0  # the other elements: none
    near = c["near_eps"]
    assert (near["elements"], near["beyond_tolerance"], near["key"], near["pass"]) == (12, 12, "a.weight", False)
    assert near["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3) and near["tolerance"] == pytest.approx(2e-5)
    line = next(x for x in out.splitlines() if "step1_weights:" in x)
    assert line.startswith("[glm52 align] FAIL step1_weights: near-eps elements: max |diff| 0.001 (a.weight)"), line
    assert "beyond their tolerance 2e-05, 12 of 12 elements" in line, line
    first = v["first_difference"]
    assert (first["comparison"], first["step"], first["tensor"], first["near_eps_only"]) == (
        "step1_weights",
        1,
        "a.weight",
        True,
    )
    assert first["near_eps"]["max_abs_diff"] == pytest.approx(1e-3, rel=1e-3) and first["near_eps"]["elements"] == 12
    assert (
        "first dump difference after update 1: step1_weights a.weight near-eps elements max |diff| 0.001 "
        "(tolerance 2e-05, 12 of 12 elements beyond it)" in out
    ), out
    # the same elements 1e-5 apart: within their loose tolerance
    save_file({"a.weight": weights + np.float32(1e-5), "b.bias": np.full(3, 2.0, np.float32)}, str(paddle_weights))
    assert _align(tiny_model, root) == 0, capsys.readouterr().out
    assert _verdict(root)["comparisons"]["step1_weights"]["near_eps"]["pass"] is True


def test_one_layers_indexer_kl_beyond_the_loss_tolerance_fails_though_the_mean_recall_agrees(
    tiny_model, tmp_path, capsys
):
    """The indexer comparison of glm52 align (``indexer_recall`` in the receipt; docs/indexer.md,
    "Against the torch reference") holds the mean top-k recall as a curve and, per layer, the largest
    |difference| of its recall over the run within ``--loss-atol`` and of its KL relative to the
    reference's within ``--kl-rel-tol``. Here layer 1's KL is 50% apart at step 2 while every recall, and so the mean
    recall curve, agrees: the comparison fails (exit 1) and says which layer and measure. A rule that
    looked at the mean recall alone would pass an indexer whose KL target differs between the runs."""
    from paddleformers_glm.parity.align import compare_indexer

    root = _runs(tmp_path / "r", tiny_model)
    recall, kl = [[0.5, 0.5]] * 3, [[0.1, 0.1]] * 3
    block = {"stage": "sparse", "loss_weight": 0.5, "layers": [0, 1], "mean_recall": [0.5] * 3, "recall": recall}
    ref = dict(block, kl=kl)
    pd = dict(block, kl=[[0.1, 0.1], [0.1, 0.15], [0.1, 0.1]], shared_supervision=False)
    _edit_record(root, "reference", indexer=ref, indexer_loss_coeff=0.5)
    _edit_record(root, "paddle", indexer=pd)
    assert _align(tiny_model, root, "--indexer-stage", "sparse", "--indexer-loss-coeff", "0.5") == 1
    out = capsys.readouterr().out
    c = _verdict(root)["comparisons"]["indexer_recall"]
    assert _failed(root) == ["indexer_recall"] and c["consistent_steps"] == 3  # the mean recall curve agrees
    assert c["per_layer"]["1"]["kl_max_diff"] == pytest.approx(0.05) and c["per_layer"]["0"]["kl_max_diff"] == 0
    assert c["per_layer"]["1"]["kl_max_rel_diff"] == pytest.approx(0.5)
    assert "FAIL indexer_recall: consistent_steps 3/3" in out
    assert "layer 1: kl max |diff| / |reference| 0.5 beyond 0.02" in out
    assert compare_indexer({"indexer": ref}, {"indexer": pd}, 3, 1e-4, 0.6)["pass"]  # within a wider tolerance


def test_idle_experts_recorded_for_fewer_steps_on_one_side_fail(tiny_model, tmp_path, capsys):
    """docs/parity.md, "idle experts": per step, MoE layer -> the experts no token reached, identical on
    both sides. The Paddle run's record holds 2 of the 3 steps, the reference's all 3, equal where
    both have a step: the comparison fails (exit 1) and says how many steps each recorded. Comparing
    only the common steps would pass a run that lost a step's routing record, whatever it routed there."""
    root = _runs(tmp_path / "r", tiny_model)
    idle = [{"3": [1]}, {"3": [2]}, {}]
    _edit_record(root, "reference", expert_load={"idle_experts": idle})
    _edit_record(root, "paddle", expert_load={"idle_experts": idle[:2]})
    assert _align(tiny_model, root) == 1
    out = capsys.readouterr().out
    c = _verdict(root)["comparisons"]["idle_experts"]
    assert _failed(root) == ["idle_experts"]
    assert (c["pass"], c["length_match"], c["first_mismatch_step"]) == (False, False, None)
    line = next(x for x in out.splitlines() if "idle_experts:" in x)
    assert line.startswith("[glm52 align] FAIL idle_experts:") and "equal over their common steps" in line, line
    assert "the reference recorded idle experts for 3 steps, the paddle run for 2" in line, line


@pytest.mark.parametrize("bad", [math.nan, None])
def test_a_layers_non_finite_indexer_kl_fails_it(bad):
    """docs/parity.md: a NaN difference is no small one. A layer's KL the run could not compute (NaN,
    or null as its loss record writes it) at one step fails the indexer comparison, naming the layer
    and measure; Python's ``max`` would drop a NaN after the first step (a pass), and a null made
    the comparison raise a TypeError."""
    from paddleformers_glm.parity.align import compare_indexer

    block = {"stage": "sparse", "layers": [0, 1], "mean_recall": [0.5] * 3, "recall": [[0.5, 0.5]] * 3}
    ref = dict(block, kl=[[0.1, 0.1]] * 3)
    pd = dict(block, kl=[[0.1, 0.1], [0.1, bad], [0.1, 0.1]])
    c = compare_indexer({"indexer": ref}, {"indexer": pd}, 3, 1e-4, 1e-2)
    assert c["pass"] is False and math.isnan(c["per_layer"]["1"]["kl_max_diff"]), c
    assert c["reason"] == "layer 1: kl max |diff| / |reference| nan beyond 0.01", c["reason"]
    pd = dict(block, kl=ref["kl"], mean_recall=[0.5, bad, 0.5])
    c = compare_indexer({"indexer": ref}, {"indexer": pd}, 3, 1e-4)
    assert c["pass"] is False and c["consistent_steps"] == 1


def test_a_dump_tensor_of_another_shape_is_named_with_both_shapes(tiny_model, tmp_path, capsys):
    """A step-1 weight of another shape on the Paddle side is a difference with no value to compare:
    align exits 1 and its first-difference line names both shapes (the line raised a TypeError
    formatting the missing value, after verdict.json was written)."""
    from safetensors.numpy import save_file

    root = _runs(tmp_path / "r", tiny_model)
    t = {"a.weight": np.ones((3, 4), np.float32), "b.bias": np.full(3, 2.0, np.float32)}
    save_file(t, str(root / "paddle" / "dump_step1" / "weights" / "model.safetensors"))
    capsys.readouterr()
    assert _align(tiny_model, root) == 1
    out = capsys.readouterr().out
    assert "first dump difference after update 1: step1_weights a.weight shape reference [4, 3] paddle [3, 4]" in out
    assert _verdict(root)["first_difference"]["shapes"] == {"reference": [4, 3], "paddle": [3, 4]}


@pytest.mark.parametrize("scale, code", [(1.2, 1), (1.001, 0)])
def test_indexer_kl_is_held_to_a_relative_tolerance(tiny_model, tmp_path, capsys, scale, code):
    """The indexer KL (curve and per layer) is 1e-5 to 4e-4, at or below ``--loss-atol`` (1e-4), so an
    absolute tolerance passes any KL: here the Paddle run's KL is 20% above the reference's every
    step (as a run that dropped ``--indexer-shared-supervision`` on one side: 9-22% on the curve). Measured
    before: exit 0, both comparisons pass (max |diff| 5.2e-5). ``--kl-rel-tol`` (default 2e-2; fp32
    pairs measured up to 4.0e-3) fails it and passes a pair 1e-3 apart; both lines name it."""
    kl = [2.6e-4, 2.0e-4, 2.1e-4]
    block = {"stage": "sparse", "loss_weight": 0.5, "layers": [0, 1], "mean_recall": [0.5] * 3}
    block["recall"] = [[0.5, 0.5]] * 3
    root = _runs(tmp_path / "r", tiny_model)
    ref = dict(block, kl=[[x, x / 2] for x in kl])
    _edit_record(root, "reference", indexer=ref, indexer_losses=kl, indexer_loss_coeff=0.5)
    pd = dict(block, kl=[[x * scale, x / 2 * scale] for x in kl], shared_supervision=False)
    _edit_record(root, "paddle", indexer=pd, indexer_losses=[x * scale for x in kl])
    assert _align(tiny_model, root, "--indexer-stage", "sparse", "--indexer-loss-coeff", "0.5") == code
    out = capsys.readouterr().out
    v = _verdict(root)
    assert v["tolerances"]["kl_rel_tol"] == 0.02
    assert _failed(root) == ([] if code == 0 else ["indexer_losses", "indexer_recall"])
    for key in ("indexer_losses", "indexer_recall"):
        line = next(x for x in out.splitlines() if f" {key}:" in x)
        assert "kl max |diff| / |reference| " in line and "(kl-rel-tol 0.02)" in line, line
        assert v["summary"][key]["kl_max_rel_diff"] == pytest.approx(scale - 1, rel=1e-6), key
    if code:
        assert "layer 0: kl max |diff| / |reference| 0.2 beyond 0.02" in out
        more = ("--indexer-stage", "sparse", "--indexer-loss-coeff", "0.5", "--kl-rel-tol", "0.25")
        assert _align(tiny_model, root, *more) == 0  # a wider tolerance, given
        assert _verdict(root)["tolerances"]["kl_rel_tol"] == 0.25


def test_align_in_bf16_with_the_indexer_kl_needs_the_kl_tolerance(tiny_model, tmp_path, capsys):
    """``--dtype bfloat16`` takes every tolerance from the user; with the indexer trained that
    includes ``--kl-rel-tol`` (a bf16 KL pair has no measured fp32 bound), without it the KL is not
    compared and the flag is not asked for."""
    base = ["align", "--model", str(tiny_model), "--out", str(tmp_path / "a"), "--steps", "2", "--dtype", "bfloat16"]
    base += ["--loss-atol", "5e-3", "--rel-tol", "1", "--later-rel-tol", "1", "--weight-atol", "1e-2"]
    base += ["--final-weight-atol", "1e-2", "--no-run", "--seq-len", "1"]
    assert cli_main([*base, "--indexer-stage", "sparse", "--indexer-loss-coeff", "0.5"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "no default tolerance" in err[0] and "set --kl-rel-tol from" in err[0], err
    assert not (tmp_path / "a").exists()
    for more in (("--indexer-stage", "sparse", "--indexer-loss-coeff", "0.5", "--kl-rel-tol", "0.1"), ()):
        assert cli_main([*base, *more]) == 2  # on to the next refusal
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "--seq-len must be >= 2" in err[0], err


def test_align_refuses_data_without_a_label_before_any_run(tiny_model, tmp_path, capsys):
    """jsonl records whose labels are all -100 leave nothing to train on: glm52 train refuses them in
    one line. Measured before: align recorded the data's fingerprint as "unavailable", started the
    reference run, which died after loading the model (11 s) with a traceback, exit 2 ("a run
    failed"). Now align refuses in one line naming the file and the problem before anything runs."""
    data = tmp_path / "allmasked.jsonl"
    data.write_text(
        "".join(json.dumps({"input_ids": list(range(3, 19)), "labels": [-100] * 16}) + "\n" for _ in range(4))
    )
    out = tmp_path / "a"
    args = ["align", "--model", str(tiny_model), "--out", str(out), "--steps", "2", "--seq-len", "16"]
    assert cli_main([*args, "--data", str(data), "--no-run"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"glm52 align: error: --data {data}:"), err
    assert "no label to train on" in err[0], err
    assert not out.exists()


def test_align_checks_the_data_with_the_vocabulary_the_config_class_reads(tiny_model, tmp_path):
    """config.json may leave ``vocab_size`` out (the config class and transformers' default it):
    the data check reads the vocabulary through the config class, as both trainers do (reading the
    key itself raised a KeyError traceback before any run); the data is then judged by it."""
    import argparse

    from paddleformers_glm.parity.align import _align_data_error

    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    config = json.loads((model / "config.json").read_text())
    vocab = config.pop("vocab_size")
    (model / "config.json").write_text(json.dumps(config))
    data = tmp_path / "tokens.npy"
    np.save(data, np.arange(64, dtype=np.int64) % vocab)
    args = argparse.Namespace(model=str(model), data=str(data), seq_len=16, seed=1)
    assert _align_data_error(args) is None
    np.save(data, np.arange(64, dtype=np.float32))
    assert f"--data {data}: expected integer tokens" in _align_data_error(args)
    args.data = str(tmp_path / "missing.npy")  # named once, by the flag (not "--data --data: ...")
    assert _align_data_error(args) == f"--data: no file {args.data}"
