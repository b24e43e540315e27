"""The trainer on the real GLM-5.2 model (tiny official-layout checkpoint) through the GLM adapter:
the step-1 loss is the model's own HF-convention loss over the global batch; a PP2 split whose
second stage starts on a *shared* indexer layer, TP2, the headline TP2 x PP2 with sequence
parallel (world 4), EP2, ETP2, TP2 x EP2 and TP2 x PP2 x EP2 with SP match the single-process run
within 1e-5 (losses, MTP losses, grad norms); the headline run twice gives bit-identical losses
and exported bytes."""

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


def test_glm_rejects_a_layout_that_cannot_split_the_model(tiny_ckpt, tmp_path, capsys):
    # 4 attention heads cannot be split over 8 tensor-parallel ranks
    assert train_main(["--model", str(tiny_ckpt), "--tp", "8", "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert "8" in err and "num_attention_heads" in err


def _run(tiny_ckpt, out, *layout):
    args = ["--model", str(tiny_ckpt), "--steps", str(STEPS), "--seq-len", str(SEQ), "--global-batch-size", str(GBS)]
    args += ["--micro-batch-size", "1", "--out", str(out), "--export", *layout]
    p, _ = run_train_cli(args, timeout=240)
    if p.returncode != 0:
        pytest.fail(f"glm {layout} failed:\n{p.stderr[-3000:]}\n{worker_logs(out)}")
    return losses(out)


@pytest.fixture(scope="module")
def single_mbs1(tiny_ckpt, tmp_path_factory):
    return _run(tiny_ckpt, tmp_path_factory.mktemp("glm_single"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "layout",
    [
        ("--tp", "2"),
        ("--tp", "2", "--pp", "2", "--sp"),
        ("--dp", "2", "--ep", "2"),
        ("--tp", "2", "--etp", "2"),
        ("--tp", "2", "--ep", "2"),
        ("--tp", "2", "--pp", "2", "--ep", "2", "--sp"),
    ],
    ids=["tp2", "tp2-pp2-sp", "dp2-ep2", "tp2-etp2", "tp2-ep2", "tp2-pp2-ep2-sp"],
)
def test_glm_parallel_layouts_match_single_process(tiny_ckpt, single_mbs1, tmp_path, layout):
    got = _run(tiny_ckpt, tmp_path, *layout)
    for key in ("losses", "mtp_losses", "grad_norms"):
        diff = max(abs(a - b) for a, b in zip(single_mbs1[key], got[key]))
        assert len(got[key]) == STEPS and diff <= 1e-5, (layout, key, diff)


@pytest.mark.slow
def test_glm_headline_layout_is_bit_reproducible(tiny_ckpt, tmp_path):
    a = _run(tiny_ckpt, tmp_path / "a", "--tp", "2", "--pp", "2", "--sp")
    b = _run(tiny_ckpt, tmp_path / "b", "--tp", "2", "--pp", "2", "--sp")
    assert a["losses"] == b["losses"] and a["mtp_losses"] == b["mtp_losses"]
    assert a["profile"]["tp"] == 2 and a["profile"]["pp"] == 2 and a["profile"]["sp"] is True
    fa = (tmp_path / "a" / "export" / "model.safetensors").read_bytes()
    assert fa == (tmp_path / "b" / "export" / "model.safetensors").read_bytes()


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


def test_glm_resume_continues_the_uninterrupted_curve_bit_for_bit(tiny_ckpt, tmp_path):
    def cfg(out, **kw):
        return TrainConfig(
            model="glm", model_args={"model_dir": str(tiny_ckpt)}, steps=4, seq_len=SEQ, global_batch_size=GBS,
            micro_batch_size=MBS, out=str(out), progress=False, warmup_steps=1, **kw,
        )  # fmt: skip

    full = run_training(cfg(tmp_path / "full", save_every=2))
    ckpt = tmp_path / "full" / "checkpoints" / "step_00000002"
    assert ckpt.is_dir()
    resumed = run_training(cfg(tmp_path / "resumed", resume=str(ckpt)))
    assert resumed["run"]["resumed_from_step"] == 2
    for key in ("losses", "mtp_losses", "grad_norms", "lrs"):
        assert resumed[key] == full[key], (key, resumed[key], full[key])


def test_glm_stage_loads_only_its_own_tensors(tiny_ckpt):
    from paddleformers_glm.parallel.pipeline import split_stages
    from paddleformers_glm.parallel.topology import get_topology
    from paddleformers_glm.train.glm_adapter import GlmAdapter

    adapter = GlmAdapter(str(tiny_ckpt))
    spec = split_stages(8, 2, has_mtp=True)[1]  # layers 4..7 + MTP + head
    stage = adapter.build_stage(spec, get_topology())
    state = adapter.full_state()
    assert set(state) == set(stage.state_dict())
    assert not any(k.startswith(("model.layers.0.", "model.layers.3.")) for k in state)
    assert "model.layers.8.eh_proj.weight" in state and "lm_head.weight" in state


@pytest.mark.slow
def test_distributed_export_of_unchanged_weights_equals_the_source_bytes(tiny_ckpt, tmp_path):
    """lr 0: the TP2 x PP2 x SP run's export is the loaded weights, gathered from 4 ranks and
    written in the official layout; it must equal the source checkpoint tensor for tensor."""
    from paddleformers_glm.parity.ckpt_check import check_checkpoints

    args = ["--model", str(tiny_ckpt), "--steps", "1", "--seq-len", str(SEQ), "--global-batch-size", str(GBS)]
    args += ["--micro-batch-size", "1", "--lr", "0", "--min-lr", "0", "--tp", "2", "--pp", "2", "--sp"]
    p, _ = run_train_cli([*args, "--out", str(tmp_path), "--export"], timeout=240)
    if p.returncode != 0:
        pytest.fail(f"export run failed:\n{p.stderr[-3000:]}\n{worker_logs(tmp_path)}")
    report = check_checkpoints(str(tiny_ckpt), str(tmp_path / "export"))
    assert report["exit_code"] == 0 and report["hash_match"] is True, report.get("differences", [])[:3]
    assert report["counts"]["ref_tensors"] == report["counts"]["cand_tensors"] == 296
