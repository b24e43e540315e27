"""Test and benchmark helpers: a stand-in model holding exactly the contract's parameters, and a
synthetic official-layout checkpoint written with the ``safetensors`` library (not our writer, so
tests that read it back check our reader against an independent implementation).
"""

from __future__ import annotations

import json
import math
import os
from collections import OrderedDict
from typing import Any

import numpy as np
import paddle

from ..checkpoint.layout import fleet_param_specs, param_specs, resolve_dtype
from ..checkpoint.safetensors_io import paddle_to_st_dtype, st_to_paddle_dtype, to_paddle

__all__ = ["SpecModel", "random_array", "write_synthetic_checkpoint"]


class SpecModel(paddle.nn.Layer):
    """A ``paddle.nn.Layer`` whose ``state_dict()`` is exactly ``fleet_param_specs(config)`` (zeros).

    Stands in for ``GlmMoeDsaForCausalLM`` in checkpoint tests: same names, shapes and dtypes
    (``"model"`` kinds in ``dtype``, router weight and correction bias in float32).
    """

    def __init__(self, config: Any, dtype: str = "float32") -> None:
        super().__init__()
        self.config = config
        self._names: dict[str, str] = {}
        init = paddle.nn.initializer.Constant(0.0)
        for k, (shape, kind) in fleet_param_specs(config).items():
            self._names[k] = attr = k.replace(".", "__")
            p = self.create_parameter(list(shape), dtype=resolve_dtype(kind, dtype), default_initializer=init)
            self.add_parameter(attr, p)

    def state_dict(self, *args: Any, **kwargs: Any) -> OrderedDict:  # type: ignore[override]
        return OrderedDict((k, getattr(self, a)) for k, a in self._names.items())


def random_array(rng: np.random.Generator, shape: tuple[int, ...], st_dtype: str) -> np.ndarray:
    """Random weights as the raw array safetensors stores (bf16 as uint16 bits, rounded to nearest)."""
    x = (rng.standard_normal(shape, dtype=np.float32) * 0.02).astype(np.float32)
    if st_dtype == "BF16":
        u = x.view(np.uint32)
        return ((u + 0x7FFF + ((u >> 16) & 1)) >> 16).astype(np.uint16)
    if st_dtype == "F32":
        return x
    if st_dtype == "F16":
        return x.astype(np.float16)
    raise ValueError(f"unsupported dtype {st_dtype}")


def write_synthetic_checkpoint(
    config: Any, out_dir: str, *, layout: str = "hf", n_shards: int = 2, dtype: str = "bfloat16", seed: int = 0
) -> dict[str, str]:
    """Random weights for every tensor of ``layout`` in ``n_shards`` files + index + config.json.

    Written shard by shard with ``safetensors.paddle.save_file`` (bf16 kept bit-exact), so at most
    one shard is in memory. Returns ``{key: file name}``.
    """
    from safetensors.paddle import save_file

    specs = param_specs(config, layout)
    keys = sorted(specs)
    sizes = {k: math.prod(specs[k][0]) * (4 if resolve_dtype(specs[k][1], dtype) == "float32" else 2) for k in keys}
    total = sum(sizes.values())
    per = total / n_shards
    groups: list[list[str]] = [[] for _ in range(n_shards)]
    acc = 0
    for k in keys:
        groups[min(int(acc // per), n_shards - 1)].append(k)
        acc += sizes[k]
    groups = [g for g in groups if g]
    os.makedirs(out_dir, exist_ok=True)
    rng = np.random.default_rng(seed)
    n = len(groups)
    names = [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)] if n > 1 else ["model.safetensors"]
    weight_map: dict[str, str] = {}
    for name, group in zip(names, groups):
        tensors = {}
        for k in group:
            st = paddle_to_st_dtype(resolve_dtype(specs[k][1], dtype))
            tensors[k] = to_paddle(random_array(rng, specs[k][0], st), st_to_paddle_dtype(st))
            weight_map[k] = name
        save_file(tensors, os.path.join(out_dir, name), metadata={"format": "pt"})
    if n > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
    config.save_pretrained(out_dir)
    return weight_map
