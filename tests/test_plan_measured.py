"""``glm52 plan`` against ``glm52 train`` on the tiny checkpoint: every rank's measured parameter,
gradient and optimizer-state bytes (loss.json ``memory``) equal the plan's (1 rank, TP2 x PP2,
TP2 x EP2, DP2 x sharding 2), the activation estimate is within a factor of 2 of the first step's
saved bytes, and (multi-process) every rank read exactly the checkpoint bytes of its own shards."""

from __future__ import annotations

from pathlib import Path

import pytest

from paddleformers_glm.configuration import GlmMoeDsaConfig
from paddleformers_glm.parallel.pipeline import split_stages
from paddleformers_glm.train import plan as planmod
from paddleformers_glm.train.memory import state_bytes
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


def _check_plan_equals_measured(ckpt, got, tp=1, pp=1, ep=1, sharding=1):
    config = GlmMoeDsaConfig.from_pretrained(str(ckpt))
    world = got["profile"]["world"]
    lay = planmod.Layout(
        tp=tp, pp=pp, dp=world // (tp * pp * sharding), ep=ep, dtype="float32", sp=bool(got["profile"]["sp"]),
        seq_len=SEQ, sharding=sharding, sharding_stage=1, sharding_partition="fleet",
    )  # fmt: skip
    plan = planmod.plan_layout(config, lay)
    specs = split_stages(config.num_hidden_layers, pp, has_mtp=True)
    mem = got["memory"]
    assert [m["rank"] for m in mem] == list(range(world))
    for m, p in zip(mem, plan["ranks"]):
        assert (m["params_bytes"], m["grads_bytes"]) == (p["params_bytes"], p["grads_bytes"]), (m, p)
        if m["optimizer"] == "paddle.optimizer.AdamW":  # the planner's rule as written
            want = p["optimizer_bytes"]
        else:  # the trainer's own AdamW keeps a Python step count instead of Paddle's beta powers
            params = planmod.stage_params(config, lay, specs[p["stage"]])
            items = planmod.state_items(config, params, stepped_only=True)  # and state only once stepped
            want = state_bytes(items, beta_pows=False)["optimizer_bytes"]
        assert m["optimizer_bytes"] == want, (m, p)
        assert m["peak_bytes"] > 0 and m["peak_kind"] in ("peak_rss", "max_memory_allocated")
        # the activation estimate against the first step's peak saved bytes
        micro = got["profile"]["global_batch_size"] // (lay.data_parallel * got["profile"]["micro_batch_size"])
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
def test_dp2_sharding2_plan_equals_measured(tiny_ckpt, tmp_path):
    """Fleet's whole-tensor optimizer-state partition, rank by rank (needs the trainer's --sharding)."""
    import argparse

    from paddleformers_glm.train.command import add_train_arguments

    if "--sharding" not in add_train_arguments(argparse.ArgumentParser())._option_string_actions:
        pytest.skip("this trainer has no --sharding")
    got = _train(tiny_ckpt, tmp_path, "--dp", "2", "--sharding", "2")
    assert got["profile"]["world"] == 4
    _check_plan_equals_measured(tiny_ckpt, got, sharding=2)
