"""The contract between the trainer and a model (GLM-5.2; a small stand-in for tests).

A model plugs in with a :class:`ModelAdapter`: it reports its sizes (for layout validation),
builds the module of one pipeline stage, names its loss terms and how each is normalised, and
loads its initial weights (from a checkpoint, slice by slice: ``load_stage``; or as a full state
the trainer slices: ``full_state``, fine for small stand-ins).  Everything parallel
(topology, stage split, schedules, gradient sync, optimizer, checkpoints) is the trainer's.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np

from ..configuration import IGNORE_INDEX
from ..parallel.pipeline import StageSpec
from ..parallel.topology import Topology

if TYPE_CHECKING:  # the contract and the adapters' checks load without Paddle (glm52 train checks before it launches)
    import paddle.nn as nn

__all__ = ["LossSpec", "ModelAdapter", "get_adapter_factory", "make_adapter", "register_adapter", "token_count"]


@dataclass(frozen=True)
class LossSpec:
    """How the trainer normalises and reports one loss term a stage returns (docs/parallel.md, "Loss
    normalisation"): ``normalize`` "tokens" divides it by the tokens of the *global* batch whose label
    ``labels[:, shift:]`` is not -100, "micro_batches" (a term that is already a per-micro-batch mean:
    indexer KL, aux losses) by the global number of micro-batches; ``weight``: its coefficient in the
    optimised objective; ``report``: its key in loss.json, where terms of one key are averaged (e.g.
    one term per MTP depth)."""

    normalize: str = "tokens"
    shift: int = 1
    weight: float = 1.0
    report: str = "losses"

    def __post_init__(self) -> None:
        if self.normalize not in ("tokens", "micro_batches"):
            raise ValueError(f"LossSpec.normalize must be 'tokens' or 'micro_batches', got {self.normalize!r}")


def token_count(labels: np.ndarray, shift: int, ignore_index: int = IGNORE_INDEX) -> int:
    """Tokens a causal-LM loss with this label shift averages over (``labels[:, shift:] != ignore``)."""
    return int((np.asarray(labels)[:, shift:] != ignore_index).sum())


class ModelAdapter:
    """Subclass and register (``register_adapter("name", factory)``); see docs/parallel.md.  The
    constructor must be cheap (read a config, no weights): the CLI builds one in the parent process
    only to validate the layout before launching workers."""

    name: str = "model"
    num_layers: int = 0  # decoder layers the pipeline splits (MTP excluded)
    has_mtp: bool = False
    vocab_size: int = 0
    weights_loaded: bool = False  # True when the initial weights come from a checkpoint (not a random init)
    supports_context_parallel: bool = False  # True: the stage module reads the cp_* batch keys (parallel/context.py)

    def parallel_sizes(self) -> dict[str, int | None]:
        """Sizes for ParallelConfig.validate: num_attention_heads, vocab_size, num_experts, ..."""
        return {"vocab_size": self.vocab_size, "num_layers": self.num_layers}

    def check_layout(self, pc: Any) -> None:
        """Reject parallel layouts this model cannot run yet (raise ParallelConfigError); default: all."""

    def layer_kinds(self) -> list[str] | None:
        """Per decoder layer "full" / "shared" (DSA indexer schedule), or None."""
        return None

    def loss_specs(self) -> dict[str, LossSpec]:
        raise NotImplementedError

    def set_indexer_training(
        self, stage: str | None, loss_coeff: float | None = None, shared_supervision: bool = False
    ) -> None:
        """``--indexer-stage`` / ``--indexer-loss-coeff`` / ``--indexer-shared-supervision`` (train/indexer_stage.py);
        called before :meth:`loss_specs` and :meth:`build_stage`. A model without a DSA indexer takes
        none of them."""
        if stage not in (None, "none") or loss_coeff is not None or shared_supervision:
            raise ValueError(f"--indexer-stage {stage}: the {self.name} model has no DSA indexer to train")

    def indexer_info(self) -> dict[str, Any] | None:
        """The run's indexer training for loss.json (stage, loss weight, layers), or None."""
        return None

    def build_stage(self, spec: StageSpec, topo: Topology) -> nn.Layer:
        """The module of one pipeline stage, parameter names as the full model's, with its
        ``forward_stage(carry, batch, part=None) -> StageOutput`` (docs/parallel.md, "Stage module")."""
        raise NotImplementedError

    def load_stage(self, module: nn.Layer, topo: Topology) -> dict[str, Any] | None:
        """Fill ``module`` (this rank's stage, TP/EP-local shapes) in place from the model's weights,
        reading only what this rank holds, so no rank ever holds a full-size copy; returns a summary
        for the run's logs, or None (not implemented): the trainer then slices :meth:`full_state`."""
        return None

    def full_state(self) -> Mapping[str, Any]:
        """Initial weights: structured name -> full array (checkpoint or deterministic init).
        Only used when :meth:`load_stage` returns None."""
        raise NotImplementedError

    def checkpoint_info(self) -> dict[str, Any]:
        """For loss.json: {"path", "config_sha256", "revision"?} of the loaded weights, or {}."""
        return {}

    def export(self, full_state: Mapping[str, np.ndarray], out_dir: str) -> None:
        """Write ``full_state`` in the model's release layout (``--export``)."""
        raise NotImplementedError(f"model {self.name!r} has no exporter")

    def export_trained(self, module: nn.Layer, topo: Topology, out_dir: str, dtype: str = "trained") -> int:
        """The trainer's ``--export`` (collective): by default the state gathered to rank 0 and
        :meth:`export` (small models, their own float32 format: ``dtype`` ``--export-dtype``, for
        models with a release dtype); returns the number of tensors written by all ranks."""
        from ..parallel.state import gather_full_state

        full = gather_full_state(module, topo)
        if topo.rank == 0:
            self.export(full, out_dir)
        return len(full) if full is not None else 0


# Built-in kinds as "module:class", imported only when that kind is asked for: this module imports
# no adapter (each adapter imports this one for ModelAdapter), so registration runs one way.
_BUILTIN: dict[str, str] = {
    "glm": "paddleformers_glm.train.glm_adapter:GlmAdapter",
    "toy": "paddleformers_glm.train.toy_adapter:ToyAdapter",
}
_REGISTRY: dict[str, Callable[..., ModelAdapter]] = {}


def register_adapter(kind: str, factory: Callable[..., ModelAdapter]) -> None:
    """Make ``kind`` name ``factory`` (an adapter class or a function returning an adapter)."""
    _REGISTRY[kind] = factory


def get_adapter_factory(kind: str) -> Callable[..., ModelAdapter]:
    """The factory registered for ``kind``, importing a built-in adapter's module on first use."""
    if kind not in _REGISTRY and kind in _BUILTIN:
        module, attr = _BUILTIN[kind].split(":")
        try:
            _REGISTRY[kind] = getattr(importlib.import_module(module), attr)
        except ImportError as e:
            raise KeyError(f"model kind {kind!r} is not available: {e}") from e
    if kind not in _REGISTRY:
        raise KeyError(f"unknown model kind {kind!r}; known: {sorted(set(_REGISTRY) | set(_BUILTIN))}")
    return _REGISTRY[kind]


def make_adapter(kind: str, **kwargs: Any) -> ModelAdapter:
    return get_adapter_factory(kind)(**kwargs)
