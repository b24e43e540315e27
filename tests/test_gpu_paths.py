"""Code paths that run only on a GPU build, held on the CPU through the seam each one reads.

* ``CudaGraphDecodeStep``: a CUDA graph's replay rewrites the captured output tensor in place, so
  the logits a generation keeps per step must not be that tensor (the fake graph below replays by
  rerunning the captured step into the same output tensor, as the real one does).
* The distributed export's writer: Paddle's default place (a GPU in training) is never where its
  whole tensors or their converted copies are made (the fp32 embedding is 3.8 GB at the official
  width, beside a resident model and optimizer).
* ``ops.topk``'s torch order for exact ties follows the tensor's place, not the process's device
  (``paddle.device.get_device()`` is ``"gpu:0"`` in a GPU build even for CPU tensors).
"""

from __future__ import annotations

import collections
import filecmp
import os
import sys
from pathlib import Path

import numpy as np
import paddle
import pytest

from paddleformers_glm import ops
from paddleformers_glm.generation import CudaGraphDecodeStep, generate

from ._tiny import tiny_model, tokens
from .test_topk_ties import TORCH, _same_input, _tied_rows

# ------------------------------------------------------------------------------ CUDA graph decode step


class _ReplayGraph:
    """A stand-in for ``paddle.device.cuda.graphs.CUDAGraph``: the decode step called between
    ``capture_begin`` and ``capture_end`` is recorded with its input and output tensors, and
    ``replay`` reruns it on those same input tensors and writes the result into that same output
    tensor, as a replayed CUDA graph's kernels do."""

    capturing: _ReplayGraph | None = None
    made: list[_ReplayGraph] = []

    def __init__(self) -> None:
        self.step = None
        self.replays = 0
        _ReplayGraph.made.append(self)

    def capture_begin(self) -> None:
        _ReplayGraph.capturing = self

    def capture_end(self) -> None:
        _ReplayGraph.capturing = None

    def replay(self) -> None:
        fn, args, out = self.step
        paddle.assign(fn(*args), output=out)
        self.replays += 1


def _recording(decode_step):
    """``model.decode_step`` that, while a fake graph captures, records the call and its output."""

    def step(*args):
        out = decode_step(*args)
        if _ReplayGraph.capturing is not None:
            _ReplayGraph.capturing.step = (decode_step, args, out)
        return out

    return step


@pytest.fixture
def replay_graphs(monkeypatch):
    import paddle.device.cuda.graphs as graphs

    monkeypatch.setattr(graphs, "CUDAGraph", _ReplayGraph)
    monkeypatch.setattr(_ReplayGraph, "made", [])
    return _ReplayGraph.made


@pytest.mark.parametrize(
    "kw",
    [
        {"do_sample": False},
        {"do_sample": True, "top_k": 20, "temperature": 0.7},
        {"num_beams": 2, "do_sample": False},
    ],
    ids=["greedy", "sample", "beams"],
)
def test_cuda_graph_decode_step_keeps_each_steps_logits(replay_graphs, monkeypatch, kw):
    """generate's per-step logits and scores through CudaGraphDecodeStep (its real ``__call__``,
    replays rewriting one output tensor) are the plain decode step's. Before the step returned a
    copy, every fp32 step after the first replay was that one tensor: the last step's logits."""
    model = tiny_model()
    model.eval()
    ids = tokens(1, 12, vocab=model.config.vocab_size)
    n = 5
    base = {"max_new_tokens": n, "eos_token_id": [], "return_dict_in_generate": True}
    base |= {"output_logits": True, "output_scores": True, "seed": 0, **kw}
    ref = generate(model, ids, **base)
    monkeypatch.setattr(model, "decode_step", _recording(model.decode_step))
    got = generate(model, ids, decode_step=CudaGraphDecodeStep(model), **base)

    assert len(replay_graphs) == 1 and replay_graphs[0].replays == n - 2  # prefill, eager + capture, replays
    np.testing.assert_array_equal(got.sequences.numpy(), ref.sequences.numpy())
    for name in ("logits", "scores"):
        want, have = getattr(ref, name), getattr(got, name)
        assert len(have) == len(want) == n
        for step in range(n):
            np.testing.assert_array_equal(have[step].numpy(), want[step].numpy(), err_msg=f"{name} of step {step}")


# ------------------------------------------------------------------------------ distributed export


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


def _default_place_callers(monkeypatch) -> collections.Counter:
    """Every call that lets Paddle pick a new tensor's place (its default place: the current GPU in a
    GPU build), by the first caller outside Paddle; the tensors are still made on the CPU."""
    import paddle.tensor.creation as creation

    paddle_dir = os.path.dirname(paddle.__file__)
    callers: collections.Counter = collections.Counter()

    def default_place(*_a):
        f = sys._getframe(1)
        while f is not None and f.f_code.co_filename.startswith(paddle_dir):
            f = f.f_back
        if f is not None:
            callers[f"{os.path.relpath(f.f_code.co_filename)}:{f.f_lineno} ({f.f_code.co_name})"] += 1
        return paddle.CPUPlace()

    # both names creation.py reads (to_tensor: the one with the underscore; empty / zeros: the other)
    monkeypatch.setattr(creation, "_current_expected_place_", default_place)
    monkeypatch.setattr(creation, "_current_expected_place", default_place)
    return callers


@pytest.mark.parametrize("merged", [False, True], ids=["whole", "merged"])
def test_distributed_export_makes_its_tensors_on_the_host(tiny_ckpt, tmp_path, monkeypatch, merged):
    """The export's writer never leaves a tensor's place to Paddle's default (a GPU in a training
    run): its whole tensors, merged from split pieces or not, and the engine's targets it reads back
    to the file are made on the host. ``merged``: every split tensor goes through the merge branch,
    one piece from a one-member gather (the gather is collective; the placement is what matters).
    The files are the plain export's byte for byte."""
    from paddleformers_glm.checkpoint import distributed
    from paddleformers_glm.checkpoint.distributed import export_distributed
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.parallel.pipeline import StageSpec
    from paddleformers_glm.parallel.state import to_numpy
    from paddleformers_glm.parallel.topology import Topology, get_topology
    from paddleformers_glm.train.glm_adapter import GlmAdapter

    adapter = GlmAdapter(str(tiny_ckpt))
    c = adapter.config
    stage = GlmMoeDsaForCausalLM(c, "float32", stage=StageSpec.whole(c.num_hidden_layers, True))
    adapter.load_stage(stage, get_topology())
    export_distributed(stage, c, str(tmp_path / "plain"), max_shard_size="1MB")

    topo = Topology.single()
    if merged:
        monkeypatch.setattr(topo, "size", lambda name: 2)
        gathered = []

        def one_piece(t, spec, dst, topo):
            gathered.append(spec)
            return [to_numpy(t.detach()).reshape(t.shape)]

        monkeypatch.setattr(distributed, "_gather_to_writer", one_piece)
    callers = _default_place_callers(monkeypatch)
    export_distributed(stage, c, str(tmp_path / "out"), topo, max_shard_size="1MB")
    monkeypatch.undo()

    if merged:
        assert gathered, "no tensor took the merge branch"
    assert not callers, f"tensors made on Paddle's default place: {dict(callers)}"
    names = sorted(p.name for p in (tmp_path / "plain").iterdir())
    assert names == sorted(p.name for p in (tmp_path / "out").iterdir())
    _, mismatch, errors = filecmp.cmpfiles(tmp_path / "plain", tmp_path / "out", names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


# ------------------------------------------------------------------------------ top-k ties


@pytest.mark.parametrize("case", [c for c in TORCH["topk"] if c["extra"] == 0], ids=lambda c: f"k{c['k']}_n64k")
def test_topk_tie_order_follows_the_tensors_place(monkeypatch, case):
    """CPU tensors in a process whose device is a GPU (a GPU build's default) still get torch's
    indices at n = 64 k; before, the check read the process's device and skipped the fix."""
    monkeypatch.setattr(paddle.device, "get_device", lambda: "gpu:0")
    v = _tied_rows(case["k"], case["extra"])
    _same_input(v, case["input_sha256"])
    x = paddle.to_tensor(v, place=paddle.CPUPlace())
    vals, idx = ops.topk(x, case["k"])
    want = np.array(case["indices"])
    np.testing.assert_array_equal(idx.numpy(), want)
    np.testing.assert_array_equal(vals.numpy(), np.take_along_axis(v, want, -1))
