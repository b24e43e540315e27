"""One launched rank of ``glm52 generate --tp N [--ep M] [--pp P]``: the checkpoint read split over the
job's ranks (each rank only its slices, of its pipeline stage's layers), then ``generate`` on every
rank with the same prompt.

The command (cli/generate.py) checks everything and writes the run's JSON; the launcher starts
``train/worker.py --generate RUN.json`` on each rank (the training worker's life records, so a
failed or stopped rank is named as in training). Each rank appends every step's new token to
``OUT/tokens.rank<R>`` as it is chosen (a node's first rank's file is what the command there
streams) and writes ``OUT/result.rank<R>.json`` at its end; the command checks that the node's ranks
chose the same tokens.
"""

from __future__ import annotations

import os
from typing import Any


def layout_of(spec: dict[str, Any]) -> tuple[int, dict[str, int]]:
    """(world size, ParallelConfig keywords) of ``--tp``/``--ep``/``--pp``: the experts lie over the
    tp x dp ranks of a stage, so an ``ep`` larger than ``tp`` runs ep / tp data-parallel copies of the
    attention, each on the same prompt."""
    tp, ep, pp = int(spec["tp"]), int(spec["ep"]), int(spec.get("pp", 1))
    dp = ep // tp if ep > tp and ep % tp == 0 else 1
    return tp * dp * pp, {"tp": tp, "ep": ep, "pp": pp}


def generate_on_rank(spec: dict[str, Any]) -> None:
    """Run the generation ``spec`` (written by cli/generate.py) as this launched rank."""
    import numpy as np
    import paddle

    from .._io import write_record
    from ..modeling import GlmMoeDsaForCausalLM
    from ..parallel.topology import ParallelConfig, init_topology
    from ..tokenizer import GlmTokenizer
    from ..train.job_status import beat
    from .config import GenerationConfig
    from .search import generate

    world, dims = layout_of(spec)
    beat(0, "connect")  # at the job's default group, where every rank must arrive (launch.still_connecting)
    topo = init_topology(ParallelConfig.from_world(world, **dims), **spec["sizes"])
    beat(0, "setup")
    model = GlmMoeDsaForCausalLM.from_pretrained(spec["model"], dtype=spec["dtype"], topology=topo)
    model.eval()
    defaults = GenerationConfig.from_pretrained(spec["model"], model.config)
    tok = GlmTokenizer.from_pretrained(spec["model"])
    out_dir, rank = spec["out"], topo.rank
    opts = dict(spec["opts"])
    stats: dict = {}
    if spec["speculative"]:
        opts |= {"use_mtp": True, "stats": stats}
    new: list[int] = []
    with open(os.path.join(out_dir, f"tokens.rank{rank}"), "w", encoding="utf-8") as tokens:

        def streamer(step_tokens: np.ndarray) -> None:
            new.append(int(step_tokens[0]))
            tokens.write(f"{new[-1]}\n")
            tokens.flush()

        out = generate(
            model,
            paddle.to_tensor([spec["ids"]], dtype="int64"),
            generation_config=defaults,
            eos_token_id=spec["eos"],
            seed=spec["seed"],
            streamer=None if spec["beams"] else streamer,
            tokenizer=tok,
            return_dict_in_generate=False,  # the ids, whatever generation_config.json says
            **opts,
        )
    chosen = [int(t) for t in out.numpy()[0, len(spec["ids"]) :]]
    write_record(os.path.join(out_dir, f"result.rank{rank}.json"), {"tokens": chosen, "stats": stats})
