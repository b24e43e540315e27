"""GLM-5.2 behind the trainer (``glm52 train --model DIR``): each pipeline stage is the model itself
(``GlmMoeDsaForCausalLM`` built for the stage's layers and the run's topology), so every layout the
modeling package builds trains (the top-k travels in the carry); each rank reads only its own slices
of the checkpoint (``load_stage``): no rank ever holds a full-size model or tensor (docs/parallel.md §5).
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..parallel.pipeline import StageSpec
from ..parallel.topology import ParallelConfig, ParallelConfigError, Topology
from .adapter import LossSpec, ModelAdapter
from .indexer_stage import IndexerSettings, indexer_loss_specs

if TYPE_CHECKING:  # the model is imported when a stage is built: the adapter's checks run without Paddle
    import paddle.nn as nn

__all__ = ["GlmAdapter", "check_glm_sizes", "glm_parallel_sizes"]


def glm_parallel_sizes(config: Any) -> dict[str, int | None]:
    """The model sizes ``ParallelConfig.validate`` checks a layout against (trainer and planner)."""
    return {
        "num_attention_heads": config.num_attention_heads,
        "vocab_size": config.vocab_size,
        "num_experts": config.n_routed_experts,
        "moe_intermediate_size": config.moe_intermediate_size,
        "num_layers": config.num_hidden_layers,
    }


def check_glm_sizes(config: Any, pc: ParallelConfig) -> None:
    """The sizes only GLM-5.2 has (dense FFN, shared experts) against --tp; heads, vocabulary,
    experts and the expert FFN are checked once, by ParallelConfig.validate with parallel_sizes()."""
    for what, value in (
        ("intermediate_size", config.intermediate_size),
        ("moe_intermediate_size * n_shared_experts", config.moe_intermediate_size * config.n_shared_experts),
    ):
        if value % pc.tp:
            raise ParallelConfigError(f"GLM-5.2: --tp {pc.tp} does not divide {what} ({value})")


class GlmAdapter(ModelAdapter):
    """``--model DIR``: an official-layout (or Fleet-layout) GLM-5.2 checkpoint folder."""

    name = "glm"
    supports_context_parallel = weights_loaded = True  # the model reads cp_* batch keys; a checkpoint's weights

    def __init__(self, model_dir: str, tokenizer_dir: str | None = None) -> None:
        from ..configuration import GlmMoeDsaConfig

        self.model_dir = model_dir
        self.tokenizer_dir = tokenizer_dir  # --tokenizer: the run's tokenizer, which its export ships
        self._use_config(GlmMoeDsaConfig.from_pretrained(model_dir))

    @classmethod
    def for_config(cls, config: Any) -> GlmAdapter:
        """An adapter over an already read config, for the checks only (``settings.check_run``: ``glm52
        plan`` checks a layout as the trainer does); it has no folder to load weights from."""
        self = cls.__new__(cls)
        self.model_dir = self.tokenizer_dir = None
        self._use_config(config)
        return self

    def _use_config(self, c: Any) -> None:
        self.config = c
        self.num_layers, self.has_mtp, self.vocab_size = c.num_hidden_layers, c.num_mtp_layers > 0, c.vocab_size
        self.indexer = IndexerSettings(c)  # the checkpoint's default until set_indexer_training

    def parallel_sizes(self) -> dict[str, int | None]:
        return glm_parallel_sizes(self.config)

    def check_layout(self, pc: ParallelConfig) -> None:
        check_glm_sizes(self.config, pc)

    def layer_kinds(self) -> list[str]:
        return list(self.config.indexer_types)

    def set_indexer_training(
        self, stage: str | None, loss_coeff: float | None = None, shared_supervision: bool = False
    ) -> None:
        self.indexer = IndexerSettings(self.config, stage, loss_coeff, shared_supervision)

    def indexer_info(self) -> dict[str, Any]:
        return self.indexer.describe()

    def loss_specs(self) -> dict[str, LossSpec]:
        """LM, each MTP depth, and the indexer's terms (train/indexer_stage.py); the indexer's
        warm-up trains on its KL alone, the LM and MTP losses reported with weight 0."""
        c = self.config
        lm = self.indexer.lm_weight
        specs = {"lm": LossSpec("tokens", shift=1, weight=lm, report="losses")}
        D = c.num_mtp_layers
        for d in range(1, D + 1):  # out.mtp_loss = mean over depths of each depth's token mean
            specs[f"mtp_{d}"] = LossSpec(
                "tokens", shift=d + 1, weight=lm * c.mtp_loss_scaling_factor / D, report="mtp_losses"
            )
        specs.update(indexer_loss_specs(self.indexer))
        return specs

    def build_stage(self, spec: StageSpec, topo: Topology) -> nn.Layer:
        """The model itself, built for ``spec`` (its layers, embedding / head / MTP) and ``topo``."""
        import paddle

        from ..modeling.model import GlmMoeDsaForCausalLM

        # in the run's dtype: the trainer builds stages inside ``default_dtype(--dtype)``
        model = GlmMoeDsaForCausalLM(self.config, paddle.get_default_dtype(), topology=topo, stage=spec)
        model.set_indexer_training(self.indexer.training)  # the warm-up freezes all but the indexers
        return model

    def load_stage(self, module: nn.Layer, topo: Topology) -> dict[str, Any]:
        """Read this rank's slices of its stage's tensors straight into ``module``'s parameters (as
        ``ShardedWeight`` pieces: docs/checkpoints.md, "In the trainer"); no full-size tensor exists
        on the rank at any time."""
        from ..checkpoint import load_pretrained_state
        from ..parallel.state import sharded_state_dict

        state, shard_info = sharded_state_dict(module, topo)
        report = load_pretrained_state(
            state, self.model_dir, dtype=None, config=self.config, keys=set(state), shard_info=shard_info
        )
        missing = sorted(set(state) - set(report.loaded))  # it loads no other key (keys=set(state))
        if missing:
            raise RuntimeError(f"{self.model_dir}: stage tensors not loaded: {missing[:5]} ({len(missing)} in all)")
        return {
            "bytes_read": int(report.bytes_read),
            "tensors": len(report.loaded),
            "layout": report.layout,
            "load_seconds": report.seconds,
        }

    def checkpoint_info(self) -> dict[str, Any]:
        sha = hashlib.sha256(Path(self.model_dir, "config.json").read_bytes()).hexdigest()
        info: dict[str, Any] = {"path": os.path.abspath(self.model_dir), "config_sha256": sha}
        rev = Path(self.model_dir, "REVISION")
        if rev.is_file():
            info["revision"] = rev.read_text(encoding="utf-8").strip()
        return info

    def export_trained(self, module: nn.Layer, topo: Topology, out_dir: str, dtype: str = "trained") -> int:
        """Every rank writes the official-layout tensors it owns (``checkpoint.distributed``), the
        source folder's generation config (a folder without one: the one transformers' save derives
        from its config.json) and the run's tokenizer files (``--tokenizer``, else the source folder's)
        come along: the export is usable as it stands. ``dtype`` (``--export-dtype``): ``trained``, the
        dtype the run trained in (``--dtype``), as ``save_pretrained`` writes a model's (the checkpoint's
        BF16 rounded what a float32 run trained); ``auto``, the checkpoint's config.json dtype (a run
        that changed nothing exports the source's bytes); or a dtype name."""
        from ..checkpoint.distributed import all_gather_object, export_distributed
        from ..generation import derived_generation_file

        info = export_distributed(
            module,
            self.config,
            out_dir,
            topo,
            carry_from=self.model_dir,
            tokenizer_from=self.tokenizer_dir,
            generation_config=derived_generation_file(self.model_dir, self.config),
            dtype={"trained": module.compute_dtype, "auto": None}.get(dtype, dtype),
        )
        return sum(all_gather_object(info["tensors"], topo))
