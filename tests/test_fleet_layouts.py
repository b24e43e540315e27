"""PaddleFleet-layout files end to end: each expert layout written by ``glm52 convert`` loads and
equals the HF source and converts back to the same bytes; the old spelling loads with a warning; a
file without the MTP indexer loads with a warning; a tensor-parallel interleaved file loads when its
metadata says so; ``check-ckpt`` finds no difference against an independently made PaddleFleet file.
Also pipeline layouts on Fleet's interleaved engine: the top-k carry of a chunk holding the
embedding alone, and the name a refused virtual chunk is given."""

from __future__ import annotations

import json

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import (
    CheckpointError,
    load_pretrained_state,
    paddlefleet_param_specs,
)
from paddleformers_glm.checkpoint.convert import convert_checkpoint
from paddleformers_glm.testing import SpecModel

from .conftest import FIXTURES

SRC = FIXTURES / "tiny" / "checkpoint"
CONTRACT = json.loads((FIXTURES / "paddlefleet_contract.json").read_text())
pytestmark = pytest.mark.skipif(not SRC.exists(), reason="HF fixture checkpoint not present")


def _read(folder) -> dict:
    from safetensors import safe_open

    out = {}
    for f in sorted(folder.glob("*.safetensors")):
        with safe_open(str(f), framework="paddle") as fh:
            out.update({k: fh.get_tensor(k) for k in fh.keys()})
    return out


def _write(folder, tensors: dict, metadata: dict | None = None) -> None:
    """An independent writer (the safetensors library), one file, config beside it."""
    from safetensors.paddle import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(folder / "model.safetensors"), metadata=metadata)
    (folder / "config.json").write_bytes((SRC / "config.json").read_bytes())


def _state(model) -> dict:
    return {k: v.numpy().tobytes() for k, v in model.state_dict().items()}


@pytest.fixture(scope="module")
def cfg():
    return GlmMoeDsaConfig.from_pretrained(SRC)


@pytest.fixture(scope="module")
def from_hf(cfg):
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, SRC)
    return _state(model)


@pytest.fixture(scope="module")
def exports(cfg, tmp_path_factory):
    root = tmp_path_factory.mktemp("fleet")
    for el in ("per-expert", "grouped", "stacked"):
        convert_checkpoint(SRC, root / el, layout="fleet", expert_layout=el, max_shard_size="400KB")
    return root


@pytest.mark.parametrize("expert_layout", ["per-expert", "grouped", "stacked"])
def test_each_expert_layout_loads_equal_to_hf_and_converts_back_byte_identical(
    cfg, from_hf, exports, tmp_path, expert_layout
):
    folder = exports / expert_layout
    saved = _read(folder)
    specs = paddlefleet_param_specs(cfg, expert_layout)
    assert {k: tuple(v.shape) for k, v in saved.items()} == {k: s for k, (s, _) in specs.items()}
    names = {e["fleet"].split("{P}.")[-1] for e in CONTRACT["experts"][expert_layout]}
    assert all(any(k.endswith(n.replace("{e}", "0")) for k in saved) for n in names)  # contract spelling
    assert str(saved["model.layers.3.mlp.gate.weight"].dtype) == "paddle.float32"
    model = SpecModel(cfg, "float32")
    rep = load_pretrained_state(model, folder)
    assert rep.layout == "fleet" and not rep.missing and not rep.warnings
    assert _state(model) == from_hf
    convert_checkpoint(folder, tmp_path / "hf", layout="hf", max_shard_size="700KB")
    src, back = _read(SRC), _read(tmp_path / "hf")
    assert set(src) == set(back)
    for k in src:
        assert src[k].numpy().tobytes() == back[k].numpy().tobytes() and src[k].dtype == back[k].dtype, k


def test_old_fleet_spelling_loads_with_a_warning(cfg, from_hf, tmp_path):
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, SRC)
    _write(tmp_path / "old", dict(model.state_dict()))  # the model's own names: lm_head [H, V], router [H, E]
    back = SpecModel(cfg, "float32")
    with pytest.warns(FutureWarning, match="model.lm_head.weight"):
        rep = load_pretrained_state(back, tmp_path / "old")
    assert rep.layout == "fleet-legacy" and any("--to fleet" in w for w in rep.warnings)
    assert _state(back) == from_hf


def test_mtp_indexer_absent_from_a_paddlefleet_file_is_initialised_with_a_warning(cfg, from_hf, exports, tmp_path):
    tensors = _read(exports / "per-expert")
    gone = [k for k in tensors if k.startswith("model.layers.8.transformer_layer.self_attn.core_attention.indexer.")]
    assert len(gone) == 5
    _write(tmp_path / "skip", {k: v for k, v in tensors.items() if k not in gone})
    model = SpecModel(cfg, "float32")
    with pytest.warns(UserWarning, match="MTP layer's indexer"):
        rep = load_pretrained_state(model, tmp_path / "skip")  # strict, and still loads
    assert any("initialised" in w for w in rep.warnings)
    got = _state(model)
    assert {k for k in got if got[k] != from_hf[k]} <= set(gone)
    sd = model.state_dict()
    p = "model.layers.8.transformer_layer.self_attn.core_attention.indexer."
    assert np.all(sd[p + "k_norm.weight"].numpy() == 1) and np.all(sd[p + "k_norm.bias"].numpy() == 0)
    w = sd[p + "wq_b.weight"].numpy()
    assert 0.01 < w.std() < 0.03 and abs(w.mean()) < 0.01  # N(0, initializer_range = 0.02)
    # only some of them gone is damage, not a writer's choice
    _write(tmp_path / "partial", {k: v for k, v in tensors.items() if k != gone[0]})
    with pytest.raises(CheckpointError, match="missing 1 key"):
        load_pretrained_state(SpecModel(cfg, "float32"), tmp_path / "partial")


def _interleave(a: np.ndarray, n: int) -> np.ndarray:
    """[gate | up] -> [gate_0 | up_0 | gate_1 | up_1 | ...] (what an n-way column-parallel writer stores)."""
    gate, up = np.split(a, 2, axis=1)
    return np.concatenate([p for r in range(n) for p in (np.split(gate, n, 1)[r], np.split(up, n, 1)[r])], axis=1)


def test_tensor_parallel_interleaved_fused_ffn_loads_when_the_metadata_says_so(cfg, from_hf, exports, tmp_path):
    import paddle

    tensors = _read(exports / "per-expert")
    fused = [k for k in tensors if k.endswith(("mlp.up_gate_proj.weight", "shared_experts.up_gate_proj.weight"))]
    assert len(fused) == 3 + 6
    mixed = dict(tensors)
    for k in fused:
        mixed[k] = paddle.to_tensor(_interleave(tensors[k].astype("float32").numpy(), 2)).astype(tensors[k].dtype)
    _write(tmp_path / "tp2", mixed, {"format": "pt", "fused_ffn_tp_degree": "2"})
    model = SpecModel(cfg, "float32")
    load_pretrained_state(model, tmp_path / "tp2")
    assert _state(model) == from_hf
    with pytest.raises(ValueError, match="interleaved"):  # Paddle's file driver cannot: refused, not misread
        load_pretrained_state(SpecModel(cfg, "float32"), tmp_path / "tp2", backend="paddle")
    _write(tmp_path / "unmarked", mixed)  # same bytes without the marker: read as plain [gate | up]
    plain = SpecModel(cfg, "float32")
    load_pretrained_state(plain, tmp_path / "unmarked")
    differ = {k for k, v in _state(plain).items() if v != from_hf[k]}
    assert differ == set(fused)


def _independent_paddlefleet_file(cfg, folder) -> None:
    """A PaddleFleet-layout file made from the contract alone: its ops in numpy on the HF tensors."""
    import paddle

    hf = _read(SRC)
    L = int(cfg.num_hidden_layers)
    out = {}

    def put(e, Lp, P, x=None):
        def sub(s):
            s = s.replace("{L}", Lp).replace("{P}", P)
            return s if x is None else s.replace("{e}", str(x))

        src = [hf[sub(h)].astype("float32").numpy() for h in e["hf"]]
        op = e["op"]
        a = {"copy": lambda: src[0], "transpose": lambda: src[0].T}.get(op, lambda: None)()
        if op == "gate_up":
            a = np.concatenate([src[0].T, src[1].T], axis=1)
        dtype = "float32" if e["dtype"] == "float32" else str(hf[sub(e["hf"][0])].dtype).replace("paddle.", "")
        out[sub(e["fleet"])] = paddle.to_tensor(np.ascontiguousarray(a)).astype(dtype)

    for e in CONTRACT["global"]:
        put(e, "", "")
    for i in range(L + int(cfg.num_mtp_layers)):
        mtp = i >= L
        full = mtp or cfg.indexer_types[i] == "full"
        moe = mtp or cfg.mlp_layer_types[i] == "sparse"
        kind = (
            "mtp"
            if mtp
            else {(True, False): "dense_full", (False, True): "moe_shared", (True, True): "moe_full"}[(full, moe)]
        )
        spec = CONTRACT["layer_kinds"][kind]
        Lp = f"model.layers.{i}"
        P = spec["prefix"].replace("{L}", Lp)
        for block in spec["blocks"]:
            for e in CONTRACT["experts"]["per-expert"] if block == "experts" else CONTRACT["blocks"][block]:
                for x in range(int(cfg.n_routed_experts)) if "{e}" in e["fleet"] else [None]:
                    put(e, Lp, P, x)
    _write(folder, out, {"format": "pt"})


def test_check_ckpt_finds_no_difference_against_an_independent_paddlefleet_file(cfg, exports, tmp_path):
    from paddleformers_glm.parity.ckpt_check import check_checkpoints

    _independent_paddlefleet_file(cfg, tmp_path / "pf")
    rep = check_checkpoints(str(tmp_path / "pf"), str(exports / "per-expert"), layout="fleet")
    assert rep["exit_code"] == 0, rep.get("errors")
    assert rep["counts"]["naming"] == 0 and rep["counts"]["structural"] == 0 and rep["counts"]["value"] == 0
    assert rep["counts"]["matched"] == 239
    # the HF source against our fleet file: every difference is a naming one
    rep = check_checkpoints(str(SRC), str(exports / "grouped"), layout="fleet")
    assert rep["exit_code"] == 0 and rep["counts"]["structural"] == 0 and rep["counts"]["value"] == 0


def test_hf_layout_refuses_an_expert_layout(tmp_path):
    with pytest.raises(ValueError, match="fleet layout only"):
        convert_checkpoint(SRC, tmp_path / "x", layout="hf", expert_layout="grouped")
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("which", ["per-expert", "grouped", "stacked", "tp2"])
def test_expert_and_tensor_parallel_ranks_get_their_fused_pieces_from_every_fleet_layout(cfg, exports, tmp_path, which):
    """A rank holding half the columns of a fused weight (``shard_info`` lists both ranks' pieces)
    gets Fleet's per-rank ``[gate_r | up_r]`` from every PaddleFleet file, as from the HF one."""
    import paddle
    from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

    hf = _read(SRC)
    if which == "tp2":
        tensors = _read(exports / "per-expert")
        fused = [k for k in tensors if k.endswith(("mlp.up_gate_proj.weight", "shared_experts.up_gate_proj.weight"))]
        for k in fused:
            tensors[k] = paddle.to_tensor(_interleave(tensors[k].astype("float32").numpy(), 2)).astype(tensors[k].dtype)
        folder = tmp_path / "tp2"
        _write(folder, tensors, {"format": "pt", "fused_ffn_tp_degree": "2"})
    else:
        folder = exports / which
    for key, hf_key, I in (
        ("model.layers.3.mlp.experts.2.up_gate_proj.weight", "model.layers.3.mlp.experts.2.{}_proj.weight", 32),
        (
            "model.layers.8.transformer_layer.mlp.experts.7.up_gate_proj.weight",
            "model.layers.8.mlp.experts.7.{}_proj.weight",
            32,
        ),
        ("model.layers.1.mlp.up_gate_proj.weight", "model.layers.1.mlp.{}_proj.weight", 128),
        (
            "model.layers.6.mlp.shared_experts.up_gate_proj.weight",
            "model.layers.6.mlp.shared_experts.{}_proj.weight",
            32,
        ),
    ):
        g = hf[hf_key.format("gate")].astype("float32").numpy().T
        u = hf[hf_key.format("up")].astype("float32").numpy().T
        h = I // 2
        info = {key: [((64, I), (0, 0)), ((64, I), (0, I))]}
        for r in range(2):
            state = {key: ShardedWeight(key, paddle.zeros([64, I]), (64, I), (64, 2 * I), (0, I * r))}
            load_pretrained_state(state, folder, config=cfg, keys=[key], shard_info=info)
            want = np.concatenate([g[:, h * r : h * (r + 1)], u[:, h * r : h * (r + 1)]], 1)
            np.testing.assert_array_equal(state[key].local_tensor.numpy(), want, err_msg=f"{which} {key} rank {r}")


# ------------------------------------------------------------------ pipeline layouts: the interleaved top-k carry
class _ChunkStage:
    """A stage module for :class:`PipelineChunk`: the embedding makes hidden [B, S, 2] and the empty
    top-k "no selection yet", each decoder layer a top-k [B, S, min(index_topk, S)] (``width``: what
    it makes instead); ``seen`` records the top-k each chunk was handed."""

    def __init__(self, width=None):
        from types import SimpleNamespace

        self.cfg, self.width, self.seen = SimpleNamespace(index_topk=4), width, {}

    def carry_topk_width(self, batch):  # the stage contract: the width every carry's top-k is sent at
        return min(self.cfg.index_topk, batch["input_ids"].shape[1])

    def forward_stage(self, carry, batch, part):
        import paddle

        from paddleformers_glm.parallel.pipeline import LossTerm, StageOutput

        B, S = batch["input_ids"].shape
        if carry is None:
            hidden, topk = paddle.ones([B, S, 2]), paddle.zeros([B, S, 0], dtype="int64")
        else:
            hidden, topk = carry
            self.seen[part.stage] = topk
        for _ in part.layers:
            if topk.shape[-1] == 0:  # a first layer selects; a later one keeps the selection it was given
                topk = paddle.arange(self.width or min(4, S), dtype="int64").expand([B, S, -1])
            hidden = hidden + 1.0
        if part.has_head:
            return StageOutput(losses={"lm": LossTerm(hidden.sum(), B * S)})
        return StageOutput(carry=(hidden, topk))


def _run_chunks(chunks, stage):
    """The chunks in turn as Fleet runs them: each one's output is the next one's input; returns the
    top-k each chunk sent."""
    import paddle

    from paddleformers_glm.parallel.fleet_pipeline import PipelineChunk, selection_gaps
    from paddleformers_glm.parallel.pipeline import LossLedger

    ledger = LossLedger()
    ledger.batch_keys = ["input_ids"]
    ledger.reset({"lm": 1.0})
    x, sent = (paddle.zeros([2, 6], dtype="int64"),), []
    for c, g in zip(chunks, selection_gaps(chunks)):
        x = PipelineChunk(stage, c, ledger, False, *g)(x)
        if not c.is_last:
            sent.append(x[2])  # (input_ids, hidden, top-k)
    return sent


def test_interleaved_chunk_holding_the_embedding_alone_sends_a_static_top_k_no_layer_reads():
    """--pp 2 --vpp 4 splits the toy's 6 layers E|t|t|t|t|t|t|m,L: chunk 0 holds the embedding alone.
    Fleet's interleaved schedule sends every carry of a rank with its first send's shapes, so chunk
    0's empty top-k [B, S, 0] made rank 1 abort in gloo once a later chunk sent [B, S, k]
    ("op.preamble.length <= op.nbytes. 2048 vs 0").  Every carry's top-k is now [B, S, k], chunk
    0's of -1, and chunk 1's layers are handed the empty "no selection yet", never the placeholder."""
    from paddleformers_glm.parallel.pipeline import layout_string, parse_pp_layout, split_stages

    chunks = split_stages(6, 8, has_mtp=True)  # the split --pp 2 --vpp 4 runs
    assert layout_string(chunks) == "E|t|t|t|t|t|t|m,L"
    stage = _ChunkStage()
    sent = _run_chunks(chunks, stage)
    assert [list(t.shape) for t in sent] == [[2, 6, 4]] * 7
    assert (sent[0].numpy() == -1).all() and (sent[1].numpy() >= 0).all()
    assert list(stage.seen[1].shape) == [2, 6, 0]  # chunk 1 (layer 0) selects afresh
    assert all(list(stage.seen[c].shape) == [2, 6, 4] and (stage.seen[c].numpy() >= 0).all() for c in range(2, 8))
    # one chunk per rank (1F1B): the embedding-only stage sends the placeholder too (an empty tensor
    # is refused by Fleet's NCCL p2p, "can't send/recv zero element"); the next stage selects afresh
    stage = _ChunkStage()
    sent = _run_chunks(parse_pp_layout("E|t*6,m,L", 6, 2, has_mtp=True), stage)
    assert [list(t.shape) for t in sent] == [[2, 6, 4]] and (sent[0].numpy() == -1).all()
    assert list(stage.seen[1].shape) == [2, 6, 0]
    # a layout whose every stage runs a layer sends the model's own top-k
    stage = _ChunkStage()
    sent = _run_chunks(parse_pp_layout("E,t*3|t*3,m,L", 6, 2, has_mtp=True), stage)
    assert [list(t.shape) for t in sent] == [[2, 6, 4]] and (sent[0].numpy() >= 0).all()
    # a top-k of another width than the one every carry is sent with is refused by name, not by gloo
    with pytest.raises(RuntimeError, match=r"pipeline chunk 1: the carried top-k is \[2, 6, 3\].*\[\.\.\., 4\]"):
        _run_chunks(chunks, _ChunkStage(width=3))


def test_a_virtual_chunk_holding_nothing_is_named_a_chunk():
    """--pp 2 --vpp 6 (12 chunks for 8 layers) said "pipeline stage 9 ... would hold nothing"."""
    from types import SimpleNamespace

    from paddleformers_glm.parallel.pipeline import run_stages
    from paddleformers_glm.parallel.topology import ParallelConfigError

    run = SimpleNamespace(first_stage_layers=None, last_stage_layers=None, pp_layout=None, vpp=6)
    with pytest.raises(ParallelConfigError, match=r"^virtual pipeline chunk 9 of \[0, 1, (1, ){7}0, 0, 0\] would"):
        run_stages(run, 8, 12, True)
    with pytest.raises(ParallelConfigError, match=r"^pipeline stage 1 of \[2, 0, 6\] would hold nothing"):
        run_stages(SimpleNamespace(first_stage_layers=2, last_stage_layers=6, pp_layout=None, vpp=1), 8, 3, True)
