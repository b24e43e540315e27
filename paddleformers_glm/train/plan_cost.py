"""How ``glm52 plan --search`` orders the layouts that fit: an estimated training time per token.

Memory decides whether a layout fits; among those that fit, the ranking must weigh what each
parallel dimension costs in time (the pipeline bubble, the activations tensor and expert parallelism
move every layer, the gradient reduction).  The formula and its constants are in docs/scale.md; it is
a model to rank layouts, not a prediction of wall time.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["Hardware", "bubble_fraction", "comm_parts", "step_estimate"]


@dataclass(frozen=True)
class Hardware:
    """Throughputs the estimate assumes (per GPU): ``flops`` sustained bf16 FLOP/s, ``tp_bw`` the
    bandwidth inside a node (tensor-parallel collectives) and ``net_bw`` between nodes (expert
    all-to-all, pipeline sends, gradient reductions), bytes/s one way."""

    flops: float = 400e12
    tp_bw: float = 160e9
    net_bw: float = 40e9


def bubble_fraction(pp: int, micro_batches: int, vpp: int = 1) -> float:
    """Idle share of a 1F1B step relative to its useful work: (pp - 1) / (vpp * micro_batches)."""
    if pp < 1 or micro_batches < 1 or vpp < 1:
        raise ValueError(f"bubble_fraction: pp {pp}, micro-batches {micro_batches} and vpp {vpp} must be >= 1")
    return (pp - 1) / (vpp * micro_batches)


def comm_parts(config: Any, lay: Any) -> dict[str, float]:
    """Per-rank bytes one micro-batch moves (forward and backward), by kind: ``tp``, ``ep``, ``pp``
    and ``cp`` (C_tp .. C_cp of docs/scale.md; token counts are the rank's own, its sequence slice)."""
    a, cp = 2, lay.cp  # bf16 activations on the wire
    sb, h, L = lay.seq_len // cp * lay.micro_batch_size, config.hidden_size, config.num_hidden_layers
    per_stage = L / lay.pp
    tp = 4 * sb * h * a * (lay.tp - 1) / lay.tp * per_stage
    ep = 2 * sb * config.num_experts_per_tok * h * a * (lay.ep - 1) / lay.ep / lay.tp * per_stage
    pp = 2 * sb * h * a if lay.pp > 1 else 0
    lat = config.kv_lora_rank + config.qk_rope_head_dim
    cpb = sb * (cp - 1) * a * (2 * lat + config.index_head_dim) * per_stage
    return {"tp": float(tp), "ep": float(ep), "pp": float(pp), "cp": float(cpb)}


def step_estimate(
    config: Any,
    lay: Any,
    micro_batches: int,
    grad_params: int,
    active: int,
    hw: Hardware | None = None,
    expert_params: int = 0,
) -> dict[str, float]:
    """Estimated seconds of one training step of ``lay`` and seconds per token (docs/scale.md):
    ``micro_batches``: per pipeline per step; ``active``: ``plan.active_params``; ``grad_params``:
    parameters of the largest rank (its gradients are what the data-parallel reduction moves),
    ``expert_params`` of them routed experts (synced over fewer replicas, as parallel/grads.py does)."""
    hw = hw or Hardware()
    tokens_mb = lay.seq_len * lay.micro_batch_size  # one micro-batch's tokens (all cp ranks together)
    local_mb = tokens_mb / lay.cp  # the share one rank computes
    refactor = 4 / 3 if lay.recompute == "full" else 1.0  # full recompute: one more forward (2 of 6 FLOPs)
    compute = 6 * active * local_mb * refactor / (lay.tp * lay.pp) / hw.flops
    parts = comm_parts(config, lay)
    comm = parts["tp"] / hw.tp_bw + (parts["ep"] + parts["pp"] + parts["cp"]) / hw.net_bw
    r = lay.dp * lay.sharding
    r_dense, r_expert = r * lay.cp, lay.edp * lay.sharding
    # fp32 gradients, ring all-reduce: 2 (R - 1) / R of the buffer per rank
    ring = [(2 * (n - 1) / n, k) for n, k in ((r_dense, grad_params - expert_params), (r_expert, expert_params))]
    dp = sum(f * k for f, k in ring) * 4 / hw.net_bw
    slots = micro_batches + (lay.pp - 1) / lay.vpp
    step = slots * (compute + comm) + dp
    tokens = micro_batches * r * tokens_mb
    return {
        "step_s": step,
        "s_per_token": step / tokens,
        "bubble": bubble_fraction(lay.pp, micro_batches, lay.vpp),
        "compute_s": compute,
        "comm_s": comm,
        "dp_s": dp,
    }
