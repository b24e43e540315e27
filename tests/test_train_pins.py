"""The trainer's numbers pinned without the torch reference (each computed here independently or
checked by an invariance that holds by construction):

* the step's objective: LM + ``mtp_loss_scaling_factor`` / D x each MTP depth's token mean (the
  reference's ``lm + w * mtp``), its step-1 gradient norm equal to autograd of that sum written here
  from the model's logits; the sparse stage's indexer KL enters with ``--indexer-loss-coeff``;
* the reported MTP loss with two MTP depths: the mean of the depths' token means (as the reference
  reports it), not the mean over their pooled tokens;
* the sequence balance loss is a mean over the global batch's sequences: a batch of one sequence
  twice gives the gradient norm and the reported aux loss of that sequence alone;
* a non-finite loss term whose gradient stays finite (the LM loss in the indexer warm-up, weight 0)
  still stops the run before the update (docs/failure-modes.md, "Non-finite steps");
* the synthetic stream's batch s is samples s*G .. s*G+G-1 (no sample in two batches);
* loss.json's ``lrs``: linear warm-up from lr/W at update 1, cosine to the floor (--min-lr, default
  lr/10) at the last update (docs/parity.md, the reference trainer's ``lr_at``).
"""

from __future__ import annotations

import glob
import json
import math
from pathlib import Path

import numpy as np
import paddle
import paddle.nn.functional as F
import pytest

from paddleformers_glm.train.data import open_data
from paddleformers_glm.train.loop import TrainConfig, run_training


def _save_tiny(path: Path, edit=None, **config_changes) -> str:
    """The tiny checkpoint (HF init, seed 0) with ``config_changes``, its weights edited by ``edit``."""
    from paddleformers_glm.checkpoint import save_pretrained_state
    from paddleformers_glm.tiny import init_state, tiny_config

    config = tiny_config(**config_changes)
    state = init_state(config)
    if edit is not None:
        edit(state)
    save_pretrained_state({k: paddle.to_tensor(v) for k, v in state.items()}, config, path, max_shard_size="1MB")
    return str(path)


def _glm(ckpt, out, **kw) -> dict:
    base = dict(model="glm", model_args={"model_dir": str(ckpt)}, steps=1, seq_len=16, global_batch_size=2,
                micro_batch_size=1, progress=False, out=str(out))  # fmt: skip
    return run_training(TrainConfig(**{**base, **kw}))


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


# ------------------------------------------------------------------ objective and report, two MTP depths
S2, G2 = 16, 2


@pytest.fixture(scope="module")
def two_depths(tmp_path_factory):
    """One step of a tiny model with two MTP depths (scaling factor 0.6: weight 0.3 per depth) on a
    known batch, and the same step's losses and gradient norm computed here from the model's logits."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    d = tmp_path_factory.mktemp("mtp2")
    ckpt = _save_tiny(d / "ckpt", num_nextn_predict_layers=2, mtp_loss_scaling_factor=0.6)
    toks = np.random.default_rng(7).integers(3, 256, size=G2 * S2).astype(np.int64)
    np.save(d / "data.npy", toks)  # two samples: the step's global batch is both
    run = _glm(ckpt, d / "run", seq_len=S2, global_batch_size=G2, data=str(d / "data.npy"))

    model = GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype="float32")
    model.train()
    ids = paddle.to_tensor(toks.reshape(G2, S2))
    out = model(ids, labels=ids, compute_mtp=True)

    def token_mean_ce(logits, shift):  # position i predicts token i + shift, mean over every such token
        lp = F.log_softmax(logits[:, : S2 - shift].astype("float32"), axis=-1)
        return -paddle.take_along_axis(lp, ids[:, shift:].unsqueeze(-1), axis=-1).mean()

    lm = token_mean_ce(out.logits, 1)
    depths = [token_mean_ce(lg, d + 1) for d, lg in enumerate(out.mtp_logits, 1)]
    assert len(depths) == 2
    (lm + (0.6 / 2) * paddle.add_n(depths)).backward()
    sq = sum(float((p.grad.astype("float64") ** 2).sum()) for p in model.parameters() if p.grad is not None)
    return {
        "run": run,
        "lm": float(lm),
        "depths": [float(x) for x in depths],
        "counts": [G2 * (S2 - d - 1) for d in (1, 2)],
        "grad_norm": math.sqrt(sq),
    }


def test_step1_gradient_norm_is_that_of_lm_plus_the_scaled_mtp_depths(two_depths):
    """The reference trains ``lm + (mtp_loss_scaling_factor / D) * sum_d mtp_d`` (each a token mean
    over the global batch).  The trainer's step-1 pre-clip gradient norm equals the norm of autograd
    of that sum written here (measured: 5.0252743 and 5.0252749, factor 0.6, D = 2); with every
    term weighted 1 instead it was 7.504 (each MTP depth entering at 1, not 0.3)."""
    r = two_depths
    assert r["run"]["losses"][0] == pytest.approx(r["lm"], rel=1e-6)
    assert r["run"]["grad_norms"][0] == pytest.approx(r["grad_norm"], rel=2e-5)


def test_reported_mtp_loss_is_the_mean_of_the_depths_token_means(two_depths):
    """With two MTP depths the reference reports ``sum_d mtp_total[d] / n_mtp[d] / D``; the depths
    count different tokens (G x (S-2) and G x (S-3)), so pooling their tokens gives another number
    (measured: 5.5367169 against 5.5370868 pooled, a gap of 3.7e-4; the two agree here to 3e-7)."""
    r = two_depths
    mean_of_means = sum(r["depths"]) / 2
    pooled = sum(m * n for m, n in zip(r["depths"], r["counts"])) / sum(r["counts"])
    assert abs(mean_of_means - pooled) > 1e-4  # the two conventions are told apart at this tolerance
    assert r["run"]["mtp_losses"][0] == pytest.approx(mean_of_means, abs=1e-5)


def test_sparse_stage_kl_enters_the_gradient_with_its_coefficient(tiny_ckpt, tmp_path):
    """Sparse stage: objective LM + MTP + c x KL, the KL reaching only the indexers.  Doubling
    ``--indexer-loss-coeff`` doubles every indexer gradient of step 1 (dump's pre-clip grads; measured
    exact) and leaves every backbone gradient as it was; with the coefficient dropped from the
    objective both runs' indexer gradients were equal."""
    from safetensors.numpy import load_file

    grads = {}
    for c in (0.1, 0.2):
        out = tmp_path / f"c{c}"
        _glm(tiny_ckpt, out, indexer_stage="sparse", indexer_loss_coeff=c, dump_steps=[(str(out / "dump"), 1)])
        grads[c] = {}
        for f in sorted(glob.glob(str(out / "dump" / "grads" / "*.safetensors"))):
            grads[c].update(load_file(f))
    assert grads[0.1].keys() == grads[0.2].keys()
    indexer = [k for k in grads[0.1] if ".indexer." in k and np.abs(grads[0.1][k]).max() > 0]
    backbone = [k for k in grads[0.1] if ".indexer." not in k]
    assert len(indexer) >= 10 and len(backbone) > 100, (len(indexer), len(backbone))
    for k in indexer:
        np.testing.assert_allclose(grads[0.2][k], 2 * grads[0.1][k], rtol=1e-6, atol=0, err_msg=k)
    for k in backbone:
        np.testing.assert_allclose(grads[0.2][k], grads[0.1][k], rtol=1e-6, atol=0, err_msg=k)


# ------------------------------------------------------------------ the sequence balance loss
def test_aux_loss_is_a_mean_over_the_global_batchs_sequences(tiny_ckpt, tmp_path):
    """The sequence-wise balance loss is coeff x the mean over sequences (DeepSeek-V3's L_Bal, a
    per-sequence quantity): a global batch of one sequence twice must give the step-1 gradient norm
    and the reported ``aux_losses`` of a batch of that sequence once (the LM token mean is the same
    too).  Measured (clip off): 6.25048 without the aux term, 7.69745 for both with coeff 0.5, and
    12.0362 for two sequences when the aux gradient was not divided by the batch's sequences;
    reported aux 1.04568 for both, 2.09137 for two when the report was not."""
    seq = np.random.default_rng(3).integers(3, 256, size=16).astype(np.int64)
    np.save(tmp_path / "twice.npy", np.concatenate([seq, seq]))
    runs = {
        (g, c): _glm(tiny_ckpt, tmp_path / f"g{g}c{c}", global_batch_size=g, clip_grad=0.0, moe_aux_loss_coeff=c,
                     data=str(tmp_path / "twice.npy"))
        for g, c in ((1, 0.0), (1, 0.5), (2, 0.5))
    }  # fmt: skip
    one, two = runs[1, 0.5], runs[2, 0.5]
    assert abs(one["grad_norms"][0] - runs[1, 0.0]["grad_norms"][0]) > 1e-2  # the aux term moves the gradient
    assert two["grad_norms"][0] == pytest.approx(one["grad_norms"][0], rel=1e-5)
    assert two["losses"][0] == pytest.approx(one["losses"][0], rel=1e-6)
    a1, a2 = one["expert_load"]["aux_losses"], two["expert_load"]["aux_losses"]
    assert len(a1) == len(a2) == 1 and a2[0] == pytest.approx(a1[0], rel=1e-6), (a1, a2)


# ------------------------------------------------------------------ non-finite loss, finite gradient
def test_a_nonfinite_loss_with_finite_gradients_stops_the_run(tmp_path, capsys):
    """docs/failure-modes.md: a step whose loss (LM, MTP, indexer KL: every loss term) or gradient
    norm is NaN/Inf stops the run before the optimizer step, exit 1.  In the indexer warm-up the LM
    and MTP losses have weight 0 and the backbone is frozen, so a NaN there leaves every gradient
    finite: here an ``lm_head`` of +-3e38 (finite, so the load check passes) overflows the logits,
    the LM and MTP losses are NaN, the indexers' KL gradient is finite.  The run must still stop at
    step 1 naming the LM loss (measured without the loss in the check: it trained on, exit 0,
    loss.json ``losses`` [nan, nan])."""
    from paddleformers_glm.train.command import main as train_main

    def overflow_head(state):
        rng = np.random.default_rng(0)
        w = state["lm_head.weight"]
        state["lm_head.weight"] = np.where(rng.random(w.shape) < 0.5, -3e38, 3e38).astype(np.float32)

    ckpt = _save_tiny(tmp_path / "ckpt", edit=overflow_head)
    out = tmp_path / "out"
    argv = ["--model", ckpt, "--steps", "2", "--seq-len", "16", "--global-batch-size", "2", "--no-progress",
            "--indexer-stage", "warmup", "--out", str(out)]  # fmt: skip
    assert train_main(argv) == 1
    err = capsys.readouterr().err
    assert "step 1: non-finite lm loss" in err and "stopped before the optimizer step" in err, err
    rec = json.loads((out / "logs" / "failure.json").read_text())
    assert (rec["cause"], rec["step"], rec["quantity"]) == ("nonfinite", 1, "lm loss"), rec
    assert rec["first_nonfinite_grad"] is None  # the gradients were finite: the loss alone stopped it


# ------------------------------------------------------------------ data
def test_synthetic_batches_are_consecutive_runs_of_samples():
    """data.py: an unbounded (synthetic) source's batch s is samples s*G .. s*G+G-1, so no sample
    is trained twice and a checkpoint's data position is its step.  Checked for G = 1, 3, 4 over
    the first batches: each batch is those samples in order, and no two batches share a row."""
    d = open_data(None, 12, 64, seed=5)
    for G in (1, 3, 4):
        seen = set()
        for s in range(4):
            got = d.global_batch(s, G)
            want = [d.sample(i) for i in range(s * G, (s + 1) * G)]
            for key in ("input_ids", "labels"):
                assert np.array_equal(got[key], np.stack([w[key] for w in want])), (G, s, key)
            rows = {r.tobytes() for r in got["input_ids"]}
            assert not rows & seen, (G, s)
            seen |= rows


# ------------------------------------------------------------------ learning-rate schedule
def _documented_lr(k: int, lr: float, floor: float, warmup: int, steps: int) -> float:
    """Update k (1-based): lr * k / W during the warm-up, then cosine from lr to the floor, reached
    at the last update (docs/parity.md "learning rate"; the reference trainer's schedule)."""
    if warmup > 0 and k <= warmup:
        return lr * k / warmup
    progress = (k - warmup) / max(1, steps - warmup)
    return floor + 0.5 * (lr - floor) * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize(
    "steps, warmup, min_lr",
    [(6, 2, None), (4, 0, 2e-4), (1, 0, None)],
)
def test_loss_json_lrs_follow_the_documented_schedule(tmp_path, steps, warmup, min_lr):
    """loss.json ``lrs`` against the schedule written out here: with warm-up W the first update
    already runs at lr / W (not 0), the cosine ends at the floor on the last update, and the floor
    without --min-lr is lr / 10 (a one-step run trains at it).  Measured at lr 1e-3, W 2, 5 steps:
    [5e-4, 1e-3, 7.75e-4, 3.25e-4, 1e-4], the reference's; one update late it read [0, 5e-4, ...],
    and with a floor of 0 the last entry was 0."""
    lr = 1e-3
    cfg = TrainConfig(model="toy", steps=steps, seq_len=8, global_batch_size=2, micro_batch_size=1, lr=lr,
                      min_lr=min_lr, warmup_steps=warmup, progress=False, out=str(tmp_path))  # fmt: skip
    floor = lr / 10 if min_lr is None else min_lr
    want = [_documented_lr(k, lr, floor, warmup, steps) for k in range(1, steps + 1)]
    got = run_training(cfg)["lrs"]
    assert got == pytest.approx(want, rel=1e-6, abs=1e-12), (got, want)
    assert got[-1] == pytest.approx(floor, rel=1e-6)
