"""A save that publishes over a checkpoint folder while it is being loaded changes nothing read
(docs/checkpoints.md, "Loading"): the package's saver exchanges the folders (``renameat2``
``RENAME_EXCHANGE``), and a loader that opened each shard by its path then read the shards not yet
opened from the new checkpoint, a silent mix of two. The folder is opened once and every file of it
read relative to that directory; a folder removed under the load is one clear error. Symlinked
layouts (the Hugging Face cache's snapshot links into ``blobs/``) load as before.
"""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaForCausalLM
from paddleformers_glm.checkpoint import safetensors_io as sio
from paddleformers_glm.checkpoint import saver
from paddleformers_glm.checkpoint.errors import CheckpointError
from paddleformers_glm.tiny import make_tiny_checkpoint

REPLACED = "was replaced or removed while it was being loaded"


@pytest.fixture(scope="module")
def sources(tmp_path_factory):
    """Two tiny checkpoints of the same architecture and different weights, 17 shards each."""
    d = tmp_path_factory.mktemp("swap_sources")
    a = make_tiny_checkpoint(d / "A", seed=0, max_shard_size="100KB")
    b = make_tiny_checkpoint(d / "B", seed=7, max_shard_size="100KB")
    return a, b


@pytest.fixture
def folders(sources, tmp_path):
    """(X, Y): a copy of checkpoint A (the one loaded) and of checkpoint B (the one published over X)."""
    x, y = tmp_path / "X", tmp_path / "Y"
    shutil.copytree(sources[0], x)
    shutil.copytree(sources[1], y)
    return str(x), str(y)


def raw_tensors(path) -> dict[str, bytes]:
    with sio.Checkpoint(path) as ckpt:
        return {k: bytes(ckpt.raw(k)) for k in ckpt.keys()}


def model_state(path) -> dict[str, np.ndarray]:
    model = GlmMoeDsaForCausalLM.from_pretrained(path, dtype="float32")
    return {k: v.numpy().copy() for k, v in model.state_dict().items()}


def exchange(a: str, b: str) -> None:
    if not saver._exchange(a, b):
        pytest.skip("renameat2(RENAME_EXCHANGE) is not supported here")


def publish_after_shards(monkeypatch, folder: str, n: int, act) -> list[str]:
    """Run ``act()`` right after the load of ``folder`` opened its ``n``-th shard; returns the names
    of the shards opened (the hook's record)."""
    orig = sio.SafetensorsFile.__init__
    opened: list[str] = []

    def hooked(self, file, *args, **kwargs):
        orig(self, file, *args, **kwargs)
        if os.path.dirname(os.fspath(file)) == folder:
            opened.append(os.path.basename(os.fspath(file)))
            if len(opened) == n:
                act()

    monkeypatch.setattr(sio.SafetensorsFile, "__init__", hooked)
    return opened


@pytest.mark.parametrize("after", [2, 3])
def test_folder_exchanged_mid_load_reads_the_original(folders, sources, monkeypatch, after):
    x, y = folders
    want, other = raw_tensors(sources[0]), raw_tensors(sources[1])
    opened = publish_after_shards(monkeypatch, x, after, lambda: exchange(y, x))
    got = raw_tensors(x)
    assert len(opened) == 17  # the exchange happened with 17 - after shards still to open
    assert sorted(got) == sorted(want)
    assert [k for k in want if got[k] != want[k]] == []
    assert sum(want[k] != other[k] for k in want) > 100  # the two checkpoints differ: a mix would show
    monkeypatch.undo()
    assert raw_tensors(x) == other  # X now holds the checkpoint published over it


def test_from_pretrained_of_an_exchanged_folder_loads_the_original(folders, sources, monkeypatch):
    x, y = folders
    want = model_state(sources[0])
    publish_after_shards(monkeypatch, x, 3, lambda: exchange(y, x))
    got = model_state(x)
    assert sorted(got) == sorted(want)
    assert [k for k in want if not np.array_equal(got[k], want[k])] == []


def test_folder_exchanged_between_config_and_weights_is_refused(folders, monkeypatch):
    """The config was read from the folder before the exchange (while the model is built from it), the
    weights would come from after it: from_pretrained's own record of the folder refuses the load (a
    loader's record taken at its start would see one folder throughout, the new one)."""
    from paddleformers_glm.modeling import pretrained

    x, y = folders
    read_config = pretrained._config_with_overrides
    calls: list[str] = []

    def then_publish(path, *args, **kwargs):
        got = read_config(path, *args, **kwargs)
        calls.append(os.fspath(path))
        exchange(y, x)
        return got

    monkeypatch.setattr(pretrained, "_config_with_overrides", then_publish)
    with pytest.raises(CheckpointError, match=REPLACED) as e:
        GlmMoeDsaForCausalLM.from_pretrained(x, dtype="float32")
    assert calls and x in str(e.value) and "config.json" in str(e.value)


def test_a_convert_whose_source_is_published_over_between_batches_is_refused(folders, tmp_path, monkeypatch):
    """glm52 convert loads its source a layer batch at a time, each a load of its own: a save publishing
    over SRC between two batches wrote A's first layers and B's others under A's config, exit 0. Every
    batch now refuses a folder other than the one the config was read from; nothing is published."""
    from paddleformers_glm.checkpoint import convert

    x, y = folders
    load = convert.load_pretrained_state
    calls: list[int] = []

    def publish_before_the_second_batch(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:  # the plan-only pass, the first batch, then the second batch
            exchange(y, x)
        return load(*args, **kwargs)

    monkeypatch.setattr(convert, "load_pretrained_state", publish_before_the_second_batch)
    out = tmp_path / "out"
    with pytest.raises(CheckpointError, match=REPLACED):
        convert.convert_checkpoint(x, out, layout="hf")
    assert len(calls) == 3 and not out.exists()


@pytest.mark.parametrize("how", ["exchanged then removed", "removed"])
def test_folder_removed_mid_load_is_one_clear_error(folders, monkeypatch, how):
    x, y = folders

    def act():
        if how == "removed":
            shutil.rmtree(x)
        else:
            exchange(y, x)
            shutil.rmtree(y)  # the old checkpoint, now at Y, removed as a publish removes it

    opened = publish_after_shards(monkeypatch, x, 2, act)
    with pytest.raises(CheckpointError, match=REPLACED) as e:
        raw_tensors(x)
    msg = str(e.value)
    assert x in msg and "model-00003-of-00017.safetensors" in msg and "load it again" in msg
    assert "not there" not in msg and "missing" not in msg
    assert len(opened) == 2


def test_from_pretrained_of_a_removed_folder_is_one_clear_error(folders, monkeypatch):
    x, y = folders

    def act():
        exchange(y, x)
        shutil.rmtree(y)

    publish_after_shards(monkeypatch, x, 3, act)
    with pytest.raises(CheckpointError, match=REPLACED) as e:
        GlmMoeDsaForCausalLM.from_pretrained(x, dtype="float32")
    assert x in str(e.value) and "model-00004-of-00017.safetensors" in str(e.value)


def test_a_truly_missing_shard_is_still_named_missing(folders):
    x, _ = folders
    os.remove(os.path.join(x, "model-00005-of-00017.safetensors"))
    with pytest.raises(CheckpointError, match="index names a file that is not there") as e:
        sio.Checkpoint(x)
    assert REPLACED not in str(e.value)
    assert e.value.file == os.path.join(x, "model-00005-of-00017.safetensors")


def hf_cache_layout(src: str, root) -> str:
    """``root/snapshots/<rev>/<name>`` links to ``../../blobs/<name>.blob``, as the Hugging Face cache lays
    a download out; returns the snapshot folder."""
    blobs, snap = root / "blobs", root / "snapshots" / "0123abcd"
    blobs.mkdir(parents=True)
    snap.mkdir(parents=True)
    for name in os.listdir(src):
        shutil.copy2(os.path.join(src, name), blobs / f"{name}.blob")
        os.symlink(os.path.join("..", "..", "blobs", f"{name}.blob"), snap / name)
    return str(snap)


def test_hf_cache_layout_of_symlinks_loads_equal(sources, tmp_path):
    snap = hf_cache_layout(sources[0], tmp_path / "cache")
    assert all(os.path.islink(os.path.join(snap, n)) for n in os.listdir(snap))
    assert raw_tensors(snap) == raw_tensors(sources[0])
    want, got = model_state(sources[0]), model_state(snap)
    assert [k for k in want if not np.array_equal(got[k], want[k])] == []


def test_symlinked_folder_and_single_file_load_equal(sources, tmp_path):
    link = tmp_path / "link"
    os.symlink(sources[0], link)
    assert raw_tensors(link) == raw_tensors(sources[0])
    single = make_tiny_checkpoint(tmp_path / "single", seed=0, max_shard_size="100MB")
    assert os.path.isfile(os.path.join(single, sio.SINGLE_NAME))
    want = raw_tensors(sources[0])
    assert raw_tensors(single) == want
    assert raw_tensors(os.path.join(single, sio.SINGLE_NAME)) == want
    file_link = tmp_path / "elsewhere" / sio.SINGLE_NAME
    file_link.parent.mkdir()
    os.symlink(os.path.join(single, sio.SINGLE_NAME), file_link)
    assert raw_tensors(file_link) == want


def test_the_folder_descriptor_is_closed_with_the_checkpoint(sources):
    if not os.path.isdir("/proc/self/fd"):
        pytest.skip("no /proc/self/fd")
    before = len(os.listdir("/proc/self/fd"))
    with sio.Checkpoint(sources[0]) as ckpt:
        for k in ckpt.keys():
            ckpt.raw(k)
        held = len(os.listdir("/proc/self/fd"))
    assert held <= before + 17 + 1  # a map per shard, and the folder
    assert len(os.listdir("/proc/self/fd")) == before


def test_a_closed_checkpoint_reads_nothing_of_the_working_directory(sources, tmp_path, monkeypatch):
    """Its files are opened relative to the folder's descriptor; once closed, a read by name would be
    relative to the process's working directory (a config.json there): refused instead."""
    (tmp_path / "config.json").write_text('{"not": "this checkpoint"}')
    monkeypatch.chdir(tmp_path)
    ckpt = sio.Checkpoint(sources[0])
    assert ckpt.read_json("config.json", "the model config")["model_type"] == "glm_moe_dsa"
    ckpt.close()
    with pytest.raises(CheckpointError, match="the checkpoint is closed"):
        ckpt.read_json("config.json", "the model config")
