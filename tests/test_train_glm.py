"""The trainer on the real GLM-5.2 model (tiny official-layout checkpoint) through the GLM adapter:
the step-1 loss is the model's own HF-convention loss over the global batch, and a PP2 split
whose second stage starts on a *shared* indexer layer matches PP1."""

from __future__ import annotations

import json
from pathlib import Path

import paddle
import pytest

from paddleformers_glm.train.command import main as train_main
from paddleformers_glm.train.loop import TrainConfig, run_training
from tests._dist.runner import losses, run_train_cli, worker_logs

SEQ, GBS, MBS, STEPS = 32, 4, 2, 3


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(scope="module")
def pp1(tiny_ckpt, tmp_path_factory):
    out = tmp_path_factory.mktemp("glm_pp1")
    cfg = TrainConfig(
        model="glm", model_args={"model_dir": str(tiny_ckpt)}, steps=STEPS, seq_len=SEQ, global_batch_size=GBS,
        micro_batch_size=MBS, out=str(out), progress=False,
    )  # fmt: skip
    return run_training(cfg)


def test_step1_loss_is_the_models_own_loss_on_the_global_batch(tiny_ckpt, pp1):
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.train.data import open_data

    model = GlmMoeDsaForCausalLM.from_pretrained(str(tiny_ckpt), dtype="float32")
    batch = open_data(None, SEQ, model.config.vocab_size, 1234).global_batch(0, GBS)
    out = model(paddle.to_tensor(batch["input_ids"]), labels=paddle.to_tensor(batch["labels"]))
    assert abs(float(out.loss) - pp1["losses"][0]) <= 1e-6
    assert abs(float(out.mtp_loss) - pp1["mtp_losses"][0]) <= 1e-6
    assert pp1["weights_loaded"] is True and len(pp1["checkpoint"]["config_sha256"]) == 64


def test_glm_rejects_tensor_parallel_until_wired(tiny_ckpt, tmp_path, capsys):
    assert train_main(["--model", str(tiny_ckpt), "--tp", "2", "--out", str(tmp_path)]) == 2
    assert "need the modeling package's tensor- and expert-parallel layers" in capsys.readouterr().err


@pytest.mark.slow
def test_glm_pp2_starting_on_shared_layer_matches_pp1(tiny_ckpt, pp1, tmp_path):
    kinds = json.loads((tiny_ckpt / "config.json").read_text())["indexer_types"]
    assert kinds[4] == "shared"  # an even PP2 split starts stage 1 on layer 4
    args = ["--model", str(tiny_ckpt), "--pp", "2", "--steps", str(STEPS), "--seq-len", str(SEQ)]
    args += ["--global-batch-size", str(GBS), "--micro-batch-size", str(MBS), "--out", str(tmp_path), "--export"]
    p, _ = run_train_cli(args, timeout=150)
    if p.returncode != 0:
        pytest.fail(f"glm pp2 failed:\n{p.stderr[-3000:]}\n{worker_logs(tmp_path)}")
    got = losses(tmp_path)
    assert got["run"]["pp_layout"] == "E,t*4|t*4,m,L"
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert max(abs(a - b) for a, b in zip(pp1[key], got[key])) <= 1e-5, key
    index = json.loads((tiny_ckpt / "model.safetensors.index.json").read_text())["weight_map"]
    from safetensors import safe_open

    with safe_open(str(tmp_path / "export" / "model.safetensors"), "np") as f:
        assert set(f.keys()) == set(index)  # the official HF key set, MTP indexer included
