"""``glm52 check-ckpt``: prove a candidate checkpoint holds the same tensors as a reference, whatever
its shards, key order or layout (canonical hashes, each difference classified). The steps, what is
refused and why (links, sparse files, NaN/Inf), the classes and the receipt: docs/parity.md.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import platform
import stat
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from .. import progress
from .._io import read_json
from ..checkpoint.errors import CheckpointError
from ..checkpoint.finite import count_nonfinite_raw
from ..checkpoint.fleet import FUSED_FFN_KEY, fused_ffn_shards
from ..checkpoint.fp8 import Fp8Source, decode_e4m3, fp8_pairs, quantization_of
from ..checkpoint.safetensors_io import (
    Checkpoint,
    bf16_bits_to_float32,
    paddle_to_st_dtype,
    st_to_paddle_dtype,
    to_paddle,
)

__all__ = ["check_checkpoints", "file_safety_problems", "same_inputs", "tensor_hash", "checkpoint_hash", "versions"]

EXIT_MATCH, EXIT_MISMATCH, EXIT_UNUSABLE = 0, 1, 2
_MAX_LISTED = 200  # differences listed in full; counts are always complete


def versions(modules: tuple[str, ...] = ("paddle", "numpy", "safetensors")) -> dict[str, str]:
    """Versions that a receipt should carry to be reproducible (a module not installed says so)."""
    from .. import __version__

    out = {"python": platform.python_version(), "paddleformers_glm": __version__}
    for mod in modules:
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a receipt records what is missing too
            out[mod] = "not installed"
    return out


def sha256_file(path: str, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for b in iter(lambda: f.read(chunk), b""):
            h.update(b)
    return h.hexdigest()


def tensor_hash(dtype: str, shape: tuple[int, ...], data: bytes | memoryview) -> str:
    """Canonical tensor hash: sha256 of ``dtype|shape|`` + little-endian bytes."""
    h = hashlib.sha256(f"{dtype}|{','.join(str(int(d)) for d in shape)}|".encode())
    h.update(data)
    return h.hexdigest()


def checkpoint_hash(hashes: Mapping[str, str]) -> str:
    """Whole-checkpoint hash over sorted ``key<TAB>tensor_hash`` lines: shard- and order-independent."""
    h = hashlib.sha256()
    for k in sorted(hashes):
        h.update(f"{k}\t{hashes[k]}\n".encode())
    return h.hexdigest()


def _is_sparse(path: str, st: os.stat_result) -> bool:
    if st.st_size == 0:
        return False
    seek_hole = getattr(os, "SEEK_HOLE", None)
    if seek_hole is not None:
        try:
            with open(path, "rb") as f:
                return os.lseek(f.fileno(), 0, seek_hole) < st.st_size
        except OSError:
            pass
    return st.st_blocks * 512 < st.st_size  # fallback where SEEK_HOLE is not supported


def file_safety_problems(paths: list[str]) -> list[dict[str, str]]:
    """Symlinks, hardlinks, sparse files and non-regular files among ``paths``, one entry each."""
    problems = []
    for p in paths:
        st = os.lstat(p)
        if stat.S_ISLNK(st.st_mode):
            found = [("symlink", f"points to {os.readlink(p)}")]
        elif not stat.S_ISREG(st.st_mode):
            found = [("not a regular file", stat.filemode(st.st_mode))]
        else:
            found = [("hardlink", f"{st.st_nlink} links to this inode")] if st.st_nlink > 1 else []
            if _is_sparse(p, st):
                found.append(("sparse file", f"{st.st_blocks * 512} bytes allocated for {st.st_size}"))
        problems += [{"file": p, "problem": what, "detail": detail} for what, detail in found]
    return problems


def _as_float(arr: np.ndarray, st_dtype: str) -> np.ndarray:
    """Values of a tensor read as stored (bf16 and FP8 as their bit patterns) in float64."""
    if st_dtype == "F8_E4M3":  # its bytes' values, not the bytes as numbers (+1.0 against -1.0: 2, not 128)
        return decode_e4m3(arr).astype(np.float64)
    return (bf16_bits_to_float32(arr) if st_dtype == "BF16" else arr).astype(np.float64)


_DIFF_CHUNK = 1 << 18  # elements compared at a time: float64 chunks of 2 MB, whatever the tensor's size


def nan_worst(a: float, b: float) -> float:
    """The larger of two max abs diffs, NaN winning (``max(0.0, nan)`` is 0.0: a NaN difference is no
    small one); ``glm52 align``'s dump comparison takes the same."""
    return a if math.isnan(a) else (b if math.isnan(b) or b > a else a)


def _diff_stats(a: np.ndarray, a_dtype: str, b: np.ndarray, b_dtype: str) -> tuple[float, int, int]:
    """The max abs diff, the number of differing elements and the number of elements whose bits
    differ while their values compare equal, of two same-shape tensors (bf16 as uint16 bits), computed
    in float64 a chunk of elements at a time: the same numbers as on the whole tensors at once, without
    a float64 copy of them (4x a bf16 tensor, each side).

    A pair of equal values (the same infinity on both sides included) and a NaN pair (NaN at the same
    place on both sides) count as equal, differing by 0; a NaN against a number or an infinity against
    anything else differs, non-finitely: the max abs diff is then NaN (a NaN on one side) or inf (an
    infinity against a number or the other infinity), never a number that hides it. 0 for empty tensors.

    The third number is why bytes that hash apart can show no value difference: -0.0 against +0.0, or
    two NaNs of other payloads, are equal values in other bits (counted for the same dtype only: across
    dtypes the bits are not comparable)."""
    a, b = a.reshape(-1), b.reshape(-1)
    same_bits = a_dtype == b_dtype and a.dtype.itemsize == b.dtype.itemsize
    worst, differing, bits_only = 0.0, 0, 0
    for lo in range(0, a.shape[0], _DIFF_CHUNK):
        ca, cb = a[lo : lo + _DIFF_CHUNK], b[lo : lo + _DIFF_CHUNK]
        x, y = _as_float(ca, a_dtype), _as_float(cb, b_dtype)
        nx, ny = np.isnan(x), np.isnan(y)
        differs = (x != y) & ~(nx & ny)  # NaN != NaN: a NaN pair is no difference
        if a_dtype[0] in "IU" and b_dtype[0] in "IU":  # integers past 2**53 are one float64: compared exact
            differs = ca != cb
        if same_bits:
            bits = np.ascontiguousarray(ca).view(f"u{ca.dtype.itemsize}") != np.ascontiguousarray(cb).view(
                f"u{cb.dtype.itemsize}"
            )
            bits_only += int(np.count_nonzero(bits & ~differs))
        n = int(np.count_nonzero(differs))
        if not n:
            continue
        differing += n
        if (nx ^ ny).any():  # a NaN against a number
            worst = math.nan
        elif not math.isnan(worst):
            with np.errstate(invalid="ignore", over="ignore"):
                worst = max(worst, float(np.max(np.abs(x[differs] - y[differs]))))  # inf against -inf: inf
    return worst, differing, bits_only


def same_inputs(names: tuple[str, str], path_a: str, path_b: str, what: str) -> str | None:
    """Why a checker's two inputs (``names``: how its line calls them) are one (the same file or
    folder, however each is named: a linked parent folder, a bind mount, a hardlink, ``X X``), else
    None. ``what`` compared with itself agrees whatever it holds, so its pass would be no evidence; the
    link checks look at the named files and folder only, not at the folders above them."""
    try:
        if not os.path.samefile(path_a, path_b):
            return None
    except OSError:  # a side that is not there: its own error says so
        return None
    ra, rb = os.path.realpath(path_a), os.path.realpath(path_b)
    real = f"real path {ra}" if ra == rb else f"real paths {ra} and {rb}, one inode"
    return (
        f"{names[0]} {os.path.abspath(path_a)} and {names[1]} {os.path.abspath(path_b)} are the same files "
        f"({real}): {what} compared with itself agrees whatever it holds"
    )


def _shared_files(ref: _Side, cand: _Side) -> str | None:
    """Why the two sides read the same weights (a weight file or index of one side is one of the other,
    by device and inode: a shard given as CAND that is in the REF folder), else None. A ``config.json``
    both sides read (two single ``.safetensors`` files in one folder) does not make their weights one."""
    seen = {}
    for f in ref.weight_files:
        with contextlib.suppress(OSError):
            st = os.stat(f)
            seen[(st.st_dev, st.st_ino)] = f
    shared = []
    for f in cand.weight_files:
        with contextlib.suppress(OSError):
            st = os.stat(f)
            if (st.st_dev, st.st_ino) in seen:
                shared.append((seen[(st.st_dev, st.st_ino)], f))
    if not shared:
        return None
    (r, c), more = shared[0], f" and {len(shared) - 1} more" if len(shared) > 1 else ""
    return (
        f"ref {ref.path} and cand {cand.path} are the same files: ref {r} is cand {c} "
        f"(real path {os.path.realpath(c)}){more}; a file compared with itself matches whatever it holds"
    )


@dataclass
class _Side:
    path: str
    ckpt: Checkpoint | None = None
    config: Any = None
    config_json: dict[str, Any] | None = None
    layout: str = "unknown"
    files: list[dict[str, Any]] = field(default_factory=list)
    weight_files: list[str] = field(default_factory=list)  # shards and index: ``files`` less config.json
    problems: list[dict[str, str]] = field(default_factory=list)
    hashes: dict[str, str] = field(default_factory=dict)
    error: str | None = None
    fp8: dict[str, str] = field(default_factory=dict)  # FP8 weight -> its scale tensor
    block: tuple[int, int] = (128, 128)
    nonfinite: dict[str, int] = field(default_factory=dict)  # tensor -> NaN/Inf elements


def _open_side(path: str) -> _Side:
    from ..checkpoint.loader import detect_layout

    side = _Side(os.path.abspath(path))
    try:
        if not os.path.exists(side.path):
            raise CheckpointError("path does not exist", file=side.path)
        # the folder itself first: a linked folder makes every file in it a link
        side.problems = file_safety_problems([side.path] if os.path.islink(side.path) else [])
        side.ckpt = Checkpoint(side.path, strict=True)
        folder = side.ckpt.folder
        cfg_file = os.path.join(folder, "config.json")
        side.weight_files = side.ckpt.all_files()
        members = side.weight_files + ([cfg_file] if os.path.lexists(cfg_file) else [])
        side.problems += file_safety_problems(members)
        bar = progress.start("check-ckpt files", sum(os.path.getsize(f) for f in members), len(members), "files")
        for f in members:
            side.files.append({"file": f, "bytes": os.path.getsize(f), "sha256": sha256_file(f)})
            bar.update(os.path.getsize(f))
        if os.path.isfile(cfg_file):
            from ..configuration import GlmMoeDsaConfig

            side.config_json = read_json(cfg_file, "the model config")
            side.config = GlmMoeDsaConfig.from_pretrained(cfg_file)
            block = quantization_of(folder)
            side.fp8 = fp8_pairs(side.ckpt, block)
            side.block = block or side.block
            with contextlib.suppress(CheckpointError):  # else "unknown"
                side.layout = detect_layout(set(side.ckpt.keys()) - set(side.fp8.values()), side.config)
        bar = progress.start(
            "check-ckpt hash", sum(i.nbytes for i in side.ckpt.tensors.values()), len(side.ckpt.tensors)
        )
        # in file order: the pages the kernel maps ahead of a read are the next tensor's, dropped with it
        for k, info in sorted(side.ckpt.tensors.items(), key=lambda kv: (kv[1].file, kv[1].begin)):
            raw = side.ckpt.raw(k)
            side.hashes[k] = tensor_hash(info.dtype, info.shape, raw)
            if bad := count_nonfinite_raw(raw, info.dtype):
                side.nonfinite[k] = bad
            del raw
            side.ckpt.file_of(k).release(k, around=True)
            bar.update(info.nbytes)
        for f in side.ckpt.files.values():
            f.release_all()
    except (CheckpointError, OSError, ValueError) as e:
        side.error = str(e)
    return side


def _fused_shards(side: _Side) -> int:
    """The tensor-parallel interleave of a PaddleFleet side's fused gate/up weights, as the loader reads
    it (``fused_ffn_tp_degree``; 1 = plain [gate | up], and for the other layouts)."""
    return fused_ffn_shards(side.ckpt) if side.ckpt is not None and side.layout == "fleet" else 1


def _canonical_cand(ref: _Side, cand: _Side, config: Any, diffs: list[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Candidate tensors in the reference's layout: key -> {hash, dtype, shape, native keys, tags}.

    Same layout: the candidate's own tensors. Different layouts: each mapping unit whose sources
    the candidate has is run through the AOA engine without casts; the result is then expressed in
    the reference's dtype when that is exact (a Paddle fp32 router equal to a bf16 one is not a
    value difference). One tensor is in memory at a time; only differing ones are kept, for their
    max abs diff.
    """
    from ..checkpoint.aoa import expand_units
    from ..checkpoint.engine import CheckpointSource, TargetSpec, run_units
    from ..checkpoint.fleet import detect_expert_layout
    from ..checkpoint.layout import param_specs, resolve_dtype
    from ..checkpoint.loader import units_for

    assert cand.ckpt is not None and ref.ckpt is not None

    def own(k: str) -> dict[str, Any]:  # a candidate tensor under its own name
        info = cand.ckpt.tensors[k]  # type: ignore[union-attr]
        return {"hash": cand.hashes[k], "dtype": info.dtype, "shape": info.shape, "native": [k], "tags": []}

    if cand.layout == ref.layout or "unknown" in (cand.layout, ref.layout):
        return {k: own(k) for k in cand.ckpt.tensors}
    out: dict[str, dict[str, Any]] = {}
    other = ref if cand.layout == "hf" else cand  # the non-official side picks the rules' target layout
    if "hf" in (cand.layout, ref.layout):
        target = "fleet" if other.layout == "fleet" else "model"
        hf_units = expand_units(config, layout=target, expert_layout=detect_expert_layout(other.ckpt.keys()))
        direction = "fleet_to_hf" if ref.layout == "hf" else "hf_to_fleet"
    else:  # PaddleFleet vs the old fleet spelling: the adapters between them (hf side = PaddleFleet)
        pf = ref if ref.layout == "fleet" else cand
        hf_units = units_for(config, "fleet", detect_expert_layout(pf.ckpt.keys()))
        direction = "fleet_to_hf" if ref.layout == "fleet" else "hf_to_fleet"
    cand_specs, ref_specs = (param_specs(config, s.layout, detect_expert_layout(s.ckpt.keys())) for s in (cand, ref))  # type: ignore[union-attr]
    consumed: set[str] = set()
    usable = []
    for u in hf_units:
        srcs = u.sources(direction)
        have = [k for k in srcs if k in cand.ckpt]
        consumed.update(have)
        if len(have) != len(srcs):  # the reference's tensors show up as missing; say why here
            lacking, what = [x for x in srcs if x not in cand.ckpt], "unmappable in candidate"
            diffs += [{"class": "structural", "what": what, "cand_key": k, "lacking": lacking} for k in have]
            continue
        bad_shape = [k for k in srcs if cand.ckpt.info(k).shape != tuple(cand_specs[k][0])]
        for k in bad_shape:
            expected, actual = list(cand_specs[k][0]), list(cand.ckpt.info(k).shape)
            diffs.append({"class": "value", "what": "shape", "cand_key": k, "expected": expected, "actual": actual})
        if not bad_shape:
            usable.append(u)
    targets = {}
    for u in usable:  # no lossy casts: each target in a dtype that holds its unit's sources exactly
        dtype = _lossless_dtype({st_to_paddle_dtype(cand.ckpt.info(k).dtype) for k in u.sources(direction)})
        for k in u.targets(direction):
            targets[k] = TargetSpec(k, tuple(ref_specs[k][0]), dtype)
    trace: dict[str, dict[str, Any]] = {}

    # CheckpointSource.done drops a source tensor's pages and those the kernel mapped beside it
    for key, t in run_units(usable, direction, CheckpointSource(cand.ckpt), targets, trace=trace):
        arr = t.numpy()
        dtype = paddle_to_st_dtype(t.dtype)
        ref_info = ref.ckpt.tensors.get(key)
        exact = arr
        # a dtype change the layouts make (PaddleFleet's fp32 router for a bf16 one) is no difference when
        # exact; one the candidate made beyond its layout (every weight widened to F32) still is
        as_spec = all(
            st_to_paddle_dtype(cand.ckpt.info(k).dtype) == resolve_dtype(cand_specs[k][1], config.model_dtype)
            for k in trace[key]["sources"]
            if k in cand_specs
        )
        if ref_info is not None and ref_info.dtype != dtype and as_spec:
            cast = t.astype(st_to_paddle_dtype(ref_info.dtype))
            if np.array_equal(cast.astype(t.dtype).numpy().view(np.uint8), arr.view(np.uint8)):
                arr, dtype = cast.numpy(), ref_info.dtype
        h = tensor_hash(dtype, tuple(arr.shape), np.ascontiguousarray(arr).reshape(-1).view(np.uint8).data)
        native = trace[key]["sources"]
        tags = _naming_kinds(key, native, trace[key]["transposed"])
        out[key] = {"hash": h, "dtype": dtype, "shape": tuple(arr.shape), "native": native, "tags": tags}
        if ref_info is not None and h != ref.hashes[key] and tuple(arr.shape) == ref_info.shape:
            # a value difference: its numbers now, against the reference tensor read now; neither is kept
            out[key]["stats"] = _diff_stats(ref.ckpt.numpy(key), ref_info.dtype, exact, paddle_to_st_dtype(t.dtype))
            ref.ckpt.file_of(key).release(key, around=True)
        del t, arr, exact
    for k in cand.ckpt.keys():  # outside the contract: under its own name, which no reference tensor may hide
        if k not in consumed:  # ... nor a mapped tensor of the same name (then only in candidate)
            out[k if k not in out else f"{k} (unmapped; the mapping gives this name to other tensors)"] = own(k)
    return out


_FLOAT_BITS = {"float16": 16, "bfloat16": 16, "float32": 32, "float64": 64}


def _lossless_dtype(dtypes: set[str]) -> str:
    """The dtype a mapping unit's targets are computed in: one that holds every value of each source
    dtype exactly. A unit may mix dtypes (the router: the bf16 gate weight and its fp32 correction
    bias); the narrower one would round the candidate's other tensors before they are compared (the
    comparison then rounds into the reference's dtype only where that is exact)."""
    if len(dtypes) == 1:
        return next(iter(dtypes))
    if dtypes <= set(_FLOAT_BITS):
        widest = max(dtypes, key=_FLOAT_BITS.__getitem__)
        return "float32" if _FLOAT_BITS[widest] == 16 else widest  # bf16 + fp16: neither holds the other
    raise CheckpointError(f"a mapping unit mixes the dtypes {sorted(dtypes)}: no exact common dtype to compare in")


def _naming_kinds(key: str, native: list[str], transposed: bool) -> list[str]:
    """Why a tensor is stored differently on the other side, from the names and the engine's trace."""
    names = " ".join([key, *native])
    found = {
        "embedding rename": "embed_tokens" in names and any(k != key for k in native),
        "indexer nesting": "core_attention.indexer" in names,
        "MTP wrapper prefix": ".transformer_layer." in names or "shared_head." in names,
        "fused up_gate_proj": "up_gate_proj" in names,
        "transpose": transposed,
    }
    kinds = [kind for kind, hit in found.items() if hit]
    return kinds or (["rename"] if native != [key] else [])


def check_checkpoints(
    ref_path: str, cand_path: str, layout: str | None = None, *, allow_nonfinite: bool = False
) -> dict[str, Any]:
    """Compare two checkpoints; returns the receipt (``exit_code`` 0 match, 1 mismatch, 2 unusable).

    ``layout`` declares the candidate's layout (``hf``/``fleet``). When it differs from the
    reference's, naming differences explained by the AOA mapping are expected and do not fail the
    check; without it the candidate must use the reference's names.
    """
    t0 = time.time()
    report: dict[str, Any] = {
        "tool": "glm52 check-ckpt",
        "created_unix": int(t0),
        "versions": versions(),
        "ref": {"path": os.path.abspath(ref_path), "real_path": os.path.realpath(ref_path)},
        "cand": {"path": os.path.abspath(cand_path), "real_path": os.path.realpath(cand_path)},
        "declared_cand_layout": layout,
        "differences": [],
        "errors": [],
        "warnings": [],
    }
    if same := same_inputs(("ref", "cand"), ref_path, cand_path, "a checkpoint"):  # before hashing it twice
        report["errors"].append(same)
        return _finish(report, EXIT_UNUSABLE, t0, {})
    sides = {"ref": _open_side(ref_path), "cand": _open_side(cand_path)}
    for name, s in sides.items():
        report[name].update(
            layout=s.layout,
            files=s.files,
            file_problems=s.problems,
            tensor_count=len(s.ckpt.tensors) if s.ckpt else None,
            tensor_bytes=sum(i.nbytes for i in s.ckpt.tensors.values()) if s.ckpt else None,
            native_hash=checkpoint_hash(s.hashes) if s.ckpt else None,
            nonfinite=dict(sorted(s.nonfinite.items())),
        )
        if s.error:
            report["errors"].append(f"{name}: {s.error}")
        for p in s.problems:
            report["errors"].append(f"{name}: refused {p['problem']}: {p['file']} ({p['detail']})")
        for key, count in sorted(s.nonfinite.items()):
            info, kind = s.ckpt.info(key), "FP8 scale" if key in s.fp8.values() else "tensor"  # type: ignore[union-attr]
            msg = f"{name}: {kind} {key} ({info.dtype}, file {info.file}) holds {count} NaN/Inf values"
            report["warnings" if allow_nonfinite else "errors"].append(msg)
    ref, cand = sides["ref"], sides["cand"]
    if shared := _shared_files(ref, cand):
        report["errors"].append(shared)
    quant_mixed = bool(ref.fp8) != bool(cand.fp8)
    fp8_bytes = {
        n: any(i.dtype == "F8_E4M3" for i in s.ckpt.tensors.values()) if s.ckpt else False for n, s in sides.items()
    }
    for name, other in (("ref", "cand"), ("cand", "ref")):
        if fp8_bytes[name] and not sides[name].fp8 and not fp8_bytes[other] and not report["errors"]:
            report["errors"].append(
                f"{name} holds F8_E4M3 weights but no config.json (its quantization_config pairs them with their "
                f"scales): it cannot be compared by value with the unquantized {other}; put the checkpoint's "
                "config.json beside its weights"
            )
    if not report["errors"] and layout is not None and cand.layout not in (layout, "unknown"):
        report["errors"].append(f"cand: declared layout {layout!r} but its keys are the {cand.layout!r} layout")
    if not report["errors"] and quant_mixed and ref.layout != cand.layout:
        no_cfg = [name for name, s in sides.items() if s.config_json is None]  # its FP8 pairs unread
        report["errors"].append(
            "an FP8 and an unquantized checkpoint are compared in the official layout only "
            f"(ref: {ref.layout}, cand: {cand.layout})"
            + (f"; {no_cfg[0]} has no config.json: its layout and quantization are unknown" if len(no_cfg) == 1 else "")
        )
    shards: dict[str, int] = {}
    for name, side in sides.items() if not report["errors"] else ():
        try:
            shards[name] = _fused_shards(side)
        except CheckpointError as e:
            report["errors"].append(f"{name}: {e}")
    if shards and ref.layout != cand.layout and max(shards.values()) > 1:  # its weights are read un-interleaved
        report["errors"].append(
            f"{FUSED_FFN_KEY} {shards} (fused gate/up interleaved by tensor-parallel shard): compared across "
            "layouts as plain [gate | up] only; convert the file (glm52 convert) and compare that"
        )
    if report["errors"]:
        return _finish(report, EXIT_UNUSABLE, t0, sides)
    config = ref.config or cand.config
    # the one expected config difference of a quantized copy: the FP8 side's quantization_config (the
    # unquantized side must not declare one: loaders would build FP8 layers for its weights)
    cfg_ref, cfg_cand = (
        {k: v for k, v in (s.config_json or {}).items() if not (quant_mixed and s.fp8 and k == "quantization_config")}
        for s in (ref, cand)
    )
    report["config_match"] = cfg_ref == cfg_cand
    if cfg_ref != cfg_cand:
        diff = sorted(k for k in set(cfg_ref) | set(cfg_cand) if cfg_ref.get(k) != cfg_cand.get(k))
        entry: dict[str, Any] = {"class": "config", "keys": diff}
        missing = [name for name, s in sides.items() if s.config_json is None]
        if len(missing) == 1:  # no config.json beside its weights: not a list of differing keys
            entry["missing_in"] = missing[0]
            entry["other_keys"] = len(sides["ref" if missing[0] == "cand" else "cand"].config_json or {})
        report["differences"].append(entry)
    pre: list[dict[str, Any]] = []
    if shards["ref"] != shards["cand"]:  # the same bytes load as other weights
        what = f"{FUSED_FFN_KEY} ref {shards['ref']}, cand {shards['cand']}"
        pre.append({"class": "structural", "what": what, "key": "__metadata__"})
    try:
        canon = _canonical_cand(ref, cand, config, pre)
    except CheckpointError as e:
        report["errors"].append(f"cand: cannot map to the {ref.layout} layout: {e}")
        return _finish(report, EXIT_UNUSABLE, t0, sides)
    assert ref.ckpt is not None
    counts = {"matched": 0, "naming": 0, "structural": 0, "value": 0, "quantization": 0}
    for d in pre:
        counts[d["class"]] += 1
    report["differences"].extend(pre)
    naming_units, quant = _compare_tensors(ref, cand, canon, quant_mixed, counts, report["differences"])
    report["differences"].extend(naming_units.values())
    if quant["tensors"]:
        quant["fp8_side"] = "ref" if ref.fp8 else "cand"
        report["differences"].insert(0, quant)
    report["value_summary"] = _value_summary(report["differences"])  # over every FP8 difference too
    if len(quant["differing"]) > _MAX_LISTED:
        quant["differing_truncated"] = len(quant["differing"]) - _MAX_LISTED
        quant["differing"] = quant["differing"][:_MAX_LISTED]
    report["cand"]["canonical_hash"] = checkpoint_hash({k: v["hash"] for k, v in canon.items()})
    report["ref"]["canonical_hash"] = report["ref"]["native_hash"]
    report["compare_layout"] = ref.layout
    report["hash_match"] = report["cand"]["canonical_hash"] == report["ref"]["canonical_hash"]
    report["counts"] = {
        "ref_tensors": len(ref.ckpt.tensors),
        "cand_tensors": len(cand.ckpt.tensors) if cand.ckpt else 0,
        "compared": len(set(ref.ckpt.keys()) | set(canon)),
        **counts,
        "naming_groups": len(naming_units),
    }
    naming_ok = layout is not None and layout != ref.layout
    ok = (
        counts["structural"] == 0
        and counts["value"] == 0
        and (report["hash_match"] or quant["tensors"] > 0)  # a quantized copy cannot hash alike
        and report["config_match"]
        and (counts["naming"] == 0 or naming_ok)
    )
    report["reasons"] = [] if ok else _reasons(report, counts, ref, cand, naming_ok)
    return _finish(report, EXIT_MATCH if ok else EXIT_MISMATCH, t0, sides)


def _fmt(x: float | None) -> str:
    return "nan" if x is None or math.isnan(x) else f"{x:.3g}"


def _reasons(report: dict[str, Any], counts: dict[str, int], ref: _Side, cand: _Side, naming_ok: bool) -> list[str]:
    """Why a comparison that ran is a mismatch: one line per failed condition of the verdict."""
    out = []
    if counts["structural"]:
        out.append(f"structural differences: {counts['structural']} (see the structural lines)")
    if counts["value"]:  # the tensors are named on the value lines (the key on this line too would come first)
        vs = report["value_summary"]
        why = [f"largest max_abs_diff {_fmt(vs['max_abs_diff'])}"] if vs["max_abs_diff_key"] is not None else []
        why += [f"{vs['bits_only']} in other bits only (equal values)"] if vs["bits_only"] else []
        out.append(f"value differences: {counts['value']}" + (f" ({'; '.join(why)})" if why else ""))
    for d in report["differences"]:
        if d["class"] == "config" and "missing_in" in d:
            other = "ref" if d["missing_in"] == "cand" else "cand"
            out.append(f"config.json missing in {d['missing_in']} ({other} has one)")
        elif d["class"] == "config":
            out.append(
                f"config.json differs: {len(d['keys'])} keys ({', '.join(d['keys'][:5])}{', ...' * (len(d['keys']) > 5)})"
            )
    if counts["naming"] and not naming_ok:
        why = f"the candidate looks like the {cand.layout} layout, the reference is {ref.layout}"
        if cand.layout in ("hf", "fleet"):
            why += f"; pass --layout {cand.layout} if the candidate is meant to be in that layout"
        else:
            why += "; without --layout the candidate must use the reference's names"
        out.append(f"naming differences: {counts['naming']} ({why})")
    if not out:  # every condition above held: the canonical hashes alone differ
        out.append("hash_match false: the canonical hashes differ")
    return out


def _compare_tensors(
    ref: _Side,
    cand: _Side,
    canon: dict[str, dict[str, Any]],
    quant_mixed: bool,
    counts: dict[str, int],
    differences: list[dict[str, Any]],
) -> tuple[dict[tuple[str, ...], dict[str, Any]], dict[str, Any]]:
    """Every tensor of either side, in the reference's layout: updates `counts`, appends structural
    and value differences to `differences`; returns the naming groups and the quantization entry."""
    assert ref.ckpt is not None
    naming_units: dict[tuple[str, ...], dict[str, Any]] = {}
    quant = {
        "class": "quantization",
        "tensors": 0,
        "equal_after_rounding": 0,
        "max_abs_diff": 0.0,  # as unrounded_max_abs_diff: the values before the rounding (kept for older readers)
        "unrounded_max_abs_diff": 0.0,
        "differing": [],
    }
    scales = (set(ref.fp8.values()) | set(cand.fp8.values())) if quant_mixed else set()
    plain_keys = set(canon) if ref.fp8 else set(ref.ckpt.keys())  # the unquantized side's (quant_mixed)
    for key in sorted(set(ref.ckpt.keys()) | set(canon)):
        if key in scales:  # the FP8 side's scales are part of the quantization entry ...
            if key in plain_keys:  # ... the unquantized side has none
                counts["structural"] += 1
                differences.append({"class": "structural", "key": key, "what": "FP8 scale on the unquantized side"})
            continue
        r, c = ref.ckpt.tensors.get(key), canon.get(key)
        if quant_mixed and r is not None and c is not None and (key in ref.fp8 or key in cand.fp8):
            counts["quantization"] += 1
            quant["tensors"] += 1
            equal, stats = _compare_dequantized(ref, cand, key)
            quant["unrounded_max_abs_diff"] = nan_worst(
                quant["unrounded_max_abs_diff"], stats["unrounded_max_abs_diff"]
            )
            quant["max_abs_diff"] = quant["unrounded_max_abs_diff"]
            if equal:
                quant["equal_after_rounding"] += 1
                counts["matched"] += 1
            else:
                counts["value"] += 1
                quant["differing"].append({"key": key, **stats})
            continue
        if r is None or c is None:
            counts["structural"] += 1
            if r is None:
                d = {"what": "only in candidate", "cand_keys": c["native"]}  # type: ignore[index]
            else:
                d = {"what": "missing in candidate", "file": os.path.basename(r.file)}
            differences.append({"class": "structural", "key": key, **d})
            continue
        if c["dtype"] != r.dtype or tuple(c["shape"]) != r.shape or c["hash"] != ref.hashes[key]:
            counts["value"] += 1
            differences.append(_value_difference(ref, cand, key, r, c))
            continue
        counts["matched"] += 1
        if c["tags"]:
            counts["naming"] += 1
            group = naming_units.setdefault(
                tuple(c["native"]), {"class": "naming", "ref_keys": [], "cand_keys": c["native"], "kinds": []}
            )
            group["ref_keys"].append(key)
            group["kinds"] = sorted(set(group["kinds"]) | set(c["tags"]))
    return naming_units, quant


def _value_difference(ref: _Side, cand: _Side, key: str, r: Any, c: dict[str, Any]) -> dict[str, Any]:
    """The entry of a tensor present on both sides that differs: its shape, or its dtype / bytes
    with the max abs diff, the number of differing elements and, where bytes differ in equal values
    (signed zeros, NaN payloads), how many: else such a mismatch would read ``max_abs_diff`` 0 and
    ``differing_elements`` 0, nothing a reader could act on."""
    d: dict[str, Any] = {"class": "value", "key": key, "cand_keys": c["native"]}
    if tuple(c["shape"]) != r.shape:
        d.update(what="shape", expected=list(r.shape), actual=list(c["shape"]))
        return d
    if "stats" in c:  # computed when the mapping produced it (_canonical_cand)
        mad, differing, bits_only = c["stats"]
    else:  # the candidate's own tensor: both read now, their pages dropped after
        mad, differing, bits_only = _diff_stats(
            ref.ckpt.numpy(key), r.dtype, cand.ckpt.numpy(c["native"][0]), c["dtype"]
        )  # type: ignore[union-attr]
        ref.ckpt.file_of(key).release(key, around=True)  # type: ignore[union-attr]
        cand.ckpt.file_of(c["native"][0]).release(c["native"][0], around=True)  # type: ignore[union-attr]
    d.update(
        what="dtype" if c["dtype"] != r.dtype else "bytes",
        expected=r.dtype,
        actual=c["dtype"],
        max_abs_diff=mad,
        differing_elements=differing,
        bits_only_elements=bits_only,
    )
    if bits_only and not differing and c["dtype"] == r.dtype:
        d["reason"] = _BITS_ONLY
    return d


_BITS_ONLY = "equal values in other bits only: the sign of a zero (-0.0 vs +0.0) or a NaN's payload"


def _value_summary(differences: list[dict[str, Any]]) -> dict[str, Any]:
    """The value differences by kind (``shape``, ``dtype``, ``bytes``) and the largest ``max_abs_diff``
    among them with its key (NaN wins: a NaN difference is no small one), over all of them: the receipt
    lists at most ``_MAX_LISTED`` differences, so a reader taking its numbers from the list would miss the
    rest. An FP8 weight that differs after dequantize + round (the ``quantization`` entry's ``differing``,
    summarised before that list is cut to ``_MAX_LISTED``) is one of them: a ``bytes`` difference
    (``shape`` where the shapes differ) whose ``max_abs_diff`` is measured on the rounded values, as the
    verdict is; ``quantization`` counts those. The kinds add up to ``counts.value``."""
    out: dict[str, Any] = {
        "shape": 0,
        "dtype": 0,
        "bytes": 0,
        "bits_only": 0,  # of the ``bytes`` ones: equal values in other bits (signed zeros, NaN payloads)
        "quantization": 0,  # of the ``bytes`` / ``shape`` ones: FP8 weights compared by dequantized value
        "max_abs_diff": None,
        "max_abs_diff_key": None,
    }
    entries = []
    for d in differences:
        if d["class"] == "quantization":
            out["quantization"] += len(d["differing"])
            entries += d["differing"]
        elif d["class"] == "value":
            entries.append(d)
    for d in entries:
        out[d["what"]] += 1
        out["bits_only"] += "reason" in d
        if d["what"] == "shape":  # no value to compare
            continue
        m, worst = d.get("max_abs_diff"), out["max_abs_diff"]
        if m is not None and (worst is None or nan_worst(worst, m) is not worst):  # NaN wins, the first of them
            out.update(max_abs_diff=m, max_abs_diff_key=d.get("key", d.get("cand_key")))
    return out


def _compare_dequantized(ref: _Side, cand: _Side, key: str) -> tuple[bool, dict[str, Any]]:
    """Whether the FP8 side's dequantized weight, rounded to the other side's dtype (as a load in that
    dtype rounds it), equals the other side's tensor (the verdict); and its numbers: ``max_abs_diff``,
    ``differing_elements`` and ``bits_only_elements`` of the rounded values (what the verdict compares),
    ``unrounded_max_abs_diff`` of the dequantized values before the rounding (nonzero also where the
    rounded ones are equal: the rounding the comparison absorbs)."""
    import paddle

    fp8, plain = (cand, ref) if key in cand.fp8 else (ref, cand)
    shape = fp8.ckpt.info(key).shape  # type: ignore[union-attr]
    db = plain.ckpt.info(key).dtype  # type: ignore[union-attr]
    if shape != plain.ckpt.info(key).shape:  # type: ignore[union-attr]
        shapes = {"ref": list(ref.ckpt.info(key).shape), "cand": list(cand.ckpt.info(key).shape)}  # type: ignore[union-attr]
        stats = {"what": "shape", "expected": shapes["ref"], "actual": shapes["cand"]}
        return False, {**stats, "max_abs_diff": math.inf, "unrounded_max_abs_diff": math.inf}
    src = Fp8Source(fp8.ckpt, pairs=fp8.fp8, block=fp8.block)  # type: ignore[arg-type]
    want = st_to_paddle_dtype(db)
    # whole rows of scale blocks at a time (about _DIFF_CHUNK values): the same bytes and numbers as
    # the whole tensor dequantized at once, without it (fp32) and its float64 copies in memory
    rows = max(1, _DIFF_CHUNK // max(1, shape[-1] if shape else 1) // fp8.block[0]) * fp8.block[0]
    equal, worst, unrounded, differing, bits_only = True, 0.0, 0.0, 0, 0
    for r0 in range(0, max(1, shape[0]), rows) if len(shape) == 2 else [None]:
        if r0 is not None:
            nr = min(rows, shape[0] - r0)
            a = src.read_numpy(key, (r0, 0), (nr, shape[1]))
            b = plain.ckpt.numpy(key, (slice(r0, r0 + nr),))  # type: ignore[union-attr]
        else:
            a, b = src.read_numpy(key, (0,) * len(shape), shape), plain.ckpt.numpy(key)  # type: ignore[union-attr]
        assert a is not None
        rounded = to_paddle(a, "float32").astype(want)
        rb = (rounded.view(paddle.int16) if want == "bfloat16" else rounded).numpy()
        equal &= rb.tobytes() == b.tobytes()
        if a.size:
            unrounded = nan_worst(unrounded, _diff_stats(a, "F32", b, db)[0])  # a NaN difference stays NaN
            mad, n, n_bits = _diff_stats(rb.view(b.dtype) if rb.dtype.itemsize == b.dtype.itemsize else rb, db, b, db)
            worst, differing, bits_only = nan_worst(worst, mad), differing + n, bits_only + n_bits
        del a, b, rounded, rb
    for side, k in ((fp8, key), (fp8, fp8.fp8[key]), (plain, key)):
        side.ckpt.file_of(k).release(k, around=True)  # type: ignore[union-attr]
    stats = {
        "what": "bytes",
        "rounded_to": db,
        "max_abs_diff": worst,
        "differing_elements": differing,
        "bits_only_elements": bits_only,
        "unrounded_max_abs_diff": unrounded,
    }
    if bits_only and not differing:
        stats["reason"] = _BITS_ONLY
    return equal, stats


def _finish(report: dict[str, Any], code: int, t0: float, sides: Mapping[str, _Side]) -> dict[str, Any]:
    for s in sides.values():
        if s.ckpt is not None:
            s.ckpt.close()
    report["exit_code"] = code
    report["result"] = {EXIT_MATCH: "match", EXIT_MISMATCH: "mismatch", EXIT_UNUSABLE: "unusable input"}[code]
    held = {name: len(s.nonfinite) for name, s in sides.items() if s.nonfinite}
    if code == EXIT_MATCH and held:  # --allow-nonfinite: NaN/Inf at the same places (the same bytes) on both sides
        where = ", ".join(f"{name} {n}" for name, n in held.items())
        report["result"] = f"match with non-finite values (NaN/Inf at the same places on both sides; tensors: {where})"
    if len(report["differences"]) > _MAX_LISTED:
        report["differences_truncated"] = len(report["differences"]) - _MAX_LISTED
        report["differences"] = report["differences"][:_MAX_LISTED]
    report["seconds"] = round(time.time() - t0, 3)
    return report


_SUMMARY_LINES = 20  # differences printed; the receipt lists up to _MAX_LISTED, counts are complete


def _value_line(d: Mapping[str, Any], what: str) -> str:
    extra = ""
    if "differing_elements" in d:
        extra = f" max_abs_diff={_fmt(d['max_abs_diff'])} differing_elements={d['differing_elements']}"
        if d.get("bits_only_elements"):
            extra += f" bits_only_elements={d['bits_only_elements']}"
        if "reason" in d:
            extra += f" ({d['reason']})"
    dtypes = f" expected={d.get('expected')} actual={d.get('actual')}" if "expected" in d else ""
    return f"  value ({what}): {d.get('key', d.get('cand_key'))}{dtypes}{extra}"


def summary_lines(report: Mapping[str, Any]) -> list[str]:
    """A short human summary of a receipt: the verdict, the counts, why a mismatch is one (``reasons``),
    then the first differences (an FP8 weight that differs after dequantize + round, by its key as a
    same-layout value difference) and how many more there are."""
    lines = [f"check-ckpt: {report['result']} (exit {report['exit_code']})"]
    lines += [f"  error: {e}" for e in report.get("errors", [])]
    lines += [f"  warning: {w}" for w in report.get("warnings", [])]
    if "counts" in report:
        c = report["counts"]
        lines.append(
            f"  tensors ref={c['ref_tensors']} cand={c['cand_tensors']}  matched={c['matched']} "
            f"naming={c['naming']} structural={c['structural']} value={c['value']}  hash_match={report['hash_match']}"
        )
        if c.get("quantization"):
            lines.append(f"  quantization: {c['quantization']} FP8 tensors compared by dequantized value")
    lines += [f"  reason: {r}" for r in report.get("reasons", [])]
    shown: list[str] = []
    more = report.get("differences_truncated", 0)
    for d in report.get("differences", []):
        if d["class"] == "naming":
            shown.append(f"  naming ({', '.join(d['kinds']) or 'rename'}): {d['cand_keys']} -> {d['ref_keys']}")
        elif d["class"] == "value":
            shown.append(_value_line(d, d["what"]))
        elif d["class"] == "structural":
            shown.append(f"  structural ({d['what']}): {d.get('key', d.get('cand_key'))}")
        elif d["class"] == "quantization":
            shown.append(
                f"  quantization (FP8 on the {d['fp8_side']} side): {d['equal_after_rounding']}/{d['tensors']} "
                f"equal after dequantize + round (before the rounding: max_abs_diff={_fmt(d['max_abs_diff'])})"
            )
            for q in d["differing"]:
                kind = "shape" if q["what"] == "shape" else f"FP8 dequantized, rounded to {q.get('rounded_to')}"
                shown.append(_value_line(q, kind))
            more += d.get("differing_truncated", 0)
        elif d["class"] == "config" and "missing_in" in d:
            other = "ref" if d["missing_in"] == "cand" else "cand"
            shown.append(f"  config: {d['missing_in']} has no config.json ({other}'s has {d['other_keys']} keys)")
        else:
            shown.append(f"  {d['class']}: {d.get('keys')}")
    lines += shown[:_SUMMARY_LINES]
    if (more := more + len(shown[_SUMMARY_LINES:])) > 0:
        lines.append(f"  ... {more} more")
    return lines
