"""The toy stand-in model behind the trainer (``glm52 train --model toy``, train/toy.py): its config and
its :class:`~.adapter.ModelAdapter`.  No Paddle here: ``glm52 train`` checks a toy run's layout with the
adapter before it starts any process; the model itself is imported when a stage is built."""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from .._io import atomic_path, write_json_atomic
from ..parallel.pipeline import StageSpec
from ..parallel.topology import Topology
from .adapter import LossSpec, ModelAdapter

if TYPE_CHECKING:
    import paddle.nn as nn

__all__ = ["ToyAdapter", "ToyConfig"]


@dataclass
class ToyConfig:
    vocab_size: int = 64
    hidden_size: int = 32
    num_heads: int = 4
    ffn_size: int = 64
    layer_kinds: list[str] = field(default_factory=lambda: ["full", "full", "shared", "shared", "full", "shared"])
    mlp_kinds: list[str] = field(default_factory=lambda: ["dense", "dense", "moe", "moe", "moe", "moe"])
    index_topk: int = 4
    index_dim: int = 16
    num_experts: int = 4
    experts_per_token: int = 2
    expert_ffn: int = 16
    mtp: bool = True
    mtp_weight: float = 0.3
    rms_eps: float = 1e-6

    @property
    def num_layers(self) -> int:
        return len(self.layer_kinds)

    def __post_init__(self) -> None:
        if len(self.mlp_kinds) != len(self.layer_kinds):
            raise ValueError(f"ToyConfig: {len(self.mlp_kinds)} mlp_kinds for {len(self.layer_kinds)} layers")
        if self.layer_kinds and self.layer_kinds[0] != "full":
            raise ValueError("ToyConfig: layer 0 must be a full indexer layer")


def toy_config(given: Mapping[str, Any] | None) -> ToyConfig:
    """A :class:`ToyConfig` from ``--model-config``'s JSON: an object of its keys, each value of its
    default's type (a list: of strings), so a typo or a wrong type is one line naming the key, not a
    TypeError from the dataclass or, later, from a worker building the model."""
    if given is None:
        return ToyConfig()
    if not isinstance(given, Mapping):
        raise ValueError(f"--model-config must be a JSON object of the toy model's keys, got {type(given).__name__}")
    defaults = asdict(ToyConfig())
    for k, v in given.items():
        if k not in defaults:
            raise ValueError(f"--model-config: unknown key {k!r}; the toy model's keys: {', '.join(defaults)}")
        want = type(defaults[k])
        if want is list:
            ok = isinstance(v, list) and all(isinstance(x, str) for x in v)
        elif want is float:
            ok = isinstance(v, (int, float)) and not isinstance(v, bool)
        else:  # int (not a bool) or bool
            ok = type(v) is want
        if not ok:
            name = {list: "a list of strings", float: "a number", int: "an integer", bool: "true or false"}[want]
            raise ValueError(f"--model-config: {k} must be {name}, got {v!r} ({type(v).__name__})")
    return ToyConfig(**given)


class ToyAdapter(ModelAdapter):
    """The toy model behind the trainer's ``--model toy``; config keys as in :class:`ToyConfig`."""

    name = "toy"

    def __init__(self, config: ToyConfig | Mapping[str, Any] | None = None, seed: int = 0) -> None:
        self.cfg = config if isinstance(config, ToyConfig) else toy_config(config)
        self.seed = seed
        self.num_layers, self.has_mtp, self.vocab_size = self.cfg.num_layers, self.cfg.mtp, self.cfg.vocab_size

    def parallel_sizes(self) -> dict[str, int | None]:
        return {
            "num_attention_heads": self.cfg.num_heads,
            "vocab_size": self.cfg.vocab_size,
            "num_experts": self.cfg.num_experts,
            "moe_intermediate_size": self.cfg.expert_ffn,
            "num_layers": self.cfg.num_layers,
        }

    def layer_kinds(self) -> list[str]:
        return list(self.cfg.layer_kinds)

    def loss_specs(self) -> dict[str, LossSpec]:
        specs = {"lm": LossSpec("tokens", shift=1, weight=1.0, report="losses")}
        if self.cfg.mtp:
            specs["mtp_1"] = LossSpec("tokens", shift=2, weight=self.cfg.mtp_weight, report="mtp_losses")
        return specs

    def build_stage(self, spec: StageSpec, topo: Topology) -> nn.Layer:
        from .toy import ToyStage

        return ToyStage(self.cfg, spec, topo)

    def full_state(self) -> dict[str, np.ndarray]:
        from .toy import init_full_state

        return init_full_state(self.cfg, self.seed)

    def checkpoint_info(self) -> dict[str, Any]:
        return {"path": None, "config": asdict(self.cfg), "init_seed": self.seed}

    def export(self, full_state: Mapping[str, np.ndarray], out_dir: str) -> None:
        from safetensors.numpy import save_file

        # through a temporary file: safetensors < 0.8 truncates the target first (a failed write would
        # tear the last export), 0.8 leaves its own temporary file's mode 0600
        with atomic_path(os.path.join(out_dir, "model.safetensors")) as tmp:
            save_file({k: np.ascontiguousarray(v) for k, v in sorted(full_state.items())}, tmp)
        write_json_atomic(os.path.join(out_dir, "config.json"), {"model_type": "toy", **asdict(self.cfg)})
