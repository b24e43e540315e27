"""Each bad checkpoint input (truncated or corrupt files, wrong shapes, dtypes, keys or index) is refused with a message naming file, key and what was expected, and
nothing is written: the model keeps its values, a conversion leaves no output folder."""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import struct

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import CheckpointError, load_pretrained_state
from paddleformers_glm.checkpoint.convert import convert_checkpoint
from paddleformers_glm.testing import SpecModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
pytestmark = pytest.mark.skipif(not FIXTURE.exists(), reason="HF fixture checkpoint not present")
SHARD1, SHARD2 = "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"


@pytest.fixture
def src(tmp_path):
    d = tmp_path / "src"
    shutil.copytree(FIXTURE, d)
    return d


def _corrupt_header(d):
    p = d / SHARD1
    b = bytearray(p.read_bytes())
    b[8] = ord("X")  # the header's opening brace
    p.write_bytes(bytes(b))
    return "corrupt header", SHARD1, None


def _truncate(d):
    p = d / SHARD2
    b = p.read_bytes()
    p.write_bytes(b[:-100])
    return "tensor bytes lie beyond the end of the file", SHARD2, None


def _missing_shard(d):
    os.remove(d / SHARD2)
    idx = json.loads((d / "model.safetensors.index.json").read_text())
    idx["weight_map"] = {k: v for k, v in idx["weight_map"].items() if v != SHARD2}
    (d / "model.safetensors.index.json").write_text(json.dumps(idx))
    return "missing shard(s) ['model-00002-of-00002.safetensors']", SHARD2, None


def _index_names_missing_file(d):
    os.remove(d / SHARD2)
    return "index names a file that is not there", SHARD2, "lm_head.weight"


def _key_in_two_shards(d):
    from safetensors import safe_open
    from safetensors.paddle import save_file

    with safe_open(str(d / SHARD1), framework="paddle") as h:
        emb = h.get_tensor("model.embed_tokens.weight")
    with safe_open(str(d / SHARD2), framework="paddle") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors["model.embed_tokens.weight"] = emb
    save_file(tensors, str(d / SHARD2), metadata={"format": "pt"})
    return "key appears in two shards", SHARD2, "model.embed_tokens.weight"


def _non_float_weight(d):
    import paddle
    from safetensors import safe_open
    from safetensors.paddle import save_file

    key = "model.layers.0.self_attn.q_a_proj.weight"
    with safe_open(str(d / SHARD1), framework="paddle") as h:
        tensors = {k: h.get_tensor(k) for k in h.keys()}
    tensors[key] = paddle.zeros(tensors[key].shape, dtype="int32")
    save_file(tensors, str(d / SHARD1), metadata={"format": "pt"})
    idx_p = d / "model.safetensors.index.json"
    idx = json.loads(idx_p.read_text())
    idx["metadata"]["total_size"] += 2 * 48 * 64  # int32 is 2 bytes wider than bf16 per element
    idx_p.write_text(json.dumps(idx))
    return "non-float tensor where a weight is expected", SHARD1, key


def _bad_header_length(d):
    p = d / SHARD1
    b = bytearray(p.read_bytes())
    b[:8] = struct.pack("<Q", len(b))
    p.write_bytes(bytes(b))
    return "header length exceeds the file size", SHARD1, None


CASES = [
    _corrupt_header,
    _truncate,
    _missing_shard,
    _index_names_missing_file,
    _key_in_two_shards,
    _non_float_weight,
    _bad_header_length,
]


@pytest.mark.parametrize("damage", CASES, ids=[c.__name__.strip("_") for c in CASES])
def test_bad_input_refused_and_nothing_written(src, tmp_path, damage):
    cfg = GlmMoeDsaConfig.from_pretrained(src)
    needle, file, key = damage(src)
    model = SpecModel(cfg)
    with pytest.raises(CheckpointError) as ei:
        load_pretrained_state(model, src)
    e = ei.value
    assert needle in str(e)
    assert e.file is not None and os.path.basename(e.file) == file
    if key is not None:
        assert e.key == key
    assert all(not v.numpy().any() for v in model.state_dict().values())  # model untouched
    out = tmp_path / "converted"
    with pytest.raises(CheckpointError):
        convert_checkpoint(src, out, layout="fleet")
    assert not out.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["src"]  # no partial output anywhere


def test_a_folder_with_both_model_safetensors_and_an_index_is_refused_by_the_loader(src):
    """transformers 5.23 (``_get_resolved_checkpoint_files``) loads ``model.safetensors`` when a folder
    has it *and* ``model.safetensors.index.json``; this loader read the index's shards and only warned
    that ``model.safetensors`` is "not named by the index" (strict is about weights; a stray
    ``adapter_model.safetensors`` is such a warning). Here the two are different weights: the same
    folder gave different models in transformers and here. Now refused, both files named."""
    from safetensors.numpy import save_file

    cfg = GlmMoeDsaConfig.from_pretrained(src)
    save_file({"model.norm.weight": np.zeros(cfg.hidden_size, np.float32)}, str(src / "model.safetensors"))
    model = SpecModel(cfg)
    before = {k: v.numpy().copy() for k, v in model.state_dict().items()}
    with pytest.raises(CheckpointError, match="transformers loads model.safetensors") as ei:
        load_pretrained_state(model, src)
    assert ei.value.file == str(src / "model.safetensors") and "model.safetensors.index.json" in str(ei.value)
    assert all(np.array_equal(v.numpy(), before[k]) for k, v in model.state_dict().items())
