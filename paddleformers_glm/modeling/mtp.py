"""Multi-token prediction (MTP) layer, DeepSeek-V3 style, as GLM-5.2 ships it (decoder layer index L+j):
depth d combines the previous depth's hidden state with the embedding of token i+d and predicts token
i+d+1 (docs/model.md, "MTP"). With `index_share_for_mtp_iteration` the layer reuses the main model's
last top-k instead of running its own indexer (the checkpoint still carries that indexer).
"""

from __future__ import annotations

import paddle
from paddle import nn

from ..configuration import GlmMoeDsaConfig
from ..parallel.layers import mark_sequence_parallel
from ..parallel.topology import Topology
from .cache import LayerCache
from .decoder import DecoderLayer
from .indexer_training import IndexerRecord, count_real_queries
from .norms import RMSNorm


class MTPLayer(nn.Layer):
    def __init__(self, config: GlmMoeDsaConfig, topo: Topology) -> None:
        super().__init__()
        H = config.hidden_size
        self.enorm = RMSNorm(H, config.rms_norm_eps)
        self.hnorm = RMSNorm(H, config.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias_attr=False)
        self.transformer_layer = DecoderLayer(config, has_indexer=True, mlp_type="sparse", topo=topo)
        self.norm = RMSNorm(H, config.rms_norm_eps)
        self.share_topk = bool(config.index_share_for_mtp_iteration)
        # replicated, applied to this rank's sequence shard under sequence parallel
        mark_sequence_parallel([self.enorm, self.hnorm, self.eh_proj, self.norm], enabled=topo.sequence_parallel)

    def forward(
        self,
        hidden: paddle.Tensor,
        token_embeds: paddle.Tensor,
        cos: paddle.Tensor,
        sin: paddle.Tensor,
        key_padding: paddle.Tensor | None,
        main_topk: paddle.Tensor | None,
        cache: LayerCache | None = None,
        token_valid: paddle.Tensor | None = None,
    ) -> tuple[paddle.Tensor, paddle.Tensor, IndexerRecord | None]:
        """-> (h_d [B, S, H] before `norm`, top-k used, its attention's indexer-training record or None). ``cache``: the
        layer's own decoding cache (speculative decoding drafts with it; ``main_topk`` then holds the
        main model's slots of the same positions, which the MTP cache's slots equal). ``token_valid``:
        the real tokens of this depth's inputs for its MoE's balancing (`mtp_token_valid`) and, with
        its own indexer, the queries that indexer's KL and recall count."""
        x = self.eh_proj(paddle.concat([self.enorm(token_embeds), self.hnorm(hidden)], axis=-1))
        reuse = self.share_topk and main_topk is not None
        topk = main_topk if reuse else None
        h, topk, rec = self.transformer_layer(
            x, cos, sin, key_padding, topk, reuse_topk=reuse, cache=cache, token_valid=token_valid
        )
        if rec is not None and rec.indexer is not None and token_valid is not None:
            count_real_queries(rec, token_valid)  # the fill past the window's end is no query of the data
        return h, topk, rec


def mtp_token_valid(key_padding: paddle.Tensor, depth: int) -> paddle.Tensor:
    """The real tokens of MTP depth ``depth``'s inputs [B, S] (by global position, like
    ``key_padding``; all ones without padding): position i combines h_i with token i + depth, so it
    is real when both are. Past the end of the window the token is the model's fill (its target is
    ignored too): not real, so a window counts the same positions whether padding or the window's
    end follows its last token, with or without a mask."""
    m = key_padding.detach().astype("int64")
    B, S = int(m.shape[0]), int(m.shape[1])
    ahead = paddle.concat([m[:, min(depth, S) :], paddle.zeros([B, min(depth, S)], dtype="int64")], axis=1)
    return m * ahead
