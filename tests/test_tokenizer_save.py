"""A tokenizer save replaces the folder's tokenizer files as one unit (docs/checkpoints.md, "Saving a
tokenizer"): a full disk or a kill at any point of ``GlmTokenizer.save_pretrained`` leaves the old
tokenizer whole or the new one, never the new tokenizer.json beside the old tokenizer_config.json
(which loaded silently, with the old chat template and padding side); the folder's other files
(weights, config.json, anything else) are never touched; ``make_tiny_checkpoint`` publishes its
weights and tokenizer together."""

from __future__ import annotations

import errno
import hashlib
import json
import os
import signal
import subprocess
import sys

import pytest

from paddleformers_glm import tokenizer_files as tokfiles
from paddleformers_glm.tiny import make_tiny_tokenizer
from paddleformers_glm.tokenizer import GlmTokenizer, TokenizerError

# files a checkpoint folder holds beside its tokenizer: a save of the tokenizer must leave each as it is
OTHER_FILES = {
    "model.safetensors": os.urandom(4096),
    "config.json": b'{"model_type": "glm_moe_dsa"}\n',
    "notes.txt": b"unrelated\n",
    "runs/log.txt": b"a subfolder's file\n",
}
JOURNAL = ".tokenizer.commit"


def _old_tokenizer():
    tok = make_tiny_tokenizer(256)
    tok.chat_template = "OLD {{ messages }}"
    return tok


def _new_tokenizer(with_template: bool = True):
    tok = make_tiny_tokenizer(200)
    tok.chat_template = "NEW {% for m in messages %}{{ m.content }}{% endfor %}" if with_template else None
    tok.padding_side = "left"
    tok.eos_token = "<|user|>"
    return tok


def _signature(tok):
    """What tells two tokenizers apart: vocabulary, templates, padding side, special tokens."""
    return (
        len(tok),
        tok.chat_template,
        dict(tok.chat_templates),
        tok.padding_side,
        tok.special_tokens_map,
        tok.eos_token_id,
    )


def _make_old_folder(folder, layout: str):
    """The old tokenizer saved into a checkpoint folder; ``"files"``: also with a chat_template.jinja,
    named templates and a special_tokens_map.json (transformers' layout), which a new tokenizer
    without them must not leave behind to be read with its files."""
    for name, data in OTHER_FILES.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    _old_tokenizer().save_pretrained(folder)
    if layout == "files":
        (folder / "chat_template.jinja").write_text("OLD-JINJA {{ messages }}")
        (folder / "additional_chat_templates").mkdir()
        (folder / "additional_chat_templates" / "tool_use.jinja").write_text("OLD-TOOLS")
        (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|endoftext|>"}))
    return {name: os.stat(folder / name) for name in OTHER_FILES}


def _expected(tmp_path, layout: str):
    """(old signature, new signature, old listing, new listing) of a save over a ``layout`` folder."""
    old, new = tmp_path / "expect-old", tmp_path / "expect-new"
    old.mkdir()
    new.mkdir()
    _make_old_folder(old, layout)
    _make_old_folder(new, layout)
    _new_tokenizer(layout == "plain").save_pretrained(new)
    return (
        _signature(GlmTokenizer.from_pretrained(old)),
        _signature(GlmTokenizer.from_pretrained(new)),
        _listing(old),
        _listing(new),
    )


def _listing(folder):
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


def _check_other_files(folder, stats):
    for name, data in OTHER_FILES.items():
        st = os.stat(folder / name)
        assert (folder / name).read_bytes() == data, name
        assert (st.st_ino, st.st_mtime_ns) == (stats[name].st_ino, stats[name].st_mtime_ns), name


def _fsync_fails_at(monkeypatch, n: int, real_fsync) -> None:
    """``os.fsync`` raises ENOSPC (no file name, as the kernel's) at its n-th call from now."""
    calls = [0]

    def fsync(fd):
        calls[0] += 1
        if calls[0] == n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)


@pytest.mark.parametrize("layout", ["plain", "files"])
def test_a_full_disk_at_every_fsync_of_a_save_leaves_the_old_tokenizer_or_the_new(tmp_path, monkeypatch, layout):
    """ENOSPC at the Nth fsync of the save, for every N: the save raises, and the folder loads as
    exactly the old tokenizer or the new one (its listing too: no stale template file, no leftover),
    the weights and other files untouched (same inode, bytes and mtime); a later save works. Before,
    a failure at the 2nd fsync left the new tokenizer.json (vocab 200) with the old config ('OLD'
    template, right padding), which loaded without a word; and a new tokenizer without a template file
    left the old chat_template.jinja, named templates and special_tokens_map.json to be read with it."""
    old_sig, new_sig, old_list, new_list = _expected(tmp_path, layout)
    assert old_sig != new_sig
    real_fsync, seen = os.fsync, {"old": 0, "new": 0}
    n = 0
    while True:
        n += 1
        folder = tmp_path / f"n{n}"
        folder.mkdir()
        stats = _make_old_folder(folder, layout)
        _fsync_fails_at(monkeypatch, n, real_fsync)
        try:
            _new_tokenizer(layout == "plain").save_pretrained(folder)
            failed = False
        except OSError as e:
            assert e.errno == errno.ENOSPC
            failed = True
        monkeypatch.setattr(os, "fsync", real_fsync)
        sig = _signature(GlmTokenizer.from_pretrained(folder))
        assert sig in (old_sig, new_sig), f"fsync {n}: a mix of the two tokenizers loaded: {sig}"
        seen["old" if sig == old_sig else "new"] += 1
        assert _listing(folder) == (old_list if sig == old_sig else new_list), f"fsync {n}"
        _check_other_files(folder, stats)
        make_tiny_tokenizer(180).save_pretrained(folder)  # nothing left in the way of the next save
        assert len(GlmTokenizer.from_pretrained(folder)) == 180
        _check_other_files(folder, stats)
        if not failed:
            break
        assert n < 60, "the save never completed"
    assert n > 3 and seen["old"] >= 1  # failures before the commit, each leaving the old tokenizer


def _kill_at(folder, n: int) -> int:
    """Save the new tokenizer into ``folder`` in a forked child that dies (os._exit, as SIGKILL: no
    handler runs) at its Nth file operation; -> its exit code (0: the save completed first)."""
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 3
        try:
            signal.alarm(60)
            calls = [0]

            def dying(real):
                def op(*args, **kwargs):
                    calls[0] += 1
                    if calls[0] == n:
                        os._exit(137)
                    return real(*args, **kwargs)

                return op

            for name in ("fsync", "replace", "rename", "remove", "unlink", "rmdir"):
                setattr(os, name, dying(getattr(os, name)))
            _new_tokenizer().save_pretrained(folder)
            code = 0
        finally:
            os._exit(code)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def test_a_kill_at_every_step_of_a_save_leaves_the_old_tokenizer_or_the_new(tmp_path):
    """A save killed at each of its file operations (fsync, rename, remove), in turn: the folder loads
    as the old tokenizer or the new one, the load puts a save cut off after its commit in place (the
    top level is then one tokenizer, for transformers too), and the next save leaves no trace of the
    killed one. Before, a kill after the first file left the new tokenizer.json with the old config."""
    old_sig, new_sig, old_list, new_list = _expected(tmp_path, "plain")
    n = 0
    while True:
        n += 1
        folder = tmp_path / f"k{n}"
        folder.mkdir()
        stats = _make_old_folder(folder, "plain")
        code = _kill_at(folder, n)
        assert code in (0, 137), code
        sig = _signature(GlmTokenizer.from_pretrained(folder))
        assert sig in (old_sig, new_sig), f"killed at operation {n}: a mix of the two tokenizers loaded: {sig}"
        assert not (folder / JOURNAL).exists()  # the killed save's set was put in place by the load
        visible = [p for p in _listing(folder) if not p.startswith(".tokenizer.tmp-")]
        assert visible == (old_list if sig == old_sig else new_list)
        config = json.loads((folder / "tokenizer_config.json").read_text())
        vocab = json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]
        assert (len(vocab), config.get("padding_side", "right")) == (
            (256, "right") if sig == old_sig else (200, "left")
        )
        _check_other_files(folder, stats)
        make_tiny_tokenizer(180).save_pretrained(folder)
        assert not any(p.startswith(".tokenizer") for p in os.listdir(folder))  # the killed save's leftovers
        _check_other_files(folder, stats)
        if code == 0:
            break
        assert n < 80, "the save never completed"
    assert n > 5


def test_a_save_cut_off_after_its_commit_is_read_through_and_finished(tmp_path, monkeypatch):
    """The moves that put a committed set in place fail (the disk): the top level is then half new,
    half old, and the loader reads the complete set the save committed (the new tokenizer); once the
    saving process is gone, a load puts the set in place; a committed file changed afterwards is
    refused, naming it."""
    old_sig, new_sig, _, _ = _expected(tmp_path, "plain")
    folder = tmp_path / "f"
    folder.mkdir()
    stats = _make_old_folder(folder, "plain")
    real_apply = tokfiles._apply

    def half_apply(folder_, manifest):
        first = next(iter(manifest["install"]))
        os.replace(folder_ / JOURNAL / first, folder_ / first)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(tokfiles, "_apply", half_apply)
    with pytest.raises(OSError):
        _new_tokenizer().save_pretrained(folder)
    monkeypatch.setattr(tokfiles, "_apply", real_apply)
    assert (folder / JOURNAL).is_dir()
    assert len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) == 200
    assert "OLD" in (folder / "tokenizer_config.json").read_text()  # the top level is a mix
    assert _signature(GlmTokenizer.from_pretrained(folder)) == new_sig  # read through the committed set
    assert (folder / JOURNAL).is_dir()  # this (live) process's save is not finished by a load

    # a damaged committed file: refused, naming it
    pending = folder / JOURNAL / "tokenizer_config.json"
    good = pending.read_bytes()
    pending.write_bytes(good.replace(b"NEW", b"BAD"))
    with pytest.raises(TokenizerError, match="tokenizer_config.json differ"):
        GlmTokenizer.from_pretrained(folder)
    pending.write_bytes(good)

    # the saving process gone (a reaped child's pid): the load finishes the save
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    manifest_file = folder / JOURNAL / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    manifest["owner"] = {"pid": int(dead.stdout), "start": None}
    manifest_file.write_text(json.dumps(manifest))
    assert _signature(GlmTokenizer.from_pretrained(folder)) == new_sig
    assert not (folder / JOURNAL).exists()
    assert "NEW" in (folder / "tokenizer_config.json").read_text()
    _check_other_files(folder, stats)
    assert old_sig != new_sig


def test_the_saved_set_matches_its_manifest(tmp_path, monkeypatch):
    """The manifest binds each file of the set by its SHA-256, as read back."""
    folder = tmp_path / "f"
    folder.mkdir()
    texts = {"tokenizer.json": "{}", "tokenizer_config.json": "{}\n"}
    seen = {}
    real = tokfiles._apply

    def spy(folder_, manifest):
        seen.update(manifest["install"])
        real(folder_, manifest)

    monkeypatch.setattr(tokfiles, "_apply", spy)
    tokfiles.write_set(folder, texts, "")
    assert seen == {n: hashlib.sha256((folder / n).read_bytes()).hexdigest() for n in texts}


def test_make_tiny_checkpoint_never_publishes_weights_without_their_tokenizer(tmp_path, monkeypatch):
    """The tokenizer is saved into the checkpoint's temporary folder, so one publish puts weights and
    tokenizer in place: a tokenizer save that fails leaves no checkpoint, and a full disk at every
    fsync of make_tiny_checkpoint leaves no checkpoint or a whole one. Before, the weights were
    published first and the tokenizer saved after: its failure left a checkpoint without one."""
    from paddleformers_glm.tiny import make_tiny_checkpoint

    def failing_save(self, folder, *args, **kwargs):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as m:
        m.setattr(GlmTokenizer, "save_pretrained", failing_save)
        with pytest.raises(OSError):
            make_tiny_checkpoint(tmp_path / "a")
    assert not (tmp_path / "a").exists()

    real_fsync = os.fsync
    n = 0
    while True:
        n += 1
        out = tmp_path / f"n{n}"
        _fsync_fails_at(monkeypatch, n, real_fsync)
        try:
            make_tiny_checkpoint(out)
            failed = False
        except OSError:
            failed = True
        monkeypatch.setattr(os, "fsync", real_fsync)
        if out.exists():
            names = set(os.listdir(out))
            assert {"config.json", "tokenizer.json", "tokenizer_config.json"} <= names, (n, names)
            assert len(GlmTokenizer.from_pretrained(out)) == 256
        if not failed:
            break
        assert n < 40, "make_tiny_checkpoint never completed"
    assert n > 3


def _dead_pid() -> int:
    """The pid of a child that has exited and been reaped: no process of it is alive."""
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    return int(dead.stdout)


def test_a_forged_pending_save_never_removes_a_file_that_is_no_tokenizer_file(tmp_path):
    """A pending-save manifest (``.tokenizer.commit/manifest.json``) left by a dead process whose
    "remove" names the folder's weights is damaged or forged: a load refuses it, naming the
    manifest, and neither the load nor a later save removes ``model.safetensors``.  A manifest taken
    at its word would make ``GlmTokenizer.from_pretrained`` delete the checkpoint's weights."""
    folder = tmp_path / "f"
    folder.mkdir()
    stats = _make_old_folder(folder, "plain")
    (folder / JOURNAL).mkdir()
    manifest = {"owner": {"pid": _dead_pid(), "start": None}, "install": {}, "remove": ["model.safetensors"]}
    (folder / JOURNAL / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(TokenizerError, match="not a tokenizer save's manifest"):
        GlmTokenizer.from_pretrained(folder)
    _check_other_files(folder, stats)
    _new_tokenizer().save_pretrained(folder)
    _check_other_files(folder, stats)
    assert len(GlmTokenizer.from_pretrained(folder)) == 200


def test_a_save_removes_the_old_tokenizers_files_the_new_one_lacks(tmp_path):
    """Saving a tokenizer without named templates, a chat_template.jinja or a special_tokens_map.json
    over a folder whose old tokenizer had them leaves exactly the new set beside the other files:
    the old ``additional_chat_templates/tool_use.jinja`` and ``special_tokens_map.json`` would
    otherwise be read with the new files (by this loader and by transformers'), giving the old tool
    template and the old special tokens.  The listing is written out here, not computed by a save."""
    folder = tmp_path / "f"
    folder.mkdir()
    stats = _make_old_folder(folder, "files")
    new = _new_tokenizer(with_template=False)
    new.eos_token = "<|endoftext|>"
    (folder / "special_tokens_map.json").write_text(json.dumps({"eos_token": "<|user|>"}))
    new.save_pretrained(folder)
    assert _listing(folder) == [
        "config.json",
        "model.safetensors",
        "notes.txt",
        "runs",
        "runs/log.txt",
        "tokenizer.json",
        "tokenizer_config.json",
    ]
    _check_other_files(folder, stats)
    tok = GlmTokenizer.from_pretrained(folder)
    assert tok.eos_token == "<|endoftext|>" and tok.chat_templates == {} and tok.chat_template is None


def test_a_save_finishes_its_own_process_committed_but_unapplied_set(tmp_path):
    """A save of this process committed its set but did not put it in place (the moves failed):
    the next save from the same process finishes or replaces it at once.  Refusing it as "another
    process (pid <this pid>) is saving a tokenizer into this folder" after a wait would leave the
    process unable to save its tokenizer again."""
    import time

    folder = tmp_path / "f"
    folder.mkdir()
    stats = _make_old_folder(folder, "plain")
    text = (folder / "tokenizer_config.json").read_text()
    (folder / JOURNAL).mkdir()
    (folder / JOURNAL / "tokenizer_config.json").write_text(text)
    owner = {"pid": os.getpid(), "start": tokfiles.proc_stat_field(os.getpid(), 19)}
    install = {"tokenizer_config.json": hashlib.sha256(text.encode()).hexdigest()}
    (folder / JOURNAL / "manifest.json").write_text(json.dumps({"owner": owner, "install": install, "remove": []}))
    t0 = time.monotonic()
    _new_tokenizer().save_pretrained(folder)
    assert time.monotonic() - t0 < 3
    assert not (folder / JOURNAL).exists()
    assert "NEW" in (folder / "tokenizer_config.json").read_text()
    _check_other_files(folder, stats)
