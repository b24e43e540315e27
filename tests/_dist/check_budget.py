"""Per-rank memory budget check: load a GLM checkpoint as this rank's stage (own share only) and
export it with ``export_distributed``, measuring how far this process's resident memory rose above
its baseline (taken after imports and process-group setup), and how far it rose during the export
above its resident memory when the export began (``export_growth``).  Run under ``paddle.distributed.launch``
(or alone with ``--whole``: one process that builds the whole model, the control showing that the
measurement sees a full build).  Writes ``OUT_JSON.rank<N>`` with the rank's numbers.

usage: check_budget.py CKPT EXPORT_DIR OUT_JSON [--tp N --pp N --ep N] [--whole]
"""

from __future__ import annotations

import argparse
import gc
import json
import os


def _status() -> dict[str, int]:
    out = {}
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            key, _, rest = line.partition(":")
            if key in ("VmRSS", "VmHWM"):
                out[key] = int(rest.split()[0]) * 1024
    return out


def _reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark to the current RSS (Linux >= 4.0); False where not allowed."""
    try:
        with open("/proc/self/clear_refs", "w", encoding="ascii") as f:
            f.write("5")
        return True
    except OSError:
        return False


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("ckpt")
    ap.add_argument("export_dir")
    ap.add_argument("out_json")
    ap.add_argument("--tp", type=int, default=1)
    ap.add_argument("--pp", type=int, default=1)
    ap.add_argument("--ep", type=int, default=1)
    ap.add_argument("--pp-layout", default=None)
    ap.add_argument("--whole", action="store_true", help="build the whole model in this one process")
    a = ap.parse_args()

    import paddle  # noqa: F401  (imported before the baseline)

    from paddleformers_glm.checkpoint import aoa  # noqa: F401
    from paddleformers_glm.checkpoint.distributed import export_distributed
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.parallel.pipeline import StageSpec, split_stages
    from paddleformers_glm.parallel.topology import ParallelConfig, init_topology
    from paddleformers_glm.train.glm_adapter import GlmAdapter

    world = int(os.environ.get("PADDLE_TRAINERS_NUM", "1") or 1)
    adapter = GlmAdapter(a.ckpt)
    c = adapter.config
    pc = ParallelConfig.from_world(world, tp=a.tp, pp=a.pp, ep=a.ep)
    topo = init_topology(pc, **adapter.parallel_sizes())
    if a.whole:
        spec = StageSpec.whole(c.num_hidden_layers, c.num_mtp_layers > 0)
    else:
        spec = split_stages(c.num_hidden_layers, pc.pp, layout=a.pp_layout, has_mtp=c.num_mtp_layers > 0)[topo.stage]

    gc.collect()
    exact = _reset_peak()
    base = _status()
    base_rss = base["VmRSS"]  # without a reset the later peak may be an older, higher one: over-counts

    module = GlmMoeDsaForCausalLM(c, "float32", topology=topo, stage=spec)
    load = adapter.load_stage(module, topo)
    after_load = _status()["VmHWM"]
    params = sum(int(p.numel()) * p.element_size() for p in module.parameters())
    gc.collect()
    _reset_peak()  # the export's own peak, above the resident memory it starts from
    before_export = _status()["VmRSS"]
    info = export_distributed(module, c, a.export_dir, topo)
    export_peak = _status()["VmHWM"]
    peak = max(after_load, export_peak)

    rec = {
        "rank": topo.rank,
        "stage": topo.stage,
        "peak_reset": exact,
        "baseline_rss": base_rss,
        "load_growth": after_load - base_rss,
        "growth": peak - base_rss,
        "export_growth": export_peak - before_export,
        "tp_rank": topo.tp_rank,
        "params_bytes": params,
        "bytes_read": load["bytes_read"],
        "exported_bytes": info["bytes"],
    }
    with open(f"{a.out_json}.rank{topo.rank}", "w", encoding="utf-8") as f:
        json.dump(rec, f)


if __name__ == "__main__":
    main()
