"""``glm52 plan`` against ``glm52 train`` on the tiny checkpoint: every rank's measured parameter,
gradient and optimizer-state bytes (loss.json ``memory``) equal the plan's (1 rank, TP2 x PP2,
TP2 x EP2, DP2 x sharding 2), the activation estimate is within a factor of 2 of the first step's
saved bytes, and (multi-process) every rank read exactly the checkpoint bytes of its own shards.
For expert parallelism with sharding ranks (no processes): every rank's expert parameters, expert
optimizer state and expert replica count equal what the trainer's topology builds, and the
planner refuses exactly the layouts the trainer refuses."""

from __future__ import annotations

from pathlib import Path

import pytest

from paddleformers_glm.configuration import GlmMoeDsaConfig
from paddleformers_glm.parallel.pipeline import split_stages
from paddleformers_glm.train import plan as planmod
from tests._dist.runner import losses, run_train_cli, worker_logs

SEQ = 64


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def _train(ckpt, out, *layout):
    args = ["--model", str(ckpt), "--steps", "2", "--seq-len", str(SEQ), "--global-batch-size", "4"]
    p, _ = run_train_cli([*args, "--micro-batch-size", "1", "--out", str(out), *layout], timeout=300)
    if p.returncode != 0:
        pytest.fail(f"{layout} failed:\n{p.stderr[-3000:]}\n{worker_logs(out)}")
    return losses(out)


def _check_plan_equals_measured(ckpt, got, tp=1, pp=1, ep=1, sharding=1, sharding_stage=1):
    config = GlmMoeDsaConfig.from_pretrained(str(ckpt))
    world = got["profile"]["world"]
    lay = planmod.Layout(
        tp=tp, pp=pp, dp=world // (tp * pp * sharding), ep=ep, dtype="float32", sp=bool(got["profile"]["sp"]),
        seq_len=SEQ, sharding=sharding, sharding_stage=sharding_stage, sharding_partition="fleet",
    )  # fmt: skip
    plan = planmod.plan_layout(config, lay)
    specs = split_stages(config.num_hidden_layers, pp, has_mtp=True)
    mem = got["memory"]
    assert [m["rank"] for m in mem] == list(range(world))
    for m, p in zip(mem, plan["ranks"]):
        # gradients: what the backward leaves (the plan's peak) and what the step holds after the reduce
        assert m["params_bytes"] == p["params_bytes"] and m["grads_before_reduce_bytes"] == p["grads_bytes"], (m, p)
        assert m["grads_bytes"] == p["grads_after_reduce_bytes"], (m, p)
        assert m["optimizer"] == "paddle.optimizer.AdamW" and m["optimizer_bytes"] == p["optimizer_bytes"], (m, p)
        assert m["peak_bytes"] > 0 and m["peak_kind"] in ("peak_rss", "max_memory_allocated")
        # the activation estimate against the first step's peak saved bytes
        micro = got["profile"]["global_batch_size"] // (lay.replicas * got["profile"]["micro_batch_size"])
        est = planmod.activation_bytes(config, lay, specs[p["stage"]], micro)
        assert 0.5 <= est / m["activations_bytes"] <= 2.0, (m["rank"], est, m["activations_bytes"])


def test_single_process_plan_equals_measured(tiny_ckpt, tmp_path):
    _check_plan_equals_measured(tiny_ckpt, _train(tiny_ckpt, tmp_path))


@pytest.mark.slow
@pytest.mark.parametrize("tp,pp,ep", [(2, 2, 1), (2, 1, 2)], ids=["tp2-pp2", "tp2-ep2"])
def test_parallel_plan_equals_measured_and_ranks_read_their_shards(tiny_ckpt, tmp_path, tp, pp, ep):
    from tests.test_train_glm import _check_load_records

    got = _train(tiny_ckpt, tmp_path, "--tp", str(tp), "--pp", str(pp), "--ep", str(ep))
    assert got["profile"]["world"] == tp * pp
    _check_plan_equals_measured(tiny_ckpt, got, tp, pp, ep)
    _check_load_records(tiny_ckpt, tmp_path, got["profile"])  # bytes_read == bytes of its shards


@pytest.mark.slow
@pytest.mark.parametrize("ep,stage", [(1, 1), (2, 2)], ids=["ep1-stage1", "ep2-stage2"])
def test_dp2_sharding2_plan_equals_measured(tiny_ckpt, tmp_path, ep, stage):
    """Fleet's whole-tensor optimizer-state partition, rank by rank (needs the trainer's --sharding);
    with experts over the two dp ranks (each sharding rank holding both) and stage-2 gradients."""
    import argparse

    from paddleformers_glm.train.command import add_train_arguments

    if "--sharding" not in add_train_arguments(argparse.ArgumentParser())._option_string_actions:
        pytest.skip("this trainer has no --sharding")
    layout = ["--dp", "2", "--sharding", "2", "--ep", str(ep), "--sharding-stage", str(stage)]
    got = _train(tiny_ckpt, tmp_path, *layout)
    assert got["profile"]["world"] == 4
    _check_plan_equals_measured(tiny_ckpt, got, ep=ep, sharding=2, sharding_stage=stage)


# ---------------------------------------------------------------- expert grid x sharding, no processes
# (tp, pp, dp, sharding, cp, ep, etp)
EXPERT_GRID = [
    (1, 1, 2, 2, 1, 2, 1),  # experts over dp, repeated on both sharding ranks
    (2, 1, 1, 2, 1, 2, 1),  # experts over tp
    (1, 2, 1, 2, 2, 2, 1),  # experts over cp, two stages
    (2, 1, 2, 2, 1, 4, 1),
    (2, 1, 1, 2, 1, 1, 2),  # expert tensor parallel only
    (2, 1, 2, 2, 1, 2, 2),
    (1, 1, 4, 2, 1, 2, 1),  # edp 2 inside each sharding rank
]


def _trainer_expert_view(config, pc, rank_coord):
    """Per rank: (stage, ep rank, etp rank, [(numel, dtype)] of the expert tensors) as the trainer
    builds it: Fleet's rank order, the trainer's expert layout, the stage built under that
    Topology (lazily: only shapes)."""
    import math

    import paddle

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.parallel.layers import get_shard_spec
    from paddleformers_glm.parallel.topology import Topology, expert_layout
    from paddleformers_glm.train.memory import dtype_name

    specs = split_stages(config.num_hidden_layers, pc.pp, has_mtp=True)
    built: dict[tuple, list] = {}
    out = []
    for c in rank_coord:
        edp_r, ep_r, etp_r = expert_layout(pc, c.data, c.model, c.sep)
        key = (c.pipe, c.model, ep_r, etp_r)
        if key not in built:
            ranks = {"tp": c.model, "pp": c.pipe, "dp": c.data, "sharding": c.sharding, "cp": c.sep}
            topo = Topology(pc, ranks=ranks | {"edp": edp_r, "ep": ep_r, "etp": etp_r})
            with paddle.LazyGuard():
                stage = GlmMoeDsaForCausalLM(config, "bfloat16", topology=topo, stage=specs[c.pipe])
            built[key] = [
                (int(math.prod(p.shape)), dtype_name(p.dtype))
                for _, p in stage.named_parameters()
                if get_shard_spec(p).expert
            ]
        out.append((c.pipe, ep_r, etp_r, built[key]))
    return out


@pytest.mark.parametrize("partition", ["even", "fleet"])
@pytest.mark.parametrize("tp,pp,dp,sharding,cp,ep,etp", EXPERT_GRID)
def test_plan_expert_state_with_sharding_equals_the_trainers_build(tp, pp, dp, sharding, cp, ep, etp, partition):
    import math

    from paddle.distributed.fleet.base.topology import CommunicateTopology

    from paddleformers_glm.parallel.topology import ParallelConfig

    from ._tiny import tiny_config

    config = tiny_config()
    world = tp * pp * dp * sharding * cp
    pc = ParallelConfig.from_world(world, tp=tp, pp=pp, ep=ep, etp=etp, sharding=sharding, cp=cp, sp=tp > 1)
    assert pc.dp == dp
    lay = planmod.Layout(
        tp=tp, pp=pp, dp=dp, sharding=sharding, cp=cp, ep=ep, etp=etp, sp=tp > 1, seq_len=SEQ,
        sharding_partition=partition,
    )  # fmt: skip
    plan = planmod.plan_layout(config, lay)
    # Fleet's hybrid order (the trainer's fleet.init): data, pipe, sharding, sep (cp), context, model
    ftopo = CommunicateTopology(["data", "pipe", "sharding", "sep", "context", "model"], [dp, pp, sharding, cp, 1, tp])
    view = _trainer_expert_view(config, pc, [ftopo.get_coord(r) for r in range(world)])
    assert len(plan["ranks"]) == world
    for r, (stage, ep_r, etp_r, experts) in zip(plan["ranks"], view):
        assert r["stage"] == stage
        assert experts, "the tiny model has MoE layers on every stage"
        assert r["expert_params"] == sum(n for n, _ in experts), (r["rank"], ep_r, etp_r)
    # replicas of one expert shard: the ranks of a stage with the same (ep, etp) rank, on every sharding rank
    holders: dict[tuple, int] = {}
    for stage, ep_r, etp_r, _ in view:
        holders[(stage, ep_r, etp_r)] = holders.get((stage, ep_r, etp_r), 0) + 1
    assert set(holders.values()) == {plan["layout"]["expert_replicas"]}
    assert plan["layout"]["expert_replicas"] == plan["layout"]["edp"] * sharding
    assert plan["layout"]["edp"] == tp * dp * cp // (ep * etp)
    # expert optimizer state (AdamW multi-precision: fp32 moments + master, 2 [1] beta powers per
    # tensor) splits over the sharding ranks, each of which holds the same expert tensors
    for stage in range(pp):
        experts = next(e for s, _, _, e in view if s == stage)
        whole = sum(12 * n + 8 for n, d in experts if d == "bfloat16")
        got = [r["expert_optimizer_bytes"] for r in plan["ranks"] if r["stage"] == stage]
        if partition == "even":
            assert set(got) == {math.ceil(whole / sharding)}
        else:  # whole tensors: each expert tensor's state on exactly one sharding rank
            by_sd = plan["kinds"][stage]["expert_optimizer_bytes_by_sharding_rank"]
            assert sum(by_sd) == whole and len(by_sd) == sharding and min(by_sd) < whole


# the trainer's refusals: experts never span sharding ranks; (layout, refused)
REFUSED_OR_NOT = [
    ((1, 1, 1, 2, 1, 2, 1), True),  # ep 2 over one tp x dp x cp rank, whatever the sharding degree
    ((2, 1, 1, 4, 1, 4, 1), True),  # ep 4 > tp 2
    ((1, 1, 2, 2, 1, 4, 1), True),
    ((2, 1, 1, 2, 1, 2, 2), True),  # ep x etp 4 > tp 2
    ((1, 1, 1, 2, 2, 2, 1), False),  # ep over cp
    *((lay, False) for lay in EXPERT_GRID),
]


def _ids(v):
    return "x".join(map(str, v)) if isinstance(v, tuple) else ("refused" if v else "runs")


@pytest.mark.parametrize("layout,refused", REFUSED_OR_NOT, ids=_ids)
def test_plan_refuses_what_the_trainer_refuses(tmp_path, layout, refused):
    import argparse

    from paddleformers_glm.parallel.topology import ParallelConfigError
    from paddleformers_glm.train.adapter import make_adapter
    from paddleformers_glm.train.command import add_train_arguments, config_from_args
    from paddleformers_glm.train.settings import parallel_config

    from .conftest import TINY_CONFIG

    tp, pp, dp, sharding, cp, ep, etp = layout
    flags = [f"--{k}={v}" for k, v in (("tp", tp), ("pp", pp), ("dp", dp), ("sharding", sharding), ("cp", cp))]
    flags += [f"--ep={ep}", f"--etp={etp}", f"--seq-len={SEQ}", "--global-batch-size=16"]
    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", str(TINY_CONFIG.parent), "--out", str(tmp_path), *flags]
    )
    cfg = config_from_args(args)
    world = tp * pp * dp * sharding * cp
    trainer_error = None
    try:  # the trainer's checks before it launches (train/command.py run_train)
        pc = parallel_config(cfg, world)
        adapter = make_adapter(cfg.model, **cfg.model_args)
        pc.validate(world, **adapter.parallel_sizes())
        adapter.check_layout(pc)
    except ParallelConfigError as e:
        trainer_error = str(e)
    config = GlmMoeDsaConfig.from_pretrained(str(TINY_CONFIG))
    lay = planmod.Layout(
        tp=tp, pp=pp, dp=dp, sharding=sharding, cp=cp, ep=ep, etp=etp, seq_len=SEQ, global_batch_size=16
    )  # fmt: skip
    assert (trainer_error is not None) == refused, trainer_error
    if not refused:
        planmod.plan_layout(config, lay)  # no error
    else:
        with pytest.raises(ParallelConfigError) as e:
            planmod.plan_layout(config, lay)
        assert trainer_error in str(e.value)  # the same message: flag, expected, actual
        assert f"ep {ep}" in str(e.value) and f"--sharding {sharding}" in str(e.value)
