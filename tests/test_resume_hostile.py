"""Resume loads data, never code: hostile, corrupt and old-format resume folders are refused by name.

A checkpoint written by ``glm52 train --save-every`` is attacked file by file: a pickle whose
unpickling would create a marker file (shown to work by unpickling it once on purpose) replaces each
file that is not a tensor file, and each tensor file too; every resume through the CLI must exit
non-zero with one line naming the planted file, and the marker must never appear.  ``latest`` may
only name a step folder inside the root.  Before this, ``rank_*.pdstate.rng`` was read with
``pickle.loads`` and ``latest`` was followed anywhere.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
from pathlib import Path

import pytest

from paddleformers_glm.train.state_files import (
    FLEX_METADATA_CLASSES,
    ResumeStateError,
    check_resume_state,
    resolve_resume_state,
    restricted_unpickle,
)
from tests._dist.runner import error_lines, run_train_cli

ARGS = ["--model", "toy", "--steps", "2", "--seq-len", "16", "--global-batch-size", "2", "--seed", "3"]
STEP = "step_00000002"


class _Payload:
    """Unpickling this runs ``touch MARKER`` (``os.system`` is what pickle calls)."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def payload(marker: Path) -> bytes:
    return pickle.dumps(_Payload(marker))


@pytest.fixture(scope="module")
def saved(tmp_path_factory) -> Path:
    """OUT/checkpoints of a real two-step ``glm52 train --save-every 1`` run."""
    out = tmp_path_factory.mktemp("saved")
    p, _ = run_train_cli([*ARGS, "--save-every", "1", "--out", str(out)], timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    return out / "checkpoints"


def _files(root: Path) -> list[str]:
    return sorted(str(p.relative_to(root)) for p in root.rglob("*") if p.is_file())


def test_the_payload_runs_when_unpickled(tmp_path):
    """Control: the planted bytes do execute under a plain unpickler (so their not running below means something)."""
    marker = tmp_path / "ran"
    pickle.loads(payload(marker))
    assert marker.exists()


def test_a_checkpoint_holds_tensor_files_json_and_one_allow_listed_pickle(saved):
    """What a step folder holds; the only pickle in it is flex-checkpoint's metadata (Paddle's format)."""
    assert _files(saved / STEP) == [
        "flex/0.metadata",
        "flex/0_0.safetensors",
        "meta.json",
        "rank_00000.json",
        "rank_00000.safetensors",
    ]
    assert (saved / "latest").read_text() == STEP + "\n"
    md = restricted_unpickle(str(saved / STEP / "flex" / "0.metadata"), FLEX_METADATA_CLASSES)
    assert type(md).__name__ == "Metadata" and md.storage_metadata


@pytest.mark.slow
def test_a_planted_pickle_in_any_file_runs_nothing_and_is_refused_by_name(saved, tmp_path):
    """Each file of the checkpoint (latest, meta.json, the rank's JSON and tensors, flex metadata and
    tensors) replaced by the payload in turn: the CLI resume exits non-zero with one line naming
    that file, and no marker appears."""
    targets = ["latest"] + [f"{STEP}/{f}" for f in _files(saved / STEP)]
    assert len(targets) == 6
    for i, rel in enumerate(targets):
        root = tmp_path / f"case{i}" / "checkpoints"
        shutil.copytree(saved, root)
        marker = tmp_path / f"marker{i}"
        (root / rel).write_bytes(payload(marker))
        p, _ = run_train_cli([*ARGS, "--resume", str(root), "--out", str(tmp_path / f"out{i}")], timeout=200)
        lines = error_lines(p.stderr)
        assert p.returncode != 0, (rel, p.stdout[-2000:])
        assert not marker.exists(), f"{rel}: the planted pickle ran"
        assert len(lines) == 1 and lines[0].startswith("glm52 train: error:"), (rel, p.stderr[-3000:])
        assert str(root / rel) in lines[0], (rel, lines[0])
        assert "Traceback" not in p.stderr


def test_payload_in_every_file_at_once_runs_nothing(saved, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    marker = tmp_path / "marker"
    for rel in _files(root):
        if not rel.endswith(".safetensors") and rel != "latest":
            (root / rel).write_bytes(payload(marker))
    with pytest.raises(ResumeStateError) as e:
        check_resume_state(str(root))
    assert str(root / STEP) in str(e.value)
    assert not marker.exists()


def test_flex_metadata_nested_payload_is_refused(saved, tmp_path):
    """A genuine Metadata object carrying the payload inside: the allow-list refuses ``os.system``
    wherever it sits in the stream."""
    folder = tmp_path / "step"
    shutil.copytree(saved / STEP, folder)
    meta_file = folder / "flex" / "0.metadata"
    md = restricted_unpickle(str(meta_file), FLEX_METADATA_CLASSES)
    marker = tmp_path / "marker"
    md.flat_mapping = {"x": (_Payload(marker),)}
    meta_file.write_bytes(pickle.dumps(md))
    with pytest.raises(ResumeStateError, match=r"0\.metadata: refused to unpickle `posix\.system`"):
        check_resume_state(str(folder))
    assert not marker.exists()


@pytest.mark.parametrize(
    "name, why",
    [
        ("../etc", "refused-name"),
        ("/etc", "refused-name"),
        ("step_00000002/../..", "refused-name"),
        ("step_00000009", "missing"),
        ("", "refused-name"),
        (b"\xff\xfe", "refused-name"),
    ],
    ids=["dotdot", "absolute", "inside-then-out", "missing", "empty", "not-utf8"],
)
def test_latest_names_only_a_step_folder_inside_the_root(saved, tmp_path, name, why):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    (root / "latest").write_bytes(name if isinstance(name, bytes) else name.encode())
    with pytest.raises(ResumeStateError) as e:
        resolve_resume_state(str(root))
    msg = str(e.value)
    assert msg.startswith(f"{root / 'latest'}:"), msg
    assert ("not a folder in" in msg) if why == "missing" else ("must hold a step folder name" in msg), msg


def test_latest_may_not_follow_a_link_out_of_the_root(saved, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    elsewhere = tmp_path / "elsewhere"
    shutil.move(str(root / STEP), str(elsewhere))
    os.symlink(elsewhere, root / STEP)  # a well-formed name whose folder is a link leaving the root
    with pytest.raises(ResumeStateError, match="a link that leaves the checkpoint root"):
        resolve_resume_state(str(root))
    os.remove(root / STEP)
    os.remove(root / "latest")
    os.symlink("/etc/hostname", root / "latest")
    with pytest.raises(ResumeStateError, match="latest: must be a regular file"):
        resolve_resume_state(str(root))


@pytest.mark.slow
def test_cli_refuses_latest_pointing_at_etc(saved, tmp_path):
    root = tmp_path / "checkpoints"
    shutil.copytree(saved, root)
    (root / "latest").write_text("/etc\n")
    p, secs = run_train_cli([*ARGS, "--resume", str(root), "--out", str(tmp_path / "out")], timeout=200)
    assert p.returncode == 2, p.stderr[-2000:]
    assert error_lines(p.stderr) == [
        f"glm52 train: error: {root / 'latest'}: must hold a step folder name such as step_00000004 "
        f"(a folder inside {root}), got '/etc'"
    ]
    assert not (tmp_path / "out" / "loss.json").exists()


def _corrupt(folder: Path, rel: str, how: str) -> None:
    f = folder / rel
    data = f.read_bytes()
    if how == "empty":
        f.write_bytes(b"")
    elif how == "truncated":
        f.write_bytes(data[: len(data) // 2])
    elif how == "not-utf8":
        f.write_bytes(b"\xff" + data)
    elif how == "list":
        f.write_text("[1, 2]")


@pytest.mark.parametrize(
    "rel, how, expect",
    [
        ("meta.json", "empty", "the resume metadata is empty (0 bytes)"),
        ("meta.json", "truncated", "the resume metadata is not valid JSON"),
        ("meta.json", "not-utf8", "the resume metadata is not UTF-8 text"),
        ("meta.json", "list", "must be a JSON object"),
        ("rank_00000.json", "empty", "the rank state is empty (0 bytes)"),
        ("rank_00000.json", "truncated", "the rank state is not valid JSON"),
        ("rank_00000.safetensors", "empty", "truncated safetensors file"),
        ("rank_00000.safetensors", "truncated", "truncated safetensors file"),
        ("flex/0.metadata", "empty", "empty (0 bytes)"),
        ("flex/0.metadata", "truncated", "not a readable pickle"),
        ("flex/0_0.safetensors", "truncated", "truncated safetensors file"),
    ],
)
def test_corrupt_state_files_are_named(saved, tmp_path, rel, how, expect):
    """Zero-byte, truncated and garbled state files: an error naming the file (an EOFError or a
    UnpicklingError without a name before)."""
    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    _corrupt(folder, rel, how)
    with pytest.raises(ResumeStateError) as e:
        check_resume_state(str(folder))
    assert str(e.value).startswith(str(folder / rel)), str(e.value)
    assert expect in str(e.value), str(e.value)


def test_meta_json_fields_are_checked_by_name(saved, tmp_path):
    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    good = json.loads((folder / "meta.json").read_text())
    for key, value, expect in [
        ("step", "2", "`step` must be an integer >= 1, got '2'"),
        ("world_size", 0, "`world_size` must be an integer >= 1, got 0"),
        ("profile", [], "`profile` must be an object"),
        ("format", None, "`format` is None"),
        ("history", {"losses": ["x"]}, "`history` must be an object of number lists"),
        ("history", {"eval": [{"losses": 1.0}]}, "`history.eval` must be a list of records with a step"),
        ("history", {"eval": "x"}, "`history.eval` must be a list of records with a step"),
        ("skipped_steps", [0], "`skipped_steps` must be a list of step numbers, got [0]"),
        ("skipped_steps", [-5], "`skipped_steps` must be a list of step numbers, got [-5]"),
    ]:
        (folder / "meta.json").write_text(json.dumps({**good, key: value}))
        with pytest.raises(ResumeStateError) as e:
            check_resume_state(str(folder))
        assert str(e.value).startswith(str(folder / "meta.json")) and expect in str(e.value), str(e.value)
    # a curve shorter or longer than the steps (measured before: resumed, and loss.json's losses,
    # grad_norms and lrs then had different lengths)
    n = good["step"]
    for key in ("losses", "grad_norms", "lrs"):
        for m in (n - 1, n + 1):
            (folder / "meta.json").write_text(json.dumps({**good, "history": {**good["history"], key: [1.0] * m}}))
            with pytest.raises(ResumeStateError, match=rf"`history.{key}` must be a list of {n} entries .*, got {m}"):
                check_resume_state(str(folder))


def test_a_malformed_rng_state_is_named_before_launch(saved, tmp_path):
    """The RNG fields of a rank's JSON are checked with the rest of the state, in the launcher (measured
    before: a garbage ``rng`` passed the check and every worker failed on it, exit 1)."""
    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    file = folder / "rank_00000.json"
    good = json.loads(file.read_text())
    rng = good["rng"]
    for edit, expect in [
        ({"numpy": {**rng["numpy"], "keys": rng["numpy"]["keys"][:5]}}, "`rng.numpy.keys` must be 624 unsigned"),
        ({"numpy": {**rng["numpy"], "keys": [-1, *rng["numpy"]["keys"][1:]]}}, "`rng.numpy.keys` must be 624 unsigned"),
        ({"python": {**rng["python"], "state": [*rng["python"]["state"][:-1], 2**32]}}, "`rng.python.state` must be"),
        ({"numpy": {**rng["numpy"], "kind": 7}}, "`rng.numpy.kind` must be a string"),
        ({"python": {**rng["python"], "state": "x"}}, "`rng.python.state` must be 625 unsigned"),
        ({"python": {**rng["python"], "gauss_next": "x"}}, "`rng.python.gauss_next` must be a number"),
        ({"python": None}, "`rng.python` must be an object"),
        ({"paddle": [[{"latin1": 5}]]}, '`rng.paddle[0]` must be {"latin1": text}'),
        ({"paddle": "x"}, "`rng.paddle` must be lists"),
    ]:
        file.write_text(json.dumps({**good, "rng": {**rng, **edit}}))
        with pytest.raises(ResumeStateError) as e:
            check_resume_state(str(folder))
        assert str(e.value).startswith(str(file)) and expect in str(e.value), str(e.value)


def test_a_rank_file_that_says_another_rank_is_refused_before_launch(saved, tmp_path):
    """``rank_N.json`` records the rank N that wrote it (docs/failure-modes.md, "Resume state"): one
    that says another rank (a renamed or swapped file, whose RNG state would be restored into the
    wrong process) is refused naming the file and the field, before any worker starts."""
    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    file = folder / "rank_00000.json"
    file.write_text(json.dumps({**json.loads(file.read_text()), "rank": 1}))
    with pytest.raises(ResumeStateError) as e:
        check_resume_state(str(folder))
    assert str(e.value) == f"{file}: `rank` must be 0, got 1", str(e.value)


def test_old_pickle_format_is_refused_without_unpickling(saved, tmp_path):
    """A state folder of the earlier format (rank_*.pdstate + .rng pickles): refused by name, the
    pickles (payloads here) never opened."""
    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    meta = json.loads((folder / "meta.json").read_text())
    del meta["format"]
    (folder / "meta.json").write_text(json.dumps(meta))
    for f in ("rank_00000.safetensors", "rank_00000.json"):
        os.remove(folder / f)
    marker = tmp_path / "marker"
    (folder / "rank_00000.pdstate").write_bytes(payload(marker))
    (folder / "rank_00000.pdstate.rng").write_bytes(payload(marker))
    with pytest.raises(ResumeStateError, match="a resume state of the earlier pickle format") as e:
        check_resume_state(str(folder))
    assert str(e.value).startswith(str(folder / "rank_00000.pdstate"))
    assert not marker.exists()


def test_flex_metadata_pointing_outside_its_folder_is_refused(saved, tmp_path):
    """The allow-listed classes may still carry a hostile file name (flex's loader joins it to the
    folder): a name other than <rank>_<id>.safetensors in the folder is refused."""
    import dataclasses

    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    meta_file = folder / "flex" / "0.metadata"
    md = restricted_unpickle(str(meta_file), FLEX_METADATA_CLASSES)
    idx = next(iter(md.storage_metadata))
    md.storage_metadata[dataclasses.replace(idx, tensor_key="evil")] = "../../rank_00000.safetensors"
    meta_file.write_bytes(pickle.dumps(md))
    with pytest.raises(ResumeStateError, match=r"a tensor file name <rank>_<id>\.safetensors in the same folder"):
        check_resume_state(str(folder))


KEY = "model/layers.0.o_proj.weight"  # one piece of [32, 32] at (0, 0) in the world-1 state


def _edit_pieces(folder: Path, key: str, pieces: list[tuple[tuple, tuple, tuple]]) -> None:
    """flex/0.metadata with ``key``'s pieces replaced by ``pieces`` (global offset, local shape, global
    shape), each placed in the file that held the key."""
    import dataclasses

    meta_file = folder / "flex" / "0.metadata"
    md = restricted_unpickle(str(meta_file), FLEX_METADATA_CLASSES)
    (m,) = md.state_dict_metadata[key]
    (idx,) = [i for i in md.storage_metadata if i.tensor_key == key]
    name = md.storage_metadata.pop(idx)
    md.state_dict_metadata[key] = []
    for off, local, shape in pieces:
        md.state_dict_metadata[key].append(
            dataclasses.replace(m, global_offset=off, local_shape=local, global_shape=shape)
        )
        md.storage_metadata[dataclasses.replace(idx, global_offset=off, local_shape=local)] = name
    meta_file.write_bytes(pickle.dumps(md))


@pytest.mark.parametrize(
    "pieces, expect",
    [
        ([((1, 0), (32, 32), (32, 32))], "must be pieces inside the global shape [32, 32]"),
        ([((0, 1), (32, 32), (32, 33))], "must be pieces that cover the global shape [32, 33]"),
        ([((0, 0), (32, 32), (32, 32)), ((16, 0), (16, 32), (48, 32))], "must be pieces (not flattened) of one"),
        ([((0, 0), (32, 32), (48, 32)), ((16, 0), (16, 32), (48, 32))], "must be pieces that do not overlap"),
        ([((-1, 0), (32, 32), (32, 32))], "must be a list of LocalTensorMetadata"),
        ([((0, 0), (16, 32), (16, 32))], "has shape [16, 32] in the metadata, [32, 32] in the file"),
    ],
    ids=["past-the-end", "gap", "two-global-shapes", "overlap", "negative-offset", "other-shape-than-the-file"],
)  # fmt: skip
def test_flex_pieces_that_do_not_tile_their_tensor_are_refused_by_key(saved, tmp_path, pieces, expect):
    """The pieces flex metadata gives a key tile its global shape exactly and have the shape their
    tensor file holds (docs/failure-modes.md, "Resume state"): a piece reaching past the tensor or
    starting before it, a gap, an overlap, two global shapes, or a piece whose shape is not the one in
    the file is refused before launch naming the metadata file and the key. Paddle's resharder copies
    whatever rows overlap its target, so such a piece would load shifted weights into the run."""
    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    _edit_pieces(folder, KEY, pieces)
    with pytest.raises(ResumeStateError) as e:
        check_resume_state(str(folder))
    msg = str(e.value)
    assert msg.startswith(f"{folder / 'flex' / '0.metadata'}: ") and repr(KEY) in msg and expect in msg, msg


def _link_tensor_file_out(folder: Path) -> None:
    outside = folder.parent / "outside.safetensors"
    shutil.move(folder / "flex" / "0_0.safetensors", outside)
    os.symlink(outside, folder / "flex" / "0_0.safetensors")


def _place_an_absent_key(folder: Path) -> None:
    import dataclasses

    meta_file = folder / "flex" / "0.metadata"
    md = restricted_unpickle(str(meta_file), FLEX_METADATA_CLASSES)
    md.state_dict_metadata["model/nope"] = list(md.state_dict_metadata[KEY])
    (idx,) = [i for i in md.storage_metadata if i.tensor_key == KEY]
    md.storage_metadata[dataclasses.replace(idx, tensor_key="model/nope")] = md.storage_metadata[idx]
    meta_file.write_bytes(pickle.dumps(md))


@pytest.mark.parametrize(
    "edit, expect",
    [
        (_link_tensor_file_out, "flex/0.metadata: tensor 'model/embed_tokens.weight' is stored in 0_0.safetensors, "
         "which is not a file in"),
        (_place_an_absent_key, "flex/0.metadata: places 'model/nope' in 0_0.safetensors, which has no such tensor"),
        (lambda f: (f / "flex" / "0_0.distcp").write_bytes(b"x"), "flex/0_0.distcp: a resume state of the earlier"),
    ],
    ids=["tensor-file-linked-out", "key-absent-from-its-file", "old-format-file"],
)  # fmt: skip
def test_flex_tensor_files_are_the_checkpoints_own_and_hold_what_the_metadata_places(saved, tmp_path, edit, expect):
    """A flex tensor file is a plain file of the checkpoint's ``flex/`` folder (a link leaving it is
    refused, as a name leaving it is), holds every key the metadata places in it, and an earlier
    pickle-format file (``*.distcp``) in ``flex/`` is refused unopened (docs/failure-modes.md,
    "Resume state"): each before launch, naming the file."""
    folder = tmp_path / STEP
    shutil.copytree(saved / STEP, folder)
    edit(folder)
    with pytest.raises(ResumeStateError) as e:
        check_resume_state(str(folder))
    assert expect in str(e.value), str(e.value)


def test_latest_is_read_again_when_its_folder_is_pruned_while_it_moves_on(tmp_path, monkeypatch):
    """A run still saving into the root may prune the step ``latest`` named at the first read and move
    ``latest`` on (docs/failure-modes.md, "Resume state": ``--resume ROOT`` against a live root): the
    name is read again and the newer step folder is resumed, not refused as missing."""
    from paddleformers_glm.train import state_files

    root = tmp_path / "checkpoints"
    (root / "step_00000002").mkdir(parents=True)
    latest = root / "latest"
    latest.write_text("step_00000001\n")  # pruned: its folder is gone
    real, reads = state_files._latest_name, []

    def moving(r, file):
        reads.append(real(r, file))
        latest.write_text("step_00000002\n")  # the other run's next save lands after this read
        return reads[-1]

    monkeypatch.setattr(state_files, "_latest_name", moving)
    assert resolve_resume_state(str(root)) == str(root / "step_00000002")
    assert reads[0] == "step_00000001" and reads[-1] == "step_00000002", reads


# ------------------------------------------------------------------ the tensors inside a rank file
def _toy(out, **kw):
    from paddleformers_glm.train.loop import TrainConfig

    base = dict(model="toy", steps=3, seq_len=16, global_batch_size=4, micro_batch_size=2, lr=2e-3, seed=11)
    return TrainConfig(**{**base, "progress": False, "out": str(out), **kw})


@pytest.fixture(scope="module")
def toy_step2(tmp_path_factory) -> tuple[Path, list[float]]:
    """A step-2 resume state of a three-step toy run (in process) and the run's losses."""
    from paddleformers_glm.train.loop import run_training

    out = tmp_path_factory.mktemp("toy_state")
    full = run_training(_toy(out, save_every=2))
    return out / "checkpoints" / STEP, full["losses"]


def _rewrite_rank_file(folder: Path, change) -> None:
    """rank_00000.safetensors with its tensors (name -> numpy array) passed through ``change``."""
    import numpy as np

    from paddleformers_glm.checkpoint.safetensors_io import SafetensorsFile, SafetensorsWriter

    file = folder / "rank_00000.safetensors"
    with SafetensorsFile(str(file)) as r:
        tensors = {k: r.numpy(k).copy() for k in r.keys()}
    tensors = change(tensors)
    st = {np.dtype(d): s for d, s in [("float32", "F32"), ("int64", "I64"), ("int32", "I32")]}
    w = SafetensorsWriter(str(file), [(k, st[v.dtype], list(v.shape)) for k, v in tensors.items()], {"format": "x"})
    for k, v in tensors.items():
        w.write(k, v, st[v.dtype])
    w.close()


M1 = "optimizer/embed_tokens.weight/moment1"


@pytest.mark.parametrize(
    "case, change, expect",
    [
        ("model int", lambda t: {**t, "model/embed_tokens.weight": t["model/embed_tokens.weight"].astype("int64")},
         "`model/embed_tokens.weight` is I64, this run's is F32"),
        ("moment int", lambda t: {**t, M1: t[M1].astype("int32")}, f"`{M1}` is I32, this run's is F32"),
        ("moment shape", lambda t: {**t, M1: t[M1].reshape(-1)}, f"`{M1}` has shape [2048], this run's [64, 32]"),
        ("moment missing", lambda t: {k: v for k, v in t.items() if k != M1},
         "`optimizer/embed_tokens.weight` lacks moment1 (has beta1_pow_acc, beta2_pow_acc, moment2)"),
        ("unknown kind", lambda t: {**t, "optimizer/embed_tokens.weight/moment3": t[M1]},
         "`optimizer/embed_tokens.weight/moment3`: no such optimizer state (beta1_pow_acc, beta2_pow_acc, moment1, "
         "moment2)"),
        ("parameter entry missing", lambda t: {k: v for k, v in t.items() if not k.startswith("optimizer/embed_tokens.weight/")},
         "no optimizer state for 1 parameter(s) this rank updates that the state says stepped (meta.json "
         "flex.stepped): ['embed_tokens.weight']"),
        ("stray prefix", lambda t: {**t, "stray/embed_tokens.weight/moment1": t[M1] * 0},
         "unexpected tensor 'stray/embed_tokens.weight/moment1' (model/<name> or optimizer/<name>/<kind>)"),
        ("model tensor missing", lambda t: {k: v for k, v in t.items() if k != "model/layers.0.o_proj.weight"},
         "model tensors missing: ['model/layers.0.o_proj.weight']"),
    ],
)  # fmt: skip
def test_a_state_tensor_of_another_dtype_shape_or_kind_is_refused_by_name(toy_step2, tmp_path, case, change, expect):
    """A rank file whose tensors are not this run's state: refused naming the file and the tensor
    (docs/failure-modes.md, "Resume state"). Every parameter this rank updates that the state says
    stepped (meta.json ``flex.stepped``) has all its moments there, a model tensor is never absent, and
    a tensor outside ``model/`` and ``optimizer/`` is not taken for optimizer state.
    Before, an integer model tensor or moment was cast silently (measured: the step-3 loss 4.7478 for
    the uninterrupted 4.6749 with an I64 embedding), a missing moment restarted from zero (step-4 loss
    4.489652 for 4.489375), a moment of another shape failed in Paddle's ``set_value`` with Paddle's
    variable name (``comm_vocab_parallel_embedding_1.w_0_moment1_0``), an unknown kind as a bare
    ``KeyError`` text."""
    from paddleformers_glm.train.loop import run_training

    folder = tmp_path / STEP
    shutil.copytree(toy_step2[0], folder)
    _rewrite_rank_file(folder, change)
    with pytest.raises(ResumeStateError) as e:
        run_training(_toy(tmp_path / "out", resume=str(folder)))
    assert str(e.value).startswith(str(folder / "rank_00000.safetensors")), str(e.value)
    assert expect in str(e.value), str(e.value)


@pytest.mark.parametrize("key, kind", [(M1, "optimizer moment"), ("model/layers.0.o_proj.weight", "weight")])
def test_nonfinite_optimizer_state_is_refused_naming_the_tensor(toy_step2, tmp_path, key, kind):
    """A NaN moment (or master weight) is refused at the load like a NaN weight, as the state's, naming
    the rank file and the tensor (docs/failure-modes.md, "Resume state"), never left to the next step
    to blame on its gradients; before, the resumed run took its step-3 update with a NaN moment and
    finished with NaN weights (a four-step run stopped at step 4 on a non-finite loss blamed on the
    gradients)."""
    import numpy as np

    from paddleformers_glm.checkpoint.finite import NonFiniteError
    from paddleformers_glm.train.loop import run_training

    folder = tmp_path / STEP
    shutil.copytree(toy_step2[0], folder)

    def one_nan(t):
        m = t[key].copy()
        m.reshape(-1)[5] = np.nan
        return {**t, key: m}

    _rewrite_rank_file(folder, one_nan)
    with pytest.raises(NonFiniteError) as e:
        run_training(_toy(tmp_path / "out", resume=str(folder)))
    msg = str(e.value)
    assert msg.startswith(f"--resume: {folder / 'rank_00000.safetensors'} (the state of rank 0): "), msg
    assert f"hold NaN or Inf: {key} (1 values) [{kind}]" in msg, msg


def test_the_toy_state_resumes_bit_for_bit(toy_step2, tmp_path):
    """Control for the two tests above: the untouched state continues the run exactly."""
    from paddleformers_glm.train.loop import run_training

    assert run_training(_toy(tmp_path / "out", resume=str(toy_step2[0])))["losses"] == toy_step2[1]
