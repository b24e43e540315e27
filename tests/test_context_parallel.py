"""Context parallel (--cp): the zigzag split and its whole-sequence shifts (in process), and GLM-5.2
(tiny official-layout checkpoint) trained with --cp 2, --tp 2 --cp 2 --sp and --pp 2 --cp 2 (with
recompute) against one process: losses and MTP losses within 1e-6 at lr 1e-5 over 5 steps, at
seq 32 (zigzag chunks of index_topk keys; the indexer KL loss on, whose key gradients cross the
cp ranks: it trains as in one process) and seq 48 (chunks of 12 > index_topk = 8, so every rank's
second chunk selects among keys held by the other rank, through the shared layers' carried top-k
too); a repeat is bit-identical, a resume from step 2 bit-exact.  The latent attention of one
rank's queries over every key equals those rows of one process (in process).  Expert parallelism spans the cp ranks
(--cp 2 --ep 2: each cp rank owns half the experts; --tp 2 --cp 2 --ep 4 --sp: every rank of the
stage owns a quarter) with the same bound, the planner's parameter bytes match the --cp 2 --ep 2
run, and its step-2 state resumes at --cp 2 (experts resharded) on the same curve."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from paddleformers_glm.parallel.context import split_micro_batch, zigzag_positions
from paddleformers_glm.parallel.topology import ParallelConfigError
from paddleformers_glm.train.loop import TrainConfig, run_training
from tests._dist.runner import assert_clipped_by_true_norm, assert_indexer_matches, losses, run_train_cli, worker_logs

STEPS, GBS, LR = 5, 2, 1e-5


def test_zigzag_ranks_hold_chunk_r_and_its_mirror():
    assert zigzag_positions(16, 2, 0).tolist() == [0, 1, 2, 3, 12, 13, 14, 15]
    assert zigzag_positions(16, 2, 1).tolist() == [4, 5, 6, 7, 8, 9, 10, 11]
    assert zigzag_positions(16, 4, 1).tolist() == [2, 3, 12, 13]
    every = np.sort(np.concatenate([zigzag_positions(24, 3, r) for r in range(3)]))
    assert every.tolist() == list(range(24))
    with pytest.raises(ParallelConfigError, match="divisible by 2 x cp = 4"):
        zigzag_positions(18, 2, 0)


def test_split_shifts_labels_and_mtp_ids_over_the_whole_sequence():
    S = 8
    ids = np.arange(100, 100 + S, dtype=np.int64)[None]
    labels = np.arange(200, 200 + S, dtype=np.int64)[None]
    labels[0, 4] = -100
    mask = np.ones([1, S], dtype=np.int64)
    r0 = split_micro_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, 2, 0, [1, 2], 1)
    r1 = split_micro_batch({"input_ids": ids, "labels": labels, "attention_mask": mask}, 2, 1, [1, 2], 1)
    # rank 0 holds positions 0,1,6,7; rank 1 holds 2,3,4,5
    assert r0["input_ids"].tolist() == [[100, 101, 106, 107]] and r1["input_ids"].tolist() == [[102, 103, 104, 105]]
    assert r0["position_ids"].tolist() == [[0, 1, 6, 7]] and r1["position_ids"].tolist() == [[2, 3, 4, 5]]
    # position 1 (rank 0) predicts label 2, held by rank 1; the last position has no target
    assert r0["cp_target_1"].tolist() == [[201, 202, 207, -100]]
    assert r1["cp_target_1"].tolist() == [[203, -100, 205, 206]]
    assert r0["cp_target_2"].tolist() == [[202, 203, -100, -100]]
    assert r1["cp_target_2"].tolist() == [[-100, 205, 206, 207]]
    assert r0["cp_ids_1"].tolist() == [[101, 102, 107, 0]] and r1["cp_ids_1"].tolist() == [[103, 104, 105, 106]]
    assert r0["attention_mask"].shape == (1, S)  # key padding stays indexed by global position


def test_topk_tables_over_a_longer_key_sequence_index_every_key():
    """A cp rank's 2 queries per batch over all 6 keys: table rows b*6 + j, empty slots on the
    batch's first key (masked), a query without keys on its batch's mean row 12 + b (unmasked)."""
    import paddle

    from paddleformers_glm.ops.selection import topk_tables

    topk = paddle.to_tensor(np.array([[[5, -1], [-1, -1]], [[0, 4], [3, -1]]], np.int64))
    rows, mask, has_key = topk_tables(topk, n_keys=6)
    assert rows.numpy().tolist() == [[5, 0], [12, 12], [6, 10], [9, 6]]
    inf = float("-inf")
    assert mask.numpy().tolist() == [[0.0, inf], [0.0, 0.0], [0.0, 0.0], [0.0, inf]]
    assert has_key.numpy().tolist() == [True, False, True, True]


def test_latent_attention_of_a_cp_rank_equals_its_rows_of_one_process():
    """The latent form for one zigzag rank's queries over every key (as --cp runs it) gives the
    one-process rows (which run the dense chunks here): outputs, probabilities and gradients, with
    empty slots and a query without keys."""
    import paddle

    from paddleformers_glm.modeling.attention_forms import sparse_latent_attention

    rng = np.random.default_rng(3)
    B, S, H, D, K = 2, 16, 2, 8, 4
    q_np = rng.standard_normal((B, S, H, D)).astype(np.float32)
    kv_np = rng.standard_normal((B, S, D)).astype(np.float32)
    gy = rng.standard_normal((B, S, H, D)).astype(np.float32)
    topk = np.full((B, S, K), -1, np.int64)
    for b in range(B):
        for i in range(S):
            n = min(i + 1, K) - (i % 3 == 0)
            topk[b, i, :n] = rng.choice(i + 1, n, replace=False)
    topk[0, 0] = -1  # no key at all: the mean of every value

    def run(fn, pos):
        q, kv = paddle.to_tensor(q_np[:, pos]), paddle.to_tensor(kv_np)
        q.stop_gradient = kv.stop_gradient = False
        out, probs = fn(q, kv, paddle.to_tensor(topk[:, pos]), 0.3, 1024, True)
        (out * paddle.to_tensor(gy[:, pos])).sum().backward()
        return out.numpy(), probs.numpy(), q.grad.numpy(), kv.grad.numpy()

    full = run(sparse_latent_attention, np.arange(S))
    kv_grad = np.zeros_like(kv_np)
    for r in range(2):
        pos = zigzag_positions(S, 2, r)
        out, probs, dq, dkv = run(sparse_latent_attention, pos)
        np.testing.assert_allclose(out, full[0][:, pos], atol=1e-6, err_msg=f"rank {r} out")
        np.testing.assert_allclose(probs, full[1][:, pos], atol=1e-6, err_msg=f"rank {r} probs")
        np.testing.assert_allclose(dq, full[2][:, pos], atol=1e-6, err_msg=f"rank {r} dq")
        kv_grad += dkv
    np.testing.assert_allclose(kv_grad, full[3], atol=1e-5, err_msg="dkv summed over the ranks")


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def _single(ckpt, out, seq, **kw):
    cfg = TrainConfig(
        model="glm", model_args={"model_dir": str(ckpt)}, steps=STEPS, seq_len=seq, global_batch_size=GBS,
        micro_batch_size=1, lr=LR, out=str(out), progress=False, **kw,
    )  # fmt: skip
    return run_training(cfg)


@pytest.fixture(scope="module")
def held_out(tmp_path_factory) -> Path:
    """Held-out tokens for the evaluations of the layouts without an indexer stage (4 windows of 48)."""
    path = tmp_path_factory.mktemp("held") / "held.npy"
    np.save(path, np.random.default_rng(5).integers(0, 256, size=4 * 48).astype(np.int32))
    return path


@pytest.fixture(scope="module")
def single(tiny_ckpt, held_out, tmp_path_factory):
    return {
        48: _single(tiny_ckpt, tmp_path_factory.mktemp("single48"), 48, eval_data=str(held_out)),
        (48, "warmup"): _single(tiny_ckpt, tmp_path_factory.mktemp("single48w"), 48, indexer_stage="warmup"),
    }


@pytest.fixture(scope="module")
def kl_ckpt(tiny_ckpt, tmp_path_factory):
    """The tiny checkpoint with the indexer KL loss on: the indexer is trained, so its keys'
    gradients cross the cp ranks."""
    import json
    import shutil

    ckpt = tmp_path_factory.mktemp("kl") / "ckpt"
    shutil.copytree(tiny_ckpt, ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    cfg["indexer_loss_coeff"] = 0.1
    (ckpt / "config.json").write_text(json.dumps(cfg))
    return ckpt


def _run(ckpt, out, seq, *layout):
    args = ["--model", str(ckpt), "--steps", str(STEPS), "--seq-len", str(seq), "--global-batch-size", str(GBS)]
    args += ["--micro-batch-size", "1", "--lr", str(LR), "--out", str(out), *layout]
    p, _ = run_train_cli(args, timeout=300)
    if p.returncode != 0:
        pytest.fail(f"glm {layout} failed:\n{p.stderr[-3000:]}\n{worker_logs(out)}")
    return losses(out)


def _close(ref, got, what):
    diffs = {k: max(abs(a - b) for a, b in zip(ref[k], got[k])) for k in ("losses", "mtp_losses", "grad_norms")}
    print(f"[cp vs one process] {what}: {diffs}")  # the numbers docs/parallel.md quotes (pytest -s)
    for key in ("losses", "mtp_losses"):
        diff = max(abs(a - b) for a, b in zip(ref[key], got[key]))
        assert len(got[key]) == STEPS and diff <= 1e-6, (what, key, diff)
    # grad norms: relative, the bound of the other GLM layout tests (--tp 2 --sp alone, without
    # cp, differs from one process by 4.1e-6 relative here: TP's own summation order)
    rel = max(abs(a - b) / abs(a) for a, b in zip(ref["grad_norms"], got["grad_norms"]))
    assert rel <= 1e-5, (what, "grad_norms", rel)


def _plan_matches_measured(ckpt, got, seq, ep=1):
    """glm52 plan --cp 2 [--ep]: every rank's parameter and gradient bytes as measured (no dense
    weight is split over cp; with --ep the experts are), the activation estimate within a factor of
    2 of the measured saved bytes (the bound of the planner's other layouts), and below the
    one-process estimate."""
    from paddleformers_glm.configuration import GlmMoeDsaConfig
    from paddleformers_glm.parallel.pipeline import split_stages
    from paddleformers_glm.train import plan as planmod

    config = GlmMoeDsaConfig.from_pretrained(str(ckpt))
    lay = planmod.Layout(cp=2, ep=ep, seq_len=seq, dtype="float32", global_batch_size=GBS)
    plan = planmod.plan_layout(config, lay)
    assert plan["layout"]["world"] == 2 and [planmod.rank_coords(lay, r)["cp"] for r in (0, 1)] == [0, 1]
    spec = split_stages(config.num_hidden_layers, 1, has_mtp=True)[0]
    est = planmod.activation_bytes(config, lay, spec, GBS)
    one = planmod.activation_bytes(config, planmod.Layout(seq_len=seq, dtype="float32"), spec, GBS)
    assert est < 0.6 * one
    assert len(got["memory"]) == 2
    for m, p in zip(got["memory"], plan["ranks"]):
        assert (m["params_bytes"], m["grads_bytes"]) == (p["params_bytes"], p["grads_bytes"]), (m, p)
        assert 0.5 <= est / m["activations_bytes"] <= 2.0, (m["rank"], est, m["activations_bytes"])


@pytest.mark.slow
def test_cp2_trains_the_indexer_kl_loss_as_one_process_repeats_and_resumes_bit_exact(kl_ckpt, tmp_path):
    """--cp 2 at seq 32 with the indexer KL loss on (the runs without it: the seq-48 layouts below):
    within the bounds of one process, indexer KL losses too; a repeat bit-identical; a resume from
    step 2 bit-exact."""
    ref = _single(kl_ckpt, tmp_path / "single", 32)
    a = _run(kl_ckpt, tmp_path / "a", 32, "--cp", "2")
    assert a["profile"]["cp"] == 2 and a["profile"]["world"] == 2
    _close(ref, a, "cp2-kl")
    assert len(a["indexer_losses"]) == STEPS and min(a["indexer_losses"]) > 0
    assert a["indexer"]["stage"] == "sparse"  # the checkpoint's coefficient > 0: the sparse stage by default
    assert_indexer_matches(ref, a, "cp2-kl")  # the KL (~2e-4 here) and per-layer KL and recall
    _plan_matches_measured(kl_ckpt, a, 32)
    b = _run(kl_ckpt, tmp_path / "b", 32, "--cp", "2", "--save-every", "2")
    for key in ("losses", "mtp_losses", "grad_norms", "lrs", "indexer_losses"):
        assert a[key] == b[key], key  # a repeat is bit-identical
    ckpt = tmp_path / "b" / "checkpoints" / "step_00000002"
    c = _run(kl_ckpt, tmp_path / "c", 32, "--cp", "2", "--resume", str(ckpt))
    assert c["run"]["resumed_from_step"] == 2
    for key in ("losses", "mtp_losses", "grad_norms", "lrs", "indexer_losses"):
        assert c[key] == b[key], key  # resume continues the uninterrupted run bit for bit


@pytest.mark.slow
@pytest.mark.parametrize(
    "seq,layout",
    [
        (48, ("--cp", "2", "--indexer-stage", "warmup")),
        (48, ("--tp", "2", "--cp", "2", "--sp")),
        (48, ("--pp", "2", "--cp", "2", "--recompute", "full")),
        (48, ("--tp", "2", "--cp", "2", "--ep", "4", "--sp")),
    ],
    ids=["cp2-warmup-seq48", "tp2-cp2-sp-seq48", "pp2-cp2-recompute-seq48", "tp2-cp2-ep4-sp-seq48"],
)
def test_cp_layouts_match_one_process(tiny_ckpt, single, held_out, tmp_path, seq, layout):
    """cp2-warmup: the indexer's dense warm-up, whose target spans every causal key across the cp
    ranks, and its per-query mean over the whole sequence (docs/indexer.md).  tp2-cp2-sp: the step-1
    dump shows the clip that ran scaled the gradients by clip / (true norm + 1e-6) (tests/_dist/runner.py). The
    layouts without an indexer stage also evaluate held-out tokens after the last step: one
    process's loss (each cp rank its zigzag slice; on pp2-cp2 through Fleet's eval_batch)."""
    dump = tmp_path / "dump"
    clip_check = "--tp" in layout and "--ep" not in layout  # no expert parallelism: Fleet's optimizer wrapper
    held = ("--eval-data", str(held_out)) if "warmup" not in layout else ()
    got = _run(tiny_ckpt, tmp_path, seq, *layout, *held, *(("--dump-step", str(dump), "1") if clip_check else ()))
    if clip_check:
        assert_clipped_by_true_norm(dump, got["grad_norms"][0], clip=1.0)
    assert got["profile"]["cp"] == 2
    if "--pp" in layout:
        assert got["run"]["pp_layout"] == "E,t*4|t*4,m,L"  # stage 1 starts on shared layer 4: the carried top-k
    ref = single[(seq, "warmup")] if "warmup" in layout else single[seq]
    _close(ref, got, layout)
    if held:
        (r,), (g,) = ref["eval"], got["eval"]
        assert r["step"] == g["step"] == STEPS and r["tokens"] == g["tokens"] == GBS * 47
        assert all(abs(r[k] - g[k]) <= 1e-6 for k in ("losses", "mtp_losses")), (r, g)
    if "warmup" in layout:
        assert_indexer_matches(ref, got, layout)


@pytest.mark.slow
def test_cp2_ep2_splits_the_experts_over_the_cp_ranks(tiny_ckpt, single, tmp_path):
    from paddleformers_glm.configuration import GlmMoeDsaConfig
    from paddleformers_glm.train import plan as planmod

    got = _run(tiny_ckpt, tmp_path / "a", 48, "--cp", "2", "--ep", "2", "--save-every", "2")
    assert got["profile"]["cp"] == 2 and got["profile"]["world"] == 2
    _close(single[48], got, ("--cp", "2", "--ep", "2"))
    _plan_matches_measured(tiny_ckpt, got, 48, ep=2)
    # each rank holds half the experts: fewer parameter bytes than a --cp 2 rank (every expert)
    config = GlmMoeDsaConfig.from_pretrained(str(tiny_ckpt))
    full = planmod.plan_layout(config, planmod.Layout(cp=2, seq_len=48, dtype="float32", global_batch_size=GBS))
    assert all(m["params_bytes"] < full["ranks"][0]["params_bytes"] for m in got["memory"])
    # the step-2 state (each cp rank saved its own experts and their AdamW state) resumes at --cp 2
    # without ep (every rank needs every expert: resharded) and continues the curve
    ckpt = tmp_path / "a" / "checkpoints" / "step_00000002"
    r = _run(tiny_ckpt, tmp_path / "b", 48, "--cp", "2", "--resume", str(ckpt))
    assert r["run"]["resumed_from_step"] == 2 and r["lrs"] == got["lrs"]
    for key in ("losses", "mtp_losses"):
        diff = max(abs(a - b) for a, b in zip(got[key][2:], r[key][2:]))
        assert len(r[key]) == STEPS and diff <= 1e-6, (key, diff)


def test_plan_accepts_expert_parallel_over_the_cp_ranks(tiny_ckpt):
    from paddleformers_glm.configuration import GlmMoeDsaConfig
    from paddleformers_glm.train import plan as planmod

    config = GlmMoeDsaConfig.from_pretrained(str(tiny_ckpt))
    lay = planmod.Layout(cp=2, ep=2, seq_len=48, dtype="float32", global_batch_size=GBS)
    assert planmod.plan_layout(config, lay)["layout"]["world"] == 2  # dp 1: ep 2 only fits over cp
    with pytest.raises(ParallelConfigError, match=r"must divide tp 1 x dp 1 x cp 2 = 2"):
        planmod.plan_layout(config, planmod.Layout(cp=2, ep=4, seq_len=48, global_batch_size=GBS))
