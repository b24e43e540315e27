"""Normalisation layers, computed in fp32 whatever the parameter dtype (as HF does)."""

from __future__ import annotations

import paddle
from paddle import nn

from ..ops import rms_norm
from ..ops.norm import mean_square as _mean_square


class RMSNorm(nn.Layer):
    """y = weight * (x / sqrt(mean(x^2) + eps)); statistics in fp32, cast back before the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = self.create_parameter([hidden_size], default_initializer=nn.initializer.Constant(1.0))

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def reference(self, x: paddle.Tensor) -> paddle.Tensor:
        """The op-by-op form (autograd through every op): what the tests hold `forward` to."""
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
