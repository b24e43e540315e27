"""Run on 2 launched ranks (the shared TP2 launch, tests/conftest.py): rank 1 alone holds the
non-finite value or the longer report, as a pipeline's last stage alone holds the loss terms or an
expert-parallel rank alone holds its experts.  Writes rank 0's view and rank 1's view to the JSON
path given as argv[1] (each rank its own ``.rank<N>`` file)."""

from __future__ import annotations

import json
import math
import sys

import paddle
import paddle.distributed as dist

from paddleformers_glm.parallel.grads import GradSynchronizer
from paddleformers_glm.parallel.topology import get_topology
from paddleformers_glm.train.nonfinite import NonFiniteStep, check_written_state, gather_json, loss_flag

rank = dist.get_rank()
res: dict = {}

# a report longer on rank 1 than on rank 0 comes back whole on every rank
reports = gather_json({"rank": rank, "pad": "x" * (5 if rank == 0 else 500)}, 2)
res["gather_lengths"] = [len(r["pad"]) for r in reports]

# NaN in rank 1's state only: every rank refuses the write, naming rank 1
state = {"model/w": paddle.ones([4]) * (float("nan") if rank == 1 else 1.0)}
try:
    check_written_state(state, rank, 2, 3, "resume state")
    res["written_state_refused_for_rank"] = None
except NonFiniteStep as e:
    res["written_state_refused_for_rank"] = e.record["rank"]

# rank 1's NaN loss sum (its second term) reaches every rank through the trainer's global norm,
# whose gradients are finite everywhere
model = paddle.nn.Linear(3, 4)
model(paddle.ones([2, 3])).sum().backward()
sync = GradSynchronizer(model, get_topology())
grads = sync.main_grads()[0]
# each gradient element is 2 (the sum over a batch of 2 rows of ones) whatever the weights: 16 elements,
# replicated on both ranks and counted once
res["finite_norm"] = sync.global_norm(grads, loss_flag([1.0, 2.0]))
res["norm_is_nan"] = math.isnan(sync.global_norm(grads, loss_flag([1.0, float("nan") if rank == 1 else 2.0])))

with open(f"{sys.argv[1]}.rank{rank}", "w", encoding="utf-8") as f:
    json.dump(res, f)
