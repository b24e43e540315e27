"""Checkpoint conversion (HF <-> Fleet layout, block-FP8 <-> unquantized) without building the model.

It streams: the whole checkpoint is checked first (every refusal a load makes before it reads a
weight), then the output is written one layer at a time -- the global tensors (embedding, final
norm, head), then each decoder layer and MTP layer: that layer's Fleet-named tensors are loaded from
the source (Paddle tensors in the work dtype, as :func:`load_pretrained_state` fills them), mapped to
the output layout, quantized if asked and written into their planned places in the output shards,
and dropped. The shard plan, headers and index are computed up front from the config, as
:func:`save_pretrained_state` does, so the bytes are the same as a whole-model load and save; only
the memory differs: about one layer in the work dtype (docs/checkpoints.md, "Converting").
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import time
import warnings
from collections.abc import Iterator, Sequence
from typing import Any

from .. import progress
from .aoa import MappingUnit, checkpoint_units, memo_units, quiet_paddle_logs
from .engine import StateDictSource
from .errors import CheckpointError
from .finite import check_finite_state
from .fp8 import quantization_of
from .layout import fleet_param_specs, resolve_dtype
from .loader import load_config_for, load_pretrained_state, logger
from .safetensors_io import SafetensorsWriter, folder_identity
from .saver import SaveReport, plan_save, write_checkpoint, write_mapped

__all__ = ["convert_checkpoint", "empty_state", "layer_batches"]


def empty_state(config: Any, dtype: str, keys: Sequence[str] | None = None) -> dict[str, Any]:
    """Uninitialised Paddle tensors for the Fleet parameters ``keys`` (default: every one; router and
    bias in float32)."""
    import paddle

    specs = fleet_param_specs(config)
    return {
        k: paddle.empty(list(specs[k][0]), dtype=resolve_dtype(specs[k][1], dtype))
        for k in (specs if keys is None else keys)
    }


def layer_batches(units: Sequence[MappingUnit]) -> list[list[MappingUnit]]:
    """The save direction's units by layer, in the engine's order: the global ones, then each layer."""
    by_layer: dict[int, list[MappingUnit]] = {}
    for u in units:
        by_layer.setdefault(-1 if u.layer is None else u.layer, []).append(u)
    return [by_layer[k] for k in sorted(by_layer)]


class _Once(logging.Filter):
    """Each message once: the layer-by-layer loads repeat the whole checkpoint's warnings."""

    def __init__(self) -> None:
        super().__init__()
        self.seen: set[str] = set()

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        if msg in self.seen:
            return False
        self.seen.add(msg)
        return True


@contextlib.contextmanager
def _warn_once(seen: set[tuple[type, str]]) -> Iterator[None]:
    """Re-issue the warnings raised within that were not raised before (``seen``), where raised."""
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        yield
    for w in caught:
        if (w.category, str(w.message)) not in seen:
            seen.add((w.category, str(w.message)))
            warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    layout: str = "fleet",
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    quantization: str | None = None,
    expert_layout: str = "per-expert",
) -> SaveReport:
    """Load ``src`` (either layout, strict; block-FP8 is dequantized) and write ``out`` in ``layout``,
    one layer at a time (the module docstring): byte for byte what ``save_pretrained_state`` of the
    whole loaded state writes.

    ``quantization="fp8"`` writes the official block-FP8 format: the weights pass through fp32 (the
    exact dequantized values, so an FP8 source comes back byte-identical), which doubles the memory
    of a bf16 pass. ``None``/``"none"`` writes ``dtype`` (default: the config dtype). Atomic like
    every save. ``expert_layout`` picks PaddleFleet's routed-expert tensors for ``layout="fleet"``.
    """
    t0 = time.perf_counter()
    src = os.fspath(src)
    if not os.path.exists(src):  # not the config.json of its parent folder that load_config_for would look for
        raise CheckpointError("checkpoint path does not exist", file=src)
    src_folder = os.path.abspath(src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)))
    if os.path.isdir(out) and os.path.samefile(out, src_folder):
        # the save replaces the folder's weight files, index and config: the checkpoint being read
        raise CheckpointError(
            f"the output folder {os.fspath(out)} is the source checkpoint's folder ({src_folder}): the conversion "
            "would replace the checkpoint it reads; write to another folder"
        )
    if os.path.isdir(out):  # a source file that is a link into the output folder goes with the folder it replaces
        inside = os.path.realpath(out) + os.sep
        for name in sorted(os.listdir(src_folder)):
            if os.path.realpath(os.path.join(src_folder, name)).startswith(inside):
                raise CheckpointError(
                    f"the source checkpoint's {name} is a link into the output folder {os.fspath(out)}: the "
                    "conversion replaces that folder and would delete the file the source reads; write to another folder",
                    file=os.path.join(src_folder, name),
                )
    # every layer batch below is a load of its own: each refuses a folder other than the one the config
    # came from (a save publishing over SRC mid-convert), not only a folder swapped during that batch
    identity = folder_identity(src)
    config = load_config_for(os.path.abspath(src))
    quantize = quantization not in (None, "none")
    work = "float32" if quantize else dtype or config.model_dtype
    fleet = fleet_param_specs(config)
    once, seen = _Once(), set()
    logger.addFilter(once)
    try:
        with memo_units():  # the unit lists are built once, not per layer
            with _warn_once(seen):  # every refusal of a whole load, before anything is written
                checked = load_pretrained_state(
                    dict.fromkeys(fleet), src, dtype=work, config=config, plan_only=True, folder_identity=identity
                )
            return _stream(
                src,
                config,
                work,
                out,
                layout,
                dtype,
                max_shard_size,
                quantization,
                expert_layout,
                seen,
                t0,
                identity,
                fp8=bool(checked.quantized),
            )
    finally:
        logger.removeFilter(once)


_FLOAT16_NOTE = " (in float16 a weight beyond 65504, float16's largest, becomes Inf)"


def _stream(
    src: str,
    config: Any,
    work: str,
    out: str | os.PathLike,
    layout: str,
    dtype: str | None,
    max_shard_size: int | str,
    quantization: str | None,
    expert_layout: str,
    seen: set[tuple[type, str]],
    t0: float,
    identity: tuple[int, int] | None = None,
    *,
    fp8: bool = False,
) -> SaveReport:
    """The save half of :func:`convert_checkpoint`: ``save_pretrained_state``'s checks, plan and
    atomic write, its source loaded a layer at a time (``fp8``: whether it holds block-FP8 weights,
    for the wording of a non-finite refusal)."""
    quiet_paddle_logs()
    # an FP8 source keeps its own blocks (re-blocked, its values were quantized a second time)
    folder = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    block = quantization_of(folder) if quantization not in (None, "none") else None
    plan = plan_save(
        config, out, layout, max_shard_size, dtype or config.model_dtype, quantization, expert_layout, block
    )
    targets = plan.targets
    batches = [
        (b, list(dict.fromkeys(k for u in b for k in u.fleet)))
        for b in layer_batches(checkpoint_units(config, layout, expert_layout))
    ]
    fleet = fleet_param_specs(config)

    def nbytes(shape: Sequence[int], dt: str) -> int:
        return math.prod(shape) * progress.itemsize(dt)

    load_total = sum(nbytes(fleet[k][0], resolve_dtype(fleet[k][1], work)) for _, keys in batches for k in keys)
    save_total = sum(nbytes(t.global_shape, t.dtype) for t in targets.values())

    def write(writers: dict[str, SafetensorsWriter]) -> None:
        with progress.shared(load=(load_total, sum(len(keys) for _, keys in batches)), save=(save_total, len(targets))):
            for units, keys in batches:
                state = empty_state(config, work, keys)
                with _warn_once(seen):
                    load_pretrained_state(state, src, dtype=work, config=config, keys=keys, folder_identity=identity)
                # as from_pretrained refuses it: nothing is published (float16: a finite weight can overflow)
                check_finite_state(state, src, _FLOAT16_NOTE if work == "float16" else "", fp8=fp8)
                write_mapped(units, StateDictSource(state), plan, writers)
                del state

    carry_from = src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src))
    return write_checkpoint(plan, config, {"format": "pt"}, carry_from, write, t0)
