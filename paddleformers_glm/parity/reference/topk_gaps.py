"""The margin of every top-k decision the HF reference makes at its selection boundary.

:class:`GapMonitor` sees the exact tensors HF transformers hands to ``torch.topk`` inside every DSA
indexer and MoE router call (through a ``TorchFunctionMode`` and the modules' own forward hooks)
and records the gap between the k-th and the (k+1)-th value.  A gap below the rounding noise of
two implementations (~1e-7 in fp32) is a near tie that they may break differently; the fixture
generator (tools/make_reference.py) rejects a seed with a gap below :data:`MIN_GAP`, the torch
reference trainer (``parity.reference.train``) records every step's margins (:attr:`GapMonitor.step`)
for ``glm52 align``, which names the loss jump a near tie causes.
"""

from __future__ import annotations

import math
from typing import Any

__all__ = ["MIN_GAP", "NEAR_TIE", "GapMonitor", "TieError", "boundary_gaps"]

# the smallest top-k boundary gap a fixture seed may have (tools/make_reference.py)
MIN_GAP = 1e-4
NEAR_TIE = 1e-6  # a top-k margin below it is within the two frameworks' fp32 rounding: a near tie


def boundary_gaps(x: Any, valid: Any, k: int) -> Any:
    """Per row of ``x`` with more than ``k`` valid entries, the k-th minus the (k+1)-th largest
    valid value (None when no row has that many)."""
    import torch

    x = x.reshape(-1, x.shape[-1])
    valid = valid.reshape(-1, x.shape[-1])
    rows = valid.sum(-1) > k
    if not bool(rows.any()):
        return None
    srt = torch.where(valid, x, torch.full_like(x, -math.inf))[rows].sort(dim=-1, descending=True).values
    return srt[:, k - 1] - srt[:, k]


class TieError(RuntimeError):
    """A top-k selection boundary is closer than MIN_GAP: the seed is rejected."""


class GapMonitor:
    """The top-k margins of every indexer and router call (the module docstring says how)."""

    def __init__(self, min_gap: float | None = MIN_GAP):
        self.min_gap = min_gap  # None: record the margins only
        self.stack: list[list] = []  # [kind, topk-call counter]
        self.mins = {"indexer": math.inf, "router_expert": math.inf, "router_group": math.inf}
        self.counts = {"indexer": 0, "router_expert": 0, "router_group": 0}
        self.calls = {"indexer": 0, "router": 0}
        self.phase = ""
        self.phase_mins: dict[str, dict] = {}
        # category -> margins since the caller last emptied it (the reference trainer: each step, to
        # loss.json's topk_min_gaps).  min_nonzero: exact ties are common at the indexer (its relu) and
        # both frameworks break them alike, so a min of 0 would hide the near tie that can actually flip
        self.step: dict[str, dict] = {}

    def attach(self, module: Any) -> None:
        from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaIndexer, GlmMoeDsaTopkRouter

        for m in module.modules():
            if not isinstance(m, (GlmMoeDsaIndexer, GlmMoeDsaTopkRouter)):
                continue
            kind = "indexer" if isinstance(m, GlmMoeDsaIndexer) else "router"
            m.register_forward_pre_hook(lambda mod, args, kind=kind: self._enter(kind))
            m.register_forward_hook(lambda mod, args, out, kind=kind: self._leave(kind))

    def _enter(self, kind):
        self.stack.append([kind, 0])
        self.calls[kind] += 1

    def _leave(self, kind):
        top = self.stack.pop()
        assert top[0] == kind
        want = 1 if kind == "indexer" else 3
        assert top[1] == want, f"{kind} made {top[1]} topk calls, expected {want}"

    def on_topk(self, scores, k: int) -> None:
        if not self.stack:
            return
        import torch

        top = self.stack[-1]
        kind, n = top
        top[1] += 1
        x = scores.detach().to(torch.float32)
        if kind == "indexer":
            valid = x > torch.finfo(torch.float32).min / 2  # masked keys carry finfo.min (+ score)
            self._gap("indexer", x, valid, k)
        elif n == 1:  # group selection over group scores [T, n_group]
            self._gap("router_group", x, torch.ones_like(x, dtype=torch.bool), k)
        elif n == 2:  # expert selection over biased scores, -inf outside the chosen groups
            self._gap("router_expert", x, torch.isfinite(x), k)

    def _gap(self, cat: str, x, valid, k: int) -> None:
        gaps = boundary_gaps(x, valid, k)
        if gaps is None:
            return
        gap = float(gaps.min())
        self.counts[cat] += gaps.numel()
        self.mins[cat] = min(self.mins[cat], gap)
        pm = self.phase_mins.setdefault(self.phase, {})
        pm[cat] = min(pm.get(cat, math.inf), gap)
        st = self.step.setdefault(
            cat, {"min": math.inf, "min_nonzero": math.inf, "exact_ties": 0, "near_ties": 0, "decisions": 0}
        )
        st["min"] = min(st["min"], gap)
        nonzero = gaps[gaps > 0]
        if nonzero.numel():
            st["min_nonzero"] = min(st["min_nonzero"], float(nonzero.min()))
        st["exact_ties"] += int((gaps == 0).sum())
        st["near_ties"] += int((gaps < NEAR_TIE).sum())
        st["decisions"] += gaps.numel()
        if self.min_gap is not None and not gap >= self.min_gap:
            raise TieError(f"{cat} gap {gap:.3e} < {self.min_gap} in phase {self.phase!r}")

    def mode(self):
        import torch
        from torch.overrides import TorchFunctionMode

        monitor = self

        class _Mode(TorchFunctionMode):
            def __torch_function__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if func is torch.topk or func is torch.Tensor.topk:
                    k = args[1] if len(args) > 1 else kwargs["k"]
                    monitor.on_topk(args[0], int(k))
                return func(*args, **kwargs)

        return _Mode()
