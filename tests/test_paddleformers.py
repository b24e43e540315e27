"""PaddleFormers integration (the `paddleformers` extra): Auto classes resolve a GLM-5.2 folder to
ours only through `integrations.paddleformers.register()`, with a warning per replacement; its
Trainer trains our model with the losses of a one-process `glm52 train` and saves a folder our
`from_pretrained` reads back bit for bit.

Skipped without PaddleFormers; CI runs this file in a second virtualenv that has it (.ci/run).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import warnings

import numpy as np
import pytest

pf = pytest.importorskip("paddleformers", reason="needs the `paddleformers` extra (pip install -e .[paddleformers])")

import paddle  # noqa: E402
from paddleformers.transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer  # noqa: E402
from paddleformers.transformers.auto.configuration import CONFIG_MAPPING  # noqa: E402

from paddleformers_glm import GlmMoeDsaConfig, GlmMoeDsaForCausalLM, GlmTokenizer  # noqa: E402
from paddleformers_glm.integrations import paddleformers as pf_glm  # noqa: E402

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from paddleformers_glm.tiny import make_tiny_checkpoint

    return make_tiny_checkpoint(tmp_path_factory.mktemp("pf") / "tiny")


@pytest.fixture(autouse=True)
def _undo():
    yield
    pf_glm.unregister()


def test_importing_registers_nothing(tiny):
    """Importing the model and the integration module leaves PaddleFormers' own resolution alone."""
    assert not pf_glm.is_registered()
    assert "glm_moe_dsa" not in CONFIG_MAPPING._extra_content
    cfg = AutoConfig.from_pretrained(tiny)
    assert type(cfg).__module__.startswith("paddleformers.transformers.glm_moe_dsa")


@pytest.mark.skipif(pf_glm.paddleformers_model_runs(), reason="paddlefleet is installed here")
def test_paddleformers_own_model_needs_paddlefleet(tiny):
    """Where PaddleFormers 1.2.0 breaks on its own: its GlmMoeDsaForCausalLM cannot be imported
    without paddlefleet, so its AutoModelForCausalLM cannot load a GLM-5.2 folder."""
    with pytest.raises(ImportError, match="paddlefleet"):
        AutoModelForCausalLM.from_pretrained(tiny)


def test_register_resolves_all_three_and_warns_for_each(tiny):
    if pf_glm.paddleformers_model_runs():
        pytest.skip("paddlefleet is installed: the default keeps PaddleFormers' model")
    with pytest.warns(pf_glm.ReplacementWarning) as caught:
        replaced = pf_glm.register()
    assert replaced == ["AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"]
    messages = [str(w.message) for w in caught if issubclass(w.category, pf_glm.ReplacementWarning)]
    assert len(messages) == 3 and all("paddlefleet" in m and "instead of" in m for m in messages)
    assert "paddleformers.transformers.glm_moe_dsa.GlmMoeDsaForCausalLM" in messages[1]

    cfg = AutoConfig.from_pretrained(tiny)
    assert isinstance(cfg, GlmMoeDsaConfig) and cfg.to_dict() == GlmMoeDsaConfig.from_pretrained(tiny).to_dict()
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    assert isinstance(model, GlmMoeDsaForCausalLM)
    direct = GlmMoeDsaForCausalLM.from_pretrained(tiny, dtype="float32")
    ids = paddle.to_tensor(np.arange(3, 19, dtype="int64")[None])
    model.eval()
    np.testing.assert_array_equal(model(ids)["logits"].numpy(), direct(ids).logits.numpy())
    tok = AutoTokenizer.from_pretrained(tiny)
    assert isinstance(tok, GlmTokenizer) and tok("Hello")["input_ids"] == GlmTokenizer.from_pretrained(tiny).encode(
        "Hello"
    )
    # from_config with our config builds ours too
    assert isinstance(AutoModelForCausalLM.from_config(cfg), GlmMoeDsaForCausalLM)
    # a second call changes nothing and warns nothing
    with warnings.catch_warnings():
        warnings.simplefilter("error", pf_glm.ReplacementWarning)
        assert pf_glm.register() == replaced

    pf_glm.unregister()
    assert type(AutoConfig.from_pretrained(tiny)).__module__.startswith("paddleformers.transformers.glm_moe_dsa")
    with pytest.raises(ImportError, match="paddlefleet"):
        AutoModelForCausalLM.from_pretrained(tiny)


def test_with_paddlefleet_the_default_keeps_paddleformers_model(tiny, monkeypatch):
    monkeypatch.setattr(pf_glm, "paddleformers_model_runs", lambda: True)
    with warnings.catch_warnings():
        warnings.simplefilter("error", pf_glm.ReplacementWarning)
        assert pf_glm.register() == []
    assert not pf_glm.is_registered()
    assert type(AutoConfig.from_pretrained(tiny)).__module__.startswith("paddleformers.transformers.glm_moe_dsa")
    with pytest.warns(pf_glm.ReplacementWarning, match="register\\(replace=True\\) was called"):
        assert pf_glm.register(replace=True) == ["AutoConfig", "AutoModelForCausalLM", "AutoTokenizer"]
    assert isinstance(AutoConfig.from_pretrained(tiny), GlmMoeDsaConfig)


def test_other_model_types_still_go_to_paddleformers(tiny, tmp_path):
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    cfg = AutoConfig.from_pretrained(other)
    assert type(cfg).__module__.startswith("paddleformers.transformers.qwen2")


def _trainer_losses(model, batches, steps, lr, out_dir):
    from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments

    class Batches(paddle.io.IterableDataset):
        def __iter__(self):
            for b in batches:
                for r in range(b["input_ids"].shape[0]):
                    yield {"input_ids": b["input_ids"][r], "labels": b["labels"][r]}

    losses = []

    class Record(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                losses.append(float(logs["loss"]))

    args = TrainingArguments(
        output_dir=str(out_dir),
        max_steps=steps,
        per_device_train_batch_size=batches[0]["input_ids"].shape[0],
        learning_rate=lr,
        lr_scheduler_type="constant",
        warmup_steps=0,
        adam_beta1=0.9,
        adam_beta2=0.95,
        adam_epsilon=1e-8,
        weight_decay=0.1,
        max_grad_norm=1.0,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        device="cpu",
        amp_master_grad=False,
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Batches(), callbacks=[Record()])
    trainer.train()
    return trainer, losses


def test_trainer_trains_like_glm52_train_and_saves_for_from_pretrained(tiny, tmp_path):
    """The same tiny checkpoint, synthetic data, AdamW (betas 0.9/0.95, weight decay 0.1 on
    matrices), constant lr (glm52's cosine with --min-lr = --lr) and global-norm clip 1.0, one batch
    of 4 per step, no callback: experts no token reached (steps 2-4 of this data have such experts)
    get a zero-gradient AdamW step in both, as torch does for HF's fused expert tensors: PaddleFormers' Trainer logs the objective glm52
    train optimises (LM loss + 0.1 x MTP loss) at every step; its HF save reloads with our
    from_pretrained bit for bit."""
    from paddleformers_glm.train.data import open_data

    steps, seq, gbs, lr, seed = 4, 32, 4, 1e-3, 1234
    run = tmp_path / "glm52"
    cmd = [sys.executable, "-m", "paddleformers_glm.cli", "train", "--model", str(tiny), "--steps", str(steps)]
    cmd += ["--seq-len", str(seq), "--global-batch-size", str(gbs), "--micro-batch-size", str(gbs)]
    cmd += ["--lr", str(lr), "--min-lr", str(lr), "--weight-decay", "0.1", "--clip-grad", "1.0"]
    cmd += ["--seed", str(seed), "--out", str(run), "--no-progress"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=os.environ.copy())
    assert p.returncode == 0, p.stderr[-3000:]
    ref = json.loads((run / "loss.json").read_text())
    cfg = GlmMoeDsaConfig.from_pretrained(tiny)
    objective = [a + cfg.mtp_loss_scaling_factor * b for a, b in zip(ref["losses"], ref["mtp_losses"])]

    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    # the Trainer's weight-decay rule (not bias / norm) picks the matrices glm52 train decays
    decayed = {
        n for n, p in model.named_parameters() if not p.stop_gradient and not any(k in n for k in ("bias", "norm"))
    }
    assert decayed == {n for n, p in model.named_parameters() if not p.stop_gradient and p.ndim >= 2}
    data = open_data(None, seq, cfg.vocab_size, seed)
    batches = [data.global_batch(s, gbs) for s in range(steps)]
    trainer, losses = _trainer_losses(model, batches, steps, lr, tmp_path / "pf")
    assert len(losses) == steps
    # the Trainer logs losses rounded to 8 decimals; the two runs sum in different orders
    np.testing.assert_allclose(losses, objective, rtol=0, atol=2e-6)
    assert losses[0] != losses[-1]

    save = tmp_path / "pf-save"
    trainer.save_model(str(save), last_fc_to_hf=True)
    assert (save / "config.json").is_file() and (save / "tokenizer.json").is_file()
    back = GlmMoeDsaForCausalLM.from_pretrained(save, dtype="float32")
    trained = dict(model.state_dict())
    reloaded = dict(back.state_dict())
    assert set(trained) == set(reloaded)
    for k, v in trained.items():
        assert reloaded[k].numpy().tobytes() == v.numpy().tobytes(), k
    # the Trainer sets config.use_cache from TrainingArguments.use_cache (default False) for training;
    # the fp32 weights are saved as such and config.json says so, as transformers' save does
    assert GlmMoeDsaConfig.from_pretrained(save).to_dict() == cfg.to_dict() | {"use_cache": False, "dtype": "float32"}


def test_trainer_default_save_is_paddles_distributed_checkpoint(tiny, tmp_path):
    """Where it stops with PaddleFormers 1.2.0: `Trainer.save_model()` without `last_fc_to_hf`
    (its default flex_checkpoint format) writes Paddle's distributed checkpoint (model_state/*.distcp,
    no config.json), which is for resuming the Trainer, not a checkpoint folder; our
    from_pretrained says so by naming the missing config.json."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    data = {"input_ids": np.arange(3, 3 + 4 * 16).reshape(4, 16) % 200}
    data["labels"] = data["input_ids"]
    trainer, _ = _trainer_losses(model, [data], 1, 1e-3, tmp_path / "pf")
    trainer.save_model(str(tmp_path / "default"))
    files = sorted(os.listdir(tmp_path / "default" / "model_state"))
    assert any(f.endswith(".distcp") for f in files), files
    with pytest.raises(FileNotFoundError, match="config"):
        GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "default")


def test_save_pretrained_writes_the_state_dict_the_trainer_passes(tiny, tmp_path):
    """The Trainer's sharding path passes the tensors to save (``state_dict=``): those are written,
    not the model's own (before: the keys were checked and the model's tensors saved)."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    state = dict(model.state_dict())
    key = "model.embedding.embed_tokens.weight"
    state[key] = state[key] * 2.0
    model.save_pretrained(str(tmp_path / "out"), state_dict=state)
    back = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "out", dtype="float32")
    np.testing.assert_array_equal(back.state_dict()[key].numpy(), state[key].numpy())
    assert not np.array_equal(back.state_dict()[key].numpy(), model.state_dict()[key].numpy())
