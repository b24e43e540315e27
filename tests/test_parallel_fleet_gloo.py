"""Fleet's stock tensor- and sequence-parallel layers on 2 gloo processes through the
compatibility ops (paddleformers_glm/parallel/fleet_gloo.py), against one process."""

from __future__ import annotations

import pytest

from tests._dist.runner import script_result

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def fleet_results(tp2_script_results):
    # tests/_dist/check_fleet_layers.py, in the TP2 launch it shares with test_parallel_dist.py (conftest.py)
    return script_result(tp2_script_results, "fleet.json")


def test_compat_ops_are_installed_on_gloo(fleet_results):
    assert {
        "mp_ops._c_identity",
        "mp_ops._c_softmax_with_cross_entropy",
        "sequence_parallel_utils.reduce_scatter",
        "p2p_communication.paddle (pipeline p2p on pair groups)",
    } <= set(fleet_results["installed"]), fleet_results["installed"]


@pytest.mark.parametrize("prefix", ["tp_mlp", "vocab_emb", "parallel_ce", "sp_mlp"])
def test_stock_fleet_layers_match_one_process(fleet_results, prefix):
    got = {k: v for k, v in fleet_results.items() if k.startswith(prefix)}
    assert got and all(v <= 1e-5 for v in got.values()), got


def test_fleet_sequence_parallel_split_is_sequence_first(fleet_results):
    # Why the model's sequence-parallel layers move the sequence axis to the front around Fleet's
    # (comm.to_sequence_first): Fleet's ScatterOp splits the first axis, which on the model's
    # batch-first [B, S, H] activations is the batch, not the sequence.
    assert fleet_results["probe_scatter_batch_first_shape"] == [1, 4, 8]  # [B/2, S, H], not [B, S/2, H]


def test_install_is_a_no_op_off_gloo():
    from paddleformers_glm.parallel.fleet_gloo import install

    assert install("nccl") == []
