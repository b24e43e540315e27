"""MoE balancing during training: expert-bias updates, the sequence aux loss's scale, load statistics.

The rule (Megatron-Core's ``moe_router_bias_update_rate``: ``bias <- fp32(bias + fp32(R) *
sign(mean - load))`` after each optimizer step) and what counts each token exactly once in every
layout are docs/model.md, "MoE balancing".  The reduced counts are integers held in float64 (exact
in any order), so every replica of a router computes the same update and the biases after N steps
are the same bits in every layout.
"""

from __future__ import annotations

import re
from typing import Any

import numpy as np
import paddle

from ..parallel import comm

__all__ = ["ExpertBalancer", "load_stats"]

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def load_stats(load: np.ndarray) -> dict[str, float]:
    """max/mean load ratio (1 = perfectly balanced) and the fraction of experts that got no token."""
    load = np.asarray(load, dtype=np.float64)
    mean = float(load.mean()) if load.size else 0.0
    return {
        "max_mean_ratio": float(load.max() / mean) if mean > 0 else 0.0,
        "unused_fraction": float((load == 0).mean()) if load.size else 0.0,
    }


class ExpertBalancer:
    """Collects every router's per-expert load after each optimizer step, updates the biases
    (rate > 0) and keeps per-step, per-layer statistics for ``loss.json``; for a module without
    routers (the toy model) it does nothing and reports nothing."""

    def __init__(
        self,
        module: Any,
        topo: Any,
        bias_update_rate: float = 0.0,
        aux_loss_coeff: float = 0.0,
        global_sequences: int = 1,
        loss_multiplier: float = 1.0,
    ) -> None:
        from ..modeling.moe import TopkRouter

        self.topo = topo
        self.routers: dict[int, Any] = {}  # by layer number
        self.names: dict[int, str] = {}  # and their names in the stage module
        for name, layer in module.named_sublayers():
            if isinstance(layer, TopkRouter):
                m = _LAYER.search(name + ".")
                if m is None:
                    raise ValueError(f"router {name!r}: no layer number in its name (expected '...layers.<i>....')")
                self.routers[int(m.group(1))] = layer
                self.names[int(m.group(1))] = name
        self.rate = float(bias_update_rate)
        self.aux_coeff = float(aux_loss_coeff)
        self.global_sequences = max(int(global_sequences), 1)
        for r in self.routers.values():
            r.balance.aux_loss_coeff = self.aux_coeff
            # the factor the trainer puts on every local loss for Fleet's averaging gradient sync
            r.balance.aux_loss_scale = float(loss_multiplier) / self.global_sequences
        self.num_experts = next(iter(self.routers.values())).num_experts if self.routers else 0
        # rows: every layer number any stage holds (the same answer on every rank)
        top = np.array([max(self.routers, default=-1) + 1, self.num_experts], dtype=np.float64)
        top = comm.all_reduce(paddle.to_tensor(top), topo.pp_group, "max").numpy()
        self.slots, self.num_experts = int(top[0]), int(top[1])
        # MoE layer numbers: every router any stage holds, whether or not it routed a real token at
        # step 1 (an MTP depth past the data's real tokens routes none then, and was left out)
        held = np.zeros([max(self.slots, 1)], dtype=np.float64)
        held[list(self.routers)] = 1.0
        held = comm.all_reduce(paddle.to_tensor(held), topo.pp_group, "max").numpy()
        self.layers: list[int] | None = np.flatnonzero(held[: self.slots] > 0).tolist() if self.active else None
        # per step: its number, per MoE layer the load statistics, MoE layer -> experts that got no token
        self.series: dict[str, list] = {k: [] for k in ("steps", "max_mean_ratio", "unused_fraction", "idle_experts")}
        self.aux_losses: list[float] = []
        self.load_total: np.ndarray | None = None
        self.load_last: np.ndarray | None = None

    @property
    def active(self) -> bool:
        return self.slots > 0 and self.num_experts > 0

    def after_step(self, step: int) -> None:
        """Reduce this step's counts, move the biases by the rule, record the statistics."""
        if not self.active:
            return
        E = self.num_experts
        mat = np.zeros([self.slots, E + 1], dtype=np.float64)  # last column: aux loss sums
        for i, r in self.routers.items():
            counts, aux = r.balance.take()
            if counts is not None:
                mat[i, :E] = counts.numpy()
            if aux is not None:
                mat[i, E] = float(aux)
        # summed over data replicas (sharding ranks too), context-parallel ranks and sequence-parallel
        # TP ranks (each routed its own tokens) and over the pipeline stages (each holds its layers' rows)
        t, topo = paddle.to_tensor(mat), self.topo
        sp_group = topo.tp_group if topo.sequence_parallel else None
        for g in (topo.dp_group, topo.sharding_group, topo.cp_group, sp_group, topo.pp_group):
            t = comm.all_reduce(t, g)
        mat = t.numpy()
        load = mat[:, :E]
        if self.rate > 0:
            rate = np.float32(self.rate)
            new: dict[int, np.ndarray] = {}
            for i, r in self.routers.items():
                row = load[i]  # exact integer counts (float64)
                step_sign = np.sign(row.sum() / E - row).astype(np.float32)
                with np.errstate(over="ignore", invalid="ignore"):  # an overflow is caught below, by name
                    new[i] = (r.e_score_correction_bias.numpy().astype(np.float32) + rate * step_sign).astype(
                        np.float32
                    )
            self._check_biases(step, new)
            with paddle.no_grad():
                for i, r in self.routers.items():
                    r.e_score_correction_bias.set_value(new[i])
        rows = load[self.layers]
        stats = [load_stats(row) for row in rows]
        self.series["steps"].append(int(step))
        for k in ("max_mean_ratio", "unused_fraction"):
            self.series[k].append([s[k] for s in stats])
        self.series["idle_experts"].append(
            {str(i): np.flatnonzero(row == 0).tolist() for i, row in zip(self.layers, rows) if (row == 0).any()}
        )
        if self.aux_coeff > 0:
            self.aux_losses.append(float(mat[self.layers, E].sum()) / max(1, len(self.layers)) / self.global_sequences)
        self.load_total = rows.copy() if self.load_total is None else self.load_total + rows
        self.load_last = rows

    def _check_biases(self, step: int, new: dict[int, np.ndarray]) -> None:
        """Raise ``NonFiniteStep`` on every rank, before any bias is set, when an updated bias of any
        rank holds NaN or Inf (a float32 overflow of ``bias + rate * sign``: the losses stay finite, so
        no other guard sees it).  The biases are a few numbers per layer; replicas of a router compute
        the same update, so the pipeline stages alone may disagree: one all-reduce of a flag over them
        (none without a pipeline), and a gather of the reports only when a bias is non-finite."""
        from .nonfinite import NonFiniteStep, gather_json

        bad = [i for i in sorted(new) if not np.isfinite(new[i]).all()]
        flag = float(bool(bad))
        if self.topo.pc.pp > 1:
            flag = float(
                comm.all_reduce(paddle.to_tensor([flag], dtype="float64"), self.topo.pp_group, "max").numpy()[0]
            )
        if not flag:
            return
        local = {"rank": self.topo.rank, "layers": bad}
        if bad:
            b = new[bad[0]]
            local.update(
                name=f"{self.names[bad[0]]}.e_score_correction_bias", value="nan" if np.isnan(b).any() else "inf"
            )
        reports = [r for r in gather_json(local, self.topo.world_size) if r["layers"]]
        first = reports[0]
        layers = sorted({i for r in reports for i in r["layers"]})
        message = (
            f"step {step}: --moe-bias-update-rate {self.rate:g} made the router bias of MoE layer(s) "
            f"{', '.join(map(str, layers))} non-finite ({first['value']}; first: {first['name']} on rank "
            f"{first['rank']}): bias + rate overflows float32; stopped before setting it (the weights "
            "are updated, the step not saved; no export)"
        )
        raise NonFiniteStep(
            {
                "kind": "nonfinite",
                "rank": first["rank"],
                "step": step,
                "quantity": "router bias",
                "value": first["value"],
                "tensor": first["name"],
                "flag": "--moe-bias-update-rate",
                "layers": layers,
                "message": message,
            }
        )

    def discard(self) -> None:
        """Drop the counts and aux-loss sums of a step that made no update (``--skip-nonfinite-steps``):
        the routers hold them until taken, so the next step's bias update would otherwise move the
        biases by two steps' load. Local, no collective: every rank skips the same steps."""
        for r in self.routers.values():
            r.balance.take()

    def report(self) -> dict[str, Any]:
        """The ``expert_load`` block of loss.json (empty for a model without routers)."""
        if not self.active or self.load_total is None:  # no step taken (--steps 0: an evaluation only)
            return {}
        out: dict[str, Any] = {
            "num_experts": self.num_experts,
            "layers": self.layers,
            "bias_update_rate": self.rate,
            "aux_loss_coeff": self.aux_coeff,
            "dropped_tokens": 0,  # dropless routing: every assignment runs
            **self.series,
            "load_total": self.load_total.astype(np.int64).tolist(),
            "load_last": self.load_last.astype(np.int64).tolist(),
        }
        if self.aux_coeff > 0:
            out["aux_losses"] = self.aux_losses  # per step: mean over sequences and MoE layers (1 = balanced)
        return {"expert_load": out}
