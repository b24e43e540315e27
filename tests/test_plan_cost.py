"""``glm52 plan --search`` ranks the layouts that fit by an estimated time per token that counts
the 1F1B pipeline bubble ((pp - 1) / (vpp x micro-batches)), compute and communication."""

from __future__ import annotations

import json

import pytest

from paddleformers_glm.cli import main as cli_main
from paddleformers_glm.configuration import GlmMoeDsaConfig
from paddleformers_glm.train import plan as planmod
from paddleformers_glm.train.plan import active_params
from paddleformers_glm.train.plan_cost import Hardware, bubble_fraction, step_estimate

from .conftest import TINY_CONFIG

# a budget (10 MiB) that the tiny model's fp32 state fits only when split over several ranks
BUDGET = ["--gpu-mem-gb", str(10 / 1024), "--dtype", "float32", "--seq-len", "32"]
GBS = 16


def test_bubble_fraction():
    assert bubble_fraction(1, 8) == 0.0
    assert bubble_fraction(4, 8) == 3 / 8
    assert bubble_fraction(4, 8, vpp=2) == 3 / 16
    assert bubble_fraction(8, 1) == 7.0
    with pytest.raises(ValueError, match="micro-batches 0"):
        bubble_fraction(4, 0)


def test_active_params_count_k_of_n_routed_experts_and_each_head():
    c = GlmMoeDsaConfig.from_pretrained(TINY_CONFIG)
    lay = planmod.Layout(dtype="float32")
    h, V, E, k, inter = c.hidden_size, c.vocab_size, c.n_routed_experts, c.num_experts_per_tok, c.moe_intermediate_size
    moe_layers = c.mlp_layer_types.count("sparse") + c.num_mtp_layers
    expected = planmod.total_params(c, lay) - V * h - moe_layers * (E - k) * 3 * h * inter + c.num_mtp_layers * V * h
    assert active_params(c, lay) == expected


def test_step_estimate_is_bubble_times_compute_when_communication_is_free():
    c = GlmMoeDsaConfig.from_pretrained(TINY_CONFIG)
    hw = Hardware(flops=1e12, tp_bw=1e30, net_bw=1e30)
    active = active_params(c, planmod.Layout(dtype="float32"))
    one = step_estimate(c, planmod.Layout(seq_len=32, dtype="float32"), 16, 10**6, active, hw)
    pp4 = step_estimate(c, planmod.Layout(seq_len=32, dtype="float32", pp=4), 4, 10**6, active, hw)
    vpp = step_estimate(c, planmod.Layout(seq_len=32, dtype="float32", pp=4, vpp=2), 4, 10**6, active, hw)
    assert one["bubble"] == 0 and pp4["bubble"] == 3 / 4 and vpp["bubble"] == 3 / 8
    # one rank, 16 micro-batches vs 4 stages, 4 micro-batches: the same tokens of work per rank
    assert one["s_per_token"] == pytest.approx(4 * pp4["s_per_token"] / (1 + 3 / 4))
    assert vpp["s_per_token"] == pytest.approx(pp4["s_per_token"] * (1 + 3 / 8) / (1 + 3 / 4))
    assert one["step_s"] == pytest.approx(16 * 6 * active * 32 / 1e12)


def _search(tmp_path, *extra):
    out = tmp_path / "s.json"
    args = ["plan", "--model", str(TINY_CONFIG.parent), "--search", "--gpus", "8", "--top", "100", *BUDGET]
    assert cli_main([*args, "--global-batch-size", str(GBS), *extra, "--json", str(out)]) == 0
    return json.loads(out.read_text())["layouts"]


def _flag(flags: str, name: str, default: int = 1) -> int:
    f = flags.split()
    return int(f[f.index(name) + 1]) if name in f else default


def test_search_ranks_by_the_bubble_when_compute_dominates(tmp_path):
    # communication made free: the order is (1 + bubble) x recompute factor, worked out here from the flags
    found = _search(tmp_path, "--tp-bw-gbs", "1e20", "--net-bw-gbs", "1e20")
    assert len(found) > 5

    def expected(r):
        pp = _flag(r["flags"], "--pp")
        m = GBS // (_flag(r["flags"], "--dp") * _flag(r["flags"], "--sharding"))
        return (1 + (pp - 1) / m) * (4 / 3 if "--recompute full" in r["flags"] else 1)

    keys = [expected(r) for r in found]
    assert keys == sorted(keys)
    assert _flag(found[0]["flags"], "--pp") == 1  # no bubble at all
    # ranked by communication volume alone, the 8-stage pipeline would come before TP2 x PP2
    pos = {r["flags"]: i for i, r in enumerate(found)}
    deep = next(r for r in found if r["flags"].startswith("--tp 1 --pp 8 "))
    tp2 = next(r for r in found if r["flags"].startswith("--tp 2 --pp 2 ") and "--recompute none" in r["flags"])
    assert deep["comm_bytes"] < tp2["comm_bytes"] and pos[deep["flags"]] > pos[tp2["flags"]]


def test_search_with_vpp_halves_each_pipelines_bubble(tmp_path):
    found = _search(tmp_path, "--vpp", "2", "--tp-bw-gbs", "1e20", "--net-bw-gbs", "1e20")
    piped = [r for r in found if _flag(r["flags"], "--pp") > 1]
    assert piped and all("--vpp 2" in r["flags"] for r in piped)
    for r in found:
        pp, m = _flag(r["flags"], "--pp"), GBS // (_flag(r["flags"], "--dp") * _flag(r["flags"], "--sharding"))
        assert r["bubble"] == pytest.approx((pp - 1) / (2 * m) if pp > 1 else 0.0)


@pytest.mark.parametrize("dp,sharding,cp,ep", [(4, 1, 1, 4), (2, 2, 1, 2), (1, 2, 2, 2), (2, 1, 2, 1), (4, 2, 1, 2)])
def test_gradient_reduction_sums_dense_and_expert_gradients_over_their_own_replicas(dp, sharding, cp, ep):
    """Dense gradients sum over dp x sharding x cp ranks, an expert's over its edp x sharding
    replicas (edp = tp x dp x cp / ep): an expert with no replica moves nothing."""
    c = GlmMoeDsaConfig.from_pretrained(TINY_CONFIG)
    hw = Hardware(flops=1e12, tp_bw=1e30, net_bw=1.0)  # 1 B/s: dp_s is the bytes each rank moves
    lay = planmod.Layout(seq_len=32, dtype="float32", dp=dp, sharding=sharding, cp=cp, ep=ep)
    dense, expert = 1000, 3000
    got = step_estimate(c, lay, 4, dense + expert, active_params(c, lay), hw, expert_params=expert)["dp_s"]
    r_dense, r_expert = dp * sharding * cp, dp * cp // ep * sharding
    ring = lambda r: 2 * (r - 1) / r  # noqa: E731
    assert got == pytest.approx(4 * (ring(r_dense) * dense + ring(r_expert) * expert))
