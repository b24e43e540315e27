"""Host reads of device values in the per-micro-batch paths, each a stream synchronisation on a GPU:
the loss ledger reads none per micro-batch (the step's totals read once), the expert dispatcher one
per MoE layer forward. Counted on CPU by wrapping the Tensor methods that copy a value to the host.

Run as a script (under Paddle's launcher, 2 processes) it is the worker of the multi-process test."""

from __future__ import annotations

import contextlib
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddleformers_glm.parallel.experts import ExpertMLP, ExpertParallelDispatcher, LocalExperts
from paddleformers_glm.parallel.pipeline import LossLedger, LossTerm
from paddleformers_glm.parallel.topology import ParallelConfig, Topology, topology_override
from tests.test_parallel_units import expert_loop_reference


@contextlib.contextmanager
def host_reads() -> Iterator[list[int]]:
    """Count host reads while the block runs: ``Tensor.numpy`` (``int()``, ``float()``, ``bool()``,
    ``.tolist()`` and indexing with a tensor go through it, test below), ``Tensor.item`` (which does
    not), and ``paddle.bincount``, whose GPU kernel copies the ids' min and max to the host to size
    its output."""
    n = [0]
    saved = {"numpy": paddle.Tensor.numpy, "item": paddle.Tensor.item, "bincount": paddle.bincount}

    def counted(fn):
        def wrapper(*args, **kwargs):
            n[0] += 1
            return fn(*args, **kwargs)

        return wrapper

    paddle.Tensor.numpy = counted(saved["numpy"])
    paddle.Tensor.item = counted(saved["item"])
    paddle.bincount = counted(saved["bincount"])
    try:
        yield n
    finally:
        paddle.Tensor.numpy, paddle.Tensor.item, paddle.bincount = saved["numpy"], saved["item"], saved["bincount"]


def test_every_scalar_conversion_reads_through_numpy_or_item():
    """The counter's premise in this Paddle: each conversion to a Python value is one counted call."""
    t = paddle.to_tensor([3, 1, 2], dtype="int64")
    f = paddle.to_tensor(2.5, dtype="float32")
    for convert in (
        lambda: int(t[0]),
        lambda: float(f),
        lambda: bool(t[0]),
        lambda: t.tolist(),
        lambda: t.numpy(),
        lambda: f.item(),
        lambda: [0, 1, 2, 3][t[1]],
        lambda: paddle.bincount(t, minlength=4),
    ):
        with host_reads() as n:
            convert()
        assert n[0] == 1
    with host_reads() as n:  # device-only work reads nothing
        (t + 1).sum().astype("float64")
        paddle.index_add(paddle.zeros([5], dtype="int64"), t, 0, paddle.ones_like(t))
    assert n[0] == 0


# ------------------------------------------------------------------ the loss ledger
def _micro_batch_terms(seed: int) -> dict[str, LossTerm]:
    rng = np.random.default_rng(seed)
    labels = paddle.to_tensor(rng.integers(-100, 50, size=(2, 16)), dtype="int64")
    count = (labels != -100).astype("int64").sum()
    return {
        "lm": LossTerm(paddle.to_tensor(rng.random() * 40, dtype="float32"), count),
        "mtp_0": LossTerm(paddle.to_tensor(rng.random() * 40, dtype="float32"), count - 2),
        "indexer_kl": LossTerm(paddle.to_tensor(rng.random(), dtype="float32"), 1),  # a Python count
    }


def _old_totals(batches: list[dict[str, LossTerm]]) -> dict[str, tuple[float, int]]:
    """What the ledger reported when it read every count per micro-batch."""
    sums: dict = {}
    counts: dict = {}
    for terms in batches:
        for name, term in terms.items():
            s64 = term.sum.astype("float32").detach().astype("float64")
            sums[name] = sums[name] + s64 if name in sums else s64
            counts[name] = counts.get(name, 0) + int(term.count)
    return {k: (float(v.numpy()), counts[k]) for k, v in sums.items()}


def test_loss_ledger_reads_nothing_per_micro_batch_and_totals_once():
    """``objective`` runs between each micro-batch's forward and backward: a read there would make
    the host wait for the forward before it can queue the backward. The step's totals are the same
    Python numbers, bit for bit, read in one copy."""
    batches = [_micro_batch_terms(s) for s in range(3)]
    ledger = LossLedger()
    ledger.reset({"lm": 0.5, "mtp_0": 0.25, "indexer_kl": 1.0})
    for terms in batches:
        with host_reads() as n:
            objective = ledger.objective(terms, "stage 0")
        assert n[0] == 0
        assert objective is not None
    with host_reads() as n:
        got = ledger.totals()
    assert n[0] == 1
    ref = _old_totals(batches)
    assert got == ref and list(got) == list(ref)
    for s, c in got.values():
        assert type(s) is float and type(c) is int
    assert got["indexer_kl"][1] == 3
    ledger.reset({})
    assert ledger.totals() == {}


def test_loss_ledger_of_the_tiny_model_reads_nothing_per_micro_batch():
    """The trainer's single-stage engine on the tiny model: two micro-batches through the ledger,
    which reads nothing; the totals equal the per-micro-batch reads of the same terms."""
    from paddleformers_glm.modeling.model import GlmMoeDsaForCausalLM
    from paddleformers_glm.parallel.pipeline import SingleStageEngine
    from paddleformers_glm.tiny import tiny_config

    paddle.seed(0)
    cfg = tiny_config()
    model = GlmMoeDsaForCausalLM(cfg)
    model.train()
    rng = np.random.default_rng(0)
    mbs = []
    for _ in range(2):
        ids = paddle.to_tensor(rng.integers(3, cfg.vocab_size, size=(1, 16)), dtype="int64")
        mbs.append({"input_ids": ids, "labels": ids})
    names = sorted(model.forward_stage(None, mbs[0]).losses)
    engine = SingleStageEngine(model)
    seen: list[dict[str, LossTerm]] = []
    reads: list[int] = []
    objective = engine.ledger.objective

    def watched(losses, where):
        seen.append(dict(losses))
        with host_reads() as n:
            out = objective(losses, where)
        reads.append(n[0])
        return out

    engine.ledger.objective = watched
    got = engine.run(mbs, dict.fromkeys(names, 1.0))
    assert reads == [0, 0]
    assert got == _old_totals(seen)
    assert all(type(c) is int for _, c in got.values()) and got["lm"][1] == 2 * 15


# ------------------------------------------------------------------ the expert dispatcher at world 1
def _experts(E: int, H: int, FF: int, topo: Topology) -> LocalExperts:
    return LocalExperts(range(E), lambda e: ExpertMLP(H, FF, topo=topo))


@pytest.fixture
def gpu_silu(monkeypatch):
    """The ops as on an accelerator: the experts' silu without its CPU-only guard (a read of whether
    any input is low enough to overflow Paddle's CPU gradient), the per-expert counts as a
    scatter-add (on the CPU they take ``paddle.bincount``, which syncs only on a GPU)."""
    from paddleformers_glm.ops import activation, selection

    monkeypatch.setattr(activation, "computes_on_cpu", lambda x: False)
    monkeypatch.setattr(selection, "computes_on_cpu", lambda x: False)


def test_dispatcher_reads_the_host_once_per_forward_at_world_1(gpu_silu):
    """One read sizes the whole dispatch (the all-to-all matrix and the rows per local expert);
    the results are those of a plain loop over the experts."""
    E, K, H, FF, T = 8, 2, 6, 8, 12
    with topology_override() as topo:
        experts = _experts(E, H, FF, topo)
        disp = ExpertParallelDispatcher(E, topo=topo)
    rng = np.random.default_rng(3)
    x_np, w_np = rng.standard_normal((T, H)).astype(np.float32), rng.random((T, K)).astype(np.float32)
    ids_np = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    ids_np[0] = [5, 5]  # one token picks an expert twice
    x, w = paddle.to_tensor(x_np, stop_gradient=False), paddle.to_tensor(w_np, stop_gradient=False)
    seen: list[list[int]] = []

    def expert_fn(xs, counts):
        seen.append(list(counts))
        return experts(xs, counts)

    with host_reads() as n:
        y = disp(x, paddle.to_tensor(ids_np), w, expert_fn)
    assert n[0] == 1
    assert seen == [np.bincount(ids_np.reshape(-1), minlength=E).tolist()]
    assert all(type(c) is int for c in seen[0])
    y.sum().backward()
    x2, w2, ref = expert_loop_reference(experts, x_np, w_np, ids_np)
    assert np.abs(y.numpy() - ref.numpy()).max() < 1e-5
    ref.sum().backward()
    assert np.abs(x.grad.numpy() - x2.grad.numpy()).max() < 1e-5
    # no token at all: still one read, an empty result
    z = paddle.zeros([0, H], dtype="float32")
    with host_reads() as n:
        y0 = disp(z, paddle.zeros([0, K], dtype="int64"), paddle.zeros([0, K], dtype="float32"), experts)
    assert n[0] == 1 and list(y0.shape) == [0, H]


@pytest.mark.parametrize("bad", [8, 11, -1])
def test_dispatcher_refuses_an_expert_id_out_of_range(bad):
    E, K, H = 8, 2, 4
    with topology_override() as topo:
        experts = _experts(E, H, 8, topo)
        disp = ExpertParallelDispatcher(E, topo=topo)
    ids = paddle.to_tensor(np.array([[0, 1], [2, bad], [3, 4]]), dtype="int64")
    with pytest.raises(ValueError, match=rf"expert ids \[{bad}\] outside \[0, n_routed_experts 8\)"):
        disp(paddle.ones([3, H]), ids, paddle.ones([3, K]), experts)


# ------------------------------------------------------------------ 2 processes (gloo): EP, ETP, replicated tokens
@pytest.mark.slow
def test_dispatcher_reads_the_host_once_per_forward_on_two_ranks(tmp_path):
    """EP 2 (distinct tokens), ETP 2, and EP 2 with tokens replicated over TP 2: one read per
    dispatcher forward on every rank (it took three: the ids, the exchanged counts, the received
    ids; four under ETP), with the single-process results."""
    from tests._dist.runner import launch_scripts, script_logs

    out = tmp_path / "reads.json"
    p = launch_scripts(2, [(str(Path(__file__).resolve()), [str(out)])], tmp_path / "logs", timeout=240)
    assert p.returncode == 0 and out.is_file(), p.stdout[-2000:] + script_logs(tmp_path / "logs", 2)
    with open(out, encoding="utf-8") as f:
        got = json.load(f)
    for layout in ("ep", "etp", "ep_replicated"):
        assert got[f"{layout}_reads"] == [1, 1], (layout, got)
        assert got[f"{layout}_fwd"] < 1e-5 and got[f"{layout}_dx"] < 1e-5, (layout, got)


def _worker(out: str) -> None:
    from paddleformers_glm.ops import activation, selection
    from paddleformers_glm.parallel.layers import local_slice
    from paddleformers_glm.parallel.topology import init_topology

    activation.computes_on_cpu = selection.computes_on_cpu = lambda x: False  # as the fixture gpu_silu

    topo = init_topology(ParallelConfig(tp=2))
    R, G = topo.tp_rank, topo.tp_group
    E, K, H, FF, T = 4, 2, 6, 8, 7
    rng = np.random.default_rng(0)  # same stream on both ranks
    Wup = [rng.standard_normal((H, 2 * FF)).astype(np.float32) * 0.4 for _ in range(E)]
    Wdn = [rng.standard_normal((FF, H)).astype(np.float32) * 0.4 for _ in range(E)]
    X = [rng.standard_normal((T, H)).astype(np.float32) for _ in range(2)]
    ids = [np.stack([rng.permutation(E)[:K] for _ in range(T)]).astype(np.int64) for _ in range(2)]
    W = [rng.random((T, K)).astype(np.float32) + 0.1 for _ in range(2)]

    def experts(tp: Topology, local: list[int]) -> LocalExperts:
        ex = LocalExperts(local, lambda e: ExpertMLP(H, FF, topo=tp))
        for e in local:
            m = ex[str(e)]
            m.up_gate_proj.set_value(local_slice(Wup[e], m.up_gate_proj.shard_spec, tp.etp_rank, tp.etp_size))
            m.down_proj.set_value(local_slice(Wdn[e], m.down_proj.shard_spec, tp.etp_rank, tp.etp_size))
        return ex

    def run(tp: Topology, s: int, count: bool) -> tuple[np.ndarray, np.ndarray, int]:
        disp = ExpertParallelDispatcher(E, topo=tp)
        ex = experts(tp, disp.local_expert_ids)
        x, w = paddle.to_tensor(X[s], stop_gradient=False), paddle.to_tensor(W[s], stop_gradient=False)
        with topology_override(tp), host_reads() as n:
            y = disp(x, paddle.to_tensor(ids[s]), w, ex)
            reads = n[0] if count else 0
        (y * y).sum().backward()
        return y.numpy(), x.grad.numpy(), reads

    layouts = {
        "ep": (ParallelConfig(tp=2, ep=2, sp=True), {"tp": G, "ep": G}, R),
        "etp": (ParallelConfig(tp=2, etp=2, sp=True), {"tp": G, "etp": G}, R),
        "ep_replicated": (ParallelConfig(tp=2, ep=2, sp=False), {"tp": G, "ep": G}, 0),
    }
    res: dict = {}
    for name, (pc, groups, s) in layouts.items():
        tp = Topology(pc, rank=R, backend=topo.backend, groups=groups, ranks=dict.fromkeys(groups, R))
        y, dx, reads = run(tp, s, True)
        with topology_override() as single:
            y1, dx1, _ = run(single, s, False)
        res[f"{name}_reads"] = comm_list(reads, G)
        res[f"{name}_fwd"] = float(np.abs(y - y1).max())
        res[f"{name}_dx"] = float(np.abs(dx - dx1).max())
    if R == 0:
        with open(out, "w", encoding="utf-8") as f:
            json.dump(res, f)


def comm_list(v: int, group) -> list[int]:
    """``v`` of every rank of ``group``."""
    from paddleformers_glm.parallel import comm

    return [int(r[0]) for r in comm.exchange_counts([v], group)]


if __name__ == "__main__":
    _worker(sys.argv[1])


# ------------------------------------------------------------------ the router's balance counts
@pytest.mark.parametrize("on_device", [False, True], ids=["cpu", "device-form"])
def test_bin_counts_equal_bincount(on_device, monkeypatch):
    from paddleformers_glm.ops import bin_counts, selection

    if on_device:  # the scatter-add a GPU runs
        monkeypatch.setattr(selection, "computes_on_cpu", lambda x: False)
    rng = np.random.default_rng(3)
    for n, length in ((0, 4), (1, 1), (37, 8), (4096, 257)):
        ids = paddle.to_tensor(rng.integers(0, length, size=(n,)), dtype="int64")
        want = np.bincount(ids.numpy(), minlength=length)
        assert bin_counts(ids, length).numpy().tolist() == want.tolist()
    two_d = paddle.to_tensor(rng.integers(0, 5, size=(6, 3)), dtype="int64")  # [N, K] ids: all counted
    assert bin_counts(two_d, 5).numpy().tolist() == np.bincount(two_d.numpy().ravel(), minlength=5).tolist()


def test_the_routers_balance_counts_and_loss_read_nothing(gpu_silu):
    """Every training forward of an MoE layer counts its assignments per expert (the load the bias
    update and the gradient sync read, padding masked) and, with an aux-loss coefficient, the
    sequence-wise balance loss: three ``paddle.bincount`` calls per layer, each two host reads on a
    GPU (it sizes its output from the ids' range).  With fixed-length counts nothing is read; the
    counts and the loss equal bincount's."""
    from paddleformers_glm.modeling.moe import RouterBalance, sequence_aux_loss

    rng = np.random.default_rng(0)
    B, S, E, K = 2, 8, 6, 2
    scores = paddle.to_tensor(rng.random((B * S, E)), dtype="float32")
    ids = paddle.to_tensor(np.argsort(-rng.random((B * S, E)), axis=1)[:, :K], dtype="int64")
    valid = paddle.to_tensor(np.r_[np.ones(S), np.r_[np.zeros(3), np.ones(S - 3)]].reshape(B, S), dtype="int64")
    bal = RouterBalance()
    bal.aux_loss_coeff = 0.01
    weights = paddle.ones([B * S, K], dtype="float32")
    with host_reads() as n:
        bal.track(scores, ids, weights, (B, S), valid)
        bal.track(scores, ids, weights, (B, S), valid)  # a second micro-batch accumulates
        aux = sequence_aux_loss(scores, ids, (B, S), E, valid=valid.reshape([-1]).astype("bool"))
    assert n[0] == 0
    real = valid.numpy().reshape(-1).astype(bool)
    assert bal.routed.numpy().tolist() == (2 * np.bincount(ids.numpy().ravel(), minlength=E)).tolist()
    assert bal.counts.numpy().tolist() == (2 * np.bincount(ids.numpy()[real].ravel(), minlength=E)).tolist()
    # the loss against the same formula with numpy's counts (docs/model.md, "MoE balancing")
    probs = scores.numpy() / (scores.numpy().sum(-1, keepdims=True) + 1e-20)
    want = 0.0
    for b in range(B):
        rows = np.arange(b * S, (b + 1) * S)[real[b * S : (b + 1) * S]]
        T = len(rows)
        f = np.bincount(ids.numpy()[rows].ravel(), minlength=E) * (E / (K * T))
        want += float((f * probs[rows].sum(0) / T).sum())
    np.testing.assert_allclose(float(aux), want, rtol=1e-6)


def test_the_gradient_syncs_has_gradient_flags_read_once_per_step(gpu_silu):
    """After each step's backward the gradient sync decides which parameters have a gradient, the
    experts by the routed-token counts of every MoE layer: it read each router's counts apart (a
    read per MoE layer per step, 75 on GLM-5.2) before one all-reduce.  The counts now join the
    flags on the device: one read.  The experts' flags are still "some token reached it"."""
    from paddleformers_glm.parallel.grads import GradSynchronizer
    from paddleformers_glm.parallel.topology import get_topology

    from ._tiny import tiny_model, tokens

    model = tiny_model(seed=2)
    model.train()
    ids = tokens(2, 16, seed=4)
    model(ids, labels=ids).loss.backward()
    sync = GradSynchronizer(model, get_topology())
    assert len(sync.routers) > 1
    # every router's counts, in the sync's order (an expert's slot indexes this vector)
    routed = np.concatenate([b.routed.numpy().astype(np.float64) for b, _ in sync.routers.values()])
    local = sync._to_main_grads()
    with host_reads() as n:
        flags = sync._flags(local)
    assert n[0] == 1
    fused = sync.expert_update == "fused"  # the layer reached at all, else this expert reached
    want = {n: bool((routed[a:b].sum() if fused else routed[slot]) > 0) for n, (slot, a, b) in sync.expert_slot.items()}
    assert {name: flags[name] for name in want} == want
    idle = [name for name, (slot, _, _) in sync.expert_slot.items() if routed[slot] == 0]
    assert idle and len(idle) < len(sync.expert_slot), "the tiny step leaves some experts idle, not all"
