"""transformers 5.23's API surface on calls generic tools make (hooks on every layer, MoE training
loops, PEFT / TRL reading base-config attributes, the Trainer's save): each test names what
transformers returns for the same call on the same tiny checkpoint (measured with transformers 5.23
and torch on tests/fixtures/tiny/checkpoint); the reference-tier tests measure it again."""

import copy
import json
import shutil
import warnings

import numpy as np
import paddle
import pytest

from paddleformers_glm import GlmMoeDsaConfig
from paddleformers_glm.generation import GenerationConfig
from paddleformers_glm.modeling import GlmMoeDsaForCausalLM
from paddleformers_glm.modeling.decoder import DecoderLayer
from paddleformers_glm.modeling.model import GlmMoeDsaModel
from paddleformers_glm.modeling.mtp import MTPLayer

from ._tiny import TWO_LAYERS, tiny_config, tiny_model
from .conftest import FIXTURES

TINY = FIXTURES / "tiny" / "checkpoint"
YARN = FIXTURES / "tiny_pattern_yarn" / "checkpoint"


@pytest.fixture(scope="module")
def loaded():
    return GlmMoeDsaForCausalLM.from_pretrained(TINY, dtype="float32")


def _ids(seed=0, shape=(2, 7)):
    return paddle.to_tensor(np.random.default_rng(seed).integers(3, 256, shape).astype("int64"))


def _hf():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    transformers.logging.set_verbosity_error()
    return torch, transformers


# ---------------------------------------------------------------------------------------------- A1
def test_layers_read_as_transformers_module_list(loaded):
    """transformers 5.23 (tiny, 8 decoder layers, its MTP layer dropped on load): len(layers) == 8,
    iterating gives the decoder layers, layers[-1] is layers[7], layers[-2:] a ModuleList of 2,
    layers[8] and layers[-9] IndexError. Ours counted the MTP layer (len 9), iterated the key strings
    '0'..'8', raised KeyError '-1' for layers[-1], and layers[len - 1] was the MTP layer."""
    layers, L = loaded.model.layers, loaded.config.num_hidden_layers
    assert L == 8 and len(layers) == 8
    listed = list(layers)
    assert all(isinstance(x, DecoderLayer) for x in listed) and listed == loaded.model.decoder_layers
    assert layers[-1] is layers[7] is layers[len(layers) - 1] is listed[-1]
    tail = layers[-2:]
    assert isinstance(tail, paddle.nn.LayerList) and len(tail) == 2 and tail[0] is layers[6] and tail[1] is layers[7]
    assert [x for x in layers[::3]] == [layers[0], layers[3], layers[6]]
    assert layers[0] in layers and layers[8] not in layers  # membership over the decoder layers, as a list's
    with pytest.raises(IndexError):
        layers[-9]
    # the MTP layer stays where its names put it: model.layers.8.* (checkpoint and state-dict names)
    assert isinstance(layers[8], MTPLayer) and layers[8] is layers["8"] is loaded.model.mtp_layers[0]
    assert "8" in layers and list(layers.keys()) == [str(i) for i in range(9)]
    assert any(k.startswith("model.layers.8.") for k in loaded.state_dict())


def test_layers_of_a_pipeline_stage_keep_global_ids():
    """A stage holding decoder layers 2, 3 and the MTP layer: ids stay global (layers[3] is layer 3,
    whose parameters are model.layers.3.*); len and iteration count its decoder layers, -1 the last
    of them; a layer another stage holds is named."""
    stage = GlmMoeDsaModel(tiny_config(), layer_ids=[2, 3, 8], embedding=False, norm=False)
    layers = stage.layers
    assert len(layers) == 2 and list(layers) == [layers[2], layers[3]] and layers[-1] is layers[3]
    assert isinstance(layers[8], MTPLayer)
    with pytest.raises(KeyError, match="layer 0 is not held here"):
        layers[0]


@pytest.mark.reference
def test_layers_agree_with_transformers(loaded):
    torch, transformers = _hf()
    hf = transformers.GlmMoeDsaForCausalLM.from_pretrained(str(TINY), dtype=torch.float32)
    assert len(hf.model.layers) == len(loaded.model.layers)
    assert len(hf.model.layers[-2:]) == len(loaded.model.layers[-2:])
    assert [type(x).__name__.replace("GlmMoeDsa", "") for x in hf.model.layers] == [
        type(x).__name__ for x in loaded.model.layers
    ]


# ---------------------------------------------------------------------------------------------- A2
def test_rope_scaling_reads_as_the_rope_parameters():
    """transformers 5.23: ``rope_scaling`` is an alias of ``rope_parameters`` (the same dict): on the
    yarn fixture {'beta_fast': 32, 'beta_slow': 1, 'factor': 4.0, 'mscale': 1.0, 'mscale_all_dim': 1.0,
    'original_max_position_embeddings': 1024, 'rope_theta': 8000000, 'rope_type': 'yarn'}, on the plain
    one {'rope_theta': 8000000, 'rope_type': 'default'}. Ours read None. The saved keys do not change."""
    yarn = GlmMoeDsaConfig.from_pretrained(YARN)
    assert yarn.rope_scaling == {
        "beta_fast": 32, "beta_slow": 1, "factor": 4.0, "mscale": 1.0, "mscale_all_dim": 1.0,
        "original_max_position_embeddings": 1024, "rope_theta": 8000000, "rope_type": "yarn",
    }  # fmt: skip
    assert yarn.rope_scaling is yarn.rope_parameters
    plain = GlmMoeDsaConfig.from_pretrained(TINY)
    assert plain.rope_scaling == {"rope_theta": 8000000, "rope_type": "default"}
    for path, cfg in ((YARN, yarn), (TINY, plain)):
        file = json.loads((path / "config.json").read_text())
        assert "rope_scaling" not in file and cfg.to_dict() == file
    # as there, a change through the alias is a change of the rope the model reads
    yarn.rope_scaling["factor"] = 8.0
    assert yarn.rope["factor"] == 8.0 and yarn.to_dict()["rope_parameters"]["factor"] == 8.0


def test_rope_scaling_of_other_spellings_and_its_null_kept_on_save():
    """A file with ``rope_scaling: null`` beside ``rope_parameters`` (PaddleFormers writes both) reads
    the rope as transformers does and saves the null back; a file with only a top-level rope_theta
    reads the normalised rope (transformers' rope_parameters there); a file's own rope_scaling is read
    as it is."""
    base = json.loads((TINY / "config.json").read_text())
    both = GlmMoeDsaConfig.from_dict({**base, "rope_scaling": None})
    assert both.rope_scaling == {"rope_theta": 8000000, "rope_type": "default"}
    assert both.to_dict()["rope_scaling"] is None and both.to_dict() == {**base, "rope_scaling": None}
    theta = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 8000000}
    only_theta = GlmMoeDsaConfig.from_dict(theta)
    assert only_theta.rope_scaling == {"rope_theta": 8000000, "rope_type": "default"}
    assert "rope_scaling" not in only_theta.to_dict() and only_theta.to_dict() == theta
    own = {"rope_type": "linear", "factor": 2.0}
    scaled = {k: v for k, v in base.items() if k != "rope_parameters"} | {"rope_theta": 8000000, "rope_scaling": own}
    assert GlmMoeDsaConfig.from_dict(scaled).rope_scaling == own


@pytest.mark.reference
def test_rope_scaling_agrees_with_transformers():
    _, transformers = _hf()
    for path in (YARN, TINY):
        hf = transformers.GlmMoeDsaConfig.from_pretrained(str(path))
        assert GlmMoeDsaConfig.from_pretrained(path).rope_scaling == hf.rope_scaling


# ---------------------------------------------------------------------------------------------- A4
def test_training_under_checkpointing_builds_no_cache():
    """transformers 5.23 (merge_with_config_defaults): train() + gradient_checkpointing_enable() +
    use_cache=True gives the output keys ['logits'] (a warning turns use_cache off); ours returned a
    past_key_values. The loss is the one of use_cache=False."""
    model = tiny_model(**TWO_LAYERS)
    model.train()
    model.activation_checkpointing_enable()
    ids = _ids()
    with pytest.warns(UserWarning, match="incompatible with gradient checkpointing"):
        out = model(ids, labels=ids, use_cache=True)
    assert out.past_key_values is None and "past_key_values" not in out.keys()
    plain = model(ids, labels=ids, use_cache=False)
    assert float(out.loss) == float(plain.loss)
    model.activation_checkpointing_disable()
    model.eval()
    assert model(ids, use_cache=True).past_key_values is not None  # evaluation still builds one


# ---------------------------------------------------------------------------------------------- B1
def test_batch_encoding_to_device():
    """transformers: ``tok(text, return_tensors="pt").to(model.device)`` moves the tensors and returns
    the same BatchEncoding; a dtype is not a device (a warning, nothing changed). Ours raised
    ``AttributeError: to`` (the message was the bare key)."""
    from paddleformers_glm.tiny import make_tiny_tokenizer

    tok = make_tiny_tokenizer()
    enc = tok(["hello there", "hi"], padding=True, return_tensors="pd")
    ids = enc["input_ids"].numpy()
    model_device = paddle.CPUPlace()
    for device in (model_device, "cpu"):
        assert enc.to(device) is enc
        assert enc["input_ids"].place.is_cpu_place() and (enc["input_ids"].numpy() == ids).all()
    with pytest.warns(UserWarning, match="not supported"):
        assert enc.to(paddle.float16) is enc
    assert enc["input_ids"].dtype == paddle.int64
    listed = tok(["hello"])  # no tensors: nothing to move
    assert listed.to("cpu") is listed and isinstance(listed["input_ids"], list)
    with pytest.raises(AttributeError, match="'BatchEncoding' object has no attribute 'nope'.*input_ids"):
        enc.nope  # noqa: B018 - the read is what raises


# ---------------------------------------------------------------------------------------------- B2
def test_save_with_the_models_state_dict_and_a_short_refusal(loaded, tmp_path):
    """transformers' Trainer calls ``save_pretrained(out, state_dict=model.state_dict())``, which
    transformers accepts and writes. Ours refused it with the repr of every tensor (264,646
    characters on the tiny model). The model's own state dict is written now; one that differs is
    refused in a few lines."""
    state = loaded.state_dict()
    loaded.save_pretrained(tmp_path / "given", state_dict=state)
    loaded.save_pretrained(tmp_path / "plain")
    for name in ("config.json", "model.safetensors.index.json"):
        if (tmp_path / "plain" / name).exists():
            assert (tmp_path / "given" / name).read_text() == (tmp_path / "plain" / name).read_text()
    again = GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "given", dtype="float32")
    for k, v in again.state_dict().items():
        assert np.array_equal(v.numpy(), state[k].numpy()), k
    bad = dict(state)
    key = next(iter(bad))
    bad[key] = paddle.zeros([1, 1])
    with pytest.raises(ValueError) as err:
        loaded.save_pretrained(tmp_path / "bad", state_dict=bad)
    assert f"state_dict=<dict of {len(state)} tensors>" in str(err.value) and key in str(err.value)
    assert len(str(err.value)) < 600 and not (tmp_path / "bad").exists()
    with pytest.raises(ValueError, match="keys differ"):
        loaded.save_pretrained(tmp_path / "bad", state_dict={"x": paddle.zeros([1])})


# ---------------------------------------------------------------------------------------------- B3
def test_loading_info_is_a_mapping():
    """transformers 5.23 returns a dict: ``"missing_keys" in info`` True, ``list(info)`` ==
    ['missing_keys', 'unexpected_keys', 'mismatched_keys', 'error_msgs'], ``len(info)`` 4, ``items()``
    and ``get`` work. Ours raised a misleading KeyError for ``in`` / ``list()`` (Python fell back to
    ``__getitem__(0)``), AttributeError for ``items`` / ``get`` and TypeError for ``len``."""
    _, info = GlmMoeDsaForCausalLM.from_pretrained(TINY, dtype="float32", output_loading_info=True)
    want = ["missing_keys", "unexpected_keys", "mismatched_keys", "error_msgs"]
    assert "missing_keys" in info and "loaded" not in info
    assert list(info) == want and len(info) == 4 and [k for k, _ in info.items()] == want
    assert info.get("missing_keys") == set() and info.get("nope") is None and info.get("nope", 1) == 1
    assert dict(info)["error_msgs"] == [] and info.layout and info.loaded  # the report's own fields stay


# ---------------------------------------------------------------------------------------------- B4
def test_aux_loss_reads_none_and_the_tuple_is_unchanged(loaded):
    """transformers 5.23: a MoeCausalLMOutputWithPast whose aux_loss is None for this model (with
    output_router_logits too); its keys ['loss', 'logits', 'past_key_values'] and return_dict=False
    tuple (Tensor, Tensor, DynamicCache) leave the None aux_loss out; with output_router_logits the
    tuple ends with the router logits. Ours raised AttributeError for out.aux_loss."""
    ids = _ids()
    out = loaded(ids, labels=ids)
    assert out.aux_loss is None and "aux_loss" not in out.keys()
    assert [k for k in out.keys() if k in ("loss", "logits", "past_key_values")] == [
        "loss",
        "logits",
        "past_key_values",
    ]
    plain = loaded(ids, labels=ids, return_dict=False)
    assert len(plain) == 3 and type(plain[2]).__name__ == "DSACache"
    assert len(out.to_tuple()) == 3
    routed = loaded(ids, labels=ids, output_router_logits=True)
    assert routed.aux_loss is None
    tup = loaded(ids, labels=ids, output_router_logits=True, return_dict=False)
    assert len(tup) == 4 and isinstance(tup[3], tuple)


# ---------------------------------------------------------------------------------------------- B5
_BASE = {  # transformers 5.23's GlmMoeDsaConfig.from_pretrained(tiny), measured
    "is_encoder_decoder": False,
    "name_or_path": "",
    "_name_or_path": "",
    "return_dict": True,
    "use_return_dict": True,
    "output_attentions": False,
    "num_labels": 2,
    "id2label": {0: "LABEL_0", 1: "LABEL_1"},
}


def test_base_config_attributes_read_as_transformers(tmp_path):
    """Each of these raised AttributeError here; transformers' PreTrainedConfig answers them (the
    values above). None becomes a key of the saved config.json (transformers writes none of them)."""
    cfg = GlmMoeDsaConfig.from_pretrained(TINY)
    for name, value in _BASE.items():
        assert getattr(cfg, name) == value, name
    assert cfg.label2id == {"LABEL_0": 0, "LABEL_1": 1}
    file = json.loads((TINY / "config.json").read_text())
    assert cfg.to_dict() == file
    cfg.save_pretrained(tmp_path)
    assert json.loads((tmp_path / "config.json").read_text()) == file
    assert copy.deepcopy(cfg).num_labels == 2


def test_model_name_or_path_and_attn_implementation(tmp_path):
    """transformers 5.23 after from_pretrained(tiny): model.name_or_path, config._name_or_path and
    config.name_or_path are the path given; config._attn_implementation is 'sdpa', 'eager' with
    attn_implementation="eager"; none of them is saved (the saved config.json has no such key)."""
    model = GlmMoeDsaForCausalLM.from_pretrained(str(TINY), dtype="float32")
    assert model.name_or_path == model.config._name_or_path == model.config.name_or_path == str(TINY)
    assert model.config._attn_implementation == "sdpa"
    eager = GlmMoeDsaForCausalLM.from_pretrained(TINY, dtype="float32", attn_implementation="eager")
    assert eager.config._attn_implementation == "eager" and eager.config.attn_implementation == "reference"
    model.set_attn_implementation("eager")
    assert model.config._attn_implementation == "eager"
    model.config._attn_implementation = "sdpa"
    assert model.config.attn_implementation == "auto"
    model.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    assert set(saved) == set(json.loads((TINY / "config.json").read_text()))  # (dtype: the model's float32)
    with pytest.raises(ValueError, match="_attn_implementation"):
        model.config._attn_implementation = "flash_attention_2"
    assert GlmMoeDsaForCausalLM.from_config(tiny_config()).name_or_path == ""
    # a transformers-4 file's own _name_or_path (a hub id) is a key of the file: saved back as it was,
    # never replaced by the folder this machine read it from (transformers 5.23 writes none at all)
    hub = tmp_path / "hub"
    shutil.copytree(TINY, hub)
    cfg = json.loads((hub / "config.json").read_text())
    (hub / "config.json").write_text(json.dumps({**cfg, "_name_or_path": "zai-org/GLM-5.2"}))
    loaded = GlmMoeDsaForCausalLM.from_pretrained(hub, dtype="float32")
    assert loaded.name_or_path == str(hub)
    loaded.save_pretrained(tmp_path / "again")
    assert json.loads((tmp_path / "again" / "config.json").read_text())["_name_or_path"] == "zai-org/GLM-5.2"


@pytest.mark.reference
def test_base_config_attributes_agree_with_transformers():
    _, transformers = _hf()
    hf = transformers.GlmMoeDsaConfig.from_pretrained(str(TINY))
    ours = GlmMoeDsaConfig.from_pretrained(TINY)
    for name in (*_BASE, "label2id", "output_hidden_states"):
        assert getattr(ours, name) == getattr(hf, name), name


# ---------------------------------------------------------------------------------------------- C
def test_class_level_calls_transformers_makes():
    """transformers 5.23: ``GlmMoeDsaForCausalLM.can_generate()`` on the class is True (a classmethod;
    ours: TypeError missing 'self'); ``_from_config(config)`` (AutoModel.from_config's call) builds the
    model, ``dtype=torch.bfloat16`` in that dtype (ours: AttributeError)."""
    assert GlmMoeDsaForCausalLM.can_generate() is True
    cfg = tiny_config(**TWO_LAYERS)
    model = GlmMoeDsaForCausalLM._from_config(cfg)
    assert isinstance(model, GlmMoeDsaForCausalLM) and model.dtype == paddle.float32 and model.can_generate()
    assert GlmMoeDsaForCausalLM._from_config(cfg, dtype=paddle.bfloat16).dtype == paddle.bfloat16
    with pytest.raises(TypeError, match="foo"):
        GlmMoeDsaForCausalLM._from_config(cfg, foo=1)


def test_a_dtype_object_is_kept_by_name():
    """A model built with a Paddle or numpy dtype (the constructor, ``from_config``; transformers'
    callers pass dtype objects) kept the object: the forward then refused bf16 ``inputs_embeds`` as
    "bfloat16, the model computes in paddle.bfloat16", and ``from_config(dtype=np.float32)`` was
    "not a model dtype". Each is kept by its name, the forward takes the embeddings."""
    cfg = tiny_config(**TWO_LAYERS)
    embeds = paddle.zeros([1, 3, cfg.hidden_size], dtype="bfloat16")
    for model in (GlmMoeDsaForCausalLM(cfg, paddle.bfloat16), GlmMoeDsaForCausalLM.from_config(cfg, dtype="bf16")):
        assert model.compute_dtype == "bfloat16"
        assert model(inputs_embeds=embeds).logits.shape == [1, 3, cfg.vocab_size]
    assert GlmMoeDsaForCausalLM.from_config(cfg, dtype=np.float32).compute_dtype == "float32"
    with pytest.raises(ValueError, match="dtype 'int8' is not a model dtype"):
        GlmMoeDsaForCausalLM(cfg, "int8")


def test_ignore_mismatched_sizes_is_a_loading_keyword():
    """transformers 5.23 takes ``ignore_mismatched_sizes`` (False: a mismatch is an error; True
    re-initialises mismatched tensors). Ours refused both as "neither a config key nor a loading
    keyword"; False is taken now, True refused as an unsupported loading option."""
    model = GlmMoeDsaForCausalLM.from_pretrained(TINY, dtype="float32", ignore_mismatched_sizes=False)
    assert model.config.to_dict() == json.loads((TINY / "config.json").read_text())
    with pytest.raises(ValueError, match="ignore_mismatched_sizes=True is not supported"):
        GlmMoeDsaForCausalLM.from_pretrained(TINY, dtype="float32", ignore_mismatched_sizes=True)


def test_update_from_string():
    """transformers 5.23: ``update_from_string("use_cache=false,index_topk=4,rms_norm_eps=1e-6")``
    sets False, 4, 1e-06 (each read as the current value's type); an unknown key is "key foo_bar
    isn't in the original config dict", "use_cache=maybe" "can't derive true or false from maybe",
    "index_topk=2.5" a ValueError. Ours had no such method."""
    cfg = GlmMoeDsaConfig.from_pretrained(TINY)
    cfg.update_from_string("use_cache=false,index_topk=4,rms_norm_eps=1e-6")
    assert (cfg.use_cache, cfg.index_topk, cfg.rms_norm_eps) == (False, 4, 1e-06)
    for text, message in (
        ("foo_bar=1", "key foo_bar isn't in the original config dict"),
        ("use_cache=maybe", "can't derive true or false from maybe"),
        ("index_topk=2.5", "invalid literal"),
        ("use_cache", "not key=value"),
    ):
        with pytest.raises(ValueError, match=message):
            cfg.update_from_string(text)
    assert cfg.use_cache is False and cfg.index_topk == 4  # a refused string changes nothing
    # a value the config's check refuses (n_group must divide the experts) is undone with the rest:
    # it stayed set, and the config's own to_dict() no longer loaded
    saved = cfg.to_dict()
    with pytest.raises(ValueError, match="n_group"):
        cfg.update_from_string("use_cache=true,n_group=3")
    with pytest.raises(ValueError, match="n_group"):
        cfg.update({"use_cache": True, "n_group": 3})
    assert cfg.to_dict() == saved and GlmMoeDsaConfig.from_dict(cfg.to_dict()) == cfg


def test_update_from_string_reads_each_spelling_of_a_bool_as_transformers():
    """transformers 5.23 (configuration_utils.py, ``update_from_string``) reads "true", "1", "y" and
    "yes" as True and "false", "0", "n", "no" as False, in any case.  A script passing
    ``use_cache=1`` (as from an environment variable) would otherwise switch the cache off."""
    cfg = GlmMoeDsaConfig.from_pretrained(TINY)
    for text, want in [
        *((t, True) for t in ("true", "1", "y", "yes", "Y", "TRUE")),
        *((t, False) for t in ("false", "0", "n", "no", "N")),
    ]:
        cfg.use_cache = not want
        cfg.update_from_string(f"use_cache={text}")
        assert cfg.use_cache is want, text


def test_generation_config_validate_and_save():
    """transformers 5.23: ``GenerationConfig(do_sample=False, temperature=0.5).validate()`` returns
    None (a warning), ``validate(strict=True)`` raises "GenerationConfig is invalid: ... `temperature`:
    `do_sample` is not set to `True`", ``max_new_tokens=0`` raises "`max_new_tokens` must be greater
    than 0", and ``save_pretrained`` refuses the invalid config ("Fix these issues to save the
    configuration."), as ``model.save_pretrained`` does after ``generation_config.temperature = 0.3``.
    Ours had no validate and saved it."""
    g = GenerationConfig(do_sample=False, temperature=0.5)
    with pytest.warns(UserWarning, match="temperature"):
        assert g.validate() is None
    with pytest.raises(ValueError, match="(?s)GenerationConfig is invalid.*`temperature`: `do_sample` is not set"):
        g.validate(strict=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        GenerationConfig(do_sample=True, temperature=0.5).validate()
    with pytest.raises(ValueError, match="`max_new_tokens` must be greater than 0"):
        GenerationConfig(max_new_tokens=0).validate()
    with pytest.raises(ValueError, match="num_return_sequences"):
        GenerationConfig(num_return_sequences=2).validate()
    with pytest.raises(ValueError, match="Fix these issues to save the configuration"):
        g.save_pretrained("/nonexistent-not-written")


def test_generation_config_read_unchanged_saves_back(tmp_path):
    """transformers saves a config read from a file and unchanged even with ignored options (it only
    warns), so a published generation_config.json can always be saved back; changed, it is refused."""
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.6, "top_p": 0.95}))
    g = GenerationConfig.from_pretrained(tmp_path)
    g.save_pretrained(tmp_path / "out")
    assert json.loads((tmp_path / "out" / "generation_config.json").read_text())["temperature"] == 0.6
    g.temperature = 0.7
    with pytest.raises(ValueError, match="temperature"):
        g.save_pretrained(tmp_path / "out2")


def test_model_save_refuses_a_changed_invalid_generation_config(tmp_path):
    """transformers 5.23: ``model.generation_config.temperature = 0.3`` (do_sample unset), then
    ``model.save_pretrained`` raises "GenerationConfig is invalid" and writes nothing."""
    model = GlmMoeDsaForCausalLM.from_pretrained(TINY, dtype="float32")
    model.save_pretrained(tmp_path / "ok")  # unchanged: saved
    model.generation_config.temperature = 0.3
    with pytest.raises(ValueError, match="GenerationConfig is invalid"):
        model.save_pretrained(tmp_path / "bad")
    assert not (tmp_path / "bad").exists()
    model.generation_config.do_sample = True
    model.save_pretrained(tmp_path / "sampling")
    assert json.loads((tmp_path / "sampling" / "generation_config.json").read_text())["temperature"] == 0.3


@pytest.mark.reference
def test_generation_config_validate_agrees_with_transformers(tmp_path):
    _, transformers = _hf()
    for kw in ({"do_sample": False, "temperature": 0.5}, {"max_new_tokens": 0}, {"length_penalty": 2.0}):
        outcomes = []
        for cls in (transformers.GenerationConfig, GenerationConfig):
            try:
                cls(**kw).validate(strict=True)
                outcomes.append("ok")
            except ValueError:
                outcomes.append("refused")
        assert outcomes[0] == outcomes[1], kw


def test_loading_and_saving_leave_the_callers_root_logger_as_it_was(tmp_path, caplog):
    """transformers logs through its own loggers and leaves the root logger's level alone. Ours
    raised the root logger to WARNING on the first load or save, which silenced every INFO line of
    the caller's own loggers (those without a level of their own) for the rest of the process."""
    import logging

    caplog.set_level(logging.INFO)  # the root logger at INFO, as logging.basicConfig(level=INFO) sets it
    model = GlmMoeDsaForCausalLM.from_pretrained(TINY, dtype="float32")
    model.save_pretrained(tmp_path / "saved")
    GlmMoeDsaForCausalLM.from_pretrained(tmp_path / "saved", dtype="float32")
    assert logging.getLogger().level == logging.INFO
    logging.getLogger("a_callers_logger").info("the caller's line")
    assert "the caller's line" in caplog.messages
