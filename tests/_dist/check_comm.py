"""Run under ``python -m paddle.distributed.launch --nproc_per_node 2``: checks every collective,
autograd pair, parallel layer, the expert dispatcher (EP, ETP, replicated tokens) and the
full-state gather/shard against single-process references.  Writes {check: max abs diff} (and a
few exact flags) from rank 0 to the JSON path given as argv[1]."""

from __future__ import annotations

import json
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet import meta_parallel as mpu
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

from paddleformers_glm.parallel import comm
from paddleformers_glm.parallel.experts import ExpertMLP, ExpertParallelDispatcher, LocalExperts
from paddleformers_glm.parallel.layers import (
    ColumnParallelLinear,
    ParallelLMHead,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_shard_spec,
    local_slice,
    parallel_cross_entropy,
)
from paddleformers_glm.parallel.state import gather_full_state, shard_full_state
from paddleformers_glm.parallel.topology import ParallelConfig, Topology, init_topology, topology_override

topo = init_topology(ParallelConfig(tp=2))
R, G = topo.tp_rank, topo.tp_group
N = 2
res: dict[str, float] = {}


def md(a, b) -> float:
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    if a.shape != b.shape:
        return float("inf")
    return float(np.max(np.abs(a - b))) if a.size else 0.0


def T(a, grad: bool = False) -> paddle.Tensor:
    t = paddle.to_tensor(np.asarray(a))
    t.stop_gradient = not grad
    return t


rng = np.random.default_rng(0)  # same stream on both ranks
X = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(N)]  # X[r] is rank r's tensor

# ---------------------------------------------------------------- raw collectives
res["all_reduce"] = md(comm.all_reduce(T(X[R]), G).numpy(), X[0] + X[1])
res["all_reduce_max"] = md(comm.all_reduce(T(X[R]), G, op="max").numpy(), np.maximum(X[0], X[1]))
# fp16 / bf16: the fp32 sum of the two ranks' values, rounded once (gloo's own fp16 sum gives inf)
for dt in ("float16", "bfloat16"):
    low = [paddle.to_tensor(x).astype(dt) for x in X]
    want = (low[0].astype("float32") + low[1].astype("float32")).astype(dt).astype("float32").numpy()
    got = comm.all_reduce(low[R], G)
    res[f"all_reduce_{dt}"] = md(got.astype("float32").numpy(), want) if got.dtype == low[R].dtype else float("inf")
res["all_gather_axis0"] = md(comm.all_gather(T(X[R]), G, 0).numpy(), np.concatenate(X, 0))
res["all_gather_axis1"] = md(comm.all_gather(T(X[R]), G, 1).numpy(), np.concatenate(X, 1))
res["reduce_scatter_axis1"] = md(comm.reduce_scatter(T(X[R]), G, 1).numpy(), np.split(X[0] + X[1], 2, 1)[R])
res["split_take"] = md(comm.split_take(T(X[0]), G, 1).numpy(), np.split(X[0], 2, 1)[R])
# uneven all-to-all: rank s sends send[s][d] rows to d
send = [[1, 2], [3, 0]]
rows = [rng.standard_normal((sum(send[s]), 2)).astype(np.float32) for s in range(N)]
counts = comm.exchange_counts(send[R], G)
res["exchange_counts"] = 0.0 if counts == send else 1.0
got = comm.all_to_all_single(T(rows[R]), counts, G).numpy()
exp = np.concatenate([rows[s][sum(send[s][:R]) : sum(send[s][: R + 1])] for s in range(N)], 0)
res["all_to_all_uneven"] = md(got, exp)
back = comm.all_to_all_single(T(got), counts, G, reverse=True).numpy()
res["all_to_all_roundtrip"] = md(back, rows[R])

# ---------------------------------------------------------------- autograd pairs
W = [rng.standard_normal((3, 4)).astype(np.float32) for _ in range(N)]  # per-rank loss weights


def grad_of(fn, x_np):
    x = T(x_np, grad=True)
    y = fn(x)
    (y * T(W[R][tuple(slice(0, s) for s in y.shape)])).sum().backward()
    return y.numpy(), x.grad.numpy()


y, g = grad_of(lambda x: comm.copy_to_tp(x, G), X[0])
res["copy_to_tp_fwd"], res["copy_to_tp_bwd"] = md(y, X[0]), md(g, W[0] + W[1])
y, g = grad_of(lambda x: comm.reduce_from_tp(x, G), X[R])
res["reduce_from_tp_fwd"], res["reduce_from_tp_bwd"] = md(y, X[0] + X[1]), md(g, W[R])
y, g = grad_of(lambda x: comm.scatter_to_tp(x, -1, G), X[0])
w_full = np.concatenate([W[s][:, :2] for s in range(N)], 1)  # each rank's grad lands in its slice
res["scatter_to_tp_fwd"], res["scatter_to_tp_bwd"] = md(y, np.split(X[0], 2, 1)[R]), md(g, w_full)
y, g = grad_of(lambda x: comm.gather_from_tp(x, -1, G), X[R][:, :2])
res["gather_from_tp_fwd"], res["gather_from_tp_bwd"] = (
    md(y, np.concatenate([X[s][:, :2] for s in range(N)], 1)),
    md(g, W[R][:, 2 * R : 2 * R + 2]),
)
x3 = [rng.standard_normal((1, 2, 4)).astype(np.float32) for _ in range(N)]  # [B, S/tp, H]
w3 = [rng.standard_normal((1, 4, 4)).astype(np.float32) for _ in range(N)]
for mode in ("reduce_scatter", "split"):
    x = T(x3[R], grad=True)
    y = comm.gather_from_sp(x, group=G, grad=mode)
    (y * T(w3[R])).sum().backward()
    exp_g = (w3[0] + w3[1])[:, 2 * R : 2 * R + 2] if mode == "reduce_scatter" else w3[R][:, 2 * R : 2 * R + 2]
    res[f"gather_from_sp_{mode}_fwd"] = md(y.numpy(), np.concatenate(x3, 1))
    res[f"gather_from_sp_{mode}_bwd"] = md(x.grad.numpy(), exp_g)
# the same pairs on a group that is not Fleet's model-parallel group (built on comm.py, not Fleet's ops)
G2 = paddle.distributed.new_group([0, 1])
res["sp_fleet_group_only_hcg"] = 0.0 if comm.fleet_sp_group(G) is G and comm.fleet_sp_group(G2) is None else 1.0
for mode in ("reduce_scatter", "split"):
    x = T(x3[R], grad=True)
    y = comm.gather_from_sp(x, group=G2, grad=mode)
    (y * T(w3[R])).sum().backward()
    exp_g = (w3[0] + w3[1])[:, 2 * R : 2 * R + 2] if mode == "reduce_scatter" else w3[R][:, 2 * R : 2 * R + 2]
    res[f"own_gather_from_sp_{mode}"] = max(md(y.numpy(), np.concatenate(x3, 1)), md(x.grad.numpy(), exp_g))
x = T(w3[R], grad=True)
y = comm.reduce_scatter_to_sp(x, group=G2)
(y * T(x3[R])).sum().backward()
res["own_reduce_scatter_to_sp"] = max(
    md(y.numpy(), (w3[0] + w3[1])[:, 2 * R : 2 * R + 2]), md(x.grad.numpy(), np.concatenate(x3, 1))
)
x = T(w3[R], grad=True)
y = comm.reduce_scatter_to_sp(x, group=G)
(y * T(x3[R])).sum().backward()
res["reduce_scatter_to_sp_fwd"] = md(y.numpy(), (w3[0] + w3[1])[:, 2 * R : 2 * R + 2])
res["reduce_scatter_to_sp_bwd"] = md(x.grad.numpy(), np.concatenate(x3, 1))
sizes = [3, 1]
v = [rng.standard_normal((sizes[s], 2)).astype(np.float32) for s in range(N)]
wv = [rng.standard_normal((4, 2)).astype(np.float32) for _ in range(N)]
x = T(v[R], grad=True)
y = comm.all_gather_varlen(x, sizes, G)
(y * T(wv[R])).sum().backward()
res["all_gather_varlen_fwd"] = md(y.numpy(), np.concatenate(v, 0))
res["all_gather_varlen_bwd"] = md(x.grad.numpy(), (wv[0] + wv[1])[sum(sizes[:R]) : sum(sizes[: R + 1])])
x = T(wv[R], grad=True)
y = comm.reduce_scatter_varlen(x, sizes, G)
(y * T(v[R])).sum().backward()
res["reduce_scatter_varlen_fwd"] = md(y.numpy(), (wv[0] + wv[1])[sum(sizes[:R]) : sum(sizes[: R + 1])])
res["reduce_scatter_varlen_bwd"] = md(x.grad.numpy(), np.concatenate(v, 0))

# ---------------------------------------------------------------- layers vs single process
B, S, H, FF, V = 2, 4, 8, 12, 16
x_np = rng.standard_normal((B, S, H)).astype(np.float32)
W1, b1 = rng.standard_normal((H, FF)).astype(np.float32) * 0.3, rng.standard_normal(FF).astype(np.float32) * 0.1
W2, b2 = rng.standard_normal((FF, H)).astype(np.float32) * 0.3, rng.standard_normal(H).astype(np.float32) * 0.1
E_np, Wout = rng.standard_normal((V, H)).astype(np.float32), rng.standard_normal((H, V)).astype(np.float32) * 0.3
ids_np = rng.integers(0, V, (B, S))
lbl_np = rng.integers(0, V, (B, S))
lbl_np[0, 1] = -100
gy = rng.standard_normal((B, S, H)).astype(np.float32)


def ref_mlp():
    x, w1, bb1, w2, bb2 = (T(a, grad=True) for a in (x_np, W1, b1, W2, b2))
    y = F.linear(F.gelu(F.linear(x, w1, bb1)), w2, bb2)
    (y * T(gy)).sum().backward()
    return y.numpy(), x.grad.numpy(), w1.grad.numpy(), bb1.grad.numpy(), w2.grad.numpy(), bb2.grad.numpy()


ry, rgx, rg1, rgb1, rg2, rgb2 = ref_mlp()
for sp in (False, True):
    col = ColumnParallelLinear(H, FF, has_bias=True, sequence_parallel=sp)
    row = RowParallelLinear(FF, H, has_bias=True, input_is_parallel=True, sequence_parallel=sp)
    col.weight.set_value(local_slice(W1, col.weight.shard_spec, R, N))
    col.bias.set_value(local_slice(b1, col.bias.shard_spec, R, N))
    row.weight.set_value(local_slice(W2, row.weight.shard_spec, R, N))
    row.bias.set_value(b2)
    xin = np.split(x_np, N, 1)[R] if sp else x_np
    x = T(xin, grad=True)
    y = row(F.gelu(col(x)))
    (y * T(np.split(gy, N, 1)[R] if sp else gy)).sum().backward()
    tag = "sp" if sp else "tp"
    res[f"mlp_{tag}_fwd"] = md(y.numpy(), np.split(ry, N, 1)[R] if sp else ry)
    res[f"mlp_{tag}_dx"] = md(x.grad.numpy(), np.split(rgx, N, 1)[R] if sp else rgx)
    res[f"mlp_{tag}_dW1"] = md(col.weight.grad.numpy(), np.split(rg1, N, 1)[R])
    res[f"mlp_{tag}_db1"] = md(col.bias.grad.numpy(), np.split(rgb1, N)[R])
    res[f"mlp_{tag}_dW2"] = md(row.weight.grad.numpy(), np.split(rg2, N, 0)[R])
    # under SP the row bias grad is partial: summed over TP by the trainer (ShardSpec.sequence_parallel)
    gb2 = comm.all_reduce(row.bias.grad, G).numpy() if sp else row.bias.grad.numpy()
    res[f"mlp_{tag}_db2"] = md(gb2, rgb2)
    res[f"mlp_{tag}_row_bias_marked"] = 0.0 if row.bias.shard_spec.sequence_parallel == sp else 1.0
    # Fleet's stock layers: meta_parallel's without SP, sequence_parallel_utils' with it
    want = (
        (spu.ColumnSequenceParallelLinear, spu.RowSequenceParallelLinear)
        if sp
        else (mpu.ColumnParallelLinear, mpu.RowParallelLinear)
    )
    res[f"mlp_{tag}_fleet_layers"] = 0.0 if isinstance(col, want[0]) and isinstance(row, want[1]) else 1.0
    # Fleet's sequence-parallel flag agrees with the ShardSpec on the row bias
    res[f"mlp_{tag}_row_bias_fleet_flag"] = 0.0 if spu.is_sequence_parallel_parameter(row.bias) == sp else 1.0

# fused chunks: rank r holds [gate_r | up_r]
Wg = rng.standard_normal((H, 2 * FF)).astype(np.float32)
fused = ColumnParallelLinear(H, 2 * FF, fuse_chunks=2)
fused.weight.set_value(local_slice(Wg, fused.weight.shard_spec, R, N))
out = fused(T(x_np)).numpy()
full = x_np @ Wg
res["fused_chunks"] = md(
    out, np.concatenate([np.split(full[..., :FF], N, -1)[R], np.split(full[..., FF:], N, -1)[R]], -1)
)


# embedding + head + cross entropy (non-SP and SP) vs single process
def ref_lm():
    e, w = T(E_np, grad=True), T(Wout, grad=True)
    logits = paddle.matmul(F.embedding(T(ids_np), e), w)
    tok = F.cross_entropy(logits, T(lbl_np).unsqueeze(-1), ignore_index=-100, reduction="none").squeeze(-1)
    loss = tok.sum() / float((lbl_np != -100).sum())
    loss.backward()
    return float(loss), tok.numpy(), e.grad.numpy(), w.grad.numpy()


rl, rtok, rge, rgw = ref_lm()
for sp in (False, True):
    emb = VocabParallelEmbedding(V, H, sequence_parallel=sp)
    head = ParallelLMHead(H, V, sequence_parallel=sp)
    emb.weight.set_value(local_slice(E_np, emb.weight.shard_spec, R, N))
    head.weight.set_value(local_slice(Wout, head.weight.shard_spec, R, N))
    h = emb(T(ids_np))
    logits = head(h)
    tok = parallel_cross_entropy(logits, T(lbl_np), reduction="none")
    loss = parallel_cross_entropy(logits, T(lbl_np), reduction="mean")
    loss.backward()
    tag = "sp" if sp else "tp"
    res[f"lm_{tag}_emb_shape_ok"] = 0.0 if list(h.shape) == ([B, S // N, H] if sp else [B, S, H]) else 1.0
    res[f"lm_{tag}_loss"] = abs(float(loss) - rl)
    res[f"lm_{tag}_tok"] = md(tok.numpy(), rtok)
    res[f"lm_{tag}_dE"] = md(emb.weight.grad.numpy(), np.split(rge, N, 0)[R])
    res[f"lm_{tag}_dWout"] = md(head.weight.grad.numpy(), np.split(rgw, N, 1)[R])
# torch padding_idx semantics on Fleet's vocab-parallel embedding: pad row returned, no gradient
PAD = int(ids_np[0, 0])
pemb = VocabParallelEmbedding(V, H, padding_idx=PAD)
pemb.weight.set_value(local_slice(E_np, pemb.weight.shard_spec, R, N))
g_emb = np.linspace(-1.0, 1.0, B * S * H, dtype=np.float32).reshape(B, S, H)
pout = pemb(T(ids_np))
(pout * T(g_emb)).sum().backward()
e_ref = T(E_np, grad=True)
o_ref = F.embedding(T(ids_np), e_ref)
(o_ref * T(g_emb)).sum().backward()
g_ref = e_ref.grad.numpy().copy()
g_ref[PAD] = 0.0
res["pad_emb_fwd"] = md(pout.numpy(), o_ref.numpy())
res["pad_emb_dE"] = md(pemb.weight.grad.numpy(), np.split(g_ref, N, 0)[R])
res["pad_emb_from_fleet"] = 0.0 if isinstance(pemb, mpu.VocabParallelEmbedding) else 1.0
# ... and under SP (rows reduce-scattered into this rank's sequence half)
spemb = VocabParallelEmbedding(V, H, sequence_parallel=True, padding_idx=PAD)
spemb.weight.set_value(local_slice(E_np, spemb.weight.shard_spec, R, N))
sout = spemb(T(ids_np))
(sout * T(np.split(g_emb, N, 1)[R])).sum().backward()
res["pad_emb_sp_fwd"] = md(sout.numpy(), np.split(o_ref.numpy(), N, 1)[R])
res["pad_emb_sp_dE"] = md(spemb.weight.grad.numpy(), np.split(g_ref, N, 0)[R])
res["lm_head_from_fleet"] = 0.0 if isinstance(ParallelLMHead(H, V), mpu.ColumnParallelLinear) else 1.0
res["lm_sp_from_fleet"] = (
    0.0 if isinstance(head, spu.ColumnSequenceParallelLinear) and isinstance(emb, mpu.VocabParallelEmbedding) else 1.0
)
res["ce_sum_vs_mean"] = abs(
    float(parallel_cross_entropy(T(np.ones((2, 8), np.float32)), T(np.array([1, -100])), reduction="sum"))
    - float(np.log(16.0))
)

# ---------------------------------------------------------------- expert dispatcher
E, K, HE, FE = 4, 2, 6, 8
Wup = [rng.standard_normal((HE, 2 * FE)).astype(np.float32) * 0.4 for _ in range(E)]
Wdn = [rng.standard_normal((FE, HE)).astype(np.float32) * 0.4 for _ in range(E)]
Xt = [rng.standard_normal((6, HE)).astype(np.float32) for _ in range(N)]
ids_t = [np.stack([rng.permutation(E)[:K] for _ in range(6)]).astype(np.int64) for _ in range(N)]
wt = [rng.random((6, K)).astype(np.float32) + 0.1 for _ in range(N)]
gy_t = [rng.standard_normal((6, HE)).astype(np.float32) for _ in range(N)]


def make_experts(tp: Topology, ids: list[int]) -> LocalExperts:
    ex = LocalExperts(ids, lambda e: ExpertMLP(HE, FE, topo=tp))
    for e in ids:
        m = ex[str(e)]
        m.up_gate_proj.set_value(local_slice(Wup[e], m.up_gate_proj.shard_spec, tp.etp_rank, tp.etp_size))
        m.down_proj.set_value(local_slice(Wdn[e], m.down_proj.shard_spec, tp.etp_rank, tp.etp_size))
    return ex


def reference(token_sets: list[int], rows: int = 6):
    """Single process, all experts, the first ``rows`` tokens of ranks in token_sets (one backward over their sum)."""
    with topology_override() as single:
        ex = make_experts(single, list(range(E)))
        disp = ExpertParallelDispatcher(E, topo=single)
        outs, wts = [], []
        total = None
        for s in token_sets:
            x, w = T(Xt[s][:rows], grad=True), T(wt[s][:rows], grad=True)
            y = disp(x, T(ids_t[s][:rows]), w, ex)
            loss = (y * T(gy_t[s][:rows])).sum()
            total = loss if total is None else total + loss
            outs.append(y.numpy())
            wts.append(w)
        total.backward()

        def g(p):  # an expert no token chose has no gradient
            return p.grad.numpy() if p.grad is not None else np.zeros(p.shape, np.float32)

        return (
            outs,
            [w.grad.numpy() for w in wts],
            {e: (g(ex[str(e)].up_gate_proj), g(ex[str(e)].down_proj)) for e in range(E)},
        )


def run_parallel(tp: Topology, token_rank: int, rows: int = 6):
    ex = make_experts(tp, ExpertParallelDispatcher(E, topo=tp).local_expert_ids)
    disp = ExpertParallelDispatcher(E, topo=tp)
    x, w = T(Xt[token_rank][:rows], grad=True), T(wt[token_rank][:rows], grad=True)
    with topology_override(tp):
        y = disp(x, T(ids_t[token_rank][:rows]), w, ex)
    (y * T(gy_t[token_rank][:rows])).sum().backward()
    return (
        y.numpy(),
        w.grad.numpy(),
        {e: (ex[str(e)].up_gate_proj.grad, ex[str(e)].down_proj.grad) for e in disp.local_expert_ids},
    )


ref_out, ref_wg, ref_eg = reference([0, 1])
# (a) EP 2 over the two ranks, tokens distinct (as under sequence parallel)
tp_ep = Topology(
    ParallelConfig(tp=2, ep=2, sp=True),
    rank=R,
    backend=topo.backend,
    groups={"tp": G, "ep": G},
    ranks={"tp": R, "ep": R},
)
y, wg, eg = run_parallel(tp_ep, R)
res["ep_fwd"], res["ep_dweights"] = md(y, ref_out[R]), md(wg, ref_wg[R])
res["ep_dexperts"] = max(
    max(md(comm_g.numpy() if comm_g is not None else 0 * ref_eg[e][i], ref_eg[e][i]) for i, comm_g in enumerate(gs))
    for e, gs in eg.items()
)
# (b) ETP 2: every rank holds a column/row slice of every expert, tokens distinct
tp_etp = Topology(
    ParallelConfig(tp=2, etp=2, sp=True),
    rank=R,
    backend=topo.backend,
    groups={"tp": G, "etp": G},
    ranks={"tp": R, "etp": R},
)
y, wg, eg = run_parallel(tp_etp, R)
res["etp_fwd"], res["etp_dweights"] = md(y, ref_out[R]), md(wg, ref_wg[R])
res["etp_dexperts"] = max(
    max(
        md(gs[0].numpy(), local_slice(ref_eg[e][0], ExpertMLP(HE, FE, topo=tp_etp).up_gate_proj.shard_spec, R, N)),
        md(gs[1].numpy(), np.split(ref_eg[e][1], N, 0)[R]),
    )
    for e, gs in eg.items()
)
# (c) EP 2 with tokens replicated over TP (no SP): the dispatcher splits them; the result is replicated
ref1_out, ref1_wg, ref1_eg = reference([0])
tp_rep = Topology(
    ParallelConfig(tp=2, ep=2, sp=False),
    rank=R,
    backend=topo.backend,
    groups={"tp": G, "ep": G},
    ranks={"tp": R, "ep": R},
)
y, wg, eg = run_parallel(tp_rep, 0)
res["ep_replicated_fwd"] = md(y, ref1_out[0])
res["ep_replicated_dweights"] = md(wg, ref1_wg[0])
res["ep_replicated_dexperts"] = max(
    max(md(gs[i].numpy() if gs[i] is not None else 0 * ref1_eg[e][i], ref1_eg[e][i]) for i in range(2))
    for e, gs in eg.items()
)

# (c2) replicated tokens that tp does not divide (an odd micro-batch x sequence without SP): the ranks take
# 3 and 2 of 5 tokens, at ep 2 and at ep 1 (--tp 2 alone: every rank holds every expert, its gradient
# is partial, summed over the expert-data group = the tp ranks); 1 token: rank 1 takes none
tp_only = Topology(ParallelConfig(tp=2), rank=R, backend=topo.backend, groups={"tp": G}, ranks={"tp": R})
for name, lay, rows in (
    ("ep_replicated_odd", tp_rep, 5),
    ("tp_replicated_odd", tp_only, 5),
    ("tp_one_token", tp_only, 1),
):
    try:
        r_out, r_wg, r_eg = reference([0], rows)
        y, wg, eg = run_parallel(lay, 0, rows)
        res[f"{name}_fwd"], res[f"{name}_dweights"] = md(y, r_out[0]), md(wg, r_wg[0])

        def summed(g, e, i, lay=lay, r_eg=r_eg):
            g = T(g.numpy() if g is not None else 0 * r_eg[e][i])
            return (comm.all_reduce(g, G) if lay.ep_size == 1 else g).numpy()

        res[f"{name}_dexperts"] = max(
            max(md(summed(gs[i], e, i), r_eg[e][i]) for i in range(2)) for e, gs in sorted(eg.items())
        )
    except Exception as e:  # noqa: BLE001 - recorded as a failed check, the job goes on
        print(f"{name} failed:", type(e).__name__, e, flush=True)
        res[f"{name}_fwd"] = float("inf")


# (d) an expert-tensor-parallel group that received no token at all (with ep > 1 every token may go
# to the other ep rank's experts): no collective may carry a zero-element tensor (gloo aborts)
z = T(np.zeros((0, HE), np.float32), grad=True)
try:
    pooled = comm.all_gather_varlen(z, [0, 0], G)
    back = comm.reduce_scatter_varlen(pooled * 2.0, [0, 0], G)
    back.sum().backward()
    ok = list(back.shape) == [0, HE] and (z.grad is None or list(z.grad.shape) == [0, HE])
    res["varlen_no_rows"] = 0.0 if ok else 1.0
except Exception as e:  # noqa: BLE001 - recorded as a failed check, the job goes on
    print("varlen_no_rows failed:", e, flush=True)
    res["varlen_no_rows"] = 1.0
zx, zw = T(np.zeros((0, HE), np.float32), grad=True), T(np.zeros((0, K), np.float32), grad=True)
ex0 = make_experts(tp_etp, list(range(E)))
with topology_override(tp_etp):
    y0 = ExpertParallelDispatcher(E, topo=tp_etp)(zx, T(np.zeros((0, K), np.int64)), zw, ex0)
(y0.sum() + zw.sum() * 0.0).backward()
res["etp_no_tokens"] = 0.0 if list(y0.shape) == [0, HE] else 1.0


# ---------------------------------------------------------------- tiny GLM-5.2 at tp 2 + SP vs one process
def glm_run(tp: Topology, state: dict | None, recompute: str = "none", shape: tuple[int, int] = (2, 16)):
    """Build the whole tiny model as one stage under ``tp`` (from ``state`` or a seeded init), run
    a forward + backward of its summed mean losses under the trainer's ``recompute`` mode; returns
    (stage, loss, {name: gradient})."""
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.parallel.pipeline import StageSpec
    from paddleformers_glm.tiny import tiny_config

    cfg = tiny_config()
    with topology_override(tp):
        paddle.seed(0)
        whole = StageSpec.whole(cfg.num_hidden_layers, has_mtp=cfg.num_mtp_layers > 0)
        stage = GlmMoeDsaForCausalLM(cfg, topology=tp, stage=whole)
        if state is not None:
            shard_full_state(stage, state, tp)
        stage.recompute = recompute
        ids = T(np.random.default_rng(1).integers(0, cfg.vocab_size, shape))  # B = 2: the transposing path
        out = stage.forward_stage(None, {"input_ids": ids, "labels": ids})
        loss = paddle.add_n([t.sum / max(float(t.count), 1.0) for t in out.losses.values()])
        loss.backward()
    grads = {
        n: (p.grad.numpy() if p.grad is not None else np.zeros(p.shape, np.float32))
        for n, p in stage.named_parameters()
    }
    return stage, float(loss), grads


with topology_override() as single:
    ref_stage, ref_loss, ref_grads = glm_run(single, None)
glm_state = {k: v.numpy() for k, v in ref_stage.state_dict().items()}
tp_sp = Topology(
    ParallelConfig(tp=2, sp=True),
    rank=topo.rank,
    backend=topo.backend,
    groups={"tp": G},
    ranks={"tp": R},
    hcg=topo.hcg,
)
sp_stage, sp_loss, sp_grads = glm_run(tp_sp, glm_state)
res["glm_sp_loss"] = abs(sp_loss - ref_loss)
glm_dg = 0.0
for n, p in sp_stage.named_parameters():
    spec = get_shard_spec(p)
    g = sp_grads[n]
    # partial over the two ranks, summed as the trainer does: sequence-parallel parameters over TP,
    # experts (each rank routed its own sequence half; ep = etp = 1) over the expert-data group
    if spec.sequence_parallel or spec.expert:
        g = comm.all_reduce(T(g), G).numpy()
    want = local_slice(ref_grads[n], spec, tp_sp.rank_in(spec.group), tp_sp.size(spec.group))
    d = md(g, want)
    if not d <= 1e-5:
        print("glm tp2+sp gradient differs:", n, list(g.shape), list(want.shape), d, flush=True)
    glm_dg = max(glm_dg, d)
res["glm_sp_grads"] = glm_dg
layers = list(sp_stage.sublayers())
n_col = sum(isinstance(m, spu.ColumnSequenceParallelLinear) for m in layers)
n_row = sum(isinstance(m, spu.RowSequenceParallelLinear) for m in layers)
own = [type(m).__name__ for m in layers if type(m).__name__.startswith("Comm")]
print("glm tp2+sp: Fleet SP column", n_col, "row", n_row, "own layers", own, flush=True)
res["glm_sp_fleet_sp_linears"] = 0.0 if n_col > 0 and n_row > 0 and not own else 1.0
# Fleet's is_sequence_parallel_parameter and our ShardSpec name the same parameters
fleet_sp = {n for n, p in sp_stage.named_parameters() if spu.is_sequence_parallel_parameter(p)}
spec_sp = {
    n for n, p in sp_stage.named_parameters() if getattr(p, "shard_spec", None) and p.shard_spec.sequence_parallel
}
res["glm_sp_flags_agree"] = 0.0 if fleet_sp == spec_sp and fleet_sp else 1.0
# decoding with a cache under SP: refused by name (a decode step's few tokens cannot be split over ranks)
sp_stage.eval()
try:
    with topology_override(tp_sp):
        sp_stage(input_ids=T(np.arange(8).reshape(1, 8)), use_cache=True)
    res["glm_sp_cache_refused"] = 1.0
except NotImplementedError as e:
    print("glm tp2+sp cache:", e, flush=True)
    res["glm_sp_cache_refused"] = 0.0 if "sequence_parallel=True" in str(e) else 1.0
refused = 0
for kw in ({}, {"use_cache": False}):  # generate, with or without a cache: refused before any step
    try:
        with topology_override(tp_sp):
            sp_stage.generate(T(np.arange(7).reshape(1, 7)), max_new_tokens=2, **kw)
    except NotImplementedError as e:
        refused += "generate: this model splits its sequences over ranks (sequence_parallel=True" in str(e)
res["glm_sp_generate_refused"] = 0.0 if refused == 2 else 1.0
sp_stage.train()

# ... and at tp 2 without SP on one sequence of 9 tokens: the MoE layers' dispatcher splits the replicated
# tokens 5 / 4 over the tp ranks (an odd micro-batch x sequence)
try:
    with topology_override() as single:
        _, odd_ref_loss, odd_ref_grads = glm_run(single, glm_state, shape=(1, 9))
    tp_plain = Topology(
        ParallelConfig(tp=2), rank=topo.rank, backend=topo.backend, groups={"tp": G}, ranks={"tp": R}, hcg=topo.hcg
    )
    odd_stage, odd_loss, odd_grads = glm_run(tp_plain, glm_state, shape=(1, 9))
    res["glm_tp_odd_tokens_loss"] = abs(odd_loss - odd_ref_loss)
    odd_dg = 0.0
    for n, p in odd_stage.named_parameters():
        spec = get_shard_spec(p)
        g = comm.all_reduce(T(odd_grads[n]), G).numpy() if spec.expert else odd_grads[n]  # experts: over edp = tp
        odd_dg = max(
            odd_dg, md(g, local_slice(odd_ref_grads[n], spec, tp_plain.rank_in(spec.group), tp_plain.size(spec.group)))
        )
    res["glm_tp_odd_tokens_grads"] = odd_dg
except Exception as e:  # noqa: BLE001 - recorded as a failed check, the job goes on
    print("glm tp2 odd tokens failed:", type(e).__name__, e, flush=True)
    res["glm_tp_odd_tokens_loss"] = float("inf")


# ---------------------------------------------------------------- recompute at tp 2 + SP: bitwise, replays counted
def counted_run(mode: str) -> tuple[float, dict, dict[str, int]]:
    """``glm_run`` at tp 2 + SP under ``--recompute mode``, counting the decoder layers' forwards
    and their attention cores' (a replay in backward runs them again)."""
    from paddleformers_glm.modeling.attention import MLAttention
    from paddleformers_glm.modeling.decoder import DecoderLayer

    calls = {"layer": 0, "core": 0}
    originals = {"layer": (DecoderLayer, "forward"), "core": (MLAttention, "_core")}

    def counter(kind):
        cls, name = originals[kind]
        orig = getattr(cls, name)

        def counted(self, *a, **k):
            calls[kind] += 1
            return orig(self, *a, **k)

        return cls, name, orig, counted

    patches = [counter(kind) for kind in originals]
    for cls, name, _, counted in patches:
        setattr(cls, name, counted)
    try:
        _, loss, grads = glm_run(tp_sp, glm_state, mode)
    finally:
        for cls, name, orig, _ in patches:
            setattr(cls, name, orig)
    return loss, grads, calls


L_TINY = sp_stage.config.num_hidden_layers  # the MTP layer is not recomputed
base_loss, base_grads, base_calls = counted_run("none")
res["glm_sp_recompute_none_repeat"] = abs(base_loss - sp_loss)  # the counting itself changes nothing
for mode in ("full", "core"):
    loss, grads, calls = counted_run(mode)
    res[f"glm_sp_recompute_{mode}_loss"] = abs(loss - base_loss)
    diffs = {n: md(grads[n], base_grads[n]) for n in base_grads}
    res[f"glm_sp_recompute_{mode}_grads"] = max(diffs.values())
    differ = [n for n, d in diffs.items() if d != 0.0]
    if differ:
        print(f"glm tp2+sp recompute {mode}: gradients differ from no recompute: {differ[:8]}", flush=True)
    # each decoder layer (full) or its attention core (core) runs once more, in backward; nothing else
    # (a replayed layer runs its core again)
    want = {"layer": base_calls["layer"] + (L_TINY if mode == "full" else 0), "core": base_calls["core"] + L_TINY}
    print(f"glm tp2+sp recompute {mode}: calls {calls} (none: {base_calls})", flush=True)
    res[f"glm_sp_recompute_{mode}_replays"] = 0.0 if calls == want and base_calls["core"] > 0 else 1.0


# ---------------------------------------------------------------- full state round trip
class Small(paddle.nn.Layer):
    def __init__(self):
        super().__init__()
        self.embed = VocabParallelEmbedding(V, H)
        self.up = ColumnParallelLinear(H, 2 * FF, has_bias=True, fuse_chunks=2)
        self.down = RowParallelLinear(FF, H, has_bias=True)


full_state = {
    "embed.weight": E_np,
    "up.weight": Wg,
    "up.bias": rng.standard_normal(2 * FF).astype(np.float32),
    "down.weight": W2,
    "down.bias": b2,
}
m = Small()
shard_full_state(m, full_state)
res["shard_up_local"] = md(m.up.weight.numpy(), local_slice(Wg, m.up.weight.shard_spec, R, N))
back = gather_full_state(m)
if R == 0:
    res["gather_full_state"] = (
        max(md(back[k], v) for k, v in full_state.items()) if set(back) == set(full_state) else float("inf")
    )

if R == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
print("CHECK_COMM_DONE", R, flush=True)
