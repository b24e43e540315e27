"""Run under ``paddle.distributed.launch --nproc_per_node 2``: ``GlmMoeDsaForCausalLM.from_pretrained``
under a two-rank topology (``--tp``/``--ep`` from argv: each rank reads its shards of the
checkpoint), then ``save_pretrained`` on every rank.  Rank 0 writes the returned report to OUT_JSON.
With FLEX_DIR, the flex-checkpoint CPU probe (``check_flex_cpu.probe``) runs after it in the same
processes (a launch less for the suite).

usage: check_save_dist.py CKPT SAVE_DIR OUT_JSON TP EP MAX_SHARD_SIZE [FLEX_DIR]
"""

from __future__ import annotations

import json
import sys

from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.parallel.topology import ParallelConfig, init_topology
from paddleformers_glm.train.glm_adapter import GlmAdapter

ckpt, save_dir, out_json, tp, ep, shard = sys.argv[1:7]
adapter = GlmAdapter(ckpt)
topo = init_topology(ParallelConfig.from_world(2, tp=int(tp), ep=int(ep)), **adapter.parallel_sizes())
model, load = GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype="float32", output_loading_info=True, topology=topo)
local = {k: list(v.shape) for k, v in model.state_dict().items()}
report = model.save_pretrained(save_dir, max_shard_size=shard)
if topo.rank == 0:
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(
            {
                "bytes_read": load.bytes_read,
                "tensors": report.tensors,
                "total_size": report.total_size,
                "files": report.files,
                "local": local,
            },
            f,
        )

if len(sys.argv) > 7:
    from tests._dist.check_flex_cpu import probe

    probe(sys.argv[7])
