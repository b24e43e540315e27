"""``glm52 plan``: the 744B model's parameter count and fit verdict come quickly and without
allocating weights; the per-layer-kind composition equals building each real stage; the
activation estimate is within a factor of 2 of the bytes autograd really saves (tiny model)."""

from __future__ import annotations

import json
import math
import time

import paddle
import pytest

from paddleformers_glm.cli import main as cli_main
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.parallel.pipeline import StageSpec, split_stages
from paddleformers_glm.parallel.topology import ParallelConfig, Topology
from paddleformers_glm.train import plan as planmod
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
    assert sh["optimizer_bytes"] == math.ceil((16 * 12 + 16) / 4) and sh["grads_bytes"] == 16
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
    for r in found:  # each listed layout, planned on its own, fits
        flags = r["flags"].replace("--sp", "--sp").split()
        assert cli_main(["plan", "--model", model, *flags, *budget, "--json", str(out)]) == 0
        assert json.loads(out.read_text())["fits"] is True, r
    assert not any(r["flags"].startswith("--tp 1 --pp 1 --dp 8 --ep 1 ") for r in found)
    assert cli_main(["plan", "--model", model, "--dp", "8", *budget, "--json", str(out)]) == 0
    assert json.loads(out.read_text())["fits"] is False  # plain data parallel holds everything


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
