"""``save_pretrained`` of a model split over ranks: every rank writes the official-layout tensors
it owns (TP/EP pieces merged, one writer per tensor, the index last); the folder is byte-identical,
file for file, to a one-process ``save_pretrained`` of the same weights (tokenizer files included)."""

from __future__ import annotations

import filecmp
import json
from pathlib import Path

import pytest

from paddleformers_glm.checkpoint.distributed import save_pretrained_distributed


@pytest.fixture(scope="module")
def tiny_ckpt(tmp_path_factory) -> Path:
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return Path(make_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "ckpt"))


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

    return GlmMoeDsaForCausalLM.from_pretrained(str(tiny_ckpt), dtype="float32")


@pytest.fixture(scope="module")
def reference(model, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("ref") / "save"
    model.save_pretrained(out, max_shard_size="1MB")
    return out


def _same_folder(a: Path, b: Path) -> None:
    names = sorted(p.name for p in a.iterdir())
    assert names == sorted(p.name for p in b.iterdir())
    _, mismatch, errors = filecmp.cmpfiles(a, b, names, shallow=False)
    assert not mismatch and not errors, (mismatch, errors)


def test_one_rank_distributed_save_equals_save_pretrained(model, reference, tmp_path):
    report = save_pretrained_distributed(
        model, tmp_path / "out", max_shard_size="1MB", carry_from=model.source_path, dtype=model.compute_dtype
    )
    assert len(list(reference.glob("*.safetensors"))) > 1  # the index is exercised
    _same_folder(tmp_path / "out", reference)
    index = json.loads((reference / "model.safetensors.index.json").read_text())
    assert report.tensors == len(index["weight_map"])
    assert report.total_size == index["metadata"]["total_size"]


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"layout": "fleet"}, "layout='hf' only"),
        ({"quantization": "fp8"}, "cannot quantize"),
        ({"metadata": {"format": "np"}}, "metadata"),
    ],
)
def test_distributed_save_refuses_what_it_cannot_write(model, tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        save_pretrained_distributed(model, tmp_path / "out", **kwargs)
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
def test_tp2_ep2_from_pretrained_then_save_pretrained_equals_the_one_process_save(dist_save_and_flex_probe, reference):
    run = dist_save_and_flex_probe  # the launch (shared with the flex-checkpoint probe): conftest.py
    p, d, tiny_ckpt = run["proc"], run["dir"], run["ckpt"]
    assert p.returncode == 0, p.stderr[-2000:] + run["logs"][-4000:]
    got = json.loads((d / "r.json").read_text())
    # from_pretrained read rank 0's slices only, and the ranks really held pieces: half the heads
    # of q_b_proj, half the routed experts
    weights = sum(p.stat().st_size for p in tiny_ckpt.glob("*.safetensors"))
    assert 0 < got["bytes_read"] < 0.6 * weights, (got["bytes_read"], weights)
    assert got["local"]["model.layers.0.self_attn.q_b_proj.weight"] == [48, 96]
    assert "model.layers.3.mlp.experts.4.up_gate_proj.weight" not in got["local"]
    _same_folder(d / "save", reference)
    assert got["tensors"] == len(json.loads((reference / "model.safetensors.index.json").read_text())["weight_map"])


def test_generate_on_the_tp2_ep2_split_model_equals_one_process(dist_save_and_flex_probe):
    """The same launch then runs ``generate`` on the split model (tests/_dist/check_generate_dist.py):
    with the cache (each rank attends with its half of the heads over the replicated latent cache, the
    outputs summed over TP), without it, with beams and with seeded sampling: tokens equal one
    process's, scores within fp32 reduction-order error; an eval forward's default cache continued by
    a step: one process's logits. Both ranks chose the same tokens and stopped together, unseeded
    sampling and disagreeing ``max_time`` clocks included; a traced decode step is refused by name."""
    import numpy as np

    from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
    from tests._dist.check_generate_dist import generations

    run = dist_save_and_flex_probe
    d = run["dir"] / "generate"
    assert run["proc"].returncode == 0 and (d / "rank1.json").is_file(), (
        run["proc"].stderr[-2000:] + run["logs"][-4000:]
    )
    ranks = [json.loads((d / f"rank{r}.json").read_text()) for r in range(2)]
    model = GlmMoeDsaForCausalLM.from_pretrained(str(run["ckpt"]), dtype="float32")
    model.eval()
    want = generations(model)
    assert sorted(ranks[0]) == sorted([*want, "sampled_unseeded", "max_time", "to_static", "sums_partials"])
    # generate ran the MoE layers' inference form (each rank's experts on every token, one all-reduce)
    assert ranks[0]["sums_partials"] and all(ranks[0]["sums_partials"]), ranks[0]["sums_partials"]
    for name, one in want.items():
        if name == "forward_cache":
            for k in ("first", "step"):
                np.testing.assert_allclose(ranks[0][name][k], one[k], rtol=0, atol=2e-5, err_msg=k)
            continue
        assert ranks[0][name]["tokens"] == ranks[1][name]["tokens"] == one["tokens"], name
        for got, exp in zip(ranks[0][name].get("scores", []), one.get("scores", [])):
            got, exp = np.array(got), np.array(exp)
            finite = np.isfinite(exp)  # top-k sampling masks the rest with -inf
            assert (np.isfinite(got) == finite).all(), name
            np.testing.assert_allclose(got[finite], exp[finite], rtol=0, atol=2e-5, err_msg=name)
    # no seed: the ranks drew with the first rank's; max_time: rank 1 timed out at once, rank 0 never
    # would, and both stopped after the first new token (transformers' MaxTimeCriteria stops all rows)
    assert ranks[0]["sampled_unseeded"] == ranks[1]["sampled_unseeded"]
    assert ranks[0]["max_time"] == ranks[1]["max_time"] and len(ranks[0]["max_time"]["tokens"][0]) == 8 + 1
    # (to_static puts the traced source before the message)
    assert (
        "NotImplementedError: decode_step traced by paddle.jit.to_static on a model split over ranks"
        in ranks[0]["to_static"]
    )
