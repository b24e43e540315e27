"""Checkpoint conversion (HF <-> Fleet layout, block-FP8 <-> unquantized) without building the model.

The weights pass through a plain dict of Paddle tensors shaped by :func:`fleet_param_specs`, so
memory is one copy of the model in ``dtype`` (the config dtype by default, which keeps a bf16
checkpoint bit-exact).
"""

from __future__ import annotations

import os
from typing import Any

from .layout import fleet_param_specs, resolve_dtype
from .loader import load_config_for, load_pretrained_state
from .saver import SaveReport, save_pretrained_state

__all__ = ["convert_checkpoint", "empty_state"]


def empty_state(config: Any, dtype: str) -> dict[str, Any]:
    """Uninitialised Paddle tensors for every Fleet parameter (router and bias in float32)."""
    import paddle

    return {
        k: paddle.empty(list(shape), dtype=resolve_dtype(kind, dtype))
        for k, (shape, kind) in fleet_param_specs(config).items()
    }


def convert_checkpoint(
    src: str | os.PathLike,
    out: str | os.PathLike,
    layout: str = "fleet",
    dtype: str | None = None,
    max_shard_size: int | str = "5GB",
    quantization: str | None = None,
    expert_layout: str = "per-expert",
) -> SaveReport:
    """Load ``src`` (either layout, strict; block-FP8 is dequantized) and write ``out`` in ``layout``.

    ``quantization="fp8"`` writes the official block-FP8 format: the weights pass through fp32 (the
    exact dequantized values, so an FP8 source comes back byte-identical), which doubles the memory
    of a bf16 pass. ``None``/``"none"`` writes ``dtype`` (default: the config dtype). Atomic like
    every save. ``expert_layout`` picks PaddleFleet's routed-expert tensors for ``layout="fleet"``.
    """
    src = os.fspath(src)
    config = load_config_for(os.path.abspath(src))
    quantize = quantization not in (None, "none")
    work = "float32" if quantize else dtype or config.model_dtype
    state = empty_state(config, work)
    load_pretrained_state(state, src, dtype=work, config=config)
    return save_pretrained_state(
        state,
        config,
        out,
        layout=layout,
        max_shard_size=max_shard_size,
        dtype=dtype or config.model_dtype,
        quantization=quantization,
        expert_layout=expert_layout,
        carry_from=src if os.path.isdir(src) else os.path.dirname(os.path.abspath(src)),
    )
