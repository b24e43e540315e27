"""GLM-5.2 behind the trainer (``glm52 train --model DIR``), built from the modeling package's own
submodules.

Every layout: tensor parallel (MLA heads, dense/shared-expert FFN and vocabulary split; the
indexer replicated), sequence parallel, expert parallel and expert tensor parallel (the modeling
package builds its layers from ``parallel.layers`` / ``parallel.experts`` under the current
topology), pipeline parallel with any split (the top-k travels in the carry, so a stage may start
on a shared indexer layer), data parallel, MTP and the indexer KL loss.  Each rank builds only
its stage's submodules, in its TP/EP-local shapes, and reads only its own slices of the checkpoint
(``load_stage``): no rank ever holds a full-size model or tensor.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping
from typing import Any

import numpy as np
import paddle
import paddle.nn as nn

from ..parallel.layers import parallel_cross_entropy
from ..parallel.pipeline import LossTerm, StageOutput, StageSpec
from ..parallel.recompute import run_layer
from ..parallel.topology import ParallelConfig, ParallelConfigError, Topology
from .adapter import LossSpec, ModelAdapter

__all__ = ["GlmAdapter", "GlmStage"]

IGNORE_INDEX = -100


def _shifted_loss(logits: paddle.Tensor, labels: paddle.Tensor, shift: int) -> LossTerm:
    """HF causal-LM loss as (sum, count): position i predicts labels[i + shift]."""
    B, S = labels.shape
    target = paddle.concat([labels[:, shift:], paddle.full([B, min(shift, S)], IGNORE_INDEX, dtype=labels.dtype)], 1)[
        :, :S
    ]
    per_tok = parallel_cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none")
    return LossTerm(per_tok.sum(), int((target != IGNORE_INDEX).astype("int64").sum()))


def _loss_term(logits: paddle.Tensor, batch: Mapping[str, paddle.Tensor], shift: int) -> LossTerm:
    """The loss at ``shift``; under context parallel the batch carries the targets already shifted
    over the whole sequence (``cp_target_<shift>``, parallel/context.py), sliced to this rank."""
    target = batch.get(f"cp_target_{shift}")
    if target is None:
        return _shifted_loss(logits, batch["labels"], shift)
    per_tok = parallel_cross_entropy(logits, target, ignore_index=IGNORE_INDEX, reduction="none")
    return LossTerm(per_tok.sum(), int((target != IGNORE_INDEX).astype("int64").sum()))


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


class GlmStage(nn.Layer):
    """One pipeline stage of GLM-5.2; ``forward(carry, batch) -> StageOutput``; carry = (hidden, top-k).

    Builds only what the stage runs (its decoder layers, the MTP layers on an MTP stage, the
    embedding where tokens are embedded, final norm and LM head on the last stage), in this
    rank's TP/EP-local shapes and under the full model's parameter names.
    """

    def __init__(self, config: Any, spec: StageSpec, dtype: str = "float32") -> None:
        super().__init__()
        from ..modeling.model import GlmMoeDsaStageModel, build_lm_head, default_dtype

        self.config, self.spec = config, spec
        self.recompute = "none"  # the trainer sets --recompute
        L = config.num_hidden_layers
        self.mtp_ids = list(range(L, L + config.num_mtp_layers)) if spec.has_mtp else []
        with default_dtype(dtype):
            self.model = GlmMoeDsaStageModel(
                config,
                list(spec.layers) + self.mtp_ids,
                embedding=spec.has_embedding or spec.has_mtp,
                norm=spec.has_head,
            )
            if spec.has_head:
                self.lm_head = build_lm_head(config)

    def forward(
        self,
        carry: tuple[paddle.Tensor, ...] | None,
        batch: Mapping[str, paddle.Tensor],
        part: StageSpec | None = None,
    ) -> StageOutput:
        """``part``: run only that chunk of the stage (a virtual pipeline stage); default all of it."""
        spec = part or self.spec
        ids = batch["input_ids"]  # [B, S]
        mask = batch.get("attention_mask")
        pos = batch.get("position_ids")
        if pos is None:
            pos = paddle.arange(ids.shape[1], dtype="int64").unsqueeze(0)
        cos, sin = self.model.rotary_emb(pos)
        if spec.has_embedding:
            hidden, topk = self.model.embedding(ids), None  # [B, S, H]
        else:
            hidden, topk = carry
            topk = topk if topk.shape[-1] else None
        kls = []
        for i in spec.layers:
            hidden, topk, kl = run_layer(self.model.layers[str(i)], hidden, cos, sin, mask, topk, mode=self.recompute)
            if kl is not None:
                kls.append(kl)
        losses: dict[str, LossTerm] = {}
        if not spec.has_head:
            if kls:
                losses["indexer_kl"] = LossTerm(paddle.add_n(kls), 1)
            empty = paddle.zeros([ids.shape[0], ids.shape[1], 0], dtype="int64")
            self.model.selections.release()  # the stage's top-k tables and masks end with its forward
            return StageOutput(carry=(hidden, topk if topk is not None else empty), losses=losses or None)
        h = self.model.norm(hidden)
        losses["lm"] = _loss_term(self.lm_head(h), batch, 1)
        B, S = ids.shape
        for d, li in enumerate(self.mtp_ids if spec.has_mtp else [], start=1):  # as GlmMoeDsaForCausalLM.mtp_forward
            mtp = self.model.layers[str(li)]
            shifted = batch.get(f"cp_ids_{d}")  # context parallel: shifted over the whole sequence
            if shifted is None:
                shifted = paddle.concat([ids[:, d:], paddle.zeros([B, min(d, S)], dtype=ids.dtype)], 1)[:, :S]
            h, _, kl = mtp(h, self.model.embedding(shifted), cos, sin, mask, topk)
            if kl is not None:
                kls.append(kl)
            losses[f"mtp_{d}"] = _loss_term(self.lm_head(mtp.norm(h)), batch, d + 1)
        if kls:
            losses["indexer_kl"] = LossTerm(paddle.add_n(kls), 1)
        self.model.selections.release()
        return StageOutput(losses=losses)


class GlmAdapter(ModelAdapter):
    """``--model DIR``: an official-layout (or Fleet-layout) GLM-5.2 checkpoint folder."""

    name = "glm"
    supports_context_parallel = True  # GlmStage reads the cp_* batch keys (parallel/context.py)

    def __init__(self, model_dir: str, dtype: str | None = None) -> None:
        from ..configuration import GlmMoeDsaConfig

        # None: the run's dtype (the trainer builds stages inside ``default_dtype(--dtype)``)
        self.model_dir, self.dtype = model_dir, dtype
        self.config = GlmMoeDsaConfig.from_pretrained(model_dir)
        c = self.config
        self.num_layers, self.has_mtp, self.vocab_size = c.num_hidden_layers, c.num_mtp_layers > 0, c.vocab_size

    def parallel_sizes(self) -> dict[str, int | None]:
        return glm_parallel_sizes(self.config)

    def check_layout(self, pc: ParallelConfig) -> None:
        check_glm_sizes(self.config, pc)

    def layer_kinds(self) -> list[str]:
        return list(self.config.indexer_types)

    def loss_specs(self) -> dict[str, LossSpec]:
        c = self.config
        specs = {"lm": LossSpec("tokens", shift=1, weight=1.0, report="losses")}
        D = c.num_mtp_layers
        for d in range(1, D + 1):  # out.mtp_loss = mean over depths of each depth's token mean
            specs[f"mtp_{d}"] = LossSpec(
                "tokens", shift=d + 1, weight=c.mtp_loss_scaling_factor / D, report="mtp_losses"
            )
        if c.indexer_loss_coeff > 0:
            specs["indexer_kl"] = LossSpec("micro_batches", weight=c.indexer_loss_coeff, report="indexer_losses")
        return specs

    def build_stage(self, spec: StageSpec, topo: Topology) -> nn.Layer:
        self.check_layout(topo.pc)
        return GlmStage(self.config, spec, self.dtype or paddle.get_default_dtype())

    def load_stage(self, module: nn.Layer, topo: Topology) -> dict[str, Any]:
        """Read this rank's slices of its stage's tensors straight into ``module``'s parameters.

        Each split parameter goes to the loader as a ``ShardedWeight`` (local piece, global shape
        and offset from its ``ShardSpec``), fused ``up_gate_proj`` pieces with every rank's piece
        in ``shard_info`` (the engine then lays rank r out as ``[gate_r | up_r]``, what
        ``local_slice`` cuts); the engine reads only those slices (bf16 or fp32 sources, cast to
        the parameter's dtype).  No full-size tensor exists on the rank at any time.
        """
        from ..checkpoint import load_pretrained_state
        from ..parallel.state import sharded_state_dict

        state, shard_info = sharded_state_dict(module, topo)
        report = load_pretrained_state(
            state, self.model_dir, dtype=None, config=self.config, keys=set(state), shard_info=shard_info
        )
        if sorted(report.loaded) != sorted(state):
            missing = sorted(set(state) - set(report.loaded))
            raise RuntimeError(f"{self.model_dir}: stage tensors not loaded: {missing[:5]} ({len(missing)} in all)")
        return {
            "bytes_read": int(report.bytes_read),
            "tensors": len(report.loaded),
            "layout": report.layout,
            "load_seconds": report.seconds,
        }

    @property
    def weights_loaded(self) -> bool:
        return True

    def checkpoint_info(self) -> dict[str, Any]:
        with open(os.path.join(self.model_dir, "config.json"), "rb") as f:
            sha = hashlib.sha256(f.read()).hexdigest()
        info: dict[str, Any] = {"path": os.path.abspath(self.model_dir), "config_sha256": sha}
        rev = os.path.join(self.model_dir, "REVISION")
        if os.path.isfile(rev):
            with open(rev, encoding="utf-8") as f:
                info["revision"] = f.read().strip()
        return info

    def export(self, full_state: Mapping[str, np.ndarray], out_dir: str) -> None:
        from ..checkpoint import save_pretrained_state

        state = {k: paddle.to_tensor(np.ascontiguousarray(v)) for k, v in full_state.items()}
        save_pretrained_state(state, self.config, out_dir, layout="hf", dtype=self.config.model_dtype)
