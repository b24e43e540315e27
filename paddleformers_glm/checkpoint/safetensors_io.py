"""Strict, lazy safetensors reading and deterministic streaming writing, without torch (docs/checkpoints.md).

Why not just ``safetensors.safe_open``: it accepts files we must refuse (trailing bytes after the
last tensor, duplicate JSON keys) and its errors name neither the file nor the key. Tensors are read
from one read-only ``mmap`` per file (a slice reads only its pages); bf16 is raw uint16 bits
(``paddle.to_tensor`` of a uint16 array *is* a bfloat16 tensor, bit for bit). A writer's header is
computed up front from (dtype, shape), so each tensor is written as soon as it is produced.
"""

from __future__ import annotations

import contextlib
import json
import math
import mmap
import os
import re
import stat
import struct
import weakref
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .._io import is_int, naming_write_errors, read_json
from .errors import CheckpointError

__all__ = [
    "ST_DTYPES",
    "INDEX_NAME",
    "SINGLE_NAME",
    "TensorInfo",
    "SafetensorsFile",
    "Checkpoint",
    "folder_identity",
    "FolderReplacedError",
    "SafetensorsWriter",
    "plan_header",
    "check_metadata",
    "le_bytes",
    "st_to_paddle_dtype",
    "paddle_to_st_dtype",
    "bf16_bits_to_float32",
    "to_paddle",
    "shard_file_name",
]

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # the safetensors package's limit (decimal: 100,000,001 bytes it refuses)

# safetensors dtype name -> (itemsize, numpy dtype holding the raw bytes, paddle dtype name or None)
ST_DTYPES: dict[str, tuple[int, Any, str | None]] = {
    "F64": (8, np.float64, "float64"),
    "F32": (4, np.float32, "float32"),
    "F16": (2, np.float16, "float16"),
    "BF16": (2, np.uint16, "bfloat16"),
    "F8_E4M3": (1, np.uint8, "float8_e4m3fn"),
    "F8_E5M2": (1, np.uint8, "float8_e5m2"),
    "F8_E8M0": (1, np.uint8, None),
    "I64": (8, np.int64, "int64"),
    "I32": (4, np.int32, "int32"),
    "I16": (2, np.int16, "int16"),
    "I8": (1, np.int8, "int8"),
    "U64": (8, np.uint64, None),
    "U32": (4, np.uint32, None),
    "U16": (2, np.uint16, None),
    "U8": (1, np.uint8, "uint8"),
    "BOOL": (1, np.bool_, "bool"),
    "C64": (8, np.complex64, "complex64"),
}
_PADDLE_TO_ST = {p: s for s, (_, _, p) in ST_DTYPES.items() if p is not None}
_SHARD_RE = re.compile(r"^(?P<stem>.+)-(?P<k>\d{5})-of-(?P<n>\d{5})\.safetensors$")


def dtype_name(dtype: Any) -> str:
    """``paddle.float32`` / ``"float32"`` / numpy dtype -> ``"float32"``."""
    return str(dtype).replace("paddle.", "")


def st_to_paddle_dtype(st_dtype: str) -> str:
    """Paddle dtype name of a safetensors dtype (e.g. ``BF16 -> bfloat16``)."""
    p = ST_DTYPES[st_dtype][2]
    if p is None:
        raise CheckpointError(
            "dtype has no Paddle equivalent", expected=sorted(_PADDLE_TO_ST.values()), actual=st_dtype
        )
    return p


def paddle_to_st_dtype(dtype: Any) -> str:
    """safetensors dtype name of a Paddle dtype or dtype name (``paddle.bfloat16`` / ``"bfloat16"``)."""
    name = dtype_name(dtype)
    if name not in _PADDLE_TO_ST:
        raise CheckpointError("unsupported dtype for safetensors", expected=sorted(_PADDLE_TO_ST), actual=name)
    return _PADDLE_TO_ST[name]


def bf16_bits_to_float32(bits: np.ndarray) -> np.ndarray:
    """Exact bf16 -> fp32 conversion from the raw uint16 bits (bf16 is the top half of fp32)."""
    return (bits.astype(np.uint32) << 16).view(np.float32)


def to_paddle(arr: np.ndarray, dtype: str) -> Any:
    """A CPU Paddle tensor (a copy) of ``arr`` holding its bits as ``dtype`` (uint16 -> bfloat16)."""
    import paddle

    t = paddle.to_tensor(np.ascontiguousarray(arr), place=paddle.CPUPlace())
    return t if dtype_name(t.dtype) == dtype else t.view(dtype)


def shard_file_name(k: int, n: int, stem: str = "model") -> str:
    return f"{stem}-{k:05d}-of-{n:05d}.safetensors"


@dataclass(frozen=True)
class TensorInfo:
    """Where one tensor lives: file, dtype, shape and absolute byte range in the file."""

    key: str
    file: str
    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int

    @property
    def nbytes(self) -> int:
        return self.end - self.begin


def _read_json(file: str, what: str, data: bytes | None = None) -> dict[str, Any]:
    """`file`'s JSON object (`data`: its header's bytes) without duplicate keys; a problem is a CheckpointError."""

    def hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for k, v in pairs:
            if k in out:
                raise CheckpointError(f"duplicate key in {what}", file=file, key=k)
            out[k] = v
        return out

    return read_json(file, what, data=data, hook=hook, error=lambda m: CheckpointError(m, file=file))


def parse_header(
    file: str, warnings: list[str] | None = None, f: Any = None
) -> tuple[dict[str, TensorInfo], dict[str, str], int]:
    """Read and validate a safetensors header, every entry and the data area's tiling; returns
    (tensors, __metadata__, data start offset). ``f``: the file, already open (binary), to read it from."""
    raw, size = _read_header_bytes(file, f)
    if not raw.startswith(b"{"):
        raise CheckpointError("corrupt header: does not start with '{'", file=file, actual=raw[:16])
    header = _read_json(file, "the safetensors header", raw)
    meta = header.pop("__metadata__", None)
    meta = {} if meta is None else meta  # null: none; [], "", 0, false are no map (safetensors refuses)
    if not isinstance(meta, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in meta.items()):
        raise CheckpointError("corrupt header: __metadata__ must map strings to strings", file=file, key="__metadata__")
    data_start = 8 + len(raw)
    data_size = size - data_start
    infos = {key: _tensor_entry(file, key, entry, data_start, data_size) for key, entry in header.items()}
    _check_data_coverage(file, infos, data_start, data_size, warnings)
    return infos, dict(meta), data_start


def _read_header_bytes(file: str, opened: Any = None) -> tuple[bytes, int]:
    """(the header's bytes, the file size), after checking the 8-byte length prefix against the file
    (``opened``: the file, open, read from its start; else it is opened here by name)."""
    try:
        with contextlib.nullcontext(opened) if opened is not None else open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            f.seek(0)
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(
                    "truncated safetensors file: shorter than the 8-byte header length",
                    file=file,
                    expected=">= 8 bytes",
                    actual=size,
                )
            (n,) = struct.unpack("<Q", prefix)
            if n > MAX_HEADER_BYTES:
                text = prefix.startswith(b"{")  # e.g. the index or config.json given as the checkpoint
                raise CheckpointError(
                    "not a safetensors file: it starts with JSON text, not a header length (a checkpoint is "
                    "its folder or a .safetensors file)"
                    if text
                    else "corrupt header: header length is implausibly large",
                    file=file,
                    expected=f"<= {MAX_HEADER_BYTES}",
                    actual=n,
                )
            if 8 + n > size:
                raise CheckpointError(
                    "truncated safetensors file: header length exceeds the file size",
                    file=file,
                    expected=f"header of {n} bytes",
                    actual=f"{size - 8} bytes after the prefix",
                )
            raw = f.read(n)
    except OSError as e:
        raise CheckpointError(f"cannot read safetensors file: {e}", file=file) from e
    return raw, size


def _tensor_entry(file: str, key: str, entry: Any, data_start: int, data_size: int) -> TensorInfo:
    """One tensor's header entry, validated: its fields, dtype, shape, offsets, byte length and range."""
    if not isinstance(entry, dict) or set(entry) != {"dtype", "shape", "data_offsets"}:
        raise CheckpointError(
            "corrupt header: entry must have exactly dtype, shape, data_offsets",
            file=file,
            key=key,
            actual=sorted(entry) if isinstance(entry, dict) else type(entry).__name__,
        )
    dtype, shape, offs = entry["dtype"], entry["shape"], entry["data_offsets"]
    if not isinstance(dtype, str) or dtype not in ST_DTYPES:
        raise CheckpointError("unknown dtype name", file=file, key=key, expected=sorted(ST_DTYPES), actual=dtype)
    if not isinstance(shape, list) or not all(is_int(d) and d >= 0 for d in shape):
        raise CheckpointError(
            "corrupt header: shape must be a list of non-negative integers", file=file, key=key, actual=shape
        )
    if not (isinstance(offs, list) and len(offs) == 2 and all(is_int(o) for o in offs) and 0 <= offs[0] <= offs[1]):
        raise CheckpointError(
            "corrupt header: data_offsets must be [begin, end] with 0 <= begin <= end", file=file, key=key, actual=offs
        )
    if math.prod(max(d, 1) for d in shape) * ST_DTYPES[dtype][0] >= 2**63:
        # a zero-size tensor with a huge other axis: no array can have that shape (numpy, torch refuse)
        raise CheckpointError("corrupt header: shape too large for any array", file=file, key=key, actual=shape)
    want = math.prod(shape) * ST_DTYPES[dtype][0]
    if offs[1] - offs[0] != want:
        raise CheckpointError(
            f"byte length does not match shape {shape} x {dtype}",
            file=file,
            key=key,
            expected=want,
            actual=offs[1] - offs[0],
        )
    if offs[1] > data_size:
        raise CheckpointError(
            "truncated safetensors file: tensor bytes lie beyond the end of the file",
            file=file,
            key=key,
            expected=f"data end {offs[1]}",
            actual=f"{data_size} data bytes",
        )
    return TensorInfo(key, file, dtype, tuple(shape), data_start + offs[0], data_start + offs[1])


def _check_data_coverage(
    file: str, infos: dict[str, TensorInfo], data_start: int, data_size: int, warnings: list[str] | None
) -> None:
    """The tensors tile the data area: no overlap, no gap; trailing bytes refused (or, with a
    `warnings` list, reported there)."""
    pos, prev = 0, None
    for info in sorted(infos.values(), key=lambda i: (i.begin, i.end)):
        b = info.begin - data_start
        if b < pos:
            raise CheckpointError(
                f"byte range overlaps tensor {prev!r}", file=file, key=info.key, expected=f"begin >= {pos}", actual=b
            )
        if b > pos:
            raise CheckpointError(
                "gap in the data area: bytes not covered by any tensor",
                file=file,
                key=info.key,
                expected=f"begin {pos}",
                actual=b,
            )
        pos, prev = info.end - data_start, info.key
    if pos != data_size:
        err = CheckpointError(
            f"trailing garbage: {data_size - pos} bytes after the last tensor",
            file=file,
            expected=f"{pos} data bytes",
            actual=f"{data_size} data bytes",
        )
        if warnings is None:
            raise err
        warnings.append(str(err))


class _Closing:
    def __enter__(self) -> Any:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# What a fault in a file map may map beside the faulting page: Linux's fault-around window (64 KB by
# default) and, since 6.18 on file systems with large page-cache folios (ext4, xfs), the whole folio the
# page lies in, up to a PMD (2 MB with 4 KB pages: a page table's PAGESIZE / 8 entries). Both are
# naturally aligned blocks of the file (the map starts at offset 0), so whole PMD-size blocks cover them:
# measured on 6.18 / ext4, 64 KB blocks left 37% of the HF-written tiny checkpoint mapped after a load
# (tests/test_load_pages.py).
_FAULT_AROUND = max(1 << 16, mmap.PAGESIZE * (mmap.PAGESIZE // 8))


class SafetensorsFile(_Closing):
    """One validated safetensors file, read lazily through a read-only mmap.

    The tensors are read from the file that was validated: it stays open from validation on, so a
    file renamed over it, or its folder replaced (a save publishing a new checkpoint there while this
    one is read), changes nothing read here. A change to that same file before it is mapped (its size
    or modification time) is refused by name; after :meth:`close` it is opened again by name only if it
    is still that file. A file truncated in place *after* it is mapped cannot be caught (reading the
    lost pages faults; docs/checkpoints.md, "Loading"). ``opened``: the file, already open (binary)
    by the caller (a :class:`Checkpoint` opens its shards relative to its folder's descriptor), taken
    over as if opened here."""

    def __init__(self, file: str | os.PathLike, warnings: list[str] | None = None, opened: Any = None) -> None:
        self.file = os.fspath(file)
        self._mm: mmap.mmap | None = None
        self._fd: Any = self._open() if opened is None else opened
        try:
            self._stat = self._identity(self._fd)
            self.tensors, self.metadata, self.data_start = parse_header(self.file, warnings, self._fd)
        except BaseException:
            self._fd.close()
            raise

    def _open(self) -> Any:
        try:
            return open(self.file, "rb")
        except OSError as e:
            raise CheckpointError(f"cannot read safetensors file: {e}", file=self.file) from e

    @staticmethod
    def _identity(f: Any) -> tuple[int, int, int, int]:
        """(size, mtime ns, device, inode): what must not change between validation and reading."""
        st = os.fstat(f.fileno())
        return st.st_size, st.st_mtime_ns, st.st_dev, st.st_ino

    def _map(self) -> mmap.mmap:
        """The read-only map of the validated file (opened again by name after :meth:`close`)."""
        if self._mm is None:
            if self._fd is None:
                self._fd = self._open()
            now = self._identity(self._fd)
            if now != self._stat:
                self._fd.close()
                self._fd = None
                raise CheckpointError(
                    "safetensors file changed since it was validated (size, mtime ns, device, inode); load it again",
                    file=self.file,
                    expected=self._stat,
                    actual=now,
                )
            # a valid file is never empty: its header is at least 8 bytes
            self._mm = mmap.mmap(self._fd.fileno(), 0, access=mmap.ACCESS_READ)
            self._fd.close()  # the map holds its own descriptor: one per file, not two
            self._fd = None
        return self._mm

    def keys(self) -> list[str]:
        return list(self.tensors)

    def raw(self, key: str) -> memoryview:
        """The tensor's bytes as a zero-copy view (for hashing)."""
        info = self.tensors[key]
        return memoryview(self._map())[info.begin : info.end]

    def numpy(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        """A numpy view of the tensor (bf16 as uint16 bits); only the pages touched are read."""
        info = self.tensors[key]
        arr = np.frombuffer(self.raw(key), dtype=ST_DTYPES[info.dtype][1]).reshape(info.shape)
        return arr[index] if index is not None else arr

    def release(self, key: str, around: bool = False) -> None:
        """Drop this tensor's pages from the process (they stay in the page cache): touched file pages
        count in its RSS while the map lives, a second copy of the model (docs/checkpoints.md, "Loading").
        ``around``: also the pages the kernel's fault-around mapped beside it (the 2 MB-aligned blocks
        its ends lie in: ``_FAULT_AROUND``), which add up over many small tensors (a neighbour in use is
        mapped again from the page cache)."""
        info = self.tensors[key]
        if self._mm is None or info.nbytes == 0 or not hasattr(self._mm, "madvise"):
            return
        unit = _FAULT_AROUND if around else mmap.PAGESIZE
        start = (info.begin // unit) * unit
        end = min(-(-info.end // unit) * unit if around else info.end, len(self._mm))
        with contextlib.suppress(OSError, ValueError):  # advisory only
            self._mm.madvise(mmap.MADV_DONTNEED, start, end - start)

    def release_all(self) -> None:
        """Drop every page of the file from the process: :meth:`release` leaves the pages the kernel's
        fault-around mapped beside a tensor (up to 2 MB each side), which add up over many tensors."""
        if self._mm is not None and hasattr(self._mm, "madvise"):
            with contextlib.suppress(OSError, ValueError):  # advisory only
                self._mm.madvise(mmap.MADV_DONTNEED)

    def close(self) -> None:
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a caller still holds a view: it closes when that is dropped
                self._mm.close()
            self._mm = None
        if self._fd is not None:
            self._fd.close()
            self._fd = None


class FolderReplacedError(CheckpointError):
    """A checkpoint folder replaced or removed while it was being loaded (a save published over it):
    what was read of it is not used; loading it again reads the folder now there."""


def folder_identity(path: str | os.PathLike) -> tuple[int, int] | None:
    """(device, inode) of the folder of the checkpoint at ``path`` (the folder itself, or a file's
    folder), None when there is none: taken before a load reads the folder's config.json, so that
    :class:`Checkpoint` can tell that its weights come from the folder that config was read from."""
    path = os.path.abspath(os.fspath(path))
    try:
        st = os.stat(path if os.path.isdir(path) else os.path.dirname(path))
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Checkpoint(_Closing):
    """A safetensors checkpoint: one file, a folder with ``model.safetensors``, or an indexed shard set,
    consistent once constructed: every header and the index are validated (docs/checkpoints.md,
    "Loading"). ``strict=False`` turns what changes no tensor's value (a wrong ``total_size``, files the
    index does not name, trailing bytes after a file's last tensor) into ``warnings``.

    The folder is opened once, as a directory descriptor, and the index, every shard and the files
    read beside them (:meth:`read_json`) are opened relative to it: a save that publishes over the
    folder while it is read (the folder exchanged or renamed away) changes nothing read: a shard
    opened by its path after the exchange would be the new checkpoint's, a silent mix of two. Where
    the folder opened is removed before a file is read from it, the load fails, saying so
    (:class:`FolderReplacedError`), never naming a shard missing that the checkpoint had. ``folder_identity``: the folder's (device, inode) when the
    caller read its config.json (:func:`folder_identity`); a folder replaced since is refused likewise.
    The descriptor is closed by :meth:`close` (or when the checkpoint is collected).
    """

    def __init__(
        self, path: str | os.PathLike, strict: bool = True, *, folder_identity: tuple[int, int] | None = None
    ) -> None:
        self.path = os.path.abspath(os.fspath(path))
        self.strict = strict
        self.warnings: list[str] = []
        self.index_file: str | None = None
        self.index: dict[str, Any] | None = None
        self.files: dict[str, SafetensorsFile] = {}
        self._dir_fd: int | None = None
        if os.path.isfile(self.path):
            self.folder = os.path.dirname(self.path)
        elif os.path.isdir(self.path):
            self.folder = self.path
        else:
            raise CheckpointError("checkpoint path does not exist", file=self.path)
        self._open_folder()
        try:
            try:
                if folder_identity is not None and self._identity() != folder_identity:
                    raise self._replaced("its config.json was read from the folder that was there before")
                files = [self.path] if self.folder != self.path else self._files_from_folder()
                self._validate(files)
            except CheckpointError as e:
                if self._folder_replaced():
                    raise self._replaced_reading(e) from e
                raise
        except BaseException:
            self.close()  # every file opened so far, and the folder
            raise

    # ------------------------------------------------------------------ the folder's descriptor
    def _open_folder(self) -> None:
        """Open the folder's descriptor. A folder that may be searched but not listed (mode ``--x``)
        holds a single file that can still be read: it is opened for lookups only (``O_PATH``)."""
        flags = os.O_DIRECTORY | getattr(os, "O_CLOEXEC", 0)
        self._listable = True
        try:
            fd = os.open(self.folder, os.O_RDONLY | flags)
        except PermissionError as e:
            if not hasattr(os, "O_PATH"):
                raise CheckpointError(f"cannot open the checkpoint folder: {e.strerror or e}", file=self.folder) from e
            try:
                fd = os.open(self.folder, os.O_PATH | flags)
            except OSError:
                raise CheckpointError(f"cannot open the checkpoint folder: {e.strerror or e}", file=self.folder) from e
            self._listable = False
        except OSError as e:
            raise CheckpointError(f"cannot open the checkpoint folder: {e.strerror or e}", file=self.folder) from e
        self._dir_fd = fd
        self._dir_closer = weakref.finalize(self, os.close, fd)  # a checkpoint never closed leaks no descriptor

    def _identity(self) -> tuple[int, int]:
        assert self._dir_fd is not None
        st = os.fstat(self._dir_fd)
        return st.st_dev, st.st_ino

    def _folder_replaced(self) -> bool:
        """Whether the folder's path no longer names the directory opened (exchanged, renamed away or
        removed): what explains a file of it that went missing, rather than a checkpoint lacking it."""
        if self._dir_fd is None:
            return False
        try:  # a removed folder has no path (or another folder has it); link counts of folders vary by filesystem
            now = os.stat(self.folder)
        except OSError:
            return True
        return (now.st_dev, now.st_ino) != self._identity()

    def _replaced(self, what: str, file: str | None = None) -> FolderReplacedError:
        """The one error of a load whose folder was replaced or removed under it: it names the folder
        and ``what`` went wrong, never a file the checkpoint lacks."""
        return FolderReplacedError(
            f"the checkpoint folder {self.folder} was replaced or removed while it was being loaded (a save "
            f"published over it?): {what}; nothing of it was used, load it again",
            file=file or self.folder,
        )

    def _replaced_reading(self, cause: CheckpointError) -> FolderReplacedError:
        """:meth:`_replaced` for ``cause``, the error reading the folder gave: a file of it gone, or
        not read as it was (a missing file is what a removed folder's files are)."""
        if cause.file and cause.file != self.folder:
            name = os.path.basename(cause.file)
            return self._replaced(f"{name} could not be read from it", os.path.join(self.folder, name))
        return self._replaced(f"reading it failed: {cause}")

    def _opener(self, name: str, flags: int) -> int:
        if self._dir_fd is None:  # closed: a name relative to no folder would be the working directory's
            raise CheckpointError("the checkpoint is closed", file=os.path.join(self.folder, name))
        return os.open(name, flags, dir_fd=self._dir_fd)

    def _open(self, file: str) -> Any:
        """``file`` (a path in the folder) opened (binary) relative to the folder's descriptor."""
        try:
            return open(os.path.basename(file), "rb", opener=self._opener)
        except OSError as e:
            e.filename = file
            raise CheckpointError(f"cannot read safetensors file: {e}", file=file) from e

    def _stat(self, name: str) -> os.stat_result | None:
        """The folder's entry ``name`` (a link followed), None when there is none."""
        if self._dir_fd is None:
            raise CheckpointError("the checkpoint is closed", file=os.path.join(self.folder, name))
        try:
            return os.stat(name, dir_fd=self._dir_fd)
        except OSError:
            return None

    def read_json(self, name: str, what: str) -> dict[str, Any] | None:
        """The JSON object of the folder's file ``name`` (e.g. ``config.json``), read from the folder
        the weights are read from; None when it holds none. A file that cannot be parsed is a
        CheckpointError (a ValueError), as is one that went missing with the folder replaced."""
        file = os.path.join(self.folder, name)
        if self._stat(name) is None:
            if self._folder_replaced():
                raise self._replaced(f"{name} could not be read from it", file)
            return None
        try:
            with open(name, "rb", opener=self._opener) as f:
                data = f.read()
        except OSError as e:
            if self._folder_replaced():
                raise self._replaced(f"{name} could not be read from it", file) from e
            raise CheckpointError(f"{file}: cannot read {what}: {e.strerror or e}", file=file) from e
        return _read_json(file, what, data)

    def _validate(self, files: list[str]) -> None:
        for f in files:
            self.files[f] = SafetensorsFile(f, None if self.strict else self.warnings, self._open(f))
        self.tensors: dict[str, TensorInfo] = {}
        for f, sf in self.files.items():
            for k, info in sf.tensors.items():
                if k in self.tensors:
                    raise CheckpointError(
                        "key appears in two shards",
                        key=k,
                        file=f,
                        expected=f"only in {os.path.basename(self.tensors[k].file)}",
                        actual="also here",
                    )
                self.tensors[k] = info
        if self.index is not None:
            self._check_index()

    # ------------------------------------------------------------------ folder / index
    def _problem(self, err: CheckpointError) -> None:
        if self.strict:
            raise err
        self.warnings.append(str(err))

    def _stray(self, names: set[str], message: str) -> None:
        for name in sorted(names):
            self._problem(CheckpointError(message, file=os.path.join(self.folder, name)))

    def _files_from_folder(self) -> list[str]:
        listed = os.listdir(self._dir_fd if self._listable else self.folder)  # unlistable: its error, as before
        st_files = sorted(f for f in listed if f.endswith(".safetensors"))
        idx = os.path.join(self.folder, INDEX_NAME)
        if self._stat(INDEX_NAME) is not None:
            self.index_file = idx
            index = self.read_json(INDEX_NAME, "the index")
            if index is None:  # gone since it was seen
                raise CheckpointError("cannot read the index: it is gone", file=idx)
            wm = index.get("weight_map")
            if not isinstance(wm, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in wm.items()):
                raise CheckpointError("index has no weight_map of key -> file name", file=idx, key="weight_map")
            meta = index.get("metadata", {})
            if meta is not None and not isinstance(meta, dict):
                raise CheckpointError(
                    "index metadata must be an object", file=idx, key="metadata", actual=type(meta).__name__
                )
            self.index = index
            named = sorted(set(wm.values()))
            for name in named:
                if os.path.basename(name) != name:
                    raise CheckpointError("index names a file outside the folder", file=idx, key=name)
                st = self._stat(name)
                if st is None or not stat.S_ISREG(st.st_mode):
                    keys = sorted(k for k, v in wm.items() if v == name)
                    raise CheckpointError(
                        f"index names a file that is not there ({len(keys)} keys, e.g. {keys[:3]})",
                        file=os.path.join(self.folder, name),
                        key=keys[0],
                        expected="file present",
                        actual="missing",
                    )
            self._check_series(named, idx)
            if SINGLE_NAME in st_files and SINGLE_NAME not in named:  # not a stray: another checkpoint
                raise CheckpointError(
                    f"the folder holds {SINGLE_NAME} and {INDEX_NAME} naming other files: transformers loads "
                    f"{SINGLE_NAME}, this loader would read the index's shards; remove the one that is not the model",
                    file=os.path.join(self.folder, SINGLE_NAME),
                    expected=f"{SINGLE_NAME} or {INDEX_NAME}",
                    actual="both",
                )
            self._stray(set(st_files) - set(named), "safetensors file in the folder is not named by the index")
            return [os.path.join(self.folder, n) for n in named]
        if SINGLE_NAME in st_files:
            self._stray(set(st_files) - {SINGLE_NAME}, f"extra safetensors file beside {SINGLE_NAME} and no index")
            return [os.path.join(self.folder, SINGLE_NAME)]
        if st_files:
            self._check_series(st_files, self.folder)
            if len(st_files) == 1:
                return [os.path.join(self.folder, st_files[0])]
            raise CheckpointError(
                f"{len(st_files)} safetensors files and no {INDEX_NAME}",
                file=self.folder,
                expected=INDEX_NAME,
                actual=st_files[:4],
            )
        raise CheckpointError(
            "no safetensors files in the folder", file=self.folder, expected=f"{SINGLE_NAME} or {INDEX_NAME}"
        )

    def _check_series(self, names: Sequence[str], where: str) -> None:
        """A ``stem-0000k-of-0000n`` series must be complete: every k in 1..n named once."""
        series: dict[tuple[str, int], set[int]] = {}
        for name in names:
            m = _SHARD_RE.match(name)
            if m:
                series.setdefault((m["stem"], int(m["n"])), set()).add(int(m["k"]))
        for (stem, n), ks in series.items():
            missing = sorted(set(range(1, n + 1)) - ks)
            if missing:
                some = [shard_file_name(k, n, stem) for k in missing[:4]]
                first = os.path.join(self.folder, some[0])
                there = self._stat(some[0]) is not None  # in the folder, but the index (or listing) does not name it
                raise CheckpointError(
                    f"shard(s) {some} are in the folder but not named by {os.path.basename(where)}"
                    if there
                    else f"missing shard(s) {some}",
                    file=first,
                    expected=f"{n} shards named" if there else f"{n} shards",
                    actual=f"{len(ks)} {'named' if there else 'shards'}",
                )
            if any(k > n or k < 1 for k in ks):
                raise CheckpointError(
                    f"shard number out of range in {stem}-*-of-{n:05d}", file=where, actual=sorted(ks)
                )

    def _check_index(self) -> None:
        assert self.index is not None and self.index_file is not None
        wm: dict[str, str] = self.index["weight_map"]
        for k, name in wm.items():
            info = self.tensors.get(k)
            if info is None:
                raise CheckpointError(
                    "index names a key that its shard does not hold",
                    key=k,
                    file=os.path.join(self.folder, name),
                    expected="key present",
                    actual="absent",
                )
            if os.path.basename(info.file) != name:
                raise CheckpointError(
                    "index puts the key in another shard",
                    key=k,
                    file=self.index_file,
                    expected=os.path.basename(info.file),
                    actual=name,
                )
        for k, info in self.tensors.items():
            if k not in wm:
                raise CheckpointError("shard holds a key the index does not name", key=k, file=info.file)
        total = (self.index.get("metadata") or {}).get("total_size")
        nbytes = sum(i.nbytes for i in self.tensors.values())
        if total is not None and total != nbytes:
            self._problem(
                CheckpointError(
                    "index metadata.total_size is not the sum of tensor bytes",
                    file=self.index_file,
                    key="total_size",
                    expected=nbytes,
                    actual=total,
                )
            )

    # ------------------------------------------------------------------ access
    def keys(self) -> list[str]:
        return list(self.tensors)

    def __contains__(self, key: str) -> bool:
        return key in self.tensors

    def info(self, key: str) -> TensorInfo:
        try:
            return self.tensors[key]
        except KeyError:
            raise CheckpointError("key not in checkpoint", key=key, file=self.path) from None

    def file_of(self, key: str) -> SafetensorsFile:
        return self.files[self.info(key).file]

    def numpy(self, key: str, index: tuple[slice, ...] | None = None) -> np.ndarray:
        return self.file_of(key).numpy(key, index)

    def raw(self, key: str) -> memoryview:
        return self.file_of(key).raw(key)

    def paddle(self, key: str, index: tuple[slice, ...] | None = None) -> Any:
        """A Paddle tensor (a copy) of the tensor or of a slice of it; bf16 stays bf16 bit for bit."""
        t = to_paddle(self.numpy(key, index), st_to_paddle_dtype(self.info(key).dtype))
        self.file_of(key).release(key)
        return t

    def all_files(self) -> list[str]:
        """Every file that makes up the checkpoint (shards, then the index)."""
        out = sorted(self.files)
        if self.index_file:
            out.append(self.index_file)
        return out

    def close(self) -> None:
        for f in self.files.values():
            f.close()
        if self._dir_fd is not None:
            self._dir_closer()
            self._dir_fd = None


# ---------------------------------------------------------------------- writing
_Entry = tuple[str, str, Sequence[int]]  # (key, safetensors dtype, shape)


def check_metadata(metadata: Mapping[str, str]) -> dict[str, str]:
    """``metadata`` as a safetensors ``__metadata__`` (strings to strings, as the format and the
    ``safetensors`` package require, and as :func:`parse_header` reads it back), else a CheckpointError."""
    bad = {k: v for k, v in dict(metadata).items() if not (isinstance(k, str) and isinstance(v, str))}
    if bad:
        raise CheckpointError(
            "safetensors metadata must map strings to strings (a file with other values cannot be read back)",
            key="__metadata__",
            expected="str -> str",
            actual=bad,
        )
    return dict(metadata)


def plan_header(
    entries: Iterable[_Entry], metadata: Mapping[str, str] | None = None
) -> tuple[bytes, dict[str, tuple[int, int]]]:
    """Header bytes (padded to 8) and relative data offsets for tensors in the given order."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = check_metadata(metadata)
    offsets: dict[str, tuple[int, int]] = {}
    pos = 0
    for key, dtype, shape in entries:  # dtype names from paddle_to_st_dtype
        end = pos + math.prod(shape) * ST_DTYPES[dtype][0]
        header[key] = {"dtype": dtype, "shape": [int(d) for d in shape], "data_offsets": [pos, end]}
        offsets[key] = (pos, end)
        pos = end
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=True).encode("utf-8")
    text += b" " * (-(len(text)) % 8)
    return struct.pack("<Q", len(text)) + text, offsets


def le_bytes(array: np.ndarray) -> np.ndarray:
    """The array's bytes as safetensors stores them (little-endian), a flat uint8 array."""
    arr = np.ascontiguousarray(array)
    if arr.dtype.byteorder == ">":
        arr = arr.astype(arr.dtype.newbyteorder("<"))
    return arr.reshape(-1).view(np.uint8)


class SafetensorsWriter:
    """One safetensors file whose header is fixed up front; each planned tensor is written once, in any order
    (``create=False``: into the file another process created with the same plan, as an export's ranks do)."""

    def __init__(
        self, file: str, entries: Sequence[_Entry], metadata: Mapping[str, str] | None = None, create: bool = True
    ) -> None:
        self.file = file
        self.entries = {k: (d, tuple(int(x) for x in s)) for k, d, s in entries}
        head, self.offsets = plan_header(entries, metadata)
        self.data_start = len(head)
        self.written: set[str] = set()
        self._f = open(file, "wb" if create else "r+b")
        if create:  # at its full size at once: every process can write its tensors into place
            with naming_write_errors(self.file):
                self._f.write(head)
                self._f.truncate(self.data_start + max((e for _, e in self.offsets.values()), default=0))

    def write(self, key: str, array: np.ndarray, st_dtype: str) -> None:
        if key not in self.entries:
            raise CheckpointError("tensor not planned for this shard", key=key, file=self.file)
        want_dtype, want_shape = self.entries[key]
        if st_dtype != want_dtype or tuple(array.shape) != want_shape:
            raise CheckpointError(
                "tensor does not match the planned dtype/shape",
                key=key,
                file=self.file,
                expected=(want_dtype, want_shape),
                actual=(st_dtype, tuple(array.shape)),
            )
        if key in self.written:
            raise CheckpointError("tensor written twice", key=key, file=self.file)
        b, e = self.offsets[key]
        data = le_bytes(array)
        if data.nbytes != e - b:
            raise CheckpointError(
                "tensor byte size does not match the plan", key=key, file=self.file, expected=e - b, actual=data.nbytes
            )
        with naming_write_errors(self.file):
            self._f.seek(self.data_start + b)
            self._f.write(data.data)
        self.written.add(key)

    def close(self, complete: bool = True) -> None:
        """Flush to disk; refuses a planned tensor never written unless this process wrote only its share."""
        missing = sorted(set(self.entries) - self.written)
        if missing and complete:
            self._f.close()
            raise CheckpointError(
                f"{len(missing)} planned tensors were never written, e.g. {missing[:3]}", file=self.file, key=missing[0]
            )
        try:
            with naming_write_errors(self.file):
                self._f.flush()
                os.fsync(self._f.fileno())
        except BaseException:
            with contextlib.suppress(OSError):  # its buffer is flushed again and fails again: the error above stands
                self._f.close()
            raise
        with naming_write_errors(self.file):
            self._f.close()

    def abort(self) -> None:
        if not self._f.closed:
            self._f.close()
