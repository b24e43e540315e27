"""Run under ``paddle.distributed.launch --nproc_per_node 2`` (after check_save_dist.py, whose TP2 x EP2
topology it shares): ``generate`` on the tiny checkpoint split over the two ranks: greedy with and
without the cache, beam search, sampling with and without a seed, ``max_time`` on clocks that
disagree, transformers' hand-written cached loop, and a traced decode step.  Each rank writes what it
got to OUT_DIR/rank{r}.json; the test (tests/test_save_distributed.py) compares it with
:func:`generations` of one process and with the other rank's.

With PP = 2 (tests/test_generate_launched.py, its own launch) the model is split into two pipeline
stages instead: each rank also records which layers it built and a forward it refuses by name, and
the stages save the model (OUT_DIR/saved).

usage: check_generate_dist.py CKPT OUT_DIR TP EP [PP]
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import paddle

PROMPT = [[5, 17, 33, 2, 9, 41, 7, 3], [0, 0, 1, 2, 3, 4, 5, 6]]  # the second row left-padded
PROMPT_MASK = [[1] * 8, [0, 0] + [1] * 6]
RUNS = {
    "greedy": dict(do_sample=False),
    "greedy_uncached": dict(do_sample=False, use_cache=False),
    "beams": dict(do_sample=False, num_beams=2),
    "sampled": dict(do_sample=True, top_k=5, temperature=0.8, seed=7),
}


def generations(model: paddle.nn.Layer) -> dict:
    """Each of RUNS' tokens and scores, and the logits of transformers' own loop: an eval forward
    (its default cache) continued by one step."""
    ids, mask = paddle.to_tensor(PROMPT), paddle.to_tensor(PROMPT_MASK)
    res = {}
    for name, kw in RUNS.items():
        o = model.generate(
            ids, attention_mask=mask, max_new_tokens=5, eos_token_id=[], return_dict_in_generate=True,
            output_scores=True, **kw,
        )  # fmt: skip
        res[name] = {"tokens": o.sequences.numpy().tolist(), "scores": [s.numpy().tolist() for s in o.scores]}
    # right padding: each row's first new token follows its last real token (generate's own rule)
    right = paddle.to_tensor([[1] * 8, [1] * 5 + [0] * 3])
    o = model.generate(ids, attention_mask=right, max_new_tokens=3, eos_token_id=[], do_sample=False)
    res["right_padded"] = {"tokens": o.numpy().tolist()}
    first = model(ids, attention_mask=mask)
    grown = paddle.concat([mask, paddle.ones([2, 1], mask.dtype)], 1)
    step = model(paddle.to_tensor([[7], [8]]), attention_mask=grown, past_key_values=first.past_key_values)
    res["forward_cache"] = {"first": first.logits[:, -1].numpy().tolist(), "step": step.logits[:, -1].numpy().tolist()}
    return res


def main() -> None:
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from paddleformers_glm.parallel.topology import ParallelConfig, init_topology
    from paddleformers_glm.train.glm_adapter import GlmAdapter

    ckpt, out_dir, tp, ep = sys.argv[1], Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    pp = int(sys.argv[5]) if len(sys.argv) > 5 else 1
    topo = init_topology(ParallelConfig.from_world(2, tp=tp, ep=ep, pp=pp), **GlmAdapter(ckpt).parallel_sizes())
    model = GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype="float32", topology=topo)
    model.eval()
    res = generations(model)
    if pp > 1:
        res["built"] = {"stage_layers": list(model.stage.layers), "layers": model.model.layer_ids,
                        "head": hasattr(model, "lm_head"), "params": sum(int(p.size) for p in model.parameters())}  # fmt: skip
        ids = paddle.to_tensor([PROMPT[0]])
        o = model.generate(ids, max_new_tokens=6, eos_token_id=[], prompt_lookup_num_tokens=2, stats=(st := {}))
        res["lookup"] = {"tokens": o.numpy().tolist(), "stats": st}
        try:
            model(ids, labels=ids)
            res["labels"] = "ran"
        except NotImplementedError as e:
            res["labels"] = str(e)
        model.save_pretrained(out_dir / "saved")  # each stage writes its own tensors
    with paddle.no_grad():  # the MoE layers' inference form: experts span the TP group (ep 2 = tp 2)
        res["sums_partials"] = [not layer.mlp.training and layer.mlp.dispatcher.sums_partials()
                                for layer in model.model.decoder_layers
                                if getattr(layer.mlp, "dispatcher", None) is not None]  # fmt: skip
    ids, mask = paddle.to_tensor(PROMPT), paddle.to_tensor(PROMPT_MASK)
    # unseeded sampling: the ranks agree on a seed (the first rank's); the tokens differ from run to run
    o = model.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=[], do_sample=True, top_k=20)
    res["sampled_unseeded"] = {"tokens": o.numpy().tolist()}
    # max_time read on each rank's own clock, here as far apart as can be: rank 1 is out of time at once,
    # rank 0 never; the ranks stop together (one alone would wait on the other's collectives forever)
    limit = 0.0 if topo.rank else 1e9
    o = model.generate(ids, attention_mask=mask, max_new_tokens=5, eos_token_id=[], max_time=limit)
    res["max_time"] = {"tokens": o.numpy().tolist()}
    # a decode step traced into a static graph: Paddle 3.3's collectives take no group there, refused by name
    try:
        static = paddle.jit.to_static(model.decode_step, full_graph=True)
        model.generate(ids, attention_mask=mask, max_new_tokens=2, eos_token_id=[], decode_step=static)
        res["to_static"] = "ran"
    except NotImplementedError as e:
        res["to_static"] = str(e)
    if pp > 1:  # the last stage given another input than the first ran: named (stage 0 then waits on
        # the logits: the last stage sends it some, as a rank whose error ends the job would not)
        try:
            model(paddle.to_tensor([PROMPT[0][: 6 if topo.rank else 8]]), use_cache=False)
            res["mismatch"] = "ran"
        except ValueError as e:
            res["mismatch"] = str(e)
            from paddleformers_glm.parallel import comm

            comm.broadcast_tensor(paddle.zeros([1, 1, 1]), topo.stage_ranks[-1], topo.pp_group)
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"rank{topo.rank}.json").write_text(json.dumps(res), encoding="utf-8")


if __name__ == "__main__":
    main()
