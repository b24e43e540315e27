"""The torch reference trainer in bf16 (`parity/reference/train.py`, `Reference._to_bf16`): the
model's bf16 parameters as transformers' bf16 model has them, except that every router weight
(`mlp.gate.weight`, main layers and MTP) stays float32, and the correction biases float32.

Why: docs/model.md's bf16 table (the Paddle model's policy, which `glm52 align --dtype bfloat16`
compares against): "parameters: bf16, except the routers' `mlp.gate.weight` (fp32, the official
`moe_router_dtype`)"; `e_score_correction_bias`: "fp32 buffer". transformers (5.23,
`modeling_glm_moe_dsa.py`) keeps only the bias float32 by name
(``_keep_in_fp32_modules_strict = ["e_score_correction_bias"]``; its ``_keep_in_fp32_modules =
["indexer.weights_proj"]`` applies to float16 only, modeling_utils: "will upcast to fp32 only if the
requested dtype is fp16"), and its router computes in fp32 from the bf16 weight
(``F.linear(hidden_states.type(torch.float32), self.weight.type(torch.float32))``). Measured on the
tiny checkpoint: ``GlmMoeDsaForCausalLM.from_pretrained(dtype=torch.bfloat16)`` has 5 routers with
bf16 weights and fp32 biases, its indexer `weights_proj` bf16; the reference's 5 + 1 (MTP) routers
fp32 with the same values. The same values at load, but a router stepped as a float32 parameter is
its own master; one kept bf16 is its fp32 master rounded after every step, and the reference's bf16
losses then move by as much as the drift an align run reports (measured: 1.1e-3 at step 3 of 3), while
the bf16 align test still passes.
"""

from __future__ import annotations

import pytest

from tests._reference import missing_reference_extra

pytestmark = [
    pytest.mark.reference,
    pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra())),
]


def test_reference_bf16_keeps_every_router_weight_and_correction_bias_float32(tmp_path):
    import torch
    import transformers
    from transformers.models.glm_moe_dsa.modeling_glm_moe_dsa import GlmMoeDsaTopkRouter

    from paddleformers_glm.parity.reference.train import Reference, parse_args
    from paddleformers_glm.tiny import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "ckpt")
    ref = Reference(parse_args(["--model", ckpt, "--out", str(tmp_path / "out"), "--dtype", "bfloat16"]))

    routers = [m for mod in (ref.model, ref.mtp) for m in mod.modules() if isinstance(m, GlmMoeDsaTopkRouter)]
    assert len(routers) == 5 + 1  # the tiny config's MoE layers 3-7 and its MTP layer
    for m in routers:
        assert m.weight.dtype == torch.float32 and m.weight.requires_grad
        assert m.e_score_correction_bias.dtype == torch.float32
    biases = ref.router_biases()  # what the bias updates move
    assert len(biases) == 6 and all(b.dtype == torch.float32 for _n, b in biases)
    others = {n: p.dtype for n, p in ref.named_parameters() if not n.endswith("mlp.gate.weight")}
    assert set(others.values()) == {torch.bfloat16}, {n: d for n, d in others.items() if d != torch.bfloat16}

    # transformers' own bf16 load: the router weights bf16 (computed in fp32), the same values
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(ckpt, dtype=torch.bfloat16)
    hf_routers = [m for m in hf.modules() if isinstance(m, GlmMoeDsaTopkRouter)]
    assert len(hf_routers) == 5
    assert {m.weight.dtype for m in hf_routers} == {torch.bfloat16}
    assert {m.e_score_correction_bias.dtype for m in hf_routers} == {torch.float32}
    for ours, theirs in zip(routers, hf_routers):
        assert torch.equal(ours.weight.detach(), theirs.weight.detach().float())
