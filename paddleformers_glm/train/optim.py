"""AdamW with fp32 master weights, and the warmup + cosine learning-rate schedule.

Why not ``paddle.optimizer.AdamW``: the update must consume the gradients *after* our cross-rank
sync and true-global-norm clipping (grads.py), skip parameters that got no gradient anywhere
(torch semantics, so every layout updates the same set), and save / restore its state by
parameter name for bit-exact resume.  bf16/fp16 parameters get an fp32 master copy that the
update runs on; an fp32 parameter is its own master (no copy).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import paddle

__all__ = ["AdamW", "lr_at"]


def lr_at(step: int, max_lr: float, min_lr: float, warmup_steps: int, total_steps: int) -> float:
    """LR of update ``step`` (1-based): linear warmup to ``max_lr`` over ``warmup_steps``, then cosine
    decay reaching ``min_lr`` at ``total_steps``."""
    if step < 1:
        raise ValueError(f"lr_at: step is 1-based, got {step}")
    if warmup_steps > 0 and step <= warmup_steps:
        return max_lr * step / warmup_steps
    span = max(1, total_steps - warmup_steps)
    progress = min(1.0, (step - warmup_steps) / span)
    return min_lr + 0.5 * (max_lr - min_lr) * (1.0 + math.cos(math.pi * progress))


def default_decay(name: str, param: paddle.Tensor) -> bool:
    """Weight decay on matrices only (norm weights, biases, router bias stay undecayed; Megatron rule)."""
    return param.ndim >= 2


class AdamW:
    """Decoupled weight decay Adam (torch.optim.AdamW update order), per-parameter step counts."""

    def __init__(
        self,
        named_params: list[tuple[str, paddle.Tensor]],
        *,
        betas: tuple[float, float] = (0.9, 0.95),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
        decay: Callable[[str, paddle.Tensor], bool] = default_decay,
    ) -> None:
        self.params = list(named_params)
        self.beta1, self.beta2 = betas
        self.eps, self.weight_decay = eps, weight_decay
        self.decay = {n: bool(decay(n, p)) for n, p in self.params}
        self.state: dict[str, dict[str, paddle.Tensor | int]] = {}
        self.master: dict[str, paddle.Tensor] = {}
        for n, p in self.params:
            if p.dtype != paddle.float32:
                self.master[n] = p.detach().astype("float32")

    def master_weight(self, name: str) -> paddle.Tensor:
        """The fp32 value the update runs on (the parameter itself when it is fp32)."""
        return self.master.get(name, dict(self.params)[name])

    @paddle.no_grad()
    def step(self, grads: dict[str, paddle.Tensor], has_grad: dict[str, bool], lr: float) -> None:
        """Update every parameter that got a gradient; ``grads`` are fp32 and already synced and clipped."""
        b1, b2 = self.beta1, self.beta2
        for n, p in self.params:
            if not has_grad.get(n, False):
                continue
            g = grads[n]
            st = self.state.get(n)
            if st is None:
                st = self.state[n] = {
                    "step": 0,
                    "exp_avg": paddle.zeros(p.shape, "float32"),
                    "exp_avg_sq": paddle.zeros(p.shape, "float32"),
                }
            st["step"] = int(st["step"]) + 1
            w = self.master[n] if n in self.master else p
            if self.weight_decay and self.decay[n]:
                w = w * (1.0 - lr * self.weight_decay)
            m = st["exp_avg"] * b1 + g * (1.0 - b1)
            v = st["exp_avg_sq"] * b2 + g * g * (1.0 - b2)
            st["exp_avg"], st["exp_avg_sq"] = m, v
            bc1 = 1.0 - b1 ** st["step"]
            bc2 = 1.0 - b2 ** st["step"]
            denom = paddle.sqrt(v) / math.sqrt(bc2) + self.eps
            w = w - (lr / bc1) * (m / denom)
            if n in self.master:
                self.master[n] = w
                p.set_value(w.astype(p.dtype))
            else:
                p.set_value(w)

    def state_dict(self) -> dict[str, dict[str, paddle.Tensor | int]]:
        out: dict[str, dict[str, paddle.Tensor | int]] = {}
        for n, st in self.state.items():
            out[n] = dict(st)
        for n, w in self.master.items():
            out.setdefault(n, {})["master"] = w
        return out

    def set_state_dict(self, sd: dict[str, dict[str, paddle.Tensor | int]]) -> None:
        names = {n for n, _ in self.params}
        unknown = set(sd) - names
        if unknown:
            raise KeyError(f"optimizer state has parameters this model lacks: {sorted(unknown)[:5]}")

        def f32(v) -> paddle.Tensor:
            t = v.detach().clone() if isinstance(v, paddle.Tensor) else paddle.to_tensor(v)
            return t.astype("float32")

        self.state = {}
        for n, st in sd.items():
            st = dict(st)
            if "master" in st:
                self.master[n] = f32(st.pop("master"))
            if st:
                self.state[n] = {
                    "step": int(st["step"]),
                    "exp_avg": f32(st["exp_avg"]),
                    "exp_avg_sq": f32(st["exp_avg_sq"]),
                }
