"""MoE router (sigmoid + bias choice, group limit, weights from un-biased scores) and expert dispatch."""

import numpy as np
import paddle
import pytest

from paddleformers_glm.modeling.moe import MoE

from ._tiny import tiny_config


def _numpy_route(x, W, bias, n_group, topk_group, top_k, norm, scale):
    s = 1 / (1 + np.exp(-(x @ W)))
    choice = s + bias
    N, E = s.shape
    g = choice.reshape(N, n_group, E // n_group)
    gscore = np.sort(g, -1)[..., -2:].sum(-1)
    keep = np.argsort(-gscore, -1)[:, :topk_group]
    allowed = np.zeros((N, n_group), bool)
    np.put_along_axis(allowed, keep, True, -1)
    choice = np.where(np.repeat(allowed, E // n_group, -1), choice, -np.inf)
    ids = np.argsort(-choice, -1)[:, :top_k]
    w = np.take_along_axis(s, ids, -1)
    if norm:
        w = w / (w.sum(-1, keepdims=True) + 1e-20)
    return ids, w * scale


@pytest.mark.parametrize("n_group,topk_group,top_k,norm", [(2, 1, 2, True), (4, 2, 3, False), (1, 1, 2, True)])
def test_router_matches_numpy(n_group, topk_group, top_k, norm):
    cfg = tiny_config(n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k, norm_topk_prob=norm)
    moe = MoE(cfg)
    rng = np.random.default_rng(0)
    W = rng.standard_normal((cfg.hidden_size, 8)).astype("float32") * 0.3
    bias = (rng.standard_normal(8) * 0.1).astype("float32")
    moe.gate.weight.set_value(paddle.to_tensor(W))
    moe.gate.e_score_correction_bias.set_value(paddle.to_tensor(bias))
    x = rng.standard_normal((50, cfg.hidden_size)).astype("float32")
    _, w, ids = moe.gate(paddle.to_tensor(x))
    ref_ids, ref_w = _numpy_route(x, W, bias, n_group, topk_group, top_k, norm, cfg.routed_scaling_factor)
    assert np.array_equal(np.sort(ids.numpy(), -1), np.sort(ref_ids, -1))
    order_got, order_ref = np.argsort(ids.numpy(), -1), np.argsort(ref_ids, -1)
    np.testing.assert_allclose(
        np.take_along_axis(w.numpy(), order_got, -1), np.take_along_axis(ref_w, order_ref, -1), rtol=1e-6
    )


def test_bias_changes_choice_but_not_weights():
    cfg = tiny_config(n_group=1, topk_group=1)
    moe = MoE(cfg)
    x = paddle.randn([16, cfg.hidden_size])
    _, w0, ids0 = moe.gate(x)
    big = np.zeros(8, dtype="float32")
    big[5] = 10.0  # expert 5 always chosen now
    moe.gate.e_score_correction_bias.set_value(paddle.to_tensor(big))
    _, w1, ids1 = moe.gate(x)
    assert np.all((ids1.numpy() == 5).any(-1))
    logits = paddle.matmul(x, moe.gate.weight).numpy()
    s5 = 1 / (1 + np.exp(-logits[:, 5]))
    col = np.argmax(ids1.numpy() == 5, -1)
    raw = np.take_along_axis(w1.numpy(), col[:, None], -1)[:, 0] / cfg.routed_scaling_factor
    sel = np.take_along_axis(ids1.numpy(), np.arange(2)[None].repeat(16, 0), -1)
    denom = (1 / (1 + np.exp(-np.take_along_axis(logits, sel, -1)))).sum(-1)
    np.testing.assert_allclose(raw, s5 / denom, rtol=1e-5)


def test_bias_is_a_buffer_and_router_is_fp32():
    moe = MoE(tiny_config())
    names = [n for n, _ in moe.named_parameters()]
    assert "gate.e_score_correction_bias" not in names and "gate.weight" in names
    assert "gate.e_score_correction_bias" in moe.state_dict()
    assert moe.gate.weight.dtype == paddle.float32


@pytest.mark.parametrize("form", ["sorted", "padded"])
def test_moe_output_equals_explicit_per_token_sum(form):
    """Both routed forms (chosen per module, no global switch) give the per-token sum."""
    cfg = tiny_config()
    moe = MoE(cfg, routed_form=form)
    rng = np.random.default_rng(2)
    for p in moe.parameters():
        p.set_value(paddle.to_tensor((rng.standard_normal(p.shape) * 0.3).astype("float32")))
    x = paddle.to_tensor(rng.standard_normal((3, 5, cfg.hidden_size)).astype("float32"))
    out = moe(x).numpy().reshape(15, -1)
    flat = x.reshape([15, -1])
    _, w, ids = moe.gate(flat)
    shared = moe.shared_experts(flat).numpy()
    for t in range(15):
        expect = shared[t].copy()
        for j in range(ids.shape[1]):
            e = int(ids[t, j])
            expect += float(w[t, j]) * moe.expert(e)(flat[t : t + 1]).numpy()[0]
        np.testing.assert_allclose(out[t], expect, rtol=2e-6, atol=2e-5)


def test_router_weight_gets_gradient_through_weights_only():
    moe = MoE(tiny_config())
    x = paddle.randn([4, 6, 64])
    moe(x).sum().backward()
    assert moe.gate.weight.grad is not None and float(moe.gate.weight.grad.abs().sum()) > 0


def test_moe_rejects_an_unknown_routed_form():
    with pytest.raises(ValueError, match="routed_form must be one of"):
        MoE(tiny_config(), routed_form="grouped")


# Exact ties: logits on a 0.25 grid (x = the unit vectors, so row j of the router weight *is* token
# j's logits, every value exact), so many tokens have bitwise-equal expert scores and equal group
# scores at the selection boundary.  The expected experts below are what HF's
# GlmMoeDsaTopkRouter (torch.topk on CPU, torch 2.13) chose for these rows; neither "lowest index
# wins" nor "highest index wins" reproduces them (9 and 28 rows differ), so the test tells a
# tie-break rule apart.
_TIE_LOGITS_SEED = 7
_TORCH_TIE_CHOICE = [
    [0, 3], [4, 7], [1, 3], [0, 2], [1, 3], [4, 5], [4, 7], [0, 1], [4, 6], [4, 5], [2, 3], [0, 1], [1, 3],
    [2, 3], [4, 5], [4, 6], [5, 6], [1, 2], [6, 7], [1, 3], [2, 3], [1, 2], [6, 7], [2, 3], [4, 6], [1, 3],
    [1, 2], [0, 2], [0, 3], [4, 7], [0, 2], [6, 7], [5, 6], [0, 1], [4, 7], [4, 7], [2, 3], [6, 7], [6, 7],
    [1, 2], [4, 5], [0, 2], [4, 7], [4, 6], [1, 3], [0, 1], [0, 1], [4, 6], [2, 3], [5, 6], [1, 3], [5, 7],
    [0, 1], [5, 6], [1, 3], [0, 1], [1, 2], [0, 1], [1, 3], [5, 7], [4, 6], [4, 7], [0, 1], [5, 6],
]  # fmt: skip


def _tie_logits(hidden: int, experts: int) -> np.ndarray:
    return (np.random.default_rng(_TIE_LOGITS_SEED).integers(0, 4, size=(hidden, experts)) * 0.25).astype("float32")


def _tie_router_choice() -> np.ndarray:
    cfg = tiny_config(n_group=2, topk_group=1, num_experts_per_tok=2, norm_topk_prob=True)
    moe = MoE(cfg)
    W = _tie_logits(cfg.hidden_size, cfg.n_routed_experts)
    moe.gate.weight.set_value(paddle.to_tensor(W))
    _, _, ids = moe.gate(paddle.eye(cfg.hidden_size, dtype="float32"))
    return np.sort(ids.numpy(), -1)


def test_router_breaks_exact_ties_like_the_torch_reference():
    """A tie at the group or expert boundary goes to the same experts as in HF's router on CPU
    (paddle.topk and torch.topk order equal values alike there), so two runs whose scores are
    bitwise equal route every token the same way."""
    W = _tie_logits(64, 8)
    s = 1 / (1 + np.exp(-W.astype(np.float64)))
    third = np.sort(s.reshape(64, 2, 4), -1)[..., -3]
    second = np.sort(s.reshape(64, 2, 4), -1)[..., -2]
    assert (second == third).any(-1).sum() >= 20  # the fixture does hold exact ties
    np.testing.assert_array_equal(_tie_router_choice(), np.array(_TORCH_TIE_CHOICE))


def test_tie_fixture_is_what_the_torch_router_chooses():
    """The recorded choice above is re-derived from HF's router when the reference extra is installed."""
    torch = pytest.importorskip("torch", reason="the reference extra (torch) is not installed")
    hf = pytest.importorskip(
        "transformers.models.glm_moe_dsa.modeling_glm_moe_dsa", reason="transformers with glm_moe_dsa is not installed"
    )
    from transformers.models.glm_moe_dsa.configuration_glm_moe_dsa import GlmMoeDsaConfig as HFConfig

    cfg = HFConfig(hidden_size=64, n_routed_experts=8, num_experts_per_tok=2, n_group=2, topk_group=1)
    router = hf.GlmMoeDsaTopkRouter(cfg)
    with torch.no_grad():
        router.weight.copy_(torch.from_numpy(_tie_logits(64, 8).T.copy()))
    _, _, ids = router(torch.eye(64))
    np.testing.assert_array_equal(np.sort(ids.numpy(), -1), np.array(_TORCH_TIE_CHOICE))


def _random_router(n_group, topk_group, top_k, norm, seed=0, grid=False):
    cfg = tiny_config(n_group=n_group, topk_group=topk_group, num_experts_per_tok=top_k, norm_topk_prob=norm)
    moe = MoE(cfg)
    rng = np.random.default_rng(seed)
    W = _tie_logits(cfg.hidden_size, 8) if grid else rng.standard_normal((cfg.hidden_size, 8)).astype("float32")
    moe.gate.weight.set_value(paddle.to_tensor(W))
    if not grid:
        moe.gate.e_score_correction_bias.set_value(paddle.to_tensor((rng.standard_normal(8) * 0.1).astype("float32")))
    return moe


@pytest.mark.parametrize(
    "n_group,topk_group,top_k,norm,grid",
    [
        (2, 1, 2, True, True),
        (4, 2, 3, False, False),
        (1, 1, 2, True, False),
        (1, 1, 8, True, True),
        (2, 2, 4, True, True),
    ],
)
def test_router_without_autograd_routes_exactly_like_with_it(n_group, topk_group, top_k, norm, grid):
    """Decoding routes through the compiled router (no autograd), training through Paddle's ops:
    the same experts in the same order, ties included (`grid`: logits on a 0.25 grid, the tie
    fixture above), and the same weights to an ulp."""
    moe = _random_router(n_group, topk_group, top_k, norm, grid=grid)
    x = (
        paddle.eye(64, dtype="float32")
        if grid
        else paddle.to_tensor(np.random.default_rng(3).standard_normal((64, 64)).astype("float32"))
    )
    _, w_ops, ids_ops = moe.gate(x)
    with paddle.no_grad():
        _, w_fast, ids_fast = moe.gate(x)
    np.testing.assert_array_equal(ids_fast.numpy(), ids_ops.numpy())
    np.testing.assert_allclose(w_fast.numpy(), w_ops.numpy(), rtol=3e-7, atol=0)


def test_decoding_moe_equals_the_per_token_sum_and_the_training_form():
    """A few tokens without autograd (a decode step: the routed-rows kernel, weight applied after
    the down projection as HF does) against the explicit per-token sum and the sorted form."""
    cfg = tiny_config()
    moe = MoE(cfg)
    rng = np.random.default_rng(4)
    for p in moe.parameters():
        p.set_value(paddle.to_tensor((rng.standard_normal(p.shape) * 0.3).astype("float32")))
    x = paddle.to_tensor(rng.standard_normal((1, 3, cfg.hidden_size)).astype("float32"))
    assert 3 * cfg.num_experts_per_tok <= cfg.n_routed_experts  # the decoding form applies
    trained = moe(x).numpy()[0]
    with paddle.no_grad():
        decoded = moe(x).numpy()[0]
        flat = x.reshape([3, -1])
        _, w, ids = moe.gate(flat)
        shared = moe.shared_experts(flat).numpy()
        for t in range(3):
            expect = shared[t].copy()
            for j in np.argsort(ids.numpy()[t]):  # ascending expert id, as HF adds them
                e = int(ids[t, j])
                expect += moe.expert(e)(flat[t : t + 1]).numpy()[0] * float(w[t, j])
            np.testing.assert_allclose(decoded[t], expect, rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(decoded, trained, rtol=2e-6, atol=2e-5)


class _Rank:
    """A stand-in for a two-rank group as the dispatcher reads it (its size and this rank's place)."""

    def __init__(self, rank: int) -> None:
        self.rank, self.nranks, self.ranks = rank, 2, [0, 1]


@pytest.mark.parametrize("tp, ep, etp, share", [(2, 2, 1, "experts"), (2, 1, 2, "experts"), (2, 1, 1, "tokens")])
def test_inference_shares_of_the_routed_sum_add_up_to_it(tp, ep, etp, share):
    """The MoE inference form on a model split over TP (parallel/experts.py ``local_partial``): each
    rank's share (its experts' assignments, its expert FFN slice, or its rows' share of the tokens,
    7 tokens split 4 / 3) summed over the two ranks is the one-process routed sum; the shares
    partition it (no assignment in both, none in neither). The all-reduce that sums them is the
    launched test's (tests/test_save_distributed.py, generate at TP2 x EP2)."""
    from paddleformers_glm.parallel.experts import ExpertParallelDispatcher, LocalExperts
    from paddleformers_glm.parallel.topology import ParallelConfig, Topology

    cfg = tiny_config()
    moe = MoE(cfg)
    rng = np.random.default_rng(5)
    for p in moe.parameters():
        p.set_value(paddle.to_tensor((rng.standard_normal(p.shape) * 0.3).astype("float32")))
    flat = paddle.to_tensor(rng.standard_normal((7, cfg.hidden_size)).astype("float32"))
    _, w, ids = moe.gate(flat)
    want = moe.routed(flat, w, ids).numpy()
    shares = []
    for r in range(2):
        topo = Topology(
            ParallelConfig(tp=tp, ep=ep, etp=etp),
            rank=r,
            groups={"tp": _Rank(r), "ep": _Rank(r), "etp": _Rank(r)},
            ranks={"tp": r, "ep": r if ep > 1 else 0, "etp": r if etp > 1 else 0},
        )
        d = ExpertParallelDispatcher(cfg.n_routed_experts, topo=topo)
        assert d.share == share
        if etp > 1:  # this rank's half of each expert's FFN: columns of up_gate (gate | up), rows of down
            half = cfg.moe_intermediate_size // 2
            experts = LocalExperts(d.local_expert_ids, lambda e, r=r, half=half: _ffn_half(moe.expert(e), r, half))
        else:
            experts = LocalExperts(d.local_expert_ids, moe.expert)
        with paddle.no_grad():
            assert d.sums_partials()
            shares.append(d.local_partial(flat, ids, w, experts).numpy())
    np.testing.assert_allclose(shares[0] + shares[1], want, rtol=1e-5, atol=1e-5)
    if share == "tokens":  # rows 0-3 on rank 0, 4-6 on rank 1, zero elsewhere
        assert not shares[0][4:].any() and not shares[1][:4].any()


def _ffn_half(expert, r: int, I: int):
    """Rank r's etp half of an expert, as the model builds one (``Expert(H, I, etp=2)``): its I columns
    of gate and of up, its I rows of down."""
    from paddleformers_glm.modeling.moe import Expert

    W, D = expert.up_gate_proj.weight.numpy(), expert.down_proj.weight.numpy()
    half, cols = Expert(W.shape[0], 2 * I, etp=2), np.r_[r * I : (r + 1) * I]
    half.up_gate_proj.weight.set_value(paddle.to_tensor(np.concatenate([W[:, cols], W[:, 2 * I + cols]], axis=1)))
    half.down_proj.weight.set_value(paddle.to_tensor(D[cols]))
    return half


def test_the_inference_form_is_taken_in_eval_mode_only():
    """A training forward without gradient is recompute's first pass (Paddle's recompute runs it under
    no_grad, then replays it with gradient): it keeps the dispatch, so the replay computes the same
    values; an evaluating forward without gradient takes the shares (the dispatcher stands in for a
    split one: it answers that it could, and records which form the MoE layer asked for)."""
    cfg = tiny_config()
    moe = MoE(cfg)
    calls = []

    class _Dispatcher:
        tp_group = None  # comm.all_reduce over no group: the shares' sum is this one share

        def sums_partials(self):
            return True

        def local_partial(self, flat, ids, w, experts):
            calls.append("shares")
            return moe.routed(flat, w, ids).astype(w.dtype)

        def __call__(self, flat, ids, w, experts):
            calls.append("dispatch")
            return moe.routed(flat, w, ids)

    moe.dispatcher = _Dispatcher()
    x = paddle.to_tensor(np.random.default_rng(0).standard_normal((2, 3, cfg.hidden_size)).astype("float32"))
    with paddle.no_grad():
        moe.train()
        trained = moe(x)
        moe.eval()
        evaluated = moe(x)
    assert calls == ["dispatch", "shares"]
    np.testing.assert_allclose(evaluated.numpy(), trained.numpy(), rtol=1e-6, atol=1e-6)
