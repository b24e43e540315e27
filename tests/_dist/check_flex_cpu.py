"""Probe (2 gloo ranks): flex-checkpoint's stock resharding load on a CPU build.

Saves a [8, 4] tensor split by rows, loads it split by columns.  Prints ``NO_SHIM <error>`` for
the stock load alone and ``SHIM ok=<bool>`` for the same load inside ``flex_checkpoint_on_cpu``.
Run alone under ``paddle.distributed.launch`` (``check_flex_cpu.py DIR``), or as ``probe(DIR)``
at the end of another two-rank check (one launch less)."""

from __future__ import annotations

import sys

import numpy as np
import paddle
import paddle.distributed as dist
from paddle.distributed.flex_checkpoint.dcp.sharded_weight import ShardedWeight

from paddleformers_glm.parallel.fleet_gloo import flex_checkpoint_on_cpu


def _by_columns(r: int) -> tuple[paddle.Tensor, dict]:
    t = paddle.zeros([8, 2])
    return t, {
        "w": ShardedWeight(key="w", local_tensor=t, local_shape=(8, 2), global_shape=(8, 4), global_offset=(0, 2 * r))
    }


def probe(path: str) -> None:
    """The probe on an initialised two-rank process group."""
    r = dist.get_rank()
    full = np.arange(32, dtype="float32").reshape(8, 4)
    rows = paddle.to_tensor(full[4 * r : 4 * r + 4])
    dist.save_state_dict(
        {
            "w": ShardedWeight(
                key="w", local_tensor=rows, local_shape=(4, 4), global_shape=(8, 4), global_offset=(4 * r, 0)
            )
        },
        path,
    )
    dist.barrier()
    _, sd = _by_columns(r)
    try:
        dist.load_state_dict(sd, path)
        print(f"NO_SHIM loaded rank {r}", flush=True)
    except Exception as e:  # the CPU gap: the resharder moves slices to a GPU
        print(f"NO_SHIM {type(e).__name__}: {e}", flush=True)
    dist.barrier()
    t, sd = _by_columns(r)
    with flex_checkpoint_on_cpu():
        dist.load_state_dict(sd, path)
    print(f"SHIM ok={np.array_equal(t.numpy(), full[:, 2 * r : 2 * r + 2])} rank {r}", flush=True)
    assert paddle.Tensor.cuda is not None and "lambda" not in repr(paddle.Tensor.cuda)  # restored


def main() -> None:
    dist.init_parallel_env()
    probe(sys.argv[1])


if __name__ == "__main__":
    main()
