"""``glm52 plan``: the 744B model's parameter count and fit verdict come quickly and without
allocating weights; the per-layer-kind composition equals building each real stage; the
activation estimate is within a factor of 2 of the bytes autograd really saves (tiny model)."""

from __future__ import annotations

import json
import math
import shlex
import time

import paddle
import pytest

from paddleformers_glm.cli import main as cli_main
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.parallel.pipeline import StageSpec, split_stages
from paddleformers_glm.parallel.topology import ParallelConfig, Topology
from paddleformers_glm.train import plan as planmod
from paddleformers_glm.train.command import train_line_error
from paddleformers_glm.train.memory import state_bytes

from ._tiny import tiny_config
from .conftest import OFFICIAL_CONFIG, TINY_CONFIG


def test_plan_744b_counts_params_and_gives_a_verdict_fast_without_allocating(tmp_path, capsys, monkeypatch):
    import resource

    planmod._CACHE.clear()
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    out = tmp_path / "plan.json"
    args = ["plan", "--model", str(OFFICIAL_CONFIG.parent), "--tp", "8", "--pp", "8", "--dp", "4", "--ep", "32"]
    t0 = time.process_time()  # CPU seconds of this process: what the plan costs, not the machine's load
    rc = cli_main([*args, "--sp", "--recompute", "full", "--gpu-mem-gb", "80", "--json", str(out)])
    seconds = time.process_time() - t0
    assert rc == 0 and seconds < 10, seconds
    plan = json.loads(out.read_text())
    assert 752e9 <= plan["total_params"] <= 755e9, plan["total_params"]
    assert isinstance(plan["fits"], bool) and len(plan["ranks"]) == 256
    r = plan["ranks"][0]
    assert r["total_bytes"] == sum(
        r[k] for k in ("params_bytes", "grads_bytes", "optimizer_bytes", "activations_bytes")
    )
    # 4.5e9+ bf16 parameters were never materialised: peak RSS grew by far less than one stage's bytes
    grown = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) * 1024
    assert grown < plan["ranks"][0]["params_bytes"] / 4, grown
    assert "fits" in capsys.readouterr().out
    # one GPU cannot hold 1.5 TB of weights
    rc = cli_main(["plan", "--model", str(OFFICIAL_CONFIG.parent), "--json", str(out)])
    assert rc == 0 and json.loads(out.read_text())["fits"] is False


def _direct(config, pc, spec, ranks, dtype):
    topo = Topology(pc, ranks=ranks)
    with paddle.LazyGuard():
        st = GlmMoeDsaForCausalLM(config, dtype, topology=topo, stage=spec)
    return [(n, int(math.prod(p.shape)), str(p.dtype).replace("paddle.", "")) for n, p in st.named_parameters()]


@pytest.mark.parametrize("tp,pp,ep", [(2, 2, 1), (2, 1, 2), (1, 3, 4)])
def test_composed_stage_equals_building_that_stage(tp, pp, ep):
    c = tiny_config()
    lay = planmod.Layout(tp=tp, pp=pp, ep=ep, dtype="bfloat16")
    pc = ParallelConfig(tp=tp, pp=pp, dp=1, ep=ep)
    for spec in split_stages(c.num_hidden_layers, pp, has_mtp=True):
        got = [(n, k, d) for n, k, d, _, _ in planmod.stage_params(c, lay, spec)]
        want = _direct(c, pc, spec, {"tp": 0, "pp": spec.stage, "ep": 0}, "bfloat16")
        assert got == want, spec  # same tensors in the same order (the optimizer's order)
    # the whole model once (embedding shared by the MTP stage counted once) = the unsplit build
    full = _direct(c, ParallelConfig(), StageSpec.whole(c.num_hidden_layers, True), {}, "float32")
    assert planmod.total_params(c, lay) == sum(n for _, n, _ in full)


def test_counts_follow_a_config_changed_in_place():
    """The probes are kept per model: a config changed in place (the same object) is another model,
    counted anew, as building its stage counts it; before, a second plan of the same object gave the
    first model's counts (its probe was keyed by the object's id)."""
    c = tiny_config()
    lay = planmod.Layout(tp=2, ep=2, dtype="bfloat16")
    before = planmod.total_params(c, lay)
    c.n_routed_experts *= 2
    c.hidden_size *= 2
    after = planmod.total_params(c, lay)
    full = _direct(c, ParallelConfig(), StageSpec.whole(c.num_hidden_layers, True), {}, "float32")
    assert after == sum(n for _, n, _ in full) and after > before
    c.note = {"a set", "not JSON"}  # a value of the user's that JSON cannot hold: still planned
    assert planmod.total_params(c, lay) == after


def test_fleet_sharding_partition_is_fleets():
    from paddle.distributed.fleet.meta_optimizers.dygraph_optimizer import dygraph_sharding_optimizer as dso

    from paddleformers_glm.train.memory import fleet_sharding_partition

    numels = [6, 10, 3, 10, 1, 7, 7, 2]

    class P:  # the attributes Fleet's partition reads
        def __init__(self, i, n):
            self.name, self.shape = f"p{i}", [n]

    params = [P(i, n) for i, n in enumerate(numels)]
    fake = type("S", (), {"_sharding_world_size": 3, "_parameter_list": params})()
    fleet = dso.DygraphShardingOptimizer._partition_parameters(fake)
    ours = fleet_sharding_partition(numels, 3)
    assert [[p.name for p in fleet[r]] for r in range(3)] == [[f"p{i}" for i in ours[r]] for r in range(3)]


def test_state_bytes_rule():
    # two bf16 tensors (10 and 6 elements) and one fp32 (4), the fp32 one frozen
    params = [(10, "bfloat16"), (6, "bfloat16"), (4, "float32", False)]
    st = state_bytes(params)
    assert st == {"params_bytes": 16 * 2 + 16, "grads_bytes": 16 * 4, "optimizer_bytes": 16 * 12 + 2 * 8}
    sh = state_bytes(params, sharding_degree=4, sharding_stage=2)
    # stage 2 reduces the gradients onto their owners after the backward, which holds them all
    assert sh["optimizer_bytes"] == math.ceil((16 * 12 + 16) / 4) and sh["grads_bytes"] == 64
    assert state_bytes(params, sharding_degree=4, sharding_stage=3)["grads_bytes"] == 16
    # trainable but never stepped (no gradient reaches it): a grad buffer, no optimizer state
    st = state_bytes([(10, "bfloat16", True, False)])
    assert (st["grads_bytes"], st["optimizer_bytes"]) == (40, 0)


def _saved_bytes(stage, batch, params):
    """Peak bytes autograd keeps for backward (distinct storages, parameters excluded)."""
    ptrs = {p.data_ptr() for p in params}
    live, cur, peak = {}, [0], [0]

    def pack(t):
        ptr = t.data_ptr()
        if ptr in ptrs:
            return t
        if ptr not in live:
            live[ptr] = [0, int(math.prod(t.shape)) * t.element_size()]
            cur[0] += live[ptr][1]
            peak[0] = max(peak[0], cur[0])
        live[ptr][0] += 1
        return (ptr, t)

    def unpack(x):
        if not isinstance(x, tuple):
            return x
        ptr, t = x
        live[ptr][0] -= 1
        if live[ptr][0] == 0:
            cur[0] -= live.pop(ptr)[1]
        return t

    with paddle.autograd.saved_tensors_hooks(pack, unpack):
        out = stage.forward_stage(None, batch)
    assert out.losses
    return peak[0]


@pytest.mark.parametrize("seq", [64, 256])
def test_activation_estimate_within_factor_2_of_saved_bytes(seq):
    c = tiny_config()
    spec = StageSpec.whole(c.num_hidden_layers, True)
    stage = GlmMoeDsaForCausalLM(c, "float32", stage=spec)
    ids = paddle.randint(0, c.vocab_size, [1, seq])
    measured = _saved_bytes(stage, {"input_ids": ids, "labels": ids}, list(stage.parameters()))
    est = planmod.activation_bytes(c, planmod.Layout(seq_len=seq, dtype="float32"), spec, 1)
    assert 0.5 <= est / measured <= 2.0, (est, measured)
    full = planmod.activation_bytes(c, planmod.Layout(seq_len=seq, dtype="float32", recompute="full"), spec, 1)
    assert full < est


def test_plan_refuses_a_layout_naming_the_setting(tmp_path, capsys):
    assert cli_main(["plan", "--model", str(TINY_CONFIG.parent), "--tp", "8"]) == 2
    err = capsys.readouterr().err
    assert "tp 8" in err and "num_attention_heads" in err


def test_search_lists_fitting_layouts_fastest_first(tmp_path):
    out = tmp_path / "s.json"
    model = str(TINY_CONFIG.parent)
    # a budget (10 MiB) that the tiny model's fp32 state fits only when split over several ranks
    budget = ["--gpu-mem-gb", str(10 / 1024), "--dtype", "float32", "--seq-len", "32"]
    rc = cli_main(["plan", "--model", model, "--search", "--gpus", "8", *budget, "--json", str(out)])
    found = json.loads(out.read_text())["layouts"]
    assert rc == 0 and found
    costs = [r["s_per_token"] for r in found]  # the estimated time per token (tests/test_plan_cost.py)
    assert costs == sorted(costs)
    for r in found:  # each listed line is the run planned: alone it plans the same, and glm52 train takes it
        flags = shlex.split(r["flags"])
        assert cli_main(["plan", "--model", model, *flags, "--gpu-mem-gb", budget[1], "--json", str(out)]) == 0
        again = json.loads(out.read_text())
        assert again["fits"] is True and again["max_rank_bytes"] / 2**30 == r["max_rank_gib"], r
        assert train_line_error(["--model", model, *flags]) is None, r["flags"]
    # the run settings ride along: the search's --seq-len / --dtype, the resolved batch (glm52 train's
    # defaults differ: a listed line without them ran another, smaller, float32 run)
    assert all("--seq-len 32 " in r["flags"] and "--dtype float32" in r["flags"] for r in found)
    assert all("--global-batch-size " in r["flags"] and "--micro-batch-size 1" in r["flags"] for r in found)
    warm = ["plan", "--model", model, "--search", "--gpus", "4", *budget, "--indexer-stage", "warmup"]
    assert cli_main([*warm, "--json", str(out)]) == 0
    warm_found = json.loads(out.read_text())["layouts"]
    assert warm_found and all("--indexer-stage warmup" in r["flags"] for r in warm_found)
    assert not any(r["flags"].startswith("--tp 1 --pp 1 --dp 8 --ep 1 ") for r in found)
    assert cli_main(["plan", "--model", model, "--dp", "8", *budget, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fits"] is False  # plain data parallel holds everything


def test_search_with_a_sharding_stage_keeps_the_layouts_without_sharding(tmp_path):
    """``--search --sharding-stage 2``: the stage applies where the layout has sharding ranks; the
    layouts without them are tried at stage 1 (a stage above 1 at ``--sharding 1`` is refused), so
    the search lists the same layouts as at stage 1 apart from the sharded ones' flag."""
    listed = {}
    for stage in ("1", "2"):
        out = tmp_path / f"s{stage}.json"
        args = ["plan", "--model", str(TINY_CONFIG.parent), "--search", "--gpus", "4", "--top", "100"]
        assert cli_main([*args, "--sharding-stage", stage, "--json", str(out)]) == 0
        listed[stage] = [r["flags"] for r in json.loads(out.read_text())["layouts"]]
    assert any("--sharding" not in f for f in listed["2"]), listed["2"]
    assert [f.replace("--sharding-stage 2", "--sharding-stage 1") for f in listed["2"]] == listed["1"]


def test_search_with_cp_keeps_the_gpu_count_and_folds_experts_over_cp(tmp_path):
    """``--search --gpus 8 --cp 2``: every listed layout has 8 ranks in all (cp included) and an
    expert grid the trainer builds (ep divides tp x dp x cp: not the sharding ranks, which each hold
    the whole grid); some use an ep that only fits because the grid spans the cp ranks (ep > tp x dp)."""
    out = tmp_path / "s.json"
    budget = ["--gpu-mem-gb", str(10 / 1024), "--dtype", "float32", "--seq-len", "32"]
    args = ["plan", "--model", str(TINY_CONFIG.parent), "--search", "--gpus", "8", "--cp", "2", "--top", "100"]
    assert cli_main([*args, *budget, "--json", str(out)]) == 0
    found = json.loads(out.read_text())["layouts"]
    assert found
    sizes = []
    for r in found:
        f = r["flags"].split()
        get = {k[2:]: int(v) for k, v in zip(f, f[1:]) if k in ("--tp", "--pp", "--dp", "--ep", "--sharding", "--cp")}
        assert get["cp"] == 2 and get["tp"] * get["pp"] * get["dp"] * get.get("sharding", 1) * 2 == 8, r["flags"]
        assert (get["tp"] * get["dp"] * 2) % get["ep"] == 0, r["flags"]
        sizes.append((get["ep"], get["tp"] * get["dp"]))
    assert any(ep > tdp for ep, tdp in sizes), sizes
    assert any("--sharding" in r["flags"] and ep > 1 for r, (ep, _) in zip(found, sizes)), "sharding x EP listed"


# ---------------------------------------------------------------------- the first hour with plan
def test_plan_takes_a_train_command_line_with_a_note(tmp_path, capsys):
    """`glm52 train ...` with `train` swapped for `plan`: planned with the trainer's defaults for
    what the line leaves unset; the training-only flags are named in one note."""
    model = str(TINY_CONFIG.parent)
    train_line = ["--model", model, "--tp", "2", "--pp", "2", "--sp", "--steps", "3", "--lr", "1e-3"]
    train_line += ["--out", str(tmp_path / "run"), "--no-progress", "--seed", "7", "--dump-step", "d", "1"]
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    assert cli_main(["plan", *train_line, "--json", str(a)]) == 0
    err = capsys.readouterr().err
    note = [ln for ln in err.splitlines() if "note:" in ln]
    assert len(note) == 1 and all(f in note[0] for f in ("--steps", "--lr", "--out", "--no-progress", "--dump-step"))
    assert "--seq-len 64" in note[0] and "--dtype float32" in note[0]
    explicit = ["--tp", "2", "--pp", "2", "--sp", "--seq-len", "64", "--global-batch-size", "4", "--dtype", "float32"]
    assert cli_main(["plan", "--model", model, *explicit, "--json", str(b)]) == 0
    pa, pb = json.loads(a.read_text()), json.loads(b.read_text())
    assert pa["kinds"] == pb["kinds"] and pa["max_rank_bytes"] == pb["max_rank_bytes"]
    # a flag neither command knows is still an error, with plan's usage
    with pytest.raises(SystemExit) as e:
        cli_main(["plan", "--model", model, "--stepz", "3"])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "usage: glm52 plan" in err and "--stepz" in err


def _help(command: str) -> str:
    import contextlib
    import io

    buf = io.StringIO()
    with contextlib.redirect_stdout(buf), pytest.raises(SystemExit):
        cli_main([command, "--help"])
    return " ".join(buf.getvalue().split())


def test_plan_help_describes_vpp_as_the_trainers():
    """plan and train share their layout flags: plan's --vpp help is the trainer's, word for word
    (it once said the trainer had no --vpp)."""
    import re

    plan, train = _help("plan"), _help("train")
    vpp = re.compile(r"--vpp VPP (.*?) \(default: 1\)")
    assert vpp.search(plan) and vpp.search(plan).group(1) == vpp.search(train).group(1)
    assert "interleaved" in vpp.search(plan).group(1) and "has none" not in plan
    assert "(default: 80.0)" in plan  # --gpu-mem-gb: help shows defaults


@pytest.mark.parametrize(
    "lay",
    [
        dict(tp=8, pp=8, dp=4, ep=32, sp=True, recompute="full"),
        dict(tp=4, pp=4, dp=4, ep=16, sharding=2, sharding_stage=1, sp=True),
        dict(tp=2, pp=16, dp=2, ep=4, sharding=4, sharding_stage=2, sp=True),
        dict(tp=8, pp=8, dp=1, ep=8, sharding=4, sharding_stage=3, sp=True),
    ],
)
def test_summed_parts_equal_the_tensor_by_tensor_account(lay):
    """A stage's bytes from per-part totals (the fast path) equal state_bytes over every tensor of
    the stage (the rule itself), sharding stages 1-3 and expert parallel included."""
    from paddleformers_glm.configuration import GlmMoeDsaConfig

    c = GlmMoeDsaConfig.from_pretrained(OFFICIAL_CONFIG.parent)
    L = planmod.Layout(**lay)
    plan = planmod.plan_layout(c, L, per_rank=False)
    sd, stage = L.sharding, L.sharding_stage if L.sharding > 1 else 0
    for spec, kind in zip(split_stages(c.num_hidden_layers, L.pp, has_mtp=True), plan["kinds"]):
        params = planmod.stage_params(c, L, spec)
        items = planmod.state_items(params)
        want = state_bytes(items, sharding_degree=sd, sharding_stage=stage)
        expert = [it for it, (n, *_) in zip(items, params) if ".mlp.experts." in n]
        want["expert_optimizer_bytes"] = state_bytes(expert, sharding_degree=sd, sharding_stage=stage)[
            "optimizer_bytes"
        ]
        got = {k: kind[k] for k in want}
        assert got == want, spec
        assert kind["num_params"] == sum(n for _, n, *_ in params)


def test_search_of_256_gpus_builds_few_probes_and_reports_progress(monkeypatch, capsys):
    """The search is arithmetic over layouts: one probe per tensor-parallel shape (expert-parallel
    ranks reuse it), each layer kind summed once, never the tensors of every layer per layout."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.train import memory

    planmod._CACHE.clear()
    built, summed = [], [0]
    real_init, real_bytes = GlmMoeDsaForCausalLM.__init__, memory.state_bytes

    def counting_init(self, *a, **k):
        built.append(1)
        return real_init(self, *a, **k)

    def counting_bytes(*a, **k):
        summed[0] += 1
        return real_bytes(*a, **k)

    monkeypatch.setattr(GlmMoeDsaForCausalLM, "__init__", counting_init)
    monkeypatch.setattr(memory, "state_bytes", counting_bytes)
    rc = cli_main(["plan", "--model", str(OFFICIAL_CONFIG.parent), "--search", "--gpus", "256", "--top", "5"])
    cap = capsys.readouterr()
    assert rc == 0 and "--tp 8" in cap.out
    assert len(built) <= 4, len(built)  # tp 1, 2, 4, 8 (sp with tp > 1)
    # each part of each (tp, ep) shape summed once (all its tensors, its experts): a few hundred
    # sums for the 2604 layouts of 256 GPUs, not a walk over every layer's tensors per layout
    assert summed[0] <= 2 * sum(len(lc.parts) for lc in planmod._CACHE.values()), summed[0]
    assert summed[0] < 500
    progress = [ln for ln in cap.err.splitlines() if ln.startswith("[glm52 plan]")]
    assert len(progress) == 4 and "searched" in progress[-1] and "layouts of 256 GPUs" in progress[-1]


def _trainer_check(flags, world, tmp_path):
    """The trainer's verdict on a command line before it launches (TrainConfig.validate + check_run):
    None, or its error; with the pipeline ranks it would build (rank_spec of its chunks)."""
    import argparse

    from paddleformers_glm.parallel.pipeline import rank_spec
    from paddleformers_glm.train.adapter import make_adapter
    from paddleformers_glm.train.command import add_train_arguments, config_from_args
    from paddleformers_glm.train.settings import check_run

    args = add_train_arguments(argparse.ArgumentParser()).parse_args(
        ["--model", str(TINY_CONFIG.parent), "--out", str(tmp_path), *flags]
    )
    try:
        cfg = config_from_args(args)
        pc, chunks = check_run(cfg, make_adapter(cfg.model, **cfg.model_args), world)
    except ValueError as e:
        return str(e), None
    return None, [rank_spec(chunks, pc.pp, s) for s in range(pc.pp)]


@pytest.mark.parametrize(
    "flags",
    [
        ["--first-stage-layers", "2"],  # the first of pp x vpp chunks: 2 layers (not the first rank's 2)
        ["--last-stage-layers", "1"],  # 7 layers over 3 chunks: refused by the trainer
        ["--pp-layout", "2 2 2 2"],  # pp x vpp chunk sizes: what the trainer takes
        ["--pp-layout", "4 4"],  # pp sizes: the trainer refuses them under --vpp 2
        ["--pp-layout", "1 3 3 1"],
    ],
)
def test_plan_under_vpp_lays_out_the_trainers_chunks(tmp_path, flags):
    """``--vpp V``: the trainer splits the layers into pp x V chunks (``--pp-layout`` and the
    first/last stage sizes describe chunks) and runs chunk c on pipeline rank c % pp.  The plan
    accepts exactly the lines the trainer accepts and counts each rank's parameters as the trainer
    builds that rank (was: pp stages of the pp-only split; --first-stage-layers 2 planned rank 0 at
    159,264 parameters where the trainer builds 334,784, --pp-layout '2 2 2 2' refused)."""
    from paddleformers_glm.configuration import GlmMoeDsaConfig

    base = ["--pp", "2", "--vpp", "2", "--global-batch-size", "2", "--seq-len", "64", "--dtype", "bfloat16"]
    err, ranks = _trainer_check([*base, *flags], 2, tmp_path)
    c = GlmMoeDsaConfig.from_pretrained(str(TINY_CONFIG.parent))
    kw = dict(pp=2, vpp=2, global_batch_size=2, seq_len=64)
    kw |= {flags[0][2:].replace("-", "_"): int(flags[1]) if "stage" in flags[0] else flags[1]}
    lay = planmod.Layout(**kw)
    if err is not None:
        with pytest.raises(ValueError) as e:
            planmod.plan_layout(c, lay)
        assert err in str(e.value)
        return
    plan = planmod.plan_layout(c, lay)
    pc = ParallelConfig(tp=1, pp=2, dp=1)
    for kind, spec in zip(plan["kinds"], ranks, strict=True):
        want = _direct(c, pc, spec, {"pp": spec.stage}, "bfloat16")
        assert kind["num_params"] == sum(n for _, n, _ in want), (spec, kind["num_params"])
        assert kind["layer_ids"] == list(spec.layers)
        assert (kind["embedding"], kind["head"], kind["mtp"]) == (spec.has_embedding, spec.has_head, spec.has_mtp)


def test_plan_refuses_vpp_without_a_pipeline(tmp_path):
    from paddleformers_glm.configuration import GlmMoeDsaConfig

    err, _ = _trainer_check(["--vpp", "2", "--global-batch-size", "1", "--seq-len", "64"], 1, tmp_path)
    assert err is not None and "--vpp 2" in err
    c = GlmMoeDsaConfig.from_pretrained(str(TINY_CONFIG.parent))
    with pytest.raises(ValueError) as e:
        planmod.plan_layout(c, planmod.Layout(pp=1, vpp=2, global_batch_size=1, seq_len=64))
    assert err in str(e.value)


def _fleet_interleaved_schedule(pp, vpp, micro, stage):
    """Fleet's own interleaved 1F1B order for pipeline rank ``stage`` ("f0_vp0;f1_vp0;...;b3_vp0;"):
    ``PipelineParallelWithInterleave.forward_backward_pipeline(static_scheduler=True)`` run on a stub
    that holds the sizes it reads (no process group, no model)."""
    import collections
    import logging
    import types

    from paddle.distributed.fleet.meta_parallel.pipeline_parallel import PipelineParallelWithInterleave as P

    class Stub:
        _get_virtual_pp_rank = P._get_virtual_pp_rank

        def __getattr__(self, name):  # hooks, stamps, buffers: no-ops
            if name.startswith("__"):
                raise AttributeError(name)
            return lambda *a, **k: None

    s, ns = Stub(), types.SimpleNamespace
    s.__dict__.update(
        accumulate_steps=micro, num_stages=pp, num_model_chunks=vpp, stage_id=stage, processed_steps=10**9,
        _best_unbalanced_scheduler=False, _profiling=False, _using_cache=True, _layers=object(),
        _overlap_p2p_comm=False, user_hooks_enabled=False, bubble_hooks=ns(run_hook=lambda: None),
        _forward_micro_step_counter=collections.defaultdict(int),
        _backward_micro_step_counter=collections.defaultdict(int),
        _strategy=ns(hybrid_configs={"pp_configs": ns(forward_backward_overlap_scheduler=False)}),
    )  # fmt: skip
    logging.disable(logging.INFO)
    try:
        return P.forward_backward_pipeline(s, None, None, static_scheduler=True)
    finally:
        logging.disable(logging.NOTSET)


@pytest.mark.parametrize("pp,micro", [(2, 2), (2, 4), (2, 5), (2, 6), (4, 4), (4, 8), (4, 9), (4, 13)])
def test_vpp_activation_estimate_follows_fleets_schedule(pp, micro):
    """``--vpp 2``: the micro-batches a rank holds at its peak are those of Fleet's engine, chunk by
    chunk.  With fewer than 2 pp micro-batches Fleet runs F-then-B (``PipelineParallelWithInterleaveFthenB``:
    every forward, then every backward), else the interleaved 1F1B, whose order is Fleet's own (its
    static scheduler).  Was: min(pp - p, m) + (pp - 1 - p) / vpp micro-batches of the rank's layers;
    measured on 2 CPU ranks (tiny checkpoint, --pp 2 --vpp 2, seq 64, fp32, saved-tensor bytes of the
    first step): at 2 micro-batches (F-then-B) rank 1 saved 10,648,576 B, the plan said 3,817,472
    (0.36; 0.73 at --vpp 1), now 7,634,944 (0.72); at 4 micro-batches 7,346,432 B against 3,817,472
    (0.52), now 5,173,248 (0.70)."""
    import re
    from dataclasses import replace

    c = tiny_config()
    lay = planmod.Layout(pp=pp, vpp=2, global_batch_size=micro, seq_len=64, dtype="float32")
    plan = planmod.plan_layout(c, lay, per_rank=False)
    chunks = split_stages(c.num_hidden_layers, pp * 2, has_mtp=True)
    one = replace(lay, vpp=1)  # one micro-batch of one chunk (no recompute: nothing rebuilt)
    for stage, kind in enumerate(plan["kinds"]):
        held = [planmod.activation_bytes(c, one, ch, 1) for ch in chunks[stage::pp]]
        if micro < 2 * pp:  # F-then-B
            want = micro * sum(held)
        else:
            cur = want = 0
            for fb, _, chunk in re.findall(r"([fb])(\d+)_vp(\d+);", _fleet_interleaved_schedule(pp, 2, micro, stage)):
                cur += held[int(chunk)] if fb == "f" else -held[int(chunk)]
                want = max(want, cur)
        assert abs(kind["activations_bytes"] - want) <= 2, (stage, kind["activations_bytes"], want)


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--search", "--gpus", "2", "--gpu-tflops", "0"], "--gpu-tflops must be > 0"),
        (["--search", "--gpus", "2", "--tp-bw-gbs", "0"], "--tp-bw-gbs must be > 0"),
        (["--search", "--gpus", "2", "--net-bw-gbs", "nan"], "--net-bw-gbs must be > 0"),
        (["--search", "--gpus", "2", "--top", "-1"], "--top must be > 0"),
        (["--search", "--gpus", "-2"], "--gpus must be >= 0"),
        (["--gpu-mem-gb", "-1"], "--gpu-mem-gb must be > 0"),
        (["--reserve-gb", "-5"], "--reserve-gb must be >= 0"),
    ],
)
def test_plan_refuses_a_budget_that_is_not_a_budget(tmp_path, capsys, flags, needle):
    """The planner's own numbers are checked (before: --gpu-tflops 0 and --tp-bw-gbs 0 ended in a
    ZeroDivisionError traceback; --top -1 listed 5 of the tiny model's 6 fitting 2-GPU layouts and
    exit 0; --gpu-mem-gb -1 printed "does NOT fit in -1 GiB", exit 0). One line naming the flag, exit 2,
    no --json written."""
    out = tmp_path / "plan.json"
    assert cli_main(["plan", "--model", str(TINY_CONFIG.parent), *flags, "--json", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("glm52 plan: error: ") and needle in err[-1], err
    assert not out.exists()


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        # an unset --global-batch-size takes pp x replicas x --micro-batch-size, 0 here: that flag was named
        (["--micro-batch-size", "0"], "--micro-batch-size must be >= 1, got 0"),
        # was a MemoryError traceback (the layout's units written out before their count was checked)
        (["--pp", "2", "--pp-layout", "E,t*99999999999|t*4,m,L"], "t*99999999999 is more units than a stage can hold"),
        # a stage above 1 without sharding ranks was planned as stage 1 (and trained as it: accepted, no effect)
        (["--sharding-stage", "3"], "--sharding-stage 3 splits gradients and parameters over the --sharding ranks"),
        (["--sharding-stage", "2"], "--sharding-stage 2 splits gradients over the --sharding ranks; with --sharding 1"),
    ],
)
def test_plan_refuses_a_layout_value_naming_its_flag(capsys, flags, needle):
    assert cli_main(["plan", "--model", str(TINY_CONFIG.parent), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("glm52 plan: error: ") and needle in err[0], err


def test_plan_json_is_checked_before_the_work(tmp_path, capsys):
    """Before: `--json MODEL/config.json` replaced the checkpoint's config with the plan (exit 0; the next
    plan said "no rope_theta"), a folder at --json or a file above it ended in an IsADirectoryError /
    FileExistsError traceback after the plan was made. One line naming --json, exit 2, nothing written."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(TINY_CONFIG.parent, model)
    config = (model / "config.json").read_bytes()
    (tmp_path / "folder").mkdir()
    (tmp_path / "file").write_text("keep")
    for target, needle in (
        (model / "config.json", "this is an input of the command"),
        (tmp_path / "folder", "a folder, not a file"),
        (tmp_path / "file" / "plan.json", "is a file, not a folder"),
    ):
        assert cli_main(["plan", "--model", str(model), "--json", str(target)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"glm52 plan: error: --json {target}") and needle in err[0], err
    assert (model / "config.json").read_bytes() == config and (tmp_path / "file").read_text() == "keep"
    assert sorted(p.name for p in (tmp_path / "folder").iterdir()) == []


def test_plan_json_names_the_model_folder(tmp_path, monkeypatch):
    """The plan record's "model" was null (the config has no name_or_path); it is the --model folder,
    absolute, as the other receipts name their inputs (check-loss's a/b "path")."""
    monkeypatch.chdir(TINY_CONFIG.parent.parent)
    out = tmp_path / "plan.json"
    assert cli_main(["plan", "--model", TINY_CONFIG.parent.name, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["model"] == str(TINY_CONFIG.parent.resolve())


def _train_refusal(flags: list[str]) -> str | None:
    """What glm52 train refuses in ``flags`` before it launches, reading no file: its checks of the
    settings (``train_line_error``), then of a multi-node launch (``node_rank_of``, run after them)."""
    import argparse

    from paddleformers_glm.train.command import add_train_arguments, node_rank_of

    model = ["--model", str(TINY_CONFIG.parent)]
    if err := train_line_error([*model, *flags]):
        return err
    args = add_train_arguments(argparse.ArgumentParser()).parse_args([*model, "--out", "unused", *flags])
    try:
        node_rank_of(args)
    except ValueError as e:
        return str(e)
    return None


@pytest.mark.parametrize(
    "flags",
    [
        ["--out", "x", "--nnodes", "2", "--dp", "2"],  # needs --master
        ["--master", "1.2.3.4:99", "--nnodes", "2", "--dp", "2"],  # needs --node-rank
        ["--master", "1.2.3.4:99", "--node-rank", "5", "--nnodes", "2", "--dp", "2"],
        ["--launcher-args", "--master 1.2.3.4:99 --rank 2", "--nnodes", "2", "--dp", "2"],
        ["--model-config", "{}"],  # a checkpoint model's config is its config.json
        ["--resume-override", "lr"],  # no --resume
    ],
)
def test_plan_refuses_a_train_lines_launch_and_ignored_flags_in_trains_words(capsys, flags):
    """Before: planned, exit 0, where glm52 train refuses the line before it launches (a multi-node
    line without its rendezvous or with a node rank outside the nodes; flags a checkpoint run ignores)."""
    want = _train_refusal(flags)
    assert want is not None
    assert cli_main(["plan", "--model", str(TINY_CONFIG.parent), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == f"glm52 plan: error: {want}", err


def test_plan_takes_a_multi_node_train_line_train_takes(capsys):
    flags = ["--master", "1.2.3.4:99", "--node-rank", "1", "--nnodes", "2", "--dp", "2"]
    assert _train_refusal(flags) is None
    assert cli_main(["plan", "--model", str(TINY_CONFIG.parent), *flags]) == 0
    # a search of a multi-node line checks its launch too
    search = ["plan", "--model", str(TINY_CONFIG.parent), "--search", "--gpus", "4", "--nnodes", "2"]
    assert cli_main(search) == 2
    assert "--nnodes 2 needs --master IP:PORT" in capsys.readouterr().err


@pytest.mark.parametrize(
    "flags",
    [["--pp", "0"], ["--dp", "0"], ["--sharding", "0"], ["--pp", "-2"], ["--pp", "2", "--dp", "-1"], ["--tp", "0"]],
)
def test_plan_names_a_size_below_1_as_train_does(capsys, flags):
    """Before: "--global-batch-size must be >= 1, got 0", a batch plan derived from the sizes (pp x
    replicas x micro-batch) and the line never gave; train names the size."""
    want = _train_refusal(flags)
    assert want is not None and "global-batch-size" not in want
    assert cli_main(["plan", "--model", str(TINY_CONFIG.parent), *flags]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"glm52 plan: error: {want}"], err


def test_search_under_vpp_lists_a_pipeline_of_more_chunks_than_layers(tmp_path):
    """The trainer splits L layers into up to L + 2 chunks (the first may hold the embedding alone,
    the last the head alone); the search skipped every pp x vpp above L.  Tiny model (8 layers):
    --pp 2 --vpp 5 is 10 chunks, which the trainer takes and the search now lists."""
    out = tmp_path / "s.json"
    model = str(TINY_CONFIG.parent)
    line = ["--pp", "2", "--vpp", "5", "--global-batch-size", "4", "--seq-len", "32"]
    assert train_line_error(["--model", model, *line]) is None
    args = ["plan", "--model", model, "--search", "--gpus", "2", *line[2:], "--top", "100", "--json", str(out)]
    assert cli_main(args) == 0
    found = json.loads(out.read_text())["layouts"]
    assert any("--pp 2 " in r["flags"] and "--vpp 5" in r["flags"] for r in found), [r["flags"] for r in found]
    for r in found:
        assert train_line_error(["--model", model, *shlex.split(r["flags"])]) is None, r["flags"]


def test_plan_verdict_names_the_reserve_and_refuses_one_that_leaves_nothing(tmp_path, capsys):
    """Before: "does NOT fit in 80 GiB" with 20 GiB reserved (the budget weighed was 60), and a
    reserve of the whole GPU or more planned, every layout "does NOT fit"."""
    model = str(TINY_CONFIG.parent)
    assert cli_main(["plan", "--model", model, "--gpu-mem-gb", "80", "--reserve-gb", "20"]) == 0
    assert "fits in 80 GiB less 20 reserved" in capsys.readouterr().out
    assert cli_main(["plan", "--model", model, "--reserve-gb", "0"]) == 0
    assert "fits in 80 GiB (" in capsys.readouterr().out
    out = tmp_path / "plan.json"
    for reserve in ("80", "1000"):
        assert cli_main(["plan", "--model", model, "--reserve-gb", reserve, "--json", str(out)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert err == [f"glm52 plan: error: --reserve-gb {reserve} must be below --gpu-mem-gb 80: it leaves no memory"]
    assert not out.exists()


def test_a_large_world_has_no_row_per_rank_and_the_table_counts_its_ranks(tmp_path, capsys, monkeypatch):
    """Before: a row per rank (--dp 100000: 22 s and 2.6 GB; a million ranks a MemoryError), and the
    table counted each stage's ranks from those rows.  Past RANK_ROWS_MAX ranks the rows are left out."""
    model, out = str(TINY_CONFIG.parent), tmp_path / "plan.json"
    monkeypatch.setattr(planmod, "RANK_ROWS_MAX", 64, raising=False)
    assert cli_main(["plan", "--model", model, "--pp", "2", "--dp", "50", "--json", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["ranks"] == [] and "world 100 > 64" in plan["ranks_left_out"]
    table = capsys.readouterr().out
    assert "50 ranks (0..98)" in table and "50 ranks (1..99)" in table
    monkeypatch.undo()
    t0 = time.process_time()
    plan = planmod.plan_layout(tiny_config(), planmod.Layout(dp=10**6))
    assert time.process_time() - t0 < 10 and plan["ranks"] == [] and plan["fits"]


@pytest.mark.parametrize(
    "lay", [dict(pp=3, dp=2), dict(tp=2, pp=2, dp=3, sharding=2, cp=2), dict(pp=4), dict(dp=5), dict(tp=2, pp=2)]
)
def test_table_rank_ranges_are_those_of_the_rank_rows(lay):
    L = planmod.Layout(**lay)
    for stage in range(L.pp):
        ids = [r for r in range(L.world_size) if planmod.rank_coords(L, r)["pp"] == stage]
        assert planmod.stage_ranks(L, stage) == (len(ids), ids[0], ids[-1])


def _plan_744b(tmp_path, flags: str, *extra: str) -> dict:
    out = tmp_path / "plan.json"
    args = ["plan", "--model", str(OFFICIAL_CONFIG.parent), *shlex.split(flags), "--seq-len", "4096"]
    assert cli_main([*args, "--micro-batch-size", "1", "--gpu-mem-gb", "80", *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())


def _doc_recipe_rows() -> list[tuple[str, str, str]]:
    """The rows of docs/scale.md "Recipes on H800 80 GB": (flags, max rank GiB, verdict)."""
    import re

    text = (OFFICIAL_CONFIG.parents[2] / "docs" / "scale.md").read_text()
    section = text.split("## Recipes on H800 80 GB", 1)[1].split("\n## ", 1)[0]
    rows = re.findall(r"^\| \d+ \| `([^`]+)` \| ([\d.]+|-) \| ([^|]+) \|$", section, flags=re.M)
    assert len(rows) >= 10, rows  # the table is read, not skipped
    return rows


def test_plan_of_the_h800_recipes_gives_the_documented_max_rank_and_verdict(tmp_path, capsys):
    """docs/scale.md "Recipes on H800 80 GB" is what users size their jobs by: each row's max rank
    GiB (to its printed 0.1 GiB) and verdict, and the per-stage table below it (the first recipe;
    each stage's activation and total GiB to the two printed decimals), must be what `glm52 plan`
    prints.  This keeps the page and the planner one: a change to the estimate (a term of the
    activation estimate lost or doubled, the SP divisor of the recompute input dropped, the head's
    logits counted once) fails here until the page shows its new numbers and verdicts.  The
    estimate's agreement with measured bytes is test_plan_measured.py's."""
    for flags, doc_gib, verdict in _doc_recipe_rows():
        if doc_gib == "-":  # refused rows: the planner refuses them as the trainer does
            assert verdict.startswith("refused"), verdict
            args = ["plan", "--model", str(OFFICIAL_CONFIG.parent), *shlex.split(flags), "--gpu-mem-gb", "80"]
            assert cli_main([*args, "--json", str(tmp_path / "refused.json")]) == 2, flags
            capsys.readouterr()
            continue
        plan = _plan_744b(tmp_path, flags)
        got = plan["max_rank_bytes"] / 2**30
        assert abs(got - float(doc_gib)) <= 0.05 + 1e-9, (flags, got, doc_gib)
        assert plan["fits"] is (not verdict.startswith("does not fit")), (flags, plan["fits"], verdict)
    # the per-stage table of the first recipe, as docs/scale.md prints it
    text = (OFFICIAL_CONFIG.parents[2] / "docs" / "scale.md").read_text()
    block = text.split("Per-stage table of the first 256-GPU recipe", 1)[1].split("```")[1]
    plan = _plan_744b(tmp_path, "--tp 8 --pp 8 --dp 4 --ep 32 --sp --recompute full")
    documented = [ln.split() for ln in block.splitlines() if ln.strip()[:1].isdigit()]
    assert len(documented) == 3, block
    for cols in documented:
        kind = plan["kinds"][int(cols[0])]
        activ, total = float(cols[6]), float(cols[7])
        assert abs(kind["activations_bytes"] / 2**30 - activ) <= 0.005 + 1e-9, (cols, kind["activations_bytes"])
        assert abs(kind["total_bytes"] / 2**30 - total) <= 0.005 + 1e-9, (cols, kind["total_bytes"])


def test_plan_reserve_lowers_the_budget_the_verdict_weighs(tmp_path):
    """`--reserve-gb` is taken off the GPU before the verdict: the first H800 recipe (65.4 GiB on its
    largest rank, docs/scale.md) fits 80 GiB, and with 20 GiB reserved (a 60 GiB budget) it does
    not.  A verdict that ignored the reserve would say "fits" and the job would run out of memory."""
    flags = "--tp 8 --pp 8 --dp 4 --ep 32 --sp --recompute full"
    assert _plan_744b(tmp_path, flags)["fits"] is True
    plan = _plan_744b(tmp_path, flags, "--reserve-gb", "20")
    assert 60 * 2**30 < plan["max_rank_bytes"] < 80 * 2**30 and plan["fits"] is False


def test_fleet_sharding_stage_2_holds_every_gradient_at_the_peak(tmp_path):
    """Under Fleet's partition, sharding stage 2 reduces the gradients after the backward, so at the
    backward's peak each rank still holds all of them: the peak gradient bytes of stage 2 equal
    stage 1's, only after the reduce are they this rank's share, and only stage 3 lowers the peak.
    Counting only this rank's gradients at stage 2 would call the docs/scale.md 84.9 GiB row (does
    not fit) a fit."""
    flags = "--tp 4 --pp 8 --dp 4 --sharding 2 --ep 16 --sp --recompute full --sharding-partition fleet"
    by_stage = {s: _plan_744b(tmp_path, f"{flags} --sharding-stage {s}") for s in (1, 2, 3)}
    for k1, k2, k3 in zip(*(by_stage[s]["kinds"] for s in (1, 2, 3))):
        assert k2["grads_bytes"] == k1["grads_bytes"] > k3["grads_bytes"], k2["stage"]
        assert k2["grads_after_reduce_bytes"] < k1["grads_after_reduce_bytes"], k2["stage"]
    assert by_stage[2]["fits"] is False and by_stage[2]["max_rank_bytes"] > 80 * 2**30


def test_plan_of_a_trained_sparse_indexer_counts_its_activations(tmp_path):
    """`--indexer-stage sparse` trains the indexer (its KL loss): each full-indexer layer keeps the
    indexer's queries, keys and fp32 scores for the backward (docs/scale.md: "the indexer adds its
    queries/keys/scores only when trained").  So every stage holding such a layer plans more
    activation bytes than with the indexer frozen (`--indexer-stage none`); equal numbers would
    under-plan the sparse stage."""
    flags = "--tp 8 --pp 8 --dp 4 --ep 32 --sp --recompute core"
    none = _plan_744b(tmp_path, flags, "--indexer-stage", "none")
    sparse = _plan_744b(tmp_path, flags, "--indexer-stage", "sparse", "--indexer-loss-coeff", "0.01")
    assert sparse["kinds"][0]["activations_bytes"] > none["kinds"][0]["activations_bytes"]
    assert sparse["max_rank_bytes"] > none["max_rank_bytes"]
