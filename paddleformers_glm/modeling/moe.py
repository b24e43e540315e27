"""Feed-forward blocks: the dense SwiGLU MLP and the GLM-5.2 MoE (sigmoid router + noaux_tc).

Router (always fp32, REFERENCE §1):
    s      = sigmoid(x W_gate)                       [N, E]
    choice = s + e_score_correction_bias             (bias only chooses; it is never a weight)
    group score = sum of the top-2 `choice` in each of n_group groups -> keep topk_group groups
    experts = top-k of `choice` inside the kept groups
    weights = s[experts] (/ sum if norm_topk_prob) * routed_scaling_factor
Experts keep per-expert fused `up_gate_proj` [H, 2I] (gate columns first) like the Fleet layout.
Tokens are sorted by expert once and each expert runs one matmul on its contiguous slice.
"""

from __future__ import annotations

import paddle
from paddle import nn

from ..configuration import GlmMoeDsaConfig


class SwiGLUMLP(nn.Layer):
    """down(silu(gate(x)) * up(x)) with gate and up fused into one [H, 2I] weight."""

    def __init__(self, hidden_size: int, intermediate_size: int) -> None:
        super().__init__()
        self.intermediate_size = intermediate_size
        self.up_gate_proj = nn.Linear(hidden_size, 2 * intermediate_size, bias_attr=False)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias_attr=False)

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        gate_up = self.up_gate_proj(x)
        gate, up = gate_up[..., : self.intermediate_size], gate_up[..., self.intermediate_size :]
        return self.down_proj(nn.functional.silu(gate) * up)


class TopkRouter(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        self.num_experts = config.n_routed_experts
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group
        self.topk_group = config.topk_group
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.scaling = float(config.routed_scaling_factor)
        self.weight = self.create_parameter(
            [config.hidden_size, self.num_experts],
            dtype="float32",
            default_initializer=nn.initializer.Normal(0.0, config.initializer_range),
        )
        # A persistable fp32 buffer: updated by aux-loss-free balancing rules, never by the optimizer.
        self.register_buffer("e_score_correction_bias", paddle.zeros([self.num_experts], dtype="float32"))

    def forward(self, x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
        """x [N, H] -> (logits [N, E] fp32, weights [N, k] fp32, expert ids [N, k] int64)."""
        logits = paddle.matmul(x.astype("float32"), self.weight)
        scores = nn.functional.sigmoid(logits)
        choice = scores + self.e_score_correction_bias.detach()
        with paddle.no_grad():
            c = choice.detach()
            if self.n_group > 1:
                N = c.shape[0]
                grouped = c.reshape([N, self.n_group, self.num_experts // self.n_group])
                group_scores = paddle.topk(grouped, 2, axis=-1)[0].sum(-1)  # [N, G]
                group_idx = paddle.topk(group_scores, self.topk_group, axis=-1)[1]
                group_mask = paddle.put_along_axis(
                    paddle.zeros_like(group_scores), group_idx, paddle.ones_like(group_idx, "float32"), axis=-1
                )
                expert_mask = group_mask.unsqueeze(-1).expand_as(grouped).reshape([N, self.num_experts]) > 0
                c = paddle.where(expert_mask, c, paddle.full_like(c, float("-inf")))
            expert_ids = paddle.topk(c, self.top_k, axis=-1)[1]
        weights = paddle.take_along_axis(scores, expert_ids, axis=-1)
        if self.norm_topk_prob:
            weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
        return logits, weights * self.scaling, expert_ids


class MoE(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig) -> None:
        super().__init__()
        H, I = config.hidden_size, config.moe_intermediate_size
        self.num_experts = config.n_routed_experts
        self.gate = TopkRouter(config)
        self.experts = nn.LayerList([SwiGLUMLP(H, I) for _ in range(self.num_experts)])
        self.shared_experts = SwiGLUMLP(H, I * config.n_shared_experts) if config.n_shared_experts else None

    def routed(self, x: paddle.Tensor, weights: paddle.Tensor, expert_ids: paddle.Tensor) -> paddle.Tensor:
        """sum_k w_k * expert_{e_k}(x) for x [N, H], one matmul per expert on its sorted slice."""
        N, K = expert_ids.shape
        flat_e = expert_ids.reshape([-1])
        order = paddle.argsort(flat_e, stable=True)  # assignments grouped by expert, then token order
        token_of = (order // K).astype("int64")
        counts = paddle.bincount(flat_e, minlength=self.num_experts).tolist()  # one host sync per layer
        x_sorted = paddle.gather(x, token_of)
        w_sorted = paddle.gather(weights.reshape([-1]), order).unsqueeze(-1)
        out = paddle.zeros_like(x)
        start = 0
        for e, n in enumerate(counts):
            if n == 0:
                continue
            end = start + n
            y = self.experts[e](x_sorted[start:end]) * w_sorted[start:end].astype(x.dtype)
            out = paddle.index_add(out, token_of[start:end], 0, y)
            start = end
        return out

    def forward(self, x: paddle.Tensor) -> paddle.Tensor:
        shape = x.shape
        flat = x.reshape([-1, shape[-1]])
        _, weights, expert_ids = self.gate(flat)
        out = self.routed(flat, weights, expert_ids).reshape(shape)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out
