"""Shared experts for n_shared_experts > 1: one SwiGLU MLP `moe_intermediate_size * n_shared_experts`
wide, as transformers builds it (`modeling_glm_moe_dsa.py`, `GlmMoeDsaMoE.__init__`:
``GlmMoeDsaMLP(config=config, intermediate_size=config.moe_intermediate_size * config.n_shared_experts)``).

Every config in the repo has n_shared_experts 1 (and test_checkpoint_hf_saved.py covers 0), so a model
that built the shared experts `moe_intermediate_size` wide whatever n_shared_experts is passed every
other test. Measured with transformers 5.23, `GlmMoeDsaForCausalLM(config).state_dict()` on the tiny
config (hidden 64, moe_intermediate_size 32; layers 3-7 and the MTP layer 8 are MoE layers):

* n_shared_experts=2: ``model.layers.3.mlp.shared_experts.gate_proj.weight`` (64, 64),
  ``up_proj.weight`` (64, 64), ``down_proj.weight`` (64, 64);
* n_shared_experts=3: gate_proj (96, 64), up_proj (96, 64), down_proj (64, 96).
"""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

from paddleformers_glm.modeling import GlmMoeDsaForCausalLM

from ._reference import missing_reference_extra
from ._tiny import tiny_model, tokens

# transformers' state-dict shapes ([out, in], the official checkpoint's) of one MoE layer's shared
# experts on the tiny config, measured (module docstring)
HF_SHAPES = {
    2: {"gate_proj": (64, 64), "up_proj": (64, 64), "down_proj": (64, 64)},
    3: {"gate_proj": (96, 64), "up_proj": (96, 64), "down_proj": (64, 96)},
}
MOE_LAYERS = (3, 4, 5, 6, 7, 8)  # the tiny config's MoE layers and its MTP layer


def _headers(folder) -> dict[str, tuple[str, tuple]]:
    """(dtype, shape) of every tensor in a checkpoint folder, read with the safetensors library."""
    from safetensors import safe_open

    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="numpy") as h:
            for k in h.keys():
                sl = h.get_slice(k)
                out[k] = (sl.get_dtype(), tuple(sl.get_shape()))
    return out


def _values(folder) -> dict[str, np.ndarray]:
    """Every tensor of a checkpoint folder as float32, read with the safetensors library."""
    from safetensors import safe_open

    out = {}
    for f in sorted(pathlib.Path(folder).glob("*.safetensors")):
        with safe_open(str(f), framework="paddle") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k).astype("float32").numpy()
    return out


@pytest.mark.parametrize("n", [2, 3])
def test_shared_experts_are_n_times_moe_intermediate_wide_as_transformers(n, tmp_path):
    """The model's shared experts and what it saves have transformers' shapes (measured above)."""
    model = tiny_model(seed=0, n_shared_experts=n)
    H, width = 64, 32 * n
    for i in (3, 4, 5, 6, 7):
        mlp = model.model.layers[i].mlp.shared_experts
        assert list(mlp.up_gate_proj.weight.shape) == [H, 2 * width], i  # Paddle's [in, out], gate | up
        assert list(mlp.down_proj.weight.shape) == [width, H], i
    model.save_pretrained(tmp_path / "ours")
    saved = _headers(tmp_path / "ours")
    for i in MOE_LAYERS:
        for proj, shape in HF_SHAPES[n].items():
            assert saved[f"model.layers.{i}.mlp.shared_experts.{proj}.weight"][1] == shape, (i, proj)


def test_checkpoint_with_two_shared_experts_loads_and_round_trips(tmp_path):
    """An official-layout checkpoint with n_shared_experts 2 (written from the checkpoint contract,
    not from the model): loads into the model, runs, and saves back to the same tensors."""
    import paddle

    from paddleformers_glm.checkpoint import save_pretrained_state
    from paddleformers_glm.tiny import init_state
    from paddleformers_glm.tiny import tiny_config as official_tiny_config

    config = official_tiny_config(n_shared_experts=2)
    state = {k: paddle.to_tensor(v) for k, v in init_state(config, seed=2).items()}
    save_pretrained_state(state, config, tmp_path / "src", layout="hf", max_shard_size="1MB")
    src = _headers(tmp_path / "src")
    assert src["model.layers.3.mlp.shared_experts.gate_proj.weight"][1] == HF_SHAPES[2]["gate_proj"]

    model = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "src", dtype="float32").eval()
    assert model.config.n_shared_experts == 2
    logits = model(tokens(2, 16)).logits
    assert bool(paddle.isfinite(logits).all())
    model.save_pretrained(tmp_path / "back", max_shard_size="1MB")
    src_values, back_values = _values(tmp_path / "src"), _values(tmp_path / "back")
    assert back_values.keys() == src_values.keys()
    for k, v in src_values.items():  # bf16 source, fp32 model: the same numbers both ways
        assert np.array_equal(back_values[k], v), k
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "back", dtype="float32").eval()
    np.testing.assert_array_equal(back(tokens(2, 16)).logits.numpy(), logits.numpy())


@pytest.mark.reference
@pytest.mark.skipif(missing_reference_extra() is not None, reason=str(missing_reference_extra()))
def test_two_shared_experts_logits_match_transformers(tmp_path):
    """transformers' tiny model with n_shared_experts 2, random weights, saved by its save_pretrained:
    loaded here, the logits within 1e-5 of its own (measured 3.2e-6 of max 4.2, fp32, batch 2 x 16)."""
    import torch
    import transformers

    from tests.conftest import TINY_CONFIG

    cfg = transformers.GlmMoeDsaConfig.from_pretrained(TINY_CONFIG.parent, n_shared_experts=2)
    torch.manual_seed(0)
    hf = transformers.GlmMoeDsaForCausalLM(cfg).float().eval()
    with torch.no_grad():
        for _n, p in hf.named_parameters():
            if p.ndim == 2:
                p.normal_(0, p.shape[-1] ** -0.5)
    assert tuple(hf.model.layers[3].mlp.shared_experts.gate_proj.weight.shape) == HF_SHAPES[2]["gate_proj"]
    hf.save_pretrained(tmp_path / "hf")
    ids = tokens(2, 16)
    with torch.no_grad():
        want = hf(input_ids=torch.from_numpy(ids.numpy())).logits.numpy()
    ours = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "hf", dtype="float32").eval()
    assert ours.config.n_shared_experts == 2
    np.testing.assert_allclose(ours(ids).logits.numpy(), want, rtol=0, atol=1e-5)
