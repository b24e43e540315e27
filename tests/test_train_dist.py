"""End-to-end training on 2 and 4 gloo processes through ``python -m paddleformers_glm.train``
(which launches ``paddle.distributed.launch`` itself), compared with the single-process run.

Toy model: 6 layers (indexer kinds full, full, shared, shared, full, shared), MoE from layer 2,
MTP on the last stage reusing the embedding and the carried top-k.  fp32, 4 steps, clipping on.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from paddleformers_glm.train.launch import job_processes
from paddleformers_glm.train.loop import TrainConfig, run_training
from tests._dist.runner import env, losses, run_nodes, run_train_cli, worker_logs

pytestmark = pytest.mark.slow

STEPS, SEQ, GBS, MBS, LR = 4, 16, 4, 1, 2e-3
COMMON = [
    "--model",
    "toy",
    "--steps",
    str(STEPS),
    "--seq-len",
    str(SEQ),
    "--global-batch-size",
    str(GBS),
    "--micro-batch-size",
    str(MBS),
]
COMMON += ["--lr", str(LR), "--warmup-steps", "1", "--seed", "7"]
TOL = 1e-5
# Trained weights: Adam divides by sqrt(v), so fp32 summation-order noise in a gradient that is a
# near-cancellation (attention K projection, router) becomes ~1e-5 of weight; bound at 5% of one step.
WTOL = 0.05 * LR


def _cli(out, *extra, timeout=300):
    p, secs = run_train_cli([*COMMON, "--out", str(out), *extra], timeout=timeout)
    if p.returncode != 0:
        pytest.fail(f"train {extra} failed (rc {p.returncode}) in {secs:.1f}s:\n{p.stderr[-3000:]}\n{worker_logs(out)}")
    return losses(out), secs


def _max_diff(a, b, key):
    assert len(a[key]) == len(b[key]) == STEPS, (key, len(a[key]), len(b[key]))
    return max(abs(x - y) for x, y in zip(a[key], b[key]))


def _export_tensors(out):
    from safetensors.numpy import load_file

    return load_file(str(out / "export" / "model.safetensors"))


@pytest.fixture(scope="module")
def ref(tmp_path_factory):
    """Single process (world 1, in this process)."""
    out = tmp_path_factory.mktemp("ref")
    cfg = TrainConfig(
        model="toy",
        steps=STEPS, seq_len=SEQ, global_batch_size=GBS, micro_batch_size=MBS, lr=LR, warmup_steps=1, seed=7,
        out=str(out), export=True, progress=False, model_args={"seed": 7},
    )  # fmt: skip
    run_training(cfg)
    return losses(out), _export_tensors(out)


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return tmp_path_factory.mktemp("runs")


@pytest.fixture(scope="module")
def pp2_run(runs):
    """PP2 whose stage 1 starts on a shared indexer layer, saving a checkpoint at step 2 of 4: one run
    serves the parity test and the resume test, whichever of them a selection runs."""
    # layer 3 is a "shared" indexer layer: stage 1 needs layer 1's top-k, carried with the activations
    return _cli(runs / "pp2", "--pp", "2", "--pp-layout", "E,t*3|t*3,m,L", "--save-every", "2")


def _assert_close(ref_losses, got, what):
    for key in ("losses", "mtp_losses", "grad_norms"):
        d = _max_diff(ref_losses, got, key)
        assert d <= TOL, f"{what}: {key} differ by {d} (ref {ref_losses[key]}, got {got[key]})"


def test_reference_learns_and_reports_schema(ref):
    r, _ = ref
    assert set(r) >= {"losses", "mtp_losses", "steps", "profile", "weights_loaded", "checkpoint", "seed", "versions"}
    assert r["steps"] == STEPS and r["profile"]["world"] == 1 and r["profile"]["dtype"] == "float32"
    assert r["run"]["step_engine"] == "trainer"  # one stage: the trainer's own loop and update
    assert all(isinstance(x, float) for x in r["losses"])
    assert r["losses"][-1] < r["losses"][0], r["losses"]


def test_tp2_matches_tp1_and_is_bit_reproducible(ref, runs):
    a, secs = _cli(runs / "tp2_a", "--tp", "2", "--export")
    b, _ = _cli(runs / "tp2_b", "--tp", "2", "--export")
    _assert_close(ref[0], a, "tp2")
    assert a["losses"] == b["losses"] and a["mtp_losses"] == b["mtp_losses"] and a["grad_norms"] == b["grad_norms"]
    ha = hashlib.sha256((runs / "tp2_a" / "export" / "model.safetensors").read_bytes()).hexdigest()
    hb = hashlib.sha256((runs / "tp2_b" / "export" / "model.safetensors").read_bytes()).hexdigest()
    assert ha == hb, "exported bytes differ between two identical TP2 runs"
    ea = _export_tensors(runs / "tp2_a")
    assert set(ea) == set(ref[1])
    wd = max(float(np.max(np.abs(ea[k] - ref[1][k]))) for k in ea)
    assert wd <= WTOL, f"trained weights differ from single process by {wd}"
    print(f"tp2: loss diff {_max_diff(ref[0], a, 'losses'):.3g}, weights diff {wd:.3g}, {secs:.1f}s")


def test_pp2_stage_starting_on_shared_layer_matches_pp1(ref, pp2_run):
    a, secs = pp2_run
    assert a["run"]["pp_layout"] == "E,t*3|t*3,m,L"
    assert a["run"]["pipeline_engine"] == "PipelineParallel"  # Fleet's 1F1B engine
    assert a["run"]["step_engine"] == "train_batch"  # whole steps through Fleet's train_batch
    _assert_close(ref[0], a, "pp2")
    print(f"pp2: loss diff {_max_diff(ref[0], a, 'losses'):.3g}, {secs:.1f}s")


def test_resume_reproduces_uninterrupted_bit_for_bit(runs, pp2_run):
    full = pp2_run[0]  # saved a checkpoint at step 2 while running 4 steps
    ckpt = runs / "pp2" / "checkpoints" / "step_00000002"
    assert ckpt.is_dir(), "the pp2 run saved no step-2 checkpoint"
    r, _ = _cli(runs / "pp2_resumed", "--pp", "2", "--pp-layout", "E,t*3|t*3,m,L", "--resume", str(ckpt))
    assert r["run"]["resumed_from_step"] == 2
    for key in ("losses", "mtp_losses", "grad_norms", "lrs"):
        assert r[key] == full[key], f"{key}: resumed {r[key]} != uninterrupted {full[key]}"


def test_resume_with_another_pipeline_split_reshards(runs, pp2_run):
    """The same degrees with another --pp-layout put other layers on each rank: the state comes
    from flex/ and continues the curve.  Before, the split was not part of the saved layout, so each
    rank read its own rank file of the old split and the resume failed (measured with
    E,t*2|t*4,m,L on this run's E,t*3|t*3,m,L state: rank 0 "optimizer state has parameters this
    model lacks: ['layers.2.input_norm.weight', ...]")."""
    full = pp2_run[0]
    ckpt = runs / "pp2" / "checkpoints" / "step_00000002"
    r, _ = _cli(runs / "pp2_split", "--pp", "2", "--pp-layout", "E,t*2|t*4,m,L", "--resume", str(ckpt))
    assert r["run"]["resumed_from_step"] == 2 and r["run"]["pp_layout"] == "E,t*2|t*4,m,L"
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert _max_diff(full, r, key) <= TOL, (key, full[key], r[key])
    assert r["lrs"] == full["lrs"]


def test_tp2_pp2_sequence_parallel_world4_matches_single_process(ref, runs):
    a, secs = _cli(runs / "tp2pp2sp", "--tp", "2", "--pp", "2", "--sp", "--export", timeout=200)
    assert a["profile"] == {**a["profile"], "tp": 2, "pp": 2, "sp": True, "world": 4}
    _assert_close(ref[0], a, "tp2 pp2 sp")
    e = _export_tensors(runs / "tp2pp2sp")
    assert set(e) == set(ref[1])
    wd = max(float(np.max(np.abs(e[k] - ref[1][k]))) for k in e)
    assert wd <= WTOL, f"trained weights differ from single process by {wd}"
    print(f"tp2pp2sp: loss diff {_max_diff(ref[0], a, 'losses'):.3g}, weights diff {wd:.3g}, {secs:.1f}s")


def test_pp4_world4_every_later_stage_starts_on_a_shared_layer(ref, runs):
    # stages start on layers 1 (full), 3 and 5 (shared); the embedding lives on stages 0 and 3 (MTP)
    a, _ = _cli(runs / "pp4", "--pp", "4", "--pp-layout", "E,t|t*2|t*2|t,m,L", "--export", timeout=200)
    _assert_close(ref[0], a, "pp4")
    e = _export_tensors(runs / "pp4")
    assert set(e) == set(ref[1])
    assert max(float(np.max(np.abs(e[k] - ref[1][k]))) for k in e) <= WTOL


def test_pp2_vpp2_interleaved_matches_single_process(ref, runs):
    """Four micro-batches (2 pp) per step: Fleet's interleaved 1F1B engine,
    PipelineParallelWithInterleave (with only its pp > 2 assertion dropped), the class
    fleet.distributed_model picks for 2 pp or more micro-batches.  The F-then-B one for exactly pp,
    PipelineParallelWithInterleaveFthenB, carries the former's name as a prefix: the whole name is
    compared."""
    # four chunks on two ranks (chunk c on rank c % 2): rank 0 runs E,t0 and t3,t4; rank 1 runs
    # t1,t2 and t5,m,L; chunks start on layers 1 (full), 3 and 5 (shared: top-k carried)
    a, secs = _cli(runs / "pp2vpp2", "--pp", "2", "--vpp", "2", "--pp-layout", "E,t|t*2|t*2|t,m,L")
    assert a["run"]["pp_layout"] == "E,t|t*2|t*2|t,m,L"
    assert a["run"]["schedule"] == "interleaved 1f1b (vpp 2)"
    assert a["run"]["pipeline_engine"] == "TwoStageInterleave(PipelineParallelWithInterleave)", a["run"]
    assert a["run"]["step_engine"] == "train_batch"
    _assert_close(ref[0], a, "pp2 vpp2")
    print(f"pp2 vpp2: loss diff {_max_diff(ref[0], a, 'losses'):.3g}, {secs:.1f}s")


def test_pp2_vpp4_even_split_with_the_embedding_alone_in_chunk_0_matches_single_process(ref, runs):
    """The split --pp 2 --vpp 4 chooses for 6 layers (no --pp-layout) puts the embedding alone in
    chunk 0: its carry's top-k was empty [B, S, 0], the later chunks' [B, S, k], and Fleet's
    interleaved schedule sends every carry of a rank with its first send's shapes: rank 1 aborted
    in gloo ("op.preamble.length <= op.nbytes"; the launcher: "rank 1 died without a Python
    error").  Every carry's top-k is now [B, S, k] (-1 where no layer selected yet)."""
    a, secs = _cli(runs / "pp2vpp4", "--pp", "2", "--vpp", "4")
    assert a["run"]["pp_layout"] == "E|t|t|t|t|t|t|m,L", a["run"]["pp_layout"]
    assert a["run"]["schedule"] == "interleaved 1f1b (vpp 4)"
    _assert_close(ref[0], a, "pp2 vpp4")
    print(f"pp2 vpp4: loss diff {_max_diff(ref[0], a, 'losses'):.3g}, {secs:.1f}s")


def test_pp2_first_stage_holding_the_embedding_alone_matches_single_process(ref, runs):
    """1F1B with a first stage of the embedding alone: its top-k travels as the [B, S, k] -1
    placeholder (Fleet's NCCL p2p refuses an empty tensor, "can't send/recv zero element"), which
    stage 1 hands its model as the empty "no selection yet"; the run equals one process."""
    a, secs = _cli(runs / "pp2emb", "--pp", "2", "--pp-layout", "E|t*6,m,L")
    assert a["run"]["pp_layout"] == "E|t*6,m,L" and a["run"]["schedule"] == "1f1b", a["run"]
    _assert_close(ref[0], a, "pp2 embedding alone")
    print(f"pp2 embedding alone: loss diff {_max_diff(ref[0], a, 'losses'):.3g}, {secs:.1f}s")


def test_resume_into_expert_parallel_reshards(runs, pp2_run):
    """A state of a layout without expert parallelism resumes at --dp 2 --ep 2, where each rank holds
    half the experts, and continues the uninterrupted curve.  Before, every rank refused it after
    launch: "optimizer state for parameters this model lacks: ['layers.2.mlp.experts.0.down_proj', …]" (the
    check took a one-stage rank to hold every parameter)."""
    full = pp2_run[0]
    ckpt = runs / "pp2" / "checkpoints" / "step_00000002"
    r, _ = _cli(runs / "pp2_to_dp2ep2", "--dp", "2", "--ep", "2", "--resume", str(ckpt))
    assert r["run"]["resumed_from_step"] == 2 and r["profile"]["ep"] == 2 and r["profile"]["pp"] == 1
    for key in ("losses", "mtp_losses", "grad_norms"):
        assert _max_diff(full, r, key) <= TOL, (key, full[key], r[key])
    assert r["lrs"] == full["lrs"]


def test_pp3_vpp2_stock_interleaved_engine_matches_single_process(runs):
    """Six one-layer chunks on three ranks, 6 micro-batches (= 2 pp): the class fleet.distributed_model
    picks itself, with chunk 5 -> chunk 0 p2p wrapping from the last rank to the first. The held-out
    evaluations (each micro-batch through the chunks in turn: Fleet's interleaved schedule run
    forward-only fails on our carry) give one process's losses."""
    held = runs / "held_out.npy"
    np.save(held, np.random.default_rng(3).integers(0, 64, size=6 * SEQ).astype(np.int32))  # the toy's vocabulary
    gbs = ["--global-batch-size", "6", "--eval-data", str(held), "--eval-every", "2"]
    one, _ = _cli(runs / "one_gbs6", *gbs)
    a, secs = _cli(runs / "pp3vpp2", *gbs, "--pp", "3", "--vpp", "2", "--pp-layout", "E,t|t|t|t|t|t,m,L")
    assert a["profile"]["world"] == 3 and a["run"]["pipeline_engine"] == "PipelineParallelWithInterleave"
    assert a["run"]["step_engine"] == "train_batch"  # 6 micro-batches: Fleet's division by 6 must not reach the update
    _assert_close(one, a, "pp3 vpp2")
    assert [r["step"] for r in a["eval"]] == [r["step"] for r in one["eval"]] == [2, 4]
    for r, g in zip(one["eval"], a["eval"]):
        assert r["tokens"] == g["tokens"] == 6 * (SEQ - 1) and abs(r["losses"] - g["losses"]) <= TOL, (r, g)
    print(f"pp3 vpp2: loss diff {_max_diff(one, a, 'losses'):.3g}, {secs:.1f}s")


def test_ep2_matches_ep1(ref, runs):
    a, secs = _cli(runs / "dp2ep2", "--dp", "2", "--ep", "2")
    _assert_close(ref[0], a, "dp2 ep2")
    b, _ = _cli(runs / "tp2ep2sp", "--tp", "2", "--ep", "2", "--sp")  # Megatron layout: experts over the TP ranks
    _assert_close(ref[0], b, "tp2 ep2 sp")
    print(f"ep2: loss diff {_max_diff(ref[0], a, 'losses'):.3g} / {_max_diff(ref[0], b, 'losses'):.3g}, {secs:.1f}s")


def test_ep2_etp2_world4_matches_single_process(ref, runs):
    a, _ = _cli(runs / "ep2etp2", "--tp", "2", "--dp", "2", "--ep", "2", "--etp", "2", timeout=200)
    _assert_close(ref[0], a, "tp2 dp2 ep2 etp2")


def test_clip_off_at_tp2_dp2_without_expert_parallel_matches_one_process(runs):
    """``--clip-grad 0`` where Fleet's optimizer would clip (dp, tp): no clip at all, as in one
    process (a ClipGradByGlobalNorm(0) would scale every gradient to zero).  tp 2 x dp 2 without
    ep: each expert is whole on every rank, its gradient summed over the 4 ranks' tokens (the
    expert-data group), not over the data ranks alone."""
    one = runs / "one_clip0"
    cfg = TrainConfig(
        model="toy", steps=STEPS, seq_len=SEQ, global_batch_size=GBS, micro_batch_size=MBS, lr=LR, warmup_steps=1,
        seed=7, clip_grad=0.0, out=str(one), progress=False, model_args={"seed": 7},
    )  # fmt: skip
    run_training(cfg)
    a, _ = _cli(runs / "tp2dp2_clip0", "--clip-grad", "0", "--tp", "2", "--dp", "2", timeout=200)
    assert a["profile"]["world"] == 4
    _assert_close(losses(one), a, "tp2 dp2, --clip-grad 0")


def test_sharding2_matches_one_process_and_halves_optimizer_state(ref, runs):
    """Fleet's sharding optimizer (stage 1): each rank holds about half the optimizer state."""
    a, _ = _cli(runs / "sharding2", "--sharding", "2")
    _assert_close(ref[0], a, "sharding 2")
    full = ref[0]["optimizer_state_bytes"]
    per_rank = a["optimizer_state_bytes"]
    assert len(full) == 1 and len(per_rank) == 2, (full, per_rank)
    # greedy largest-first partition: each half within 5% of half; beta powers are per parameter
    assert all(abs(b - full[0] / 2) <= 0.05 * full[0] / 2 for b in per_rank), (full, per_rank)
    print(f"optimizer state bytes: one process {full[0]:,}, --sharding 2 per rank {per_rank}")


def test_dp2_sharding2_world4_matches_single_process(ref, runs):
    a, _ = _cli(runs / "dp2sharding2", "--dp", "2", "--sharding", "2", timeout=200)
    _assert_close(ref[0], a, "dp2 sharding2")
    assert a["run"]["sharding"] == 2 and a["profile"]["world"] == 4


# one MoE layer (no MTP block, whose MoE layer is a second one) of 32 experts, top-1
ROUTED_ONLY = {
    "num_experts": 32,
    "experts_per_token": 1,
    "mtp": False,
    "mlp_kinds": ["dense"] * 2 + ["moe"] + ["dense"] * 3,
}
ROUTED_TOL = 5e-4


def test_routed_only_expert_update_at_dp2_sharding2_world4_matches_one_process(runs, monkeypatch):
    """``--expert-update routed-only`` steps an expert only in a step where it got a token on some rank
    of its stage, so every replica must decide from the routed-token counts summed over the data
    and sharding ranks: a replica whose own tokens missed the expert would skip an update the
    others make.  One MoE layer of 32 experts, top-1, one 16-token micro-batch per rank: in one
    process, which runs the same four micro-batches per step, some expert is chosen by one
    micro-batch of a step alone (asserted below; measured at each of steps 1-3), i.e. on one
    rank of the layout and by none of the three others.  Measured: the losses equal one
    process's, the grad norms within 1.0e-7 (--dp 2 alone, a world of 2: 3.1e-5 and 5.7e-5, at
    step 4).  Counts not summed over the data ranks moved the losses by 5.7e-3 and the grad
    norms by 7.5e-3 (from step 2 on); not summed over the sharding ranks, the ranks disagreed on
    which parameters to update and the job aborted in gloo."""
    from paddleformers_glm.modeling.moe import RouterBalance

    chosen: dict[int, list[set[int]]] = {}  # router -> the experts each of its forwards chose
    track = RouterBalance.track

    def recording(self, scores, expert_ids, *args, **kwargs):
        chosen.setdefault(id(self), []).append(set(expert_ids.numpy().reshape(-1).tolist()))
        return track(self, scores, expert_ids, *args, **kwargs)

    out = runs / "routed_only_one"
    cfg = TrainConfig(
        model="toy", steps=STEPS, seq_len=SEQ, global_batch_size=GBS, micro_batch_size=MBS, lr=LR, warmup_steps=1,
        seed=7, out=str(out), progress=False, expert_update="routed-only", model_args={"config": ROUTED_ONLY, "seed": 7},
    )  # fmt: skip
    with monkeypatch.context() as m:
        m.setattr(RouterBalance, "track", recording)
        run_training(cfg)
    one, micro = losses(out), GBS // MBS
    assert chosen and all(len(c) == STEPS * micro for c in chosen.values()), {k: len(c) for k, c in chosen.items()}
    alone = 0  # (router, step) pairs before the last step with an expert that one micro-batch alone chose
    for c in chosen.values():
        for step in range(STEPS - 1):
            sets = c[step * micro : (step + 1) * micro]
            alone += any(sum(e in s for s in sets) == 1 for e in set().union(*sets))
    assert alone > 0
    config = ["--model-config", json.dumps(ROUTED_ONLY), "--expert-update", "routed-only"]
    a, secs = _cli(runs / "routed_only_dp2sharding2", *config, "--dp", "2", "--sharding", "2", timeout=200)
    assert a["run"]["settings"]["expert_update"] == "routed-only" and a["profile"]["world"] == 4
    diffs = {key: _max_diff(one, a, key) for key in ("losses", "grad_norms")}
    print(f"routed-only dp2 sharding2: {diffs}, {alone} (router, step) pairs with a lone expert, {secs:.1f}s")
    assert all(d <= ROUTED_TOL for d in diffs.values()), (diffs, one["losses"], a["losses"])


def test_two_nodes_sharing_one_out_match_one_process_and_keep_their_own_logs(ref, runs):
    """Two nodes simulated on this machine: two ``glm52 train --nnodes 2 --tp 2 --node-rank R``
    (one worker each), one rendezvous, one shared --out (a cluster filesystem).  Paddle's launcher
    names a worker's log by its rank on the node, so before, both nodes appended to one
    ``OUT/logs/workerlog.0`` (34 lines: rank 0's 20 and rank 1's 14, interleaved; node 1 echoed
    node 0's step lines as its own) and shared job.json and status/ (each node deleted the
    other's records at its start).  Now each node keeps them in ``OUT/logs/node<R>/``."""
    out = runs / "two_nodes"
    base = [sys.executable, "-m", "paddleformers_glm.train", "--no-progress", *COMMON, "--tp", "2", "--out", str(out)]
    got = run_nodes(base)
    for r, (rc, _, err) in enumerate(got):
        assert rc == 0, f"node {r} rc {rc}:\n{err[-3000:]}"
    _assert_close(ref[0], losses(out), "2 nodes x tp 1 (tp 2)")
    assert not (out / "logs" / "workerlog.0").exists()
    for r in (0, 1):
        node = out / "logs" / f"node{r}"
        job = _strict(node / "job.json")["job_id"]
        assert (node / "status" / f"rank{r}.ok").is_file() and not (node / "status" / f"rank{1 - r}.pid").exists()
        assert _strict(node / "status" / f"rank{r}.pid")["job"] == job
        assert ("[glm52 train] rank 0/2" in (node / "workerlog.0").read_text()) == (r == 0)  # rank 0 logs it
        assert job_processes(job) == [], f"node {r}: processes of the job still running"
    assert "step 1/4" in got[0][1] and "step 1/4" not in got[1][1]


def _strict(path):
    def refuse(token):
        raise ValueError(f"{path}: not strict JSON: {token}")

    return json.loads(path.read_text(encoding="utf-8"), parse_constant=refuse)


def _no_job_process_left(out, within_s=10.0):
    """Every process of the job (found by the job id in its environment) is gone within ``within_s``."""
    job = _strict(out / "logs" / "job.json")["job_id"]
    t0 = time.monotonic()
    while job_processes(job) and time.monotonic() - t0 < within_s:
        time.sleep(0.1)
    assert job_processes(job) == [], f"processes of the job still running {within_s:.0f} s later"


def _failure(out):
    """failure.json and every status record of the job, parsed as strict JSON."""
    for rec in (out / "logs" / "status").glob("*.json"):
        _strict(rec)
    return _strict(out / "logs" / "failure.json")


def _ended_after_last_beat(out, rank, rec):
    """Seconds from ``rank``'s last heartbeat (just before its fault) to the failure record: how
    long the job took to end, without its start-up (which a loaded machine stretches)."""
    return rec["time"] - _strict(out / "logs" / "status" / f"rank{rank}.beat")["time"]


@pytest.mark.parametrize("kind", ["raise", "kill"])
def test_dying_rank_ends_job_with_named_error(runs, kind):
    out = runs / f"fault_{kind}"
    p, _ = run_train_cli([*COMMON, "--tp", "2", "--out", str(out), "--fault", f"rank=1,step=2,kind={kind}"])
    assert p.returncode != 0
    msg = p.stderr
    if kind == "raise":
        assert "rank 1 failed: RuntimeError: injected fault on rank 1 at step 2" in msg, msg[-2000:]
    else:
        assert "rank 1 died without a Python error" in msg, msg[-2000:]
    rec = _failure(out)
    assert (rec["rank"], rec["cause"]) == (1, "error" if kind == "raise" else "died"), rec
    ended = _ended_after_last_beat(out, 1, rec)  # not the 30 s gloo timeout nor the 45 s grace
    assert ended < 25, f"the job took {ended:.0f} s to end after rank 1 died"
    _no_job_process_left(out)


def test_a_failed_job_exits_1_whichever_rank_failed(runs):
    """Paddle's launcher passes on the status of its lowest local rank that exited non-zero: with
    rank 0 the culprit, that was the fault's or the teardown's status, not a failure's.  Measured
    before: rank 0 SIGKILLed -> exit 247 (-9 through sys.exit); rank 0 hung under --pp 2 -> exit 143
    (SIGTERMed by Paddle's teardown: what a scheduler's requeue-on-preemption rule reads as a stop
    signal); the same faults on rank 1 -> exit 1."""
    out = runs / "fault_kill_rank0"
    p, _ = run_train_cli([*COMMON, "--tp", "2", "--out", str(out), "--fault", "rank=0,step=2,kind=kill"])
    assert p.returncode == 1, (p.returncode, p.stderr[-2000:])
    rec = _failure(out)
    assert (rec["rank"], rec["cause"], rec["returncode"]) == (0, "died", 1), rec
    _no_job_process_left(out)


def test_ranks_that_exit_0_before_finishing_are_a_failure(runs):
    """Every rank leaves with status 0 at step 2 of 4 (os._exit(0): no completion record).  Measured
    before: glm52 train exited 0 with no message and no failure.json, loss.json at 1 of 4 steps
    (success was Paddle's launcher's status alone).  Now every local rank's completion record is
    required."""
    out = runs / "fault_exit0"
    faults = "rank=0,step=2,kind=exit,code=0;rank=1,step=2,kind=exit,code=0"
    p, _ = run_train_cli([*COMMON, "--tp", "2", "--out", str(out), "--fault", faults])
    assert p.returncode == 1, p.stderr[-2000:]
    assert "rank(s) 0, 1 exited with status 0 before finishing the run" in p.stderr, p.stderr[-2000:]
    rec = _failure(out)
    assert (rec["rank"], rec["cause"]) == (0, "died"), rec
    assert _strict(out / "loss.json")["steps"] == 1
    _no_job_process_left(out)


@pytest.fixture(scope="module")
def frozen_jobs(runs):
    """The two jobs that end on a clock (gloo's 30 s timeout, ``--job-timeout 30``), started side by
    side when the first of their tests asks: they wait, not compute, so one wait serves both."""
    faults = {
        "stop": ["--fault", "rank=1,step=2,kind=stop"],
        "timeout": ["--fault", "rank=1,step=1,kind=hang", "--job-timeout", "30"],
    }
    jobs = {}
    for name, extra in faults.items():
        out = runs / f"fault_{name}"
        cmd = [sys.executable, "-m", "paddleformers_glm.train", "--no-progress", *COMMON, "--tp", "2"]
        with open(runs / f"fault_{name}.stderr", "w") as err:
            p = subprocess.Popen([*cmd, "--out", str(out), *extra], env=env(), stdout=subprocess.DEVNULL, stderr=err)
        jobs[name] = (p, out, runs / f"fault_{name}.stderr")
    yield jobs
    for p, _, _ in jobs.values():
        p.kill()


def _finished(job):
    """(exit code, stderr, out) of a ``frozen_jobs`` job once it has ended."""
    p, out, err = job
    p.wait(timeout=300)
    return p.returncode, err.read_text(), out


def test_stopped_rank_is_named_and_a_failure_record_is_left(frozen_jobs):
    """SIGSTOP on rank 1: rank 0 times out in gloo (30 s) and records rank 1 in state T first."""
    rc, stderr, out = _finished(frozen_jobs["stop"])
    assert rc != 0
    assert "rank 1 was stopped" in stderr, stderr[-2000:]
    rec = _failure(out)
    assert (rec["rank"], rec["cause"]) == (1, "stopped") and rec["message"].startswith("rank 1 was stopped")
    # ended by rank 0's gloo timeout (30 s), or at worst the launcher's 45 s watchdog on a frozen rank
    ended = _ended_after_last_beat(out, 1, rec)
    assert ended < 75, f"the job took {ended:.0f} s to end after rank 1 froze"
    _no_job_process_left(out)


def test_job_timeout_stops_a_hung_job_and_names_the_rank_behind(frozen_jobs):
    """Rank 1 hangs at step 1; ``--job-timeout 30`` ends the job (exit 124) before gloo's own
    30 s timeout can (that one starts only when rank 0 enters its collective).  The culprit is
    the rank behind in its heartbeat; were the machine so slow that rank 0 had not begun step 1
    either at 30 s, nobody would be behind and no culprit is invented: the test follows the
    recorded heartbeats, never the clock."""
    rc, stderr, out = _finished(frozen_jobs["timeout"])
    assert rc == 124, stderr[-2000:]
    rec = _failure(out)
    assert "--job-timeout 30" in rec["stopped_by_launcher"] and rec["stopped_by"]["kind"] == "timeout", rec
    beats = [_strict(out / "logs" / "status" / f"rank{r}.beat") for r in (0, 1)]
    if (beats[0]["step"], beats[0]["phase"]) != (beats[1]["step"], beats[1]["phase"]):
        assert (rec["rank"], rec["cause"]) == (1, "hung") and "rank 1 made no progress" in rec["message"], rec
    else:  # pragma: no cover - a machine too slow to start the job in 30 s
        assert (rec["rank"], rec["cause"]) == (None, "timeout"), (rec, beats)
    _no_job_process_left(out)


def test_nonfinite_steps_two_ranks_skip_then_stop_before_the_update(runs):
    """Rank 1's gradients are NaN at steps 2 and 3; one skip allowed: step 2 is skipped (logged,
    loss.json flags its grad norm), step 3 stops the job before the update: non-zero exit,
    failure.json naming step, rank and first non-finite gradient, no export, checkpoints kept."""
    out = runs / "nonfinite"
    faults = "rank=1,step=2,kind=nan;rank=1,step=3,kind=nan"
    p, _ = run_train_cli(
        [*COMMON, "--tp", "2", "--out", str(out), "--fault", faults, "--skip-nonfinite-steps", "1",
         "--save-every", "1", "--export"],
    )  # fmt: skip
    assert p.returncode == 1, p.stderr[-2000:]
    log0 = (out / "logs" / "workerlog.0").read_text()
    assert "warning: step 2: non-finite grad norm (nan); first non-finite gradient: " in log0, log0[-2000:]
    assert "step skipped, no update (1 of --skip-nonfinite-steps 1)" in log0
    rec = _failure(out)
    # the TP ranks' gradients are synced: both hold NaN, the first of them is named
    assert (rec["cause"], rec["step"], rec["rank"], rec["quantity"]) == ("nonfinite", 3, 0, "grad norm"), rec
    assert rec["first_nonfinite_grad"]["rank"] == 0 and rec["first_nonfinite_grad"]["name"]
    assert "rank(s) 0, 1 hold some" in rec["message"]
    assert rec["skipped_before"] == [2] and rec["last_checkpoint"].endswith("step_00000002")
    assert not (out / "export").exists() and not (out / "checkpoints" / "step_00000003").exists()
    loss = _strict(out / "loss.json")
    assert loss["steps"] == 2 and loss["skipped_steps"] == [2] and loss["nonfinite"] == ["grad_norms[1]"]
    _no_job_process_left(out)


def _start_training(out):
    """``--tp 2`` training for many steps, started in the background."""
    cmd = [sys.executable, "-m", "paddleformers_glm.train", "--no-progress", *COMMON, "--steps", "10000"]
    return subprocess.Popen([*cmd, "--tp", "2", "--out", str(out)], env=env(), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)  # fmt: skip


def _wait_for_step(p, out, step=2):
    """Returns once rank 1 of the job writing ``out`` has begun ``step``."""
    beat = out / "logs" / "status" / "rank1.beat"
    t0 = time.monotonic()
    while time.monotonic() - t0 < 120:
        try:
            if json.loads(beat.read_text())["step"] >= step:
                return
        except (OSError, ValueError):
            pass
        time.sleep(0.1)
    p.kill()
    pytest.fail(f"rank 1 never reached step {step}:\n{worker_logs(out)}")


SIGNALS = ("SIGTERM", "SIGINT", "SIGKILL")


def test_a_signal_to_the_launcher_ends_every_process_of_the_job(runs):
    """SIGTERM / SIGINT: one line (no traceback), exit 128 + signal, failure.json naming the sender;
    SIGKILL (no cleanup code runs): the workers die with it.  Either way no process of the job
    is left 10 s later, nor 15 s later.  The three jobs run side by side (one wait for all)."""
    outs = {sig: runs / f"signal_{sig}" for sig in SIGNALS}
    jobs = {sig: _start_training(out) for sig, out in outs.items()}
    try:
        for sig in SIGNALS:
            _wait_for_step(jobs[sig], outs[sig])
    except BaseException:
        for p in jobs.values():
            p.kill()  # the workers follow their launcher (the SIGKILL case below shows it)
        raise
    t0 = time.monotonic()
    for sig in SIGNALS:
        os.kill(jobs[sig].pid, getattr(signal, sig))
    errs = {}
    for sig in SIGNALS:
        _no_job_process_left(outs[sig], within_s=10.0)
        errs[sig] = jobs[sig].communicate(timeout=30)[1]
    time.sleep(max(0.0, 15.0 - (time.monotonic() - t0)))
    for sig in SIGNALS:
        _no_job_process_left(outs[sig], within_s=0.0)
    assert jobs["SIGKILL"].returncode == -signal.SIGKILL
    for sig in ("SIGTERM", "SIGINT"):
        p, err = jobs[sig], errs[sig]
        assert p.returncode == 128 + getattr(signal, sig), err[-2000:]
        lines = [ln for ln in err.splitlines() if ln.startswith("glm52 train") or "Traceback" in ln]
        assert len(lines) == 1 and lines[0].startswith(f"glm52 train: stopped by {sig} to the launcher"), err[-2000:]
        rec = _failure(outs[sig])
        assert (rec["rank"], rec["cause"]) == (None, "signal") and rec["stopped_by"]["sender_pid"] == os.getpid(), rec
