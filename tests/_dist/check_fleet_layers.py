"""Run under ``python -m paddle.distributed.launch --nproc_per_node 2``: Fleet's stock
meta_parallel layers (Column/RowParallelLinear, VocabParallelEmbedding, ParallelCrossEntropy) and
sequence-parallel layers (Column/RowSequenceParallelLinear with ScatterOp/GatherOp) at tp 2 on gloo,
through the compatibility ops, against the same computation on full tensors in one process.
Writes {check: max abs diff} and the installed op names from rank 0 to argv[1]."""

from __future__ import annotations

import json
import sys

import numpy as np
import paddle
import paddle.nn.functional as F
from paddle.distributed.fleet import meta_parallel as mpu
from paddle.distributed.fleet.utils import sequence_parallel_utils as spu

from paddleformers_glm.parallel.fleet_gloo import installed
from paddleformers_glm.parallel.topology import ParallelConfig, init_topology

topo = init_topology(ParallelConfig(tp=2))
R, N = topo.tp_rank, 2
res: dict = {"installed": installed()}
rng = np.random.default_rng(0)  # same stream on both ranks
H, FF, V, B, S = 8, 12, 16, 2, 4


def md(a, b) -> float:
    return float(np.max(np.abs(np.asarray(a, np.float64) - np.asarray(b, np.float64))))


def T(a, grad=False):
    t = paddle.to_tensor(np.asarray(a))
    t.stop_gradient = not grad
    return t


W1 = rng.standard_normal((H, FF)).astype(np.float32) * 0.3
b1 = rng.standard_normal(FF).astype(np.float32) * 0.1
W2 = rng.standard_normal((FF, H)).astype(np.float32) * 0.3
b2 = rng.standard_normal(H).astype(np.float32) * 0.1
X = rng.standard_normal((B, S, H)).astype(np.float32)
GY = rng.standard_normal((B, S, H)).astype(np.float32)
E = rng.standard_normal((V, H)).astype(np.float32)
ids = rng.integers(0, V, (B, S))
logits_np = rng.standard_normal((B, S, V)).astype(np.float32)
labels = rng.integers(0, V, (B, S))
labels[0, 0] = -100  # ignored


def dense_mlp(x_np):
    w1, bb1, w2, bb2 = T(W1, True), T(b1, True), T(W2, True), T(b2, True)
    x = T(x_np, True)
    y = F.linear(F.gelu(F.linear(x, w1, bb1)), w2, bb2)
    (y * T(GY if x_np.shape == GY.shape else np.transpose(GY, (1, 0, 2)))).sum().backward()
    return y.numpy(), x.grad.numpy(), w1.grad.numpy(), w2.grad.numpy(), bb2.grad.numpy()


# ---------------------------------------------------------------- TP MLP (Column -> Row)
col = mpu.ColumnParallelLinear(H, FF, has_bias=True, gather_output=False)
row = mpu.RowParallelLinear(FF, H, has_bias=True, input_is_parallel=True)
col.weight.set_value(np.split(W1, N, 1)[R])
col.bias.set_value(np.split(b1, N)[R])
row.weight.set_value(np.split(W2, N, 0)[R])
row.bias.set_value(b2)
x = T(X, True)
y = row(F.gelu(col(x)))
(y * T(GY)).sum().backward()
ry, rdx, rdw1, rdw2, rdb2 = dense_mlp(X)
res["tp_mlp_fwd"] = md(y.numpy(), ry)
res["tp_mlp_dx"] = md(x.grad.numpy(), rdx)
res["tp_mlp_dW1"] = md(col.weight.grad.numpy(), np.split(rdw1, N, 1)[R])
res["tp_mlp_dW2"] = md(row.weight.grad.numpy(), np.split(rdw2, N, 0)[R])
res["tp_mlp_db2"] = md(row.bias.grad.numpy(), rdb2)
res["tp_is_distributed"] = 0.0 if (col.weight.is_distributed and row.weight.is_distributed) else 1.0

# ---------------------------------------------------------------- vocab-parallel embedding
emb = mpu.VocabParallelEmbedding(V, H)
emb.weight.set_value(np.split(E, N, 0)[R])
out = emb(T(ids))
(out * T(GY)).sum().backward()
e_full = T(E, True)
ref = F.embedding(T(ids), e_full)
(ref * T(GY)).sum().backward()
res["vocab_emb_fwd"] = md(out.numpy(), ref.numpy())
res["vocab_emb_dE"] = md(emb.weight.grad.numpy(), np.split(e_full.grad.numpy(), N, 0)[R])

# ---------------------------------------------------------------- vocab-parallel cross entropy
lg = T(np.split(logits_np, N, -1)[R], True)
loss = mpu.ParallelCrossEntropy()(lg, T(labels[..., None]))
loss.sum().backward()
lf = T(logits_np, True)
ref = F.cross_entropy(lf, T(labels[..., None]), reduction="none", ignore_index=-100)
ref.sum().backward()
res["parallel_ce_loss"] = md(loss.numpy(), ref.numpy())
res["parallel_ce_dlogits"] = md(lg.grad.numpy(), np.split(lf.grad.numpy(), N, -1)[R])

# ---------------------------------------------------------------- sequence parallel (sequence-first)
Xs = np.transpose(X, (1, 0, 2)).copy()  # [S, B, H]
ccol = spu.ColumnSequenceParallelLinear(H, FF, has_bias=True, gather_output=False)
rrow = spu.RowSequenceParallelLinear(FF, H, has_bias=True, input_is_parallel=True)
ccol.weight.set_value(np.split(W1, N, 1)[R])
ccol.bias.set_value(np.split(b1, N)[R])
rrow.weight.set_value(np.split(W2, N, 0)[R])
rrow.bias.set_value(b2)
xs = T(Xs, True)
h = spu.ScatterOp.apply(xs)  # [S/2, B, H]
ys = spu.GatherOp.apply(rrow(F.gelu(ccol(h))))
(ys * T(np.transpose(GY, (1, 0, 2)))).sum().backward()
ry, rdx, rdw1, rdw2, rdb2 = dense_mlp(Xs)
res["sp_mlp_fwd"] = md(ys.numpy(), ry)
res["sp_mlp_dx"] = md(xs.grad.numpy(), rdx)
res["sp_mlp_dW1"] = md(ccol.weight.grad.numpy(), np.split(rdw1, N, 1)[R])
res["sp_mlp_dW2"] = md(rrow.weight.grad.numpy(), np.split(rdw2, N, 0)[R])
# the row bias sees only this rank's sequence half: its gradient is partial until summed over TP
db2 = rrow.bias.grad.detach().clone()
paddle.distributed.all_reduce(db2, group=topo.tp_group)
res["sp_mlp_db2_summed"] = md(db2.numpy(), rdb2)

# ---------------------------------------------------------------- probe: Fleet's SP split on batch-first input
# The model's activations are [B, S, H]; Fleet's ScatterOp splits axis 0 whatever the layout.
res["probe_scatter_batch_first_shape"] = list(spu.ScatterOp.apply(T(X)).shape)

if R == 0:
    with open(sys.argv[1], "w") as f:
        json.dump(res, f, indent=1)
print("CHECK_FLEET_DONE", R, flush=True)
