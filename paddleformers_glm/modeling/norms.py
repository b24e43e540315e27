"""Normalisation layers, computed in fp32 whatever the parameter dtype (as HF does)."""

from __future__ import annotations

import paddle
from paddle import nn


def _mean_square(h: paddle.Tensor) -> paddle.Tensor:
    """mean(h^2) over the last axis, accumulated in fp64 and rounded to fp32.

    Paddle's fp32 mean reduction is several ulps less accurate than torch's pairwise one; with an
    fp64 accumulator our norms stay within ~1 ulp of the reference, which keeps 8-layer logits
    inside 1e-5. The cost is O(tokens x hidden), negligible next to the matmuls.
    """
    h64 = h.astype("float64")
    return (h64 * h64).mean(axis=-1, keepdim=True).astype("float32")


class RMSNorm(nn.Layer):
    """y = weight * (x / sqrt(mean(x^2) + eps)); statistics in fp32, cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        in_dtype = x.dtype
        h = x.astype("float32")
        var = _mean_square(h)
        h = h * paddle.rsqrt(var + self.eps)
        return self.weight * h.astype(in_dtype)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Layer):
    """LayerNorm with weight and bias (the DSA indexer's `k_norm`), statistics in fp32."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))
        self.bias = self.create_parameter([hidden_size], is_bias=True, default_initializer=nn.initializer.Constant(0.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        in_dtype = x.dtype
        h = x.astype("float32")
        out = nn.functional.layer_norm(
            h, h.shape[-1:], weight=self.weight.astype("float32"), bias=self.bias.astype("float32"), epsilon=self.eps
        )
        return out.astype(in_dtype)
