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


def _trainer_losses(model, batches, steps, lr, out_dir, **extra):
    from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments

    class Batches(paddle.io.IterableDataset):
        """glm52's batches (HF convention: labels = tokens) as PaddleFormers' data feeds them:
        input tokens[:-1], labels tokens[1:] (the same predictions, one position fewer)."""

        def __iter__(self):
            for b in batches:
                for r in range(b["input_ids"].shape[0]):
                    yield {"input_ids": b["input_ids"][r][:-1], "labels": b["labels"][r][1:]}

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
        **extra,
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


def test_save_pretrained_on_a_rank_that_is_not_the_main_process_writes_nothing(tiny, tmp_path):
    """PaddleFormers' Trainer calls ``save_pretrained(dir, is_main_process=...)`` on every rank (the
    flag also comes second, positionally): only the main process writes.  Every rank writing the same
    folder at once would race on its files."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    assert model.save_pretrained(str(tmp_path / "kw"), is_main_process=False) is None
    assert model.save_pretrained(str(tmp_path / "pos"), False) is None
    assert not (tmp_path / "kw").exists() and not (tmp_path / "pos").exists()
    model.save_pretrained(str(tmp_path / "main"), is_main_process=True)
    assert (tmp_path / "main" / "config.json").is_file()


def test_forward_with_return_dict_false_gives_a_tuple(tiny):
    """PaddleFormers' (and transformers') convention: ``return_dict=False`` returns the output's
    fields that are set, in order, as a plain tuple (loss first when labels are given); code that
    unpacks ``loss, logits = model(..., return_dict=False)[:2]`` would otherwise get a ModelOutput."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    model.eval()
    ids = paddle.to_tensor([[1, 2, 3, 4, 5]])
    out = model(ids, labels=ids)
    got = model(ids, labels=ids, return_dict=False)
    assert type(got) is tuple
    assert float(got[0]) == float(out.loss)
    np.testing.assert_array_equal(got[1].numpy(), out.logits.numpy())


def test_enable_recompute_is_true_for_every_recompute_but_none(tiny):
    """``enable_recompute`` (PaddleFormers' switch, which its Trainer and workflows read) answers True
    for any recompute the model runs, ``"core"`` included, and False only for ``"none"``; setting it
    True recomputes every layer (``"full"``), as the property's docstring says.  A model in core
    recompute would otherwise report that it does not recompute."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    for mode, want in (("none", False), ("core", True), ("full", True)):
        model.recompute = mode
        assert model.enable_recompute is want, mode
    model.recompute = "none"
    model.enable_recompute = True
    assert model.recompute == "full"


def test_labels_follow_paddleformers_convention(tiny):
    """PaddleFormers' causal LMs do not shift labels: its criterion (`CriterionLayer`, the "sft"
    loss its Qwen2ForCausalLM calls) scores logits[i] against labels[i], and its data (SFTDataset,
    the pretraining workflows) feed input tokens[:-1] with labels tokens[1:]; its "mtp_sft" loss
    scores MTP depth d against labels[i + d]. The model registered for PaddleFormers takes that
    convention (before: it shifted once more, HF's way, so position i trained on token i + 2:
    on this batch 5.5975 against PaddleFormers' own criterion's 5.5702)."""
    from paddleformers.nn.criterion.interface import CriterionLayer

    theirs = AutoConfig.from_pretrained(tiny)  # PaddleFormers' own config (before register)
    criterion = CriterionLayer(theirs, loss_type="sft")
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    model.eval()
    tokens = np.random.default_rng(0).integers(3, 200, size=(2, 17)).astype("int64")
    targets = tokens.copy()
    targets[0, :5] = -100  # a prompt the loss skips
    ids, labels = paddle.to_tensor(tokens[:, :-1]), paddle.to_tensor(targets[:, 1:])
    out = model(input_ids=ids, labels=labels)
    lm, _ = criterion(out["logits"], labels)
    np.testing.assert_allclose(float(out["loss"]), float(lm), rtol=1e-6)
    mtp_logits = GlmMoeDsaForCausalLM.forward(model, ids, labels=labels, labels_shifted=True).mtp_logits[0]
    mtp, _ = criterion(mtp_logits[:, :-1], labels[:, 1:])  # "mtp_sft": depth 1 against labels[:, 1:]
    np.testing.assert_allclose(float(out["mtp_loss"]), float(mtp), rtol=1e-6)
    # the same losses as HF's convention on the whole tokens (our own forward, labels = tokens)
    hf = GlmMoeDsaForCausalLM.forward(model, paddle.to_tensor(tokens), labels=paddle.to_tensor(targets))
    np.testing.assert_allclose(
        [float(out["loss"]), float(out["mtp_loss"])], [float(hf.loss), float(hf.mtp_loss)], rtol=1e-6
    )


def test_from_pretrained_keywords_override_the_config(tiny):
    """transformers' `AutoModelForCausalLM.from_pretrained(path, use_cache=False)` sets
    `config.use_cache` False and refuses a keyword that is neither a loading option nor a config
    key (TypeError; measured with transformers 5.23); PaddleFormers' from_pretrained puts such
    keywords on the config too. Before: every such keyword was refused with "config overrides
    [...] given with an explicit config" (a config the caller never gave), PaddleFormers'
    `tensor_parallel_degree=1` and `load_state_as_np` included; `from_config` refused
    `paddle_dtype`, which `from_pretrained` takes."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    assert GlmMoeDsaConfig.from_pretrained(tiny).use_cache is True
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32", use_cache=False)
    assert model.config.use_cache is False
    with pytest.raises(TypeError, match="not_a_config_key"):
        AutoModelForCausalLM.from_pretrained(tiny, dtype="float32", not_a_config_key=1)
    kept = AutoModelForCausalLM.from_pretrained(
        tiny, dtype="float32", tensor_model_parallel_size=1, tensor_parallel_rank=0, load_via_cpu=True
    )
    assert kept.config.to_dict() == GlmMoeDsaConfig.from_pretrained(tiny).to_dict()
    # PaddleFormers 1.2.0's from_pretrained takes tensor_model_parallel_size as its TP degree (not a
    # config key to carry): a split is refused, not built as one process with a config saying 2
    with pytest.raises(ValueError, match="tensor_model_parallel_size=2.*one process"):
        AutoModelForCausalLM.from_pretrained(tiny, dtype="float32", tensor_model_parallel_size=2)
    with pytest.raises(ValueError, match="tensor_parallel_degree=2"):
        AutoModelForCausalLM.from_pretrained(tiny, dtype="float32", tensor_parallel_degree=2)
    built = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny), paddle_dtype="bfloat16")
    assert built.compute_dtype == "bfloat16"
    # PaddleFormers' collate_fn 4-D mask [B, 1, S, S] (before: Paddle's "expand_v2 ... rank (5)" from
    # deep in the attention) needs its position_ids (test_packed_sequences_of_paddleformers_collators);
    # another mask than [B, S] key padding is refused by name
    ids = paddle.to_tensor(np.arange(3, 11, dtype="int64")[None])
    with pytest.raises(ValueError, match="packed sequences .* need PaddleFormers' position_ids"):
        model(input_ids=ids, attention_mask=paddle.tril(paddle.ones([1, 1, 8, 8])))
    with pytest.raises(ValueError, match=r"attention_mask of shape \[1, 8, 8\].*key-padding"):
        model(input_ids=ids, attention_mask=paddle.tril(paddle.ones([1, 8, 8])))


def test_subfolder_reaches_the_checkpoint(tiny, tmp_path):
    """transformers 5.23 reads ``from_pretrained(repo, subfolder="model")`` from ``repo/model`` (config,
    model and tokenizer; measured on the tiny fixture), as our own classes now do. Before: the
    integration dropped ``subfolder`` as a download option, so all three looked in ``repo`` and
    failed (no config file at repo/config.json)."""
    import shutil

    shutil.copytree(tiny, tmp_path / "repo" / "model")
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    repo = str(tmp_path / "repo")
    assert (
        AutoConfig.from_pretrained(repo, subfolder="model").to_dict() == GlmMoeDsaConfig.from_pretrained(tiny).to_dict()
    )
    model = AutoModelForCausalLM.from_pretrained(repo, subfolder="model", dtype="float32")
    want = GlmMoeDsaForCausalLM.from_pretrained(tiny, dtype="float32")
    ids = paddle.to_tensor(np.arange(3, 11, dtype="int64")[None])
    assert model(input_ids=ids).logits.numpy().tobytes() == want(ids).logits.numpy().tobytes()
    assert (
        AutoTokenizer.from_pretrained(repo, subfolder="model")("hello")["input_ids"]
        == GlmTokenizer.from_pretrained(tiny)("hello")["input_ids"]
    )


def test_paddleformers_collator_pads_for_the_model(tiny):
    """PaddleFormers' DataCollatorForSeq2Seq calls `tokenizer.pad(..., return_attention_mask=...)`
    (transformers' signature; None/True give the mask, False leaves it out, measured with
    transformers 5.23) on the tokenizer AutoTokenizer gives: before, GlmTokenizer.pad raised
    TypeError (unexpected keyword 'return_attention_mask'). Its padded batch (labels padded with
    -100, the [B, S] mask, either side) gives the token-weighted mean of the rows' own losses."""
    from paddleformers.data import DataCollatorForSeq2Seq

    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    tok = AutoTokenizer.from_pretrained(tiny)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    model.train()
    rng = np.random.default_rng(0)
    rows = []
    for n in (12, 7):
        t = rng.integers(3, 200, size=n + 1)
        labels = t[1:].copy()
        labels[:3] = -100  # a prompt
        rows.append({"input_ids": t[:-1].tolist(), "labels": labels.tolist()})
    own = [
        float(model(input_ids=paddle.to_tensor([r["input_ids"]]), labels=paddle.to_tensor([r["labels"]]))["loss"])
        for r in rows
    ]
    counts = [sum(x != -100 for x in r["labels"]) for r in rows]
    for side in ("right", "left"):
        tok.padding_side = side
        batch = DataCollatorForSeq2Seq(tokenizer=tok, return_tensors="np")([dict(r) for r in rows])
        assert batch["attention_mask"].shape == batch["labels"].shape == (2, 12)
        out = model(**{k: paddle.to_tensor(v) for k, v in batch.items()})
        # (each row's MTP targets are its LM targets but the first, a -100 here: the same counts)
        np.testing.assert_allclose(float(out["loss"]), np.dot(own, counts) / sum(counts), rtol=2e-6)
    assert "attention_mask" not in tok.pad([{"input_ids": [5, 6]}, {"input_ids": [7]}], return_attention_mask=False)


@pytest.mark.skipif(paddle.device.is_compiled_with_cuda(), reason="the CPU-only limitation of PaddleFormers 1.2.0")
def test_trainer_gradient_accumulation_stops_on_cpu(tiny, tmp_path):
    """Where PaddleFormers 1.2.0 stops on its own, for any model: with `gradient_accumulation_steps`
    > 1 its training loop calls `paddle.device.synchronize()` before scaling the gradients by
    1 / steps, which raises TypeError ("device should be gpu, xpu, ...") on a CPU-only Paddle
    (measured with Paddle 3.3.1 CPU); docs/model.md says so. Accumulation runs where Paddle has an
    accelerator."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    data = {"input_ids": np.arange(3, 3 + 4 * 17).reshape(4, 17) % 200}
    data["labels"] = data["input_ids"]
    with pytest.raises(TypeError, match="device should be gpu"):
        _trainer_losses(model, [data, data], 1, 1e-3, tmp_path, gradient_accumulation_steps=2)


def test_trainer_recompute_granularity_recomputes(tiny, tmp_path):
    """`TrainingArguments(recompute_granularity=...)` makes PaddleFormers' Trainer set
    `enable_recompute = True` on every layer that has the attribute; before, our model had none, so
    the request was dropped without a word (model.recompute stayed "none"). Now it recomputes every
    decoder layer (glm52's --recompute full), with the losses of no recompute, bit for bit."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    data = {"input_ids": np.arange(3, 3 + 4 * 17).reshape(4, 17) % 200}
    data["labels"] = data["input_ids"]
    runs = {}
    for granularity in (None, "full"):
        model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
        trainer, losses = _trainer_losses(
            model, [data, data], 2, 1e-3, tmp_path / str(granularity), recompute_granularity=granularity
        )
        runs[granularity] = (model.recompute, losses)
    assert runs[None][0] == "none" and runs["full"][0] == "full"
    assert len(runs["full"][1]) == 2 and runs["full"][1] == runs[None][1]
    # PaddleFormers' PretrainedModel.recompute_enable() / recompute_disable() (its deepseek_v3
    # pretrain workflow calls the first); before: AttributeError on our model
    model.recompute_disable()
    assert model.recompute == "none" and not model.enable_recompute
    model.recompute_enable()
    assert model.recompute == "full" and model.enable_recompute


def test_trainer_evaluate_gathers_the_logits(tiny, tmp_path):
    """`Trainer.evaluate()` with `compute_metrics` gathers every output but the loss and
    `config.keys_to_ignore_at_inference` as predictions; transformers' GlmMoeDsaForCausalLM gives
    loss and logits only there (its config ignores past_key_values), so the predictions are the
    logits. Before: our 0-d `mtp_loss` was gathered too and PaddleFormers' concatenation over
    batches raised IndexError (`tensor1.shape[1]`)."""
    from paddleformers.trainer import Trainer, TrainingArguments

    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    tokens = np.random.default_rng(0).integers(3, 200, size=(8, 17)).astype("int64")

    class Rows(paddle.io.Dataset):
        def __len__(self):
            return len(tokens)

        def __getitem__(self, i):
            return {"input_ids": tokens[i, :-1], "labels": tokens[i, 1:]}

    seen = {}

    def metrics(p):
        seen["predictions"] = p.predictions
        return {"top1": float((p.predictions.argmax(-1) == p.label_ids).mean())}

    args = TrainingArguments(
        output_dir=str(tmp_path),
        per_device_eval_batch_size=4,
        report_to=[],
        device="cpu",
        amp_master_grad=False,
        disable_tqdm=True,
        prediction_loss_only=False,
    )
    result = Trainer(model=model, args=args, eval_dataset=Rows(), compute_metrics=metrics).evaluate()
    assert seen["predictions"].shape == (8, 16, model.config.vocab_size) and "eval_top1" in result
    model.eval()
    first = model(input_ids=paddle.to_tensor(tokens[:4, :-1]))["logits"].numpy()
    np.testing.assert_allclose(seen["predictions"][:4], first, rtol=0, atol=1e-6)


def test_autoconfig_keywords_as_paddleformers_from_dict(tiny, tmp_path):
    """PaddleFormers' AutoConfig hands its keywords to the config class's `from_dict`, which (its
    PretrainedConfig, as transformers': measured with 5.23, `AutoConfig.from_pretrained(path,
    use_cache=False, foo=1)` -> use_cache False, no foo; `return_unused_kwargs=True` ->
    (config, {"foo": 1})) sets the config's keys and leaves the rest out. Before: every keyword was
    kept as a config key and written to config.json (`foo`; the sft workflow's QuantizationConfig
    object, which then failed the save as not JSON serializable), and `return_unused_kwargs=True`
    returned the config alone."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    cfg = AutoConfig.from_pretrained(tiny, use_cache=False, foo=1)
    assert cfg.use_cache is False and "foo" not in cfg.to_dict()
    cfg.save_pretrained(tmp_path)
    assert "foo" not in json.loads((tmp_path / "config.json").read_text())
    cfg, unused = AutoConfig.from_pretrained(tiny, foo=1, return_unused_kwargs=True)
    assert isinstance(cfg, GlmMoeDsaConfig) and unused == {"foo": 1}
    # an attribute the config answers as transformers' base config does (num_labels) is no key of
    # this model: returned unused, and refused by the model's from_pretrained, not dropped unseen
    classes = pf_glm._classes()
    cfg, unused = classes["config"].from_pretrained(tiny, num_labels=3, return_unused_kwargs=True)
    assert unused == {"num_labels": 3} and "num_labels" not in cfg.to_dict()
    with pytest.raises(TypeError, match="num_labels"):
        classes["model"].from_pretrained(tiny, dtype="float32", num_labels=3)


def test_trainer_checkpoints_load_and_resume_with_the_callback(tiny, tmp_path):
    """`save_steps` checkpoints of PaddleFormers' Trainer (1.2.0, default save format
    flex_checkpoint): before, a checkpoint-N folder held `model_state/*.distcp` and no config.json
    (the Trainer calls save_pretrained only on its own PretrainedModel), so `from_pretrained` could
    not read it, and `train(resume_from_checkpoint=...)` raised `AttributeError: 'Fleet' object has
    no attribute '_hcg'` (its flex loader needs fleet's hybrid group, which its TrainingArguments
    sets up for one process only when paddlefleet is installed). With `CheckpointCallback()`:
    each checkpoint-N is also an HF folder (bit for bit the trained weights) and the resumed run
    logs the uninterrupted run's losses exactly (measured over 4 steps resumed at 2: steps 3-4 equal
    to all 8 decimals; here 2 steps resumed at 1)."""
    from paddleformers.trainer import Trainer, TrainerCallback, TrainingArguments

    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    tokens = np.random.default_rng(0).integers(3, 200, size=(16, 17)).astype("int64")

    class Rows(paddle.io.Dataset):
        def __len__(self):
            return len(tokens)

        def __getitem__(self, i):
            return {"input_ids": tokens[i, :-1], "labels": tokens[i, 1:]}

    def run(out, resume=None):
        losses = []

        class Record(TrainerCallback):
            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "loss" in logs:
                    losses.append((state.global_step, logs["loss"]))

        # Paddle names parameters and optimizer moments by a process-wide counter, and the Trainer's
        # optimizer state is keyed by those names: a resume in a new process (the usual) builds the
        # same names; the guard gives the same in this one test process
        with paddle.utils.unique_name.guard():
            model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
            args = TrainingArguments(
                output_dir=str(out),
                max_steps=2,
                save_steps=1,
                per_device_train_batch_size=4,
                learning_rate=1e-3,
                logging_steps=1,
                seed=1,
                report_to=[],
                device="cpu",
                amp_master_grad=False,
                disable_tqdm=True,
            )
            callbacks = [Record(), pf_glm.CheckpointCallback()]
            Trainer(model=model, args=args, train_dataset=Rows(), callbacks=callbacks).train(
                resume_from_checkpoint=resume
            )
        return model, losses

    model, losses = run(tmp_path / "a")
    assert [s for s, _ in losses] == [1, 2] and losses[0][1] != losses[1][1]
    assert (tmp_path / "a" / "checkpoint-1" / "model_state").is_dir()  # the Trainer's own files stay
    back = AutoModelForCausalLM.from_pretrained(tmp_path / "a" / "checkpoint-2", dtype="float32")
    reloaded = dict(back.state_dict())
    for k, v in model.state_dict().items():
        assert reloaded[k].numpy().tobytes() == v.numpy().tobytes(), k
    _, resumed = run(tmp_path / "b", resume=str(tmp_path / "a" / "checkpoint-1"))
    assert resumed == losses[1:]


def test_lora_model_trains_the_adapters(tiny):
    """PaddleFormers' LoRAModel freezes the model and adds adapters to the plain Linear layers it
    matches (here q_a_proj; our parallel-ready projections such as q_b_proj it refuses by class).
    Before: the backward raised ValueError "GradNodePyLayer__DenseHeadAttention's backward function
    should return None at 1 position" (the keys, from frozen weights only, were given a gradient).
    Now the adapters get gradients and the frozen weights none."""
    from paddleformers.peft import LoRAConfig, LoRAModel

    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    lora = LoRAModel(model, LoRAConfig(target_modules=[".*q_a_proj.*"], r=4, lora_alpha=8))
    lora.mark_only_lora_as_trainable()
    lora.train()
    tokens = np.random.default_rng(0).integers(3, 200, size=(2, 17)).astype("int64")
    out = lora(input_ids=paddle.to_tensor(tokens[:, :-1]), labels=paddle.to_tensor(tokens[:, 1:]))
    out["loss"].backward()
    trained = {n: p for n, p in lora.named_parameters() if not p.stop_gradient}
    assert trained and all("lora" in n for n in trained)
    assert all(p.grad is not None for p in trained.values())
    assert any(float(p.grad.abs().sum()) > 0 for p in trained.values())
    assert all(p.grad is None for p in lora.parameters() if p.stop_gradient)


def test_packed_sequences_of_paddleformers_collators(tiny):
    """PaddleFormers' SFT collate_fn packs a row's sequences with position_ids restarting at each,
    labels -100 and position 0 in the padding after them, and the block-diagonal causal mask as
    either a 4-D attention_mask (`gen_self_attn_mask`) or FlashMask's attn_mask_startend_row_indices
    (`gen_attn_mask_startend_row_indices`), plus nbatch_pack_offset with MTP. Each packed sequence
    then attends within itself: the losses (LM and MTP, train mode) equal those of the same
    sequences as rows of their own with a padding mask, with either mask form. Before: the 4-D mask
    was refused, the other two keys were a TypeError. A mask whose blocks disagree with the
    position_ids, or a mark of nbatch_pack_offset inside a sequence, is refused naming the token."""
    from paddleformers.datasets.collate import gen_attn_mask_startend_row_indices, gen_self_attn_mask

    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32")
    model.train()
    rng = np.random.default_rng(1)
    packs = [[7, 5], [9]]  # sequence lengths per row; each row padded to 16
    S = 16
    seqs = [[rng.integers(3, 200, n + 1) for n in row] for row in packs]  # n inputs + 1 target each
    ids, labels, pos, dense, startend, offsets = [], [], [], [], [], []
    for row in seqs:
        inputs = [s[:-1].tolist() for s in row]
        pad = S - sum(len(t) for t in inputs)
        ids.append(sum(inputs, []) + [0] * pad)
        labels.append(sum((s[1:].tolist() for s in row), []) + [-100] * pad)
        pos.append(sum((list(range(len(t))) for t in inputs), []) + [0] * pad)
        dense.append(gen_self_attn_mask(inputs, S, False))
        startend.append(gen_attn_mask_startend_row_indices(inputs, S, False))
        mark = np.zeros(S, "int64")
        mark[np.cumsum([len(t) for t in inputs])[:-1] - 1] = 1
        offsets.append(mark)
    t = paddle.to_tensor
    batch = {
        "input_ids": t(ids),
        "labels": t(labels),
        "position_ids": t(pos),
        "nbatch_pack_offset": t(np.stack(offsets)),
    }
    rows = [s for row in seqs for s in row]
    longest = max(len(s) - 1 for s in rows)
    own_ids = t([s[:-1].tolist() + [0] * (longest - len(s) + 1) for s in rows])
    own_labels = t([s[1:].tolist() + [-100] * (longest - len(s) + 1) for s in rows])
    own_mask = t([[1] * (len(s) - 1) + [0] * (longest - len(s) + 1) for s in rows])
    own = model(input_ids=own_ids, labels=own_labels, attention_mask=own_mask)
    for mask in (
        {"attention_mask": t(np.concatenate(dense))},
        {"attn_mask_startend_row_indices": t(np.concatenate(startend))},
    ):
        out = model(**batch, **mask)
        np.testing.assert_allclose(float(out["loss"]), float(own["loss"]), rtol=2e-6)
        np.testing.assert_allclose(float(out["mtp_loss"]), float(own["mtp_loss"]), rtol=2e-6)
    shifted = np.concatenate(startend).copy()
    shifted[0, 0, 6, 0] = 12  # token 6 seen by the next sequence's queries too
    with pytest.raises(ValueError, match="row 0, token 6: startend row index 12, but position_ids put the token"):
        model(**batch, attn_mask_startend_row_indices=t(shifted))
    merged = np.concatenate(dense).copy()
    merged[0, 0, 7, :7] = 1  # the second sequence's first query sees the first sequence
    with pytest.raises(ValueError, match="row 0, token 7: first visible key 0"):
        model(**batch, attention_mask=t(merged))
    wrong = np.stack(offsets).copy()
    wrong[0, 3] = 1
    with pytest.raises(ValueError, match="nbatch_pack_offset: row 0 marks token 3"):
        model(**{**batch, "nbatch_pack_offset": t(wrong)}, attention_mask=t(np.concatenate(dense)))


def test_paddleformers_set_llm_config_writes_its_unset_layout_onto_the_config(tiny, tmp_path):
    """PaddleFormers' SFT / DPO workflows call ``LlmMetaConfig.set_llm_config(config, training_args)``
    right after ``AutoConfig.from_pretrained``; in one process it writes -1 ("unset") into
    ``tensor_model_parallel_size`` and the other layout fields. The config takes it there (the layout
    is decided at launch, not read from these fields), while a model setting of a wrong type is still
    refused on assignment."""
    from paddleformers.trainer import TrainingArguments
    from paddleformers.transformers.configuration_utils import LlmMetaConfig

    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    cfg = AutoConfig.from_pretrained(tiny)
    args = TrainingArguments(output_dir=str(tmp_path), device="cpu", amp_master_grad=False, report_to=[])
    LlmMetaConfig.set_llm_config(cfg, args)
    assert isinstance(cfg, GlmMoeDsaConfig) and cfg.tensor_model_parallel_size == args.tensor_model_parallel_size
    with pytest.raises(ValueError, match="hidden_size"):
        cfg.hidden_size = "128"


def test_autotokenizer_gives_the_chat_encodings_paddleformers_sft_data_calls(tiny):
    """PaddleFormers' SFTDataset (template_backend "jinja", its default) calls ``encode_chat_inputs`` on
    the tokenizer its AutoTokenizer gives. Measured before: after register() that was our tokenizer
    without it, an AttributeError the dataset retried until the workflow hung. Now it gives what
    PaddleFormers' own tokenizer gives for the same folder, in each of its forms."""
    chat = {"messages": [{"role": "user", "content": "hello"}, {"role": "assistant", "content": "world"}]}
    pairs = [["hello", "world"], ["and you", "fine"]]

    def encodings(tok):
        return (
            tok.encode_chat_inputs(json.loads(json.dumps(chat)), encode_one_turn=True),
            tok.encode_chat_inputs(json.loads(json.dumps(chat)), encode_one_turn=False),
            tok.encode_chat_inputs(pairs),
        )

    want = encodings(AutoTokenizer.from_pretrained(tiny))
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    ours = AutoTokenizer.from_pretrained(tiny)
    assert isinstance(ours, GlmTokenizer)
    assert encodings(ours) == want


def test_generate_on_the_model_paddleformers_gives(tiny):
    """``model.generate`` of the model PaddleFormers' AutoModelForCausalLM gives is this package's
    (docs/model.md): it passes the base forward's output flags, which the PaddleFormers-side forward
    refused (TypeError on output_hidden_states, every call, cache on or off). Same tokens as the
    core class, with and without the cache, and the hidden states a caller asks for."""
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    model = AutoModelForCausalLM.from_pretrained(tiny, dtype="float32").eval()
    direct = GlmMoeDsaForCausalLM.from_pretrained(tiny, dtype="float32").eval()
    ids = paddle.to_tensor(np.arange(3, 11, dtype="int64")[None])
    for cache in (True, False):
        want = direct.generate(ids, max_new_tokens=4, do_sample=False, use_cache=cache)
        got = model.generate(ids, max_new_tokens=4, do_sample=False, use_cache=cache)
        np.testing.assert_array_equal(got.numpy(), want.numpy())
    out = model(ids, output_hidden_states=True, output_router_logits=True)
    ref = direct(ids, output_hidden_states=True, output_router_logits=True)
    assert len(out.hidden_states) == len(ref.hidden_states) == direct.config.num_hidden_layers + 1
    for a, b in zip(out.hidden_states + out.router_logits, ref.hidden_states + ref.router_logits):
        np.testing.assert_array_equal(a.numpy(), b.numpy())
    with pytest.raises(ValueError, match="labels_shifted=False"):
        model(ids, labels=ids, labels_shifted=False)


def test_path_by_keyword_after_register(tiny, tmp_path):
    """PaddleFormers' loaders name their first parameter ``pretrained_model_name_or_path``
    (``config`` for from_config); after register() a call that named it raised "wrapped() missing 1
    required positional argument", for every model type. Named, a GLM folder loads ours and any
    other goes to PaddleFormers as before."""
    other = tmp_path / "qwen"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"]}))
    with pytest.raises(Exception) as before:  # PaddleFormers' own failure on a folder with no weights
        AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path=str(other))
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    with pytest.raises(type(before.value)) as after:
        AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path=str(other))
    assert str(after.value) == str(before.value)
    model = AutoModelForCausalLM.from_pretrained(pretrained_model_name_or_path=tiny, dtype="float32")
    assert isinstance(model, GlmMoeDsaForCausalLM)
    assert isinstance(AutoModelForCausalLM.from_config(config=model.config), GlmMoeDsaForCausalLM)
    assert isinstance(AutoTokenizer.from_pretrained(pretrained_model_name_or_path=tiny), GlmTokenizer)
    with pytest.raises(TypeError, match="got multiple values for argument 'pretrained_model_name_or_path'"):
        AutoModelForCausalLM.from_pretrained(tiny, pretrained_model_name_or_path=str(other))  # as PaddleFormers


def test_from_config_takes_paddleformers_config_and_dtype_objects(tiny):
    """A PaddleFormers ``GlmMoeDsaConfig`` (read by its AutoConfig before register()) sent to
    AutoModelForCausalLM failed with AttributeError 'num_mtp_layers'; it is refused naming its class
    and what to do (its to_dict mixes its own defaults into the file's keys: rope_theta 10000 beside
    rope_parameters' 8e6, which our config refuses as inconsistent). A dtype
    given as a Paddle dtype (as PaddleFormers passes it) was kept as the object, and the forward then
    refused bf16 embeddings as not bf16; it is kept by name, on the core class too."""
    theirs = AutoConfig.from_pretrained(tiny)
    assert not isinstance(theirs, GlmMoeDsaConfig)
    with pytest.warns(pf_glm.ReplacementWarning):
        pf_glm.register(replace=True)
    ours = GlmMoeDsaConfig.from_pretrained(tiny)
    refused = "paddleformers.transformers.glm_moe_dsa.configuration.GlmMoeDsaConfig .* read the checkpoint's config"
    with pytest.raises(TypeError, match=refused):
        AutoModelForCausalLM.from_config(theirs)
    with pytest.raises(TypeError, match=refused):
        AutoModelForCausalLM.from_pretrained(tiny, config=theirs)
    model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(tiny), dtype=paddle.bfloat16)
    assert isinstance(model, GlmMoeDsaForCausalLM) and model.compute_dtype == "bfloat16"
    assert model.config.to_dict() == ours.to_dict()
    loaded = AutoModelForCausalLM.from_pretrained(tiny, config=ours, dtype="float32")  # the core class's config
    assert type(loaded.config) is not GlmMoeDsaConfig and loaded.config.to_dict() == ours.to_dict()
    both = AutoModelForCausalLM.from_config(ours, dtype="bf16", paddle_dtype="float32")
    assert both.compute_dtype == "bfloat16"  # dtype wins; the older name is no stray keyword
    embeds = paddle.zeros([1, 4, ours.hidden_size], dtype="bfloat16")
    for core in (
        GlmMoeDsaForCausalLM.from_config(ours, dtype=paddle.bfloat16),
        GlmMoeDsaForCausalLM(ours, paddle.bfloat16),
    ):
        assert core.compute_dtype == "bfloat16"
        assert core(inputs_embeds=embeds).logits.shape == [1, 4, ours.vocab_size]
    assert GlmMoeDsaForCausalLM.from_config(ours, dtype=np.float32).compute_dtype == "float32"
