"""PaddleFleet-layout checkpoints: which layout a file is in, and what the loader does about it
(docs/checkpoints.md, "The PaddleFleet layout"; the old spelling reads as ``fleet-legacy``).

Two facts only the file can tell are read here: a tensor-parallel writer's per-shard interleave of
``fused_ffn`` weights (:data:`FUSED_FFN_KEY` in the index ``metadata`` or a file's ``__metadata__``),
and whether the MTP layer's indexer was written at all.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from .errors import CheckpointError
from .layout import LAYOUTS, layer_plan, param_specs

__all__ = [
    "FUSED_FFN_KEY",
    "LEGACY_MESSAGE",
    "detect_layout",
    "detect_expert_layout",
    "fused_ffn_shards",
    "absent_mtp_indexer",
]

FUSED_FFN_KEY = "fused_ffn_tp_degree"
LEGACY_MESSAGE = (
    "checkpoint is in the old 'fleet' spelling (router mlp.gate.weight [H, E], lm_head.weight [H, V]); "
    "the 'fleet' layout is now PaddleFleet's (router [E, H], model.lm_head.weight [V, H], not transposed). "
    "It loads for this release only: re-save it with `glm52 convert SRC OUT --to fleet`"
)
_INDEXER = ("wq_b.weight", "wk.weight", "k_norm.weight", "k_norm.bias", "weights_proj.weight")


def detect_expert_layout(keys: Iterable[str]) -> str:
    """``per-expert``, ``grouped`` or ``stacked`` from the routed-expert key names (default per-expert)."""
    ks = list(keys)
    if any(".mlp.grouped_gemm_experts.weight" in k for k in ks):
        return "grouped"
    if any(k.endswith((".mlp.experts.up_gate_proj", ".mlp.experts.down_proj")) for k in ks):
        return "stacked"
    return "per-expert"


def detect_layout(keys: Iterable[str], config: Any, shape_of: Any = None) -> str:
    """``hf``, ``fleet`` (PaddleFleet) or ``fleet-legacy``: the contract the key set overlaps most.

    The PaddleFleet and legacy key sets differ only in the head's name (and expert grouping); when a
    file has neither head, ``shape_of(key)`` (optional) tells them apart by the router's orientation.
    Ties with the official layout and no overlap are refused.
    """
    ks = set(keys)
    experts = detect_expert_layout(ks)
    scores = {layout: len(ks & set(param_specs(config, layout, experts))) for layout in LAYOUTS}
    best = max(scores.values())
    winners = [k for k, v in scores.items() if v == best]
    if winners == ["fleet", "fleet-legacy"] and shape_of is not None:
        router = next((k for k in sorted(ks) if k.endswith(".mlp.gate.weight")), None)
        if router is not None:
            shape = tuple(shape_of(router))
            winners = ["fleet" if shape and shape[0] == int(config.n_routed_experts) else "fleet-legacy"]
    if best == 0 or len(winners) != 1:
        raise CheckpointError(
            "cannot tell the checkpoint layout (hf, fleet or fleet-legacy) from its keys",
            expected="keys of the official, the PaddleFleet or the old fleet layout",
            actual=sorted(ks)[:3],
        )
    return winners[0]


def fused_ffn_shards(ckpt: Any) -> int:
    """How many tensor-parallel shards interleave the ``fused_ffn`` weights (1 = plain ``[gate | up]``)."""
    index_meta = (ckpt.index or {}).get("metadata") or {}
    values = [(ckpt.index_file, index_meta[FUSED_FFN_KEY])] if FUSED_FFN_KEY in index_meta else []
    values += [(name, f.metadata[FUSED_FFN_KEY]) for name, f in ckpt.files.items() if FUSED_FFN_KEY in f.metadata]
    out = {}
    for where, v in values:
        try:
            n = int(v)
        except (TypeError, ValueError):
            n = 0
        if n < 1:
            raise CheckpointError(
                f"{FUSED_FFN_KEY} must be a positive integer", file=where, key=FUSED_FFN_KEY, actual=v
            )
        out[where] = n
    if len(set(out.values())) > 1:
        raise CheckpointError(f"files disagree on {FUSED_FFN_KEY}", key=FUSED_FFN_KEY, actual=out)
    return next(iter(out.values()), 1)


def absent_mtp_indexer(config: Any, layout: str, missing: Iterable[str]) -> set[str]:
    """MTP indexer tensors a PaddleFleet file left out entirely (all 5 of a layer), else nothing.

    Only the ``fleet`` layout: the official checkpoint always ships them, and a partial set is damage,
    not a writer's choice, so it stays a missing-key error.
    """
    if layout != "fleet":
        return set()
    gone, out = set(missing), set()
    for lp in layer_plan(config):  # an MTP layer's indexer has the same names in the PaddleFleet and model layouts
        keys = {f"{lp.fleet_prefix}.self_attn.core_attention.indexer.{n}" for n in _INDEXER}
        if lp.mtp and keys <= gone:
            out |= keys
    return out
