"""Saves that cannot lose data: only this save's own files are replaced, an overwrite is all or
nothing (also when the saving process is SIGKILLed), temporary folders never outlive a failure
(full disk included) and killed saves' leftovers are cleaned by the next save; non-weight files
travel with the weights.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import load_pretrained_state, save_pretrained_state
from paddleformers_glm.testing import SpecModel

ROOT = pathlib.Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "fixtures" / "tiny" / "checkpoint"
FOREIGN = {
    "adapter_model.safetensors": b"not ours 1",
    "consolidated.safetensors": b"not ours 2",
    "tokenizer.json": b'{"t": 1}',
    "notes/readme.txt": b"keep me",
}


def _snapshot(folder) -> dict[str, bytes]:
    folder = pathlib.Path(folder)
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _leftovers(parent, name="out") -> list[str]:
    return sorted(p.name for p in pathlib.Path(parent).iterdir() if p.name.startswith(f".{name}."))


@pytest.fixture(scope="module")
def model():
    cfg = GlmMoeDsaConfig.from_pretrained(FIXTURE)
    m = SpecModel(cfg)
    load_pretrained_state(m, FIXTURE)
    return m


def _existing(tmp_path, model, shard="200KB") -> pathlib.Path:
    """A saved checkpoint (several shards) with other people's files beside it."""
    out = tmp_path / "out"
    save_pretrained_state(model, model.config, out, max_shard_size=shard)
    for rel, data in FOREIGN.items():
        (out / rel).parent.mkdir(exist_ok=True)
        (out / rel).write_bytes(data)
    return out


def test_overwrite_replaces_only_its_own_files(model, tmp_path):
    out = _existing(tmp_path, model)
    old = _snapshot(out)
    assert sum(n.startswith("model-") for n in old) > 2
    save_pretrained_state(model, model.config, out, max_shard_size="1MB")
    new = _snapshot(out)
    for rel, data in FOREIGN.items():
        assert new[rel] == data, rel
    ours = sorted(n for n in new if n not in FOREIGN)
    assert ours == ["config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"] + [
        "model.safetensors.index.json"
    ]
    assert _leftovers(tmp_path) == []
    back = SpecModel(model.config)
    load_pretrained_state(back, out)  # stray files are warnings, not refusals
    for (k, a), b in zip(model.state_dict().items(), back.state_dict().values()):
        assert np.array_equal(a.numpy(), b.numpy()), k


_CHILD = r"""
import os, sys, time
from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import load_pretrained_state, save_pretrained_state, saver
from paddleformers_glm.checkpoint.safetensors_io import SafetensorsWriter
from paddleformers_glm.testing import SpecModel

src, out, point, flag = sys.argv[1:5]

def stop():
    open(flag, "w").close()
    time.sleep(600)

if point == "write":
    real_write, n = SafetensorsWriter.write, [0]
    def write(self, *a, **kw):
        n[0] += 1
        if n[0] == 150:
            stop()
        return real_write(self, *a, **kw)
    SafetensorsWriter.write = write
elif point == "exchange":
    real_exchange = saver._exchange
    def exchange(a, b):
        done = real_exchange(a, b)
        stop()
        return done
    saver._exchange = exchange
cfg = GlmMoeDsaConfig.from_pretrained(src)
m = SpecModel(cfg)
load_pretrained_state(m, src)
save_pretrained_state(m, cfg, out, max_shard_size="1MB")
"""


def _kill_save_at(point, out, tmp_path):
    flag = tmp_path / f"flag-{point}"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", _CHILD, str(FIXTURE), str(out), point, str(flag)], env=env)
    try:
        deadline = time.time() + 240
        while not flag.exists():
            assert proc.poll() is None, f"child exited early ({proc.returncode})"
            assert time.time() < deadline, "child never reached the kill point"
            time.sleep(0.05)
        os.kill(proc.pid, signal.SIGKILL)
    finally:
        proc.wait()
    assert proc.returncode == -signal.SIGKILL


@pytest.mark.timeout(600)
def test_killed_overwrite_leaves_old_or_new_never_a_mix(model, tmp_path):
    out = _existing(tmp_path, model)
    old = _snapshot(out)
    # the state an uninterrupted overwrite gives (same call in a scratch copy)
    ref = tmp_path / "ref"
    shutil.copytree(out, ref)
    save_pretrained_state(model, model.config, ref, max_shard_size="1MB")
    new = _snapshot(ref)
    assert new != old
    # killed while writing shards: the old checkpoint, byte for byte; its temp folder stays behind
    _kill_save_at("write", out, tmp_path)
    assert _snapshot(out) == old
    assert len(_leftovers(tmp_path)) == 1
    # killed right after the swap: the new checkpoint, complete; the old one lingers aside
    _kill_save_at("exchange", out, tmp_path)
    assert _snapshot(out) == new
    assert len(_leftovers(tmp_path)) >= 1
    # the next save removes what killed saves left
    save_pretrained_state(model, model.config, out, max_shard_size="1MB")
    assert _leftovers(tmp_path) == [] and _snapshot(out) == new


def test_stale_temp_folders_of_dead_processes_are_cleaned_live_ones_kept(model, tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f".out.tmp-{dead.pid}-abc"
    live = tmp_path / f".out.tmp-{os.getppid()}-xyz"  # a live process's save in progress
    for d in (stale, live):
        d.mkdir()
        (d / "model.safetensors").write_bytes(b"partial")
    save_pretrained_state(model, model.config, tmp_path / "out")
    assert not stale.exists() and live.exists()


def test_without_atomic_exchange_a_kill_between_renames_is_repaired(model, tmp_path, monkeypatch):
    from paddleformers_glm.checkpoint import saver

    out = _existing(tmp_path, model)
    old = _snapshot(out)
    monkeypatch.setattr(saver, "_exchange", lambda a, b: False)
    save_pretrained_state(model, model.config, out, max_shard_size="1MB")  # the rename-aside path
    new = _snapshot(out)
    assert all(new[k] == v for k, v in FOREIGN.items()) and _leftovers(tmp_path) == []
    # a save killed after moving the old folder aside and before moving the new one in
    dead = subprocess.Popen(["true"])
    dead.wait()
    os.rename(out, tmp_path / f".out.old-{dead.pid}-q")
    saver.clean_stale_saves(str(out))
    assert _snapshot(out) == new
    del old


def test_full_disk_leaves_no_temp_folder_and_one_line_error(model, tmp_path):
    out = _existing(tmp_path, model)
    old = _snapshot(out)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    cmd = f'ulimit -f 256; exec "{sys.executable}" -m paddleformers_glm.cli convert "{FIXTURE}" "{out}" --to hf'
    r = subprocess.run(["bash", "-c", cmd], env=env, capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr
    lines = [x for x in r.stderr.strip().splitlines() if x.strip()]
    assert len(lines) == 1 and str(out) in lines[0] and "File too large" in lines[0], r.stderr
    assert _snapshot(out) == old
    assert _leftovers(tmp_path) == []


def test_non_weight_files_travel_with_save_and_convert(tmp_path):
    from paddleformers_glm.cli import main
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    src = tmp_path / "src"
    shutil.copytree(FIXTURE, src)
    extra = {
        "tokenizer.json": b'{"model": {}}',
        "tokenizer_config.json": b'{"chat_template": null}',
        "generation_config.json": b'{"do_sample": false}',
        "chat_template.jinja": b"{{ messages }}",
    }
    for n, b in extra.items():
        (src / n).write_bytes(b)
    m = GlmMoeDsaForCausalLM.from_pretrained(src)
    m.save_pretrained(tmp_path / "saved")
    assert main(["convert", str(src), str(tmp_path / "conv"), "--to", "hf"]) == 0
    for folder in (tmp_path / "saved", tmp_path / "conv"):
        snap = _snapshot(folder)
        assert {n: snap.get(n) for n in extra} == extra, folder


def test_a_save_that_carries_a_tokenizer_replaces_the_old_one_whole(model, tmp_path):
    """Saving over an earlier export with another source's tokenizer: the tokenizer is one unit. Before,
    the files the new source lacks stayed from the old export (measured: the old chat_template.jinja
    beside the new tokenizer_config.json), and transformers takes the template from
    chat_template.jinja over tokenizer_config.json's, so the export chatted with the old template.
    A save that carries no tokenizer still keeps the folder's tokenizer files (test above)."""
    old_src, new_src = tmp_path / "old_src", tmp_path / "new_src"
    for d, files in (
        (old_src, {"tokenizer.json": b'{"old": 1}', "tokenizer_config.json": b"{}", "chat_template.jinja": b"old"}),
        (new_src, {"tokenizer.json": b'{"new": 1}', "tokenizer_config.json": b'{"chat_template": "new"}'}),
    ):
        d.mkdir()
        for n, b in files.items():
            (d / n).write_bytes(b)
    out = tmp_path / "out"
    save_pretrained_state(model, model.config, out, carry_from=old_src)
    (out / "notes.txt").write_bytes(b"keep me")
    save_pretrained_state(model, model.config, out, carry_from=new_src)
    snap = _snapshot(out)
    assert "chat_template.jinja" not in snap
    assert snap["tokenizer.json"] == b'{"new": 1}' and snap["notes.txt"] == b"keep me"


@pytest.mark.parametrize("metadata", [{"step": 5}, {"format": None}])
def test_metadata_that_safetensors_cannot_hold_is_refused_before_the_old_checkpoint_is_replaced(
    model, tmp_path, metadata
):
    """A safetensors header's ``__metadata__`` maps strings to strings (the format; ``safetensors``'
    ``save_file`` refuses ``{"step": 5}`` with a TypeError). Measured before: ``save_pretrained_state(...,
    metadata={"step": 5})`` wrote the checkpoint over the old one and the loader then refused every
    shard ("__metadata__ must map strings to strings"): the old weights replaced by unloadable ones."""
    from paddleformers_glm.checkpoint import CheckpointError

    out = _existing(tmp_path, model)
    old = _snapshot(out)
    with pytest.raises(CheckpointError, match="metadata") as ei:
        save_pretrained_state(model, model.config, out, metadata=metadata)
    assert ei.value.key == "__metadata__"
    assert _snapshot(out) == old and _leftovers(tmp_path) == []
    load_pretrained_state(SpecModel(model.config), out)  # still the old, loadable checkpoint


def test_a_save_to_a_link_to_a_folder_writes_into_the_folder(model, tmp_path):
    """``out`` a symlink to a folder elsewhere (``~/ckpt -> /big/ckpt``): transformers' ``save_pretrained``
    writes through it (makedirs, then files inside). Measured before: the temporary folder was made beside
    the link (on the link's filesystem), the atomic exchange swapped the *link* with it, so ``out`` became
    a real folder there, the target kept its old contents (empty here), and the link itself stayed behind
    as ``.out.tmp-<pid>-…``, which neither that save nor later ones could remove (rmtree refuses links)."""
    target = tmp_path / "big" / "ckpt"
    target.mkdir(parents=True)
    (target / "notes.txt").write_text("keep me")
    home = tmp_path / "home"
    home.mkdir()
    (home / "out").symlink_to(target)
    for _ in range(2):  # into the empty target, then over the checkpoint there
        save_pretrained_state(model, model.config, home / "out", max_shard_size="1MB")
        assert (home / "out").is_symlink() and os.readlink(home / "out") == str(target)
        assert sorted(os.listdir(home)) == ["out"]  # nothing left beside the link
        assert _leftovers(target.parent, "ckpt") == []
        names = sorted(os.listdir(target))
        assert "notes.txt" in names and "model-00001-of-00002.safetensors" in names, names
    m = SpecModel(model.config)
    load_pretrained_state(m, home / "out")
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(m.state_dict()[k].numpy(), v.numpy())


def test_a_save_through_a_link_over_its_own_source_keeps_the_tokenizer_files_as_they_are(model, tmp_path):
    target = tmp_path / "big" / "ckpt"
    save_pretrained_state(model, model.config, target)
    (target / "tokenizer.json").write_text('{"t": 1}')
    (tmp_path / "out").symlink_to(target)
    ino = (target / "tokenizer.json").stat().st_ino
    save_pretrained_state(model, model.config, tmp_path / "out", carry_from=tmp_path / "out")
    assert (target / "tokenizer.json").stat().st_ino == ino  # linked into the new folder, not copied over itself


def test_a_target_that_is_a_file_is_refused_before_any_tensor_is_written(model, tmp_path, monkeypatch):
    """Measured before: every tensor was converted and written (296 for the tiny model; the whole model,
    for GLM-5.2 ~1.5 TB, before failing) and only then publish() refused "output path exists and is
    not a folder"."""
    from paddleformers_glm.checkpoint import CheckpointError, safetensors_io

    out = tmp_path / "out"
    out.write_text("a file, not a folder")
    written = []
    real = safetensors_io.SafetensorsWriter.write
    monkeypatch.setattr(safetensors_io.SafetensorsWriter, "write", lambda s, k, *a: (written.append(k), real(s, k, *a)))
    with pytest.raises(CheckpointError, match="not a folder") as ei:
        save_pretrained_state(model, model.config, out)
    assert ei.value.file == str(out) and written == [] and out.read_text() == "a file, not a folder"
    assert _leftovers(tmp_path) == []


_SAVE_ONLY = r"""
import sys
from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.checkpoint import save_pretrained_state
from paddleformers_glm.testing import SpecModel
cfg = GlmMoeDsaConfig.from_pretrained(sys.argv[1])
try:
    save_pretrained_state(SpecModel(cfg), cfg, sys.argv[2])
except Exception as e:
    print(type(e).__name__, e)
"""


def test_a_save_into_a_read_only_folder_leaves_no_old_checkpoint_behind(model, tmp_path):
    """Measured before (as a user without CAP_DAC_OVERRIDE): the save replaced the 0555 folder and left
    its old checkpoint in a hidden ``.out.tmp-*`` folder it could not empty, one more on every save
    (for GLM-5.2 ~1.5 TB each). Root ignores the mode, so as root the save runs without that power."""
    out = _existing(tmp_path, model)
    before = _snapshot(out)
    out.chmod(0o555)
    cmd = [sys.executable, "-c", _CHILD, str(FIXTURE), str(out), "none", str(tmp_path / "flag")]
    if os.geteuid() == 0:
        assert shutil.which("setpriv"), "running as root needs util-linux's setpriv to drop CAP_DAC_OVERRIDE"
        cmd = ["setpriv", "--bounding-set=-dac_override,-fowner,-dac_read_search", *cmd]
    try:
        subprocess.run(cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), check=True, timeout=300)
        assert _leftovers(tmp_path) == []
        after = _snapshot(out)
        assert {k: after[k] for k in FOREIGN} == {k: before[k] for k in FOREIGN}
        assert "model.safetensors.index.json" in after
        # a read-only folder around the target: one error naming the target (was a bare
        # PermissionError naming the temporary folder)
        tmp_path.chmod(0o555)
        cmd[cmd.index(_CHILD)] = _SAVE_ONLY
        run = subprocess.run(
            cmd, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True, timeout=300
        )
        assert run.stdout.startswith("CheckpointError cannot write beside the target"), run.stdout + run.stderr
        assert str(out) in run.stdout
    finally:
        tmp_path.chmod(0o755)
        out.chmod(0o755)


def test_an_empty_path_or_the_working_folder_is_refused_before_any_write(model, tmp_path, monkeypatch):
    """Measured before: ``save_pretrained("")`` (and ``"."``, or any folder holding the working
    directory) replaced the working folder by the saved one, leaving this process (and any shell in it)
    in a deleted folder; transformers refuses "" (``os.makedirs``)."""
    from paddleformers_glm.checkpoint import CheckpointError

    out = _existing(tmp_path, model)
    before = _snapshot(out)
    (out / "sub").mkdir()
    for cwd, target in ((out, ""), (out, "."), (out / "sub", str(out))):
        monkeypatch.chdir(cwd)
        match = "empty" if target == "" else "working directory"
        with pytest.raises(CheckpointError, match=match):
            save_pretrained_state(model, model.config, target)
        assert os.getcwd() == str(cwd) and os.path.isdir(os.getcwd())
    assert _snapshot(out) == before and _leftovers(tmp_path) == []


def test_a_target_name_near_the_file_name_limit_saves(model, tmp_path):
    """A 240-character folder name is a legal target; measured before, the temporary folder's name
    (the target's plus a prefix and a suffix) passed 255 bytes: "File name too long"."""
    out = tmp_path / ("c" * 240)
    save_pretrained_state(model, model.config, out, max_shard_size="200KB")
    save_pretrained_state(model, model.config, out, max_shard_size="200KB")  # over it: the swap's names too
    assert (out / "model.safetensors.index.json").is_file()
    assert _leftovers(tmp_path, "c" * 128) == []
