"""A tokenizer's files on disk: the names one tokenizer is made of, a save that replaces them as one
set (docs/checkpoints.md, "Saving a tokenizer") and a read that sees one set, also beside a save
killed part way."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from ._io import (
    atomic_write_text,
    is_int,
    naming_write_errors,
    pid_alive,
    proc_stat_field,
    read_json,
    write_json_atomic,
)

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"
TEMPLATE_DIR = "additional_chat_templates"  # transformers' named templates, NAME.jinja each
SPECIAL_TOKENS_MAP_FILE = "special_tokens_map.json"
# the files one tokenizer is made of (with TEMPLATE_DIR's): a save replaces all of them together, so
# no file of another tokenizer stays beside its files to be read with them (a model save's too)
SET_FILES = (
    TOKENIZER_FILE,
    CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    "tokenizer.model",
    TEMPLATE_FILE,
    "chat_template.json",
)
# a save's complete new set, in the folder until every file of it is in place (docs/checkpoints.md,
# "Saving a tokenizer"); a set being written is in a .tokenizer.tmp-<pid>-XXXX folder
JOURNAL_DIR = ".tokenizer.commit"
_STAGE_PREFIX = ".tokenizer.tmp-"
_MANIFEST = "manifest.json"


class TokenizerError(ValueError):
    """A tokenizer folder or a conversation that cannot be used (the message names the file or message)."""


# ------------------------------------------------------------------ saving a set of files as one
# A save writes the whole new set into a staging folder inside the target, with a manifest (each
# file's SHA-256, and the old set's files the new one lacks), and renames that folder to JOURNAL_DIR:
# that one rename is the moment the new tokenizer replaces the old one. Then the files are moved to
# the folder's top level (where transformers reads them) and JOURNAL_DIR removed. A save killed
# before the rename leaves the old set whole; one killed after it leaves JOURNAL_DIR, which the
# loader reads through (the new set whole) and the next save or load finishes.


def _fsync_dir(path: str | os.PathLike) -> None:
    """Flush a folder's entries (the renames into it) to disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _owner_alive(owner: Any) -> bool:
    """Whether the process that wrote a manifest still runs (the same pid and start time)."""
    pid = owner.get("pid") if isinstance(owner, dict) else None
    if not is_int(pid) or pid <= 0 or not pid_alive(pid):
        return False
    start = owner.get("start")
    return start is None or proc_stat_field(pid, 19) in (None, start)


def _set_names(folder: Path, prefix: str = "") -> list[str]:
    """The tokenizer files now in ``folder`` (names relative to it)."""
    names = [prefix + n for n in SET_FILES if (folder / (prefix + n)).is_file()]
    named = folder / (prefix + TEMPLATE_DIR)
    if named.is_dir():
        names += [f"{prefix}{TEMPLATE_DIR}/{f.name}" for f in sorted(named.glob("*.jinja")) if f.is_file()]
    return names


def _set_member(name: Any) -> bool:
    """Whether a manifest's name is one of a tokenizer's files (a damaged or forged manifest must not
    make the loader or a save remove or replace any other file)."""
    if not isinstance(name, str) or "\\" in name or name.startswith("/"):
        return False
    parts = name.split("/")
    if any(p in ("", ".", "..") for p in parts):
        return False
    if len(parts) == 1:
        return name.endswith(SET_FILES)
    return len(parts) == 2 and parts[0].endswith(TEMPLATE_DIR) and parts[1].endswith(".jinja")


def _manifest(folder: Path) -> dict | None:
    """The manifest of a save whose set is committed but not all in place; None when there is none."""
    file = folder / JOURNAL_DIR / _MANIFEST
    try:
        data = file.read_bytes()
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as e:
        raise TokenizerError(f"{file}: cannot read a pending tokenizer save's manifest: {e.strerror or e}") from e
    m = read_json(file, "a pending tokenizer save's manifest", error=TokenizerError, data=data)
    install, remove = m.get("install"), m.get("remove")
    if not (
        isinstance(install, dict)
        and all(_set_member(k) and isinstance(v, str) for k, v in install.items())
        and isinstance(remove, list)
        and all(_set_member(n) for n in remove)
    ):
        raise TokenizerError(f"{file}: not a tokenizer save's manifest (install: name -> SHA-256, remove: names)")
    return m


def _discard(path: Path) -> None:
    """Remove a folder of this machinery: renamed to a fresh staging name first, so that a save
    committing a new JOURNAL_DIR meanwhile is never removed in its place."""
    trash = tempfile.mkdtemp(prefix=f"{_STAGE_PREFIX}{os.getpid()}-", dir=path.parent)
    try:
        os.rename(path, trash)
    except OSError:
        os.rmdir(trash)
        if not os.path.lexists(path):
            return
        raise
    shutil.rmtree(trash, ignore_errors=True)


def _apply(folder: Path, manifest: dict) -> None:
    """Put a committed set in place: the old set's files it lacks removed, its files moved to the top
    level, then JOURNAL_DIR removed. A killed save may have done any of the steps: each is skipped
    where done, so this may run again (the next save or load) and ends in the same folder."""
    journal = folder / JOURNAL_DIR
    for name in manifest["remove"]:
        with contextlib.suppress(FileNotFoundError):
            os.remove(folder / name)
    for name in manifest["install"]:
        if os.path.lexists(journal / name):
            (folder / name).parent.mkdir(exist_ok=True)
            os.replace(journal / name, folder / name)
    for sub in sorted({(folder / n).parent for n in (*manifest["remove"], *manifest["install"])} - {folder}):
        if sub.is_dir() and not any(sub.iterdir()):  # the named templates' folder of an old set
            with contextlib.suppress(OSError):
                os.rmdir(sub)
        elif sub.is_dir():
            _fsync_dir(sub)
    _fsync_dir(folder)
    with contextlib.suppress(FileNotFoundError):
        os.remove(journal / _MANIFEST)  # every file is in place: the top level is the set
    _discard(journal)


_WAIT_FOR_SAVE_S = 5.0  # a live save's files are moved in milliseconds


def finish_pending(folder: Path, saving: bool) -> None:
    """Finish a save of ``folder``'s tokenizer whose set was committed but not all put in place (a
    killed process, or a failed one in this process); a save (``saving``) also removes the staging
    folders of saves killed before their commit, and waits a moment for another live save to end (it
    then refuses: two saves at once would mix their files). A load leaves a live save's set alone,
    reading through it."""
    try:
        manifest = _manifest(folder)
    except TokenizerError:
        if not saving:
            raise
        manifest = None  # damaged: the save about to run replaces the whole set
        _discard(folder / JOURNAL_DIR)
    deadline = time.monotonic() + _WAIT_FOR_SAVE_S
    while manifest is not None:
        owner = manifest.get("owner")
        own = isinstance(owner, dict) and owner.get("pid") == os.getpid()
        if not _owner_alive(owner) or (own and saving):
            _apply(folder, manifest)
            break
        if not saving:
            return
        if time.monotonic() > deadline:
            raise TokenizerError(
                f"{folder}: another process (pid {owner.get('pid')}) is saving a tokenizer into this folder "
                f"({folder / JOURNAL_DIR}); two saves at once would mix their files: save again once it is done"
            )
        time.sleep(0.05)
        manifest = _manifest(folder)
    if (folder / JOURNAL_DIR).is_dir() and _manifest(folder) is None:
        with contextlib.suppress(OSError):  # a save killed while removing its emptied folder
            _discard(folder / JOURNAL_DIR)
    if saving:
        for stage in folder.glob(f"{_STAGE_PREFIX}*"):
            pid = stage.name[len(_STAGE_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and (int(pid) == os.getpid() or not _owner_alive({"pid": int(pid)})):
                shutil.rmtree(stage, ignore_errors=True)


def finish_pending_save(folder: str | os.PathLike) -> None:
    """Put in place the files of a tokenizer save into ``folder`` that was killed after its commit
    (its process gone), so that a reader of the top level (transformers, a copy of the files) finds
    one tokenizer; best effort: a folder it cannot write is left as it is (loading reads through)."""
    with contextlib.suppress(OSError, TokenizerError):
        finish_pending(Path(folder), saving=False)


class _ChangedWhileRead(Exception):
    """A pending save's file did not hold what its manifest says (``names``): the folder changed while
    it was read, or the file was changed since that save."""

    def __init__(self, names: list[str]) -> None:
        super().__init__(names)
        self.names = names


_LOADED_NAMES = (TOKENIZER_FILE, CONFIG_FILE, SPECIAL_TOKENS_MAP_FILE, TEMPLATE_FILE)


def _read_view(folder: Path) -> dict[str, bytes]:
    """The bytes of the tokenizer files the loader reads, as the folder's current save made them: a
    pending save's set (JOURNAL_DIR's files, or the top level's once moved; its removed files absent),
    else the top level's files."""
    manifest = _manifest(folder)
    install = manifest["install"] if manifest else {}
    remove = set(manifest["remove"]) if manifest else set()
    names = set(_LOADED_NAMES) | {n for n in install if n in _LOADED_NAMES or n.startswith(TEMPLATE_DIR + "/")}
    if (folder / TEMPLATE_DIR).is_dir():
        names |= {f"{TEMPLATE_DIR}/{f.name}" for f in (folder / TEMPLATE_DIR).glob("*.jinja")}
    out, changed = {}, []
    for name in sorted(names - remove):
        places = [folder / JOURNAL_DIR / name, folder / name] if name in install else [folder / name]
        for place in places:
            try:
                out[name] = place.read_bytes()
                break
            except (FileNotFoundError, NotADirectoryError, IsADirectoryError):
                continue
            except OSError as e:
                raise TokenizerError(f"{place}: cannot read the tokenizer file: {e.strerror or e}") from e
        if name in install and hashlib.sha256(out.get(name, b"")).hexdigest() != install[name]:
            changed.append(name)
    if changed:
        raise _ChangedWhileRead(changed)
    return out


def _folder_state(folder: Path) -> tuple:
    """What changes when a save renames a file into ``folder`` (its entries' and its named-template
    folder's modification times) or commits or finishes a set (the manifest)."""
    times = []
    for d in (folder, folder / TEMPLATE_DIR, folder / JOURNAL_DIR):
        try:
            times.append(os.stat(d).st_mtime_ns)
        except OSError:
            times.append(None)
    try:
        manifest = (folder / JOURNAL_DIR / _MANIFEST).read_bytes()
    except OSError:
        manifest = None
    return (*times, manifest)


_READ_TRIES = 5


def read_set(folder: Path) -> dict[str, bytes]:
    """:func:`_read_view` of one save: read again while the folder changes under the read (another
    process saving into it), so that no file of one save is read with another's; a pending save's file
    that still differs from its manifest after the tries is refused, naming the files."""
    for attempt in range(_READ_TRIES):
        before = _folder_state(folder)
        try:
            files = _read_view(folder)
        except _ChangedWhileRead as e:
            changed = e.names
        else:
            if _folder_state(folder) == before or attempt == _READ_TRIES - 1:
                return files  # a folder still changing after the tries: something else writes to it
            changed = []
        time.sleep(0.02 * (attempt + 1))
    raise TokenizerError(
        f"{folder}: {', '.join(changed)} differ from what the save that wrote them recorded "
        f"({folder / JOURNAL_DIR / _MANIFEST}): that save was cut off and the files changed since, so they would "
        "mix two tokenizers; save the tokenizer into this folder again"
    )


def write_set(folder: Path, texts: dict[str, str], prefix: str) -> None:
    """Replace ``folder``'s tokenizer files (named with ``prefix``) by ``texts`` (name -> text) as one:
    the folder holds the old set or the new one after a failure or a kill at any point (docs/checkpoints.md,
    "Saving a tokenizer"); no other file of the folder is opened, moved or removed."""
    remove = sorted(set(_set_names(folder, prefix)) - set(texts))
    stage = Path(tempfile.mkdtemp(prefix=f"{_STAGE_PREFIX}{os.getpid()}-", dir=folder))
    install = {n: hashlib.sha256(t.encode("utf-8")).hexdigest() for n, t in texts.items()}
    manifest = {"owner": {"pid": os.getpid(), "start": proc_stat_field(os.getpid(), 19)}, "install": install}
    manifest["remove"] = remove
    committed = False
    try:
        for name, text in texts.items():  # named as the file it is written for, not the staging copy
            with naming_write_errors(folder / name, "the tokenizer", instead_of=None):
                atomic_write_text(stage / name, text)
        write_json_atomic(stage / _MANIFEST, manifest)
        for sub in sorted({(stage / n).parent for n in texts} - {stage}):
            _fsync_dir(sub)
        _fsync_dir(stage)
        try:
            os.rename(stage, folder / JOURNAL_DIR)  # the commit: from here the folder's tokenizer is the new one
        except OSError as e:
            if os.path.isdir(folder / JOURNAL_DIR):
                raise TokenizerError(
                    f"{folder}: another save of a tokenizer into this folder committed its files meanwhile "
                    f"({folder / JOURNAL_DIR}); save again"
                ) from e
            raise
        committed = True
        _fsync_dir(folder)
        _apply(folder, manifest)
    except BaseException:
        if not committed:
            shutil.rmtree(stage, ignore_errors=True)
        else:  # the new set is whole: put it in place if the disk lets us (else loading reads it through)
            with contextlib.suppress(Exception):
                _apply(folder, manifest)
        raise
