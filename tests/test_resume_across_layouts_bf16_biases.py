"""A bf16 indexer warm-up state saved at --pp 2 and resumed in one process in the sparse stage
(through flex/: another layout) continues the frozen backbone from its saved weights; a --pp 2 run
with moving router biases resumed in one process continues its losses and its biases."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from tests._dist.runner import run_train_cli

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def _bf16(a: np.ndarray) -> np.ndarray:
    return (a.astype(np.uint32) << 16).view(np.float32) if a.dtype == np.uint16 else a


def test_a_bf16_warmup_state_of_another_layout_resumes_the_backbone_from_its_saved_weights(tiny, tmp_path):
    """Warm-up at --pp 2 (bf16), then the sparse stage in one process from its
    step-2 state: the step-3 update moves each backbone element by at most one Adam step plus bf16
    rounding (its fp32 master is the saved weight, not the resumed run's init)."""
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsFile
    from paddleformers_glm.train.loop import TrainConfig, run_training
    from paddleformers_glm.train.state_files import read_rank_state

    warm = tmp_path / "warm"
    args = ["--model", str(tiny), "--steps", "2", "--seq-len", "32", "--global-batch-size", "2", "--micro-batch-size",
            "1", "--dtype", "bfloat16", "--lr", "1e-3", "--indexer-stage", "warmup", "--save-every", "2",
            "--pp", "2", "--out", str(warm)]  # fmt: skip
    p, _ = run_train_cli(args, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    s2 = warm / "checkpoints" / "step_00000002"
    cfg = TrainConfig(
        model="glm", model_args={"model_dir": str(tiny)}, steps=3, seq_len=32, global_batch_size=2, micro_batch_size=1,
        dtype="bfloat16", lr=1e-3, indexer_stage="sparse", indexer_loss_coeff=0.1,
        resume=str(s2), save_every=1, out=str(tmp_path / "sparse"), progress=False,
    )  # fmt: skip
    sparse = run_training(cfg)
    lr, wd = sparse["lrs"][-1], 0.1
    w2: dict[str, np.ndarray] = {}
    for f in sorted(s2.glob("rank_*.safetensors")):
        with SafetensorsFile(str(f)) as r:
            w2 |= {k: _bf16(r.numpy(k)) for k in r.keys() if k.startswith("model/") and ".indexer." not in k}
    reader, _, _ = read_rank_state(str(tmp_path / "sparse" / "checkpoints" / "step_00000003"), 0)
    with reader:
        w3 = {k: _bf16(reader.numpy(k)) for k in reader.tensors if k.startswith("model/") and ".indexer." not in k}
    assert w2.keys() == w3.keys() and len(w2) > 100, sorted(set(w2) ^ set(w3))[:5]
    for k in w2:
        a, b = w2[k].astype(np.float64), w3[k].astype(np.float64)
        bound = lr * (1 + wd * np.abs(a)) * 1.01 + np.abs(b) * 2.0**-8 + 1e-30
        assert (np.abs(b - a) <= bound).all(), (k, float(np.abs(b - a).max()))


def _model_tensors(folder: Path) -> dict[str, np.ndarray]:
    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsFile

    out: dict[str, np.ndarray] = {}
    for f in sorted(folder.glob("rank_*.safetensors")):
        with SafetensorsFile(str(f)) as r:
            out |= {k: _bf16(r.numpy(k)) for k in r.keys() if k.startswith("model/")}
    return out


def test_router_biases_of_a_pp2_state_continue_in_one_process(tiny, tmp_path):
    """--moe-bias-update-rate 0.01 at --pp 2 for 4 steps (state at 2) vs that state resumed in one
    process: the same losses, and the step-4 states' expert-selection biases equal."""
    import json

    from paddleformers_glm.train.loop import TrainConfig, run_training

    full = tmp_path / "full"
    args = ["--model", str(tiny), "--steps", "4", "--seq-len", "32", "--global-batch-size", "4", "--micro-batch-size",
            "2", "--lr", "1e-3", "--warmup-steps", "1", "--save-every", "2", "--moe-bias-update-rate", "0.01",
            "--pp", "2", "--out", str(full)]  # fmt: skip
    p, _ = run_train_cli(args, timeout=400)
    assert p.returncode == 0, p.stderr[-3000:]
    cfg = TrainConfig(
        model="glm", model_args={"model_dir": str(tiny)}, steps=4, seq_len=32, global_batch_size=4, micro_batch_size=2,
        lr=1e-3, warmup_steps=1, moe_bias_update_rate=0.01, save_every=2, progress=False, out=str(tmp_path / "one"),
        resume=str(full / "checkpoints" / "step_00000002"),
    )  # fmt: skip
    r = run_training(cfg)
    want = json.loads((full / "loss.json").read_text())["losses"]
    assert max(abs(a - b) for a, b in zip(want, r["losses"])) <= 1e-6, (want, r["losses"])
    a = _model_tensors(full / "checkpoints" / "step_00000004")
    b = _model_tensors(tmp_path / "one" / "checkpoints" / "step_00000004")
    biases = sorted(k for k in a if k.endswith("e_score_correction_bias"))
    s2 = _model_tensors(full / "checkpoints" / "step_00000002")
    assert biases and any(np.abs(s2[k]).max() > 0 for k in biases)  # moved by step 2
    assert all(np.array_equal(a[k], b[k]) for k in biases), [k for k in biases if not np.array_equal(a[k], b[k])]
