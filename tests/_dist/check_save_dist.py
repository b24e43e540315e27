"""Run under ``paddle.distributed.launch --nproc_per_node 2``: builds ``GlmMoeDsaForCausalLM`` under
a two-rank topology (``--tp``/``--ep`` from argv), reads each rank's shards of the checkpoint and
calls ``save_pretrained`` on every rank.  Rank 0 writes the returned report to OUT_JSON.

usage: check_save_dist.py CKPT SAVE_DIR OUT_JSON TP EP MAX_SHARD_SIZE
"""

from __future__ import annotations

import json
import sys

from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.modeling.model import default_dtype
from paddleformers_glm.parallel.topology import ParallelConfig, init_topology
from paddleformers_glm.train.glm_adapter import GlmAdapter

ckpt, save_dir, out_json, tp, ep, shard = sys.argv[1:7]
adapter = GlmAdapter(ckpt)
topo = init_topology(ParallelConfig.from_world(2, tp=int(tp), ep=int(ep)), **adapter.parallel_sizes())
with default_dtype("float32"):
    model = GlmMoeDsaForCausalLM(adapter.config)
adapter.load_stage(model, topo)  # this rank's slices only
model.source_path = ckpt  # what from_pretrained records: the tokenizer files are carried along
local = {k: list(v.shape) for k, v in model.state_dict().items()}
report = model.save_pretrained(save_dir, max_shard_size=shard)
if topo.rank == 0:
    with open(out_json, "w", encoding="utf-8") as f:
        json.dump(
            {"tensors": report.tensors, "total_size": report.total_size, "files": report.files, "local": local}, f
        )
