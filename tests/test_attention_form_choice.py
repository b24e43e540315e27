"""What `attn_implementation="auto"` runs for small problems (`attention_forms.choose_form`), at the
boundaries of the rule docs/model.md states ("Sparse attention gathers only the selected keys ...":
per-head dense for short sequences, S <= 2 x top-k and B·nH·S² <= 2^20; per-head sparse otherwise;
"`auto` takes dense or sparse by that rule while the per-head keys and values (B·S·k·nH·(dk + dv)
floats) stay within 2^18, and above it the form `form_costs` estimates cheapest").

test_perf_paths.py pins the large-shape cost rule and the S = 32 fixture ("sparse"); these pin the
short-sequence half, which a rule that never picks dense or uses S < 2k instead would otherwise pass
(the numbers are the same to rounding either way; what changes is the form, so the speed and
memory). The B·nH·S² <= 2^20 clause is implied by the other two (within the 2^18 budget and S <= 2k,
B·nH·S² <= 2·B·nH·S·k <= 2^19 / (dk + dv)), so no shape tells it apart.
"""

from __future__ import annotations

import pytest

from paddleformers_glm.modeling import attention
from paddleformers_glm.modeling import attention_forms as attn

from ._tiny import tiny_model, tokens

TINY = (48, 32, 32, 16, 32)  # q_lora, kv_lora, nope, rope, v of configs/glm52-tiny (4 heads, index_topk 8)
NARROW = (48, 32, 16, 16, 32)  # dk + dv = 64: one head at S x k = 4096 is exactly the 2^18 budget


def _auto(B, S, K, H, widths):
    return attn.choose_form("auto", attn.AttentionShape(B, S, K, H, *widths))


def _cheapest(B, S, K, H, widths):
    costs = attn.form_costs(attn.AttentionShape(B, S, K, H, *widths))
    return min(costs, key=costs.get)


@pytest.mark.parametrize(
    "S, want",
    [(4, "dense"), (8, "dense"), (15, "dense"), (16, "dense"), (17, "sparse"), (24, "sparse"), (32, "sparse")],
)
def test_auto_is_dense_up_to_twice_the_top_k_then_sparse_at_the_tiny_widths(S, want):
    """Batch 2, 4 heads, top-k min(8, S): S <= 16 dense, S >= 17 sparse (all within the 2^18 budget:
    at most 2·32·8·4·80 = 163840 floats), though `form_costs` would take the latent form."""
    K = min(8, S)
    assert 2 * S * K * 4 * (32 + 16 + 32) <= attn.LATENT_MIN_ELEMS == 1 << 18
    assert _auto(2, S, K, 4, TINY) == want
    assert _cheapest(2, S, K, 4, TINY) == "latent"  # so the rule, not the costs, gives the form


@pytest.mark.parametrize(
    "B, S, K, want_rule, costs_say",
    [
        (1, 64, 64, "dense", "dense"),  # S = k
        (2, 64, 32, "dense", "dense"),  # S = 2k
        (1, 128, 32, "sparse", "dense"),  # S = 4k: sparse, though the costs say dense
        (4, 64, 16, "sparse", "dense"),  # S = 4k, batch 4
        (1, 256, 16, "sparse", "latent"),  # S = 16k: sparse, though the costs say latent
    ],
)
def test_auto_keeps_the_small_problem_rule_up_to_the_budget_and_the_cheapest_form_past_it(
    B, S, K, want_rule, costs_say
):
    """One head, dk + dv = 64, B·S·k·64 = 2^18 floats exactly: still the small-problem rule. One more
    query (S + 1, same k) is past the budget: the cheapest form by `form_costs`."""
    assert B * S * K * 64 == attn.LATENT_MIN_ELEMS == 1 << 18
    assert _cheapest(B, S, K, 1, NARROW) == costs_say
    assert _auto(B, S, K, 1, NARROW) == want_rule
    assert _auto(B, S + 1, K, 1, NARROW) == _cheapest(B, S + 1, K, 1, NARROW) == costs_say


def test_the_model_runs_the_form_the_rule_gives_for_its_sequence_length(monkeypatch):
    """Through the tiny model (4 heads, index_topk 8): every attention call of a 16-token batch runs
    dense, of a 17-token batch sparse (`AttentionShape` from the model: top-k min(8, S))."""
    picked = []

    def spy(implementation, shape):
        form = attn.choose_form(implementation, shape)
        picked.append((shape.seq, shape.topk, shape.heads, form))
        return form

    monkeypatch.setattr(attention, "choose_form", spy)
    model = tiny_model(seed=0).eval()
    assert model.config.attn_implementation == "auto"
    for S, want in ((16, "dense"), (17, "sparse")):
        picked.clear()
        model(tokens(2, S))
        assert picked and set(picked) == {(S, 8, 4, want)}, picked
