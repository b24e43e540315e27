"""GlmMoeDsaConfig's Python API against transformers 5.23's ``GlmMoeDsaConfig`` (``PreTrainedConfig``):
what a user calling it as transformers' gets. Each live comparison runs only with the reference extra
installed; its torch-free twin pins the measured value.
"""

from __future__ import annotations

import copy
import json
import pickle

import pytest

from paddleformers_glm import GlmMoeDsaConfig

from .conftest import TINY_CONFIG


def _tiny(**changes) -> dict:
    return json.loads(TINY_CONFIG.read_text()) | changes


def _hf():
    pytest.importorskip("torch")
    pytest.importorskip("transformers")
    from transformers import GlmMoeDsaConfig as HFConfig

    return HFConfig


# ------------------------------------------------------------------ setting an attribute


def _set_and_read(cls) -> tuple:
    c = cls.from_dict(_tiny(seq_aux=True, num_local_experts=8))
    c.num_local_experts, c.seq_aux = 4, False
    d = c.to_dict()
    return c.n_routed_experts, d["n_routed_experts"], c.seq_aux, d["seq_aux"]


def test_transformers_sets_the_attribute_map_name_and_saves_a_set_unknown_key():
    """transformers 5.23 (measured): ``num_local_experts = 4`` sets ``n_routed_experts`` 4 (its
    attribute_map) and a set file key (``seq_aux`` False) is saved as set."""
    assert _set_and_read(_hf()) == (4, 4, False, False)


def test_setting_another_producers_name_sets_the_setting_and_a_file_key_is_saved_as_set():
    """Before: ``config.num_local_experts = 4`` left ``n_routed_experts`` 8 (the model built 8 experts)
    and ``config.seq_aux = False`` was saved as the loaded ``true``. transformers: (4, 4, False, False)."""
    assert _set_and_read(GlmMoeDsaConfig) == (4, 4, False, False)
    c = GlmMoeDsaConfig.from_dict(_tiny(num_local_experts=8))
    c.num_local_experts = 4
    assert c.to_dict()["num_local_experts"] == 4  # written under the file's name
    c.dsa_index_topk = 4  # PaddleFleet's name, read the same way
    assert c.index_topk == 4 and c.to_dict()["index_topk"] == 4
    assert copy.deepcopy(c) == c and pickle.loads(pickle.dumps(c)) == c


# ------------------------------------------------------------------ from_pretrained / from_dict keywords

_LOADING = dict(cache_dir="/nonexistent", local_files_only=True, revision="main", token=None, force_download=False)


def _load_with_keywords(cls, folder) -> tuple:
    config, unused = cls.from_pretrained(folder, return_unused_kwargs=True, foo=2, use_cache=False, **_LOADING)
    d = config.to_dict()
    written = sorted(k for k in ("return_unused_kwargs", "foo", *_LOADING) if k in d)
    return type(config).__name__, unused, config.use_cache, d["use_cache"], written


def test_transformers_from_pretrained_keywords():
    """transformers 5.23 (measured on configs/glm52-tiny): ``return_unused_kwargs=True`` gives
    ``(config, {'foo': 2})``; the config key ``use_cache`` is overridden; neither ``foo`` nor the
    download options are set or saved."""
    got = _load_with_keywords(_hf(), TINY_CONFIG.parent)
    assert got == ("GlmMoeDsaConfig", {"foo": 2}, False, False, [])


def test_from_pretrained_keywords_as_transformers():
    """Before: ``return_unused_kwargs=True`` returned the config alone and every keyword
    (``return_unused_kwargs``, ``foo``, ``cache_dir``, ``local_files_only``, ...) became a config key
    written into a saved config.json. transformers: ("GlmMoeDsaConfig", {"foo": 2}, False, False, [])."""
    assert _load_with_keywords(GlmMoeDsaConfig, TINY_CONFIG.parent) == ("GlmMoeDsaConfig", {"foo": 2}, False, False, [])
    plain = GlmMoeDsaConfig.from_pretrained(TINY_CONFIG.parent, foo=2, **_LOADING)
    assert plain == GlmMoeDsaConfig.from_pretrained(TINY_CONFIG.parent)
    config, unused = GlmMoeDsaConfig.from_dict(_tiny(), return_unused_kwargs=True, index_topk=4, bar=1)
    assert (config.index_topk, unused) == (4, {"bar": 1})


def _output_flags(cls) -> list:
    out = []
    for key, value in (("output_hidden_states", True), ("output_router_logits", True), ("return_dict", False)):
        config, unused = cls.from_pretrained(TINY_CONFIG.parent, return_unused_kwargs=True, **{key: value})
        out.append((unused, getattr(config, key), config.to_dict().get(key)))
    return out


_OUTPUT_FLAGS_MEASURED = [({}, True, True), ({}, True, True), ({}, False, False)]


def test_transformers_sets_its_output_flags_from_loading_keywords():
    """transformers 5.23 (measured): each flag is used (not returned as unused), set, and saved."""
    assert _output_flags(_hf()) == _OUTPUT_FLAGS_MEASURED


def test_output_flags_given_as_loading_keywords_are_set_and_saved():
    """Before: ``output_hidden_states=True`` and the other base-config output flags were returned as
    unused (the file has no such key), so ``from_pretrained(path, output_hidden_states=True)`` left the
    model's default off. transformers: used, set, saved (:func:`_OUTPUT_FLAGS_MEASURED`)."""
    assert _output_flags(GlmMoeDsaConfig) == _OUTPUT_FLAGS_MEASURED


def _dtype_overrides(cls) -> tuple:
    folder = TINY_CONFIG.parent
    d = cls.from_pretrained(folder, torch_dtype="float16").to_dict()
    return d["dtype"], "torch_dtype" in d, str(cls.from_pretrained(folder, dtype="float32").dtype)


def test_transformers_takes_a_torch_dtype_keyword_as_the_dtype():
    """transformers 5.23 (measured): the tiny file says ``dtype: bfloat16``; ``torch_dtype="float16"``
    saves ``dtype: float16`` (no torch_dtype key); ``dtype="float32"`` gives float32."""
    assert _dtype_overrides(_hf()) == ("float16", False, "float32")


def test_a_torch_dtype_keyword_overrides_the_files_dtype():
    """Before: ``from_pretrained(folder, torch_dtype="float16")`` on a file saying ``dtype`` was
    refused ("`torch_dtype`: 'float16' disagrees with `dtype` 'bfloat16'"); ``dtype="auto"`` was refused
    as an unsupported dtype. transformers: ("float16", False, "float32")."""
    assert _dtype_overrides(GlmMoeDsaConfig) == ("float16", False, "float32")
    assert GlmMoeDsaConfig.from_pretrained(TINY_CONFIG.parent, dtype="auto").model_dtype == "bfloat16"


def test_subfolder_is_read_as_transformers_reads_it(tmp_path):
    """transformers reads ``folder/subfolder/config.json``; before, ``subfolder`` became a config key."""
    (tmp_path / "inner").mkdir()
    (tmp_path / "inner" / "config.json").write_text(TINY_CONFIG.read_text())
    config = GlmMoeDsaConfig.from_pretrained(tmp_path, subfolder="inner")
    assert config.to_dict() == _tiny()


# ------------------------------------------------------------------ transformers' serialisation methods


def _api_calls(cls, tmp_path) -> tuple:
    c = cls.from_pretrained(TINY_CONFIG.parent)
    c.update({"index_topk": 4, "use_cache": False})
    full = json.loads(c.to_json_string(use_diff=False))
    diff = json.loads(c.to_json_string(use_diff=True))
    c.save_pretrained(tmp_path, push_to_hub=False)
    c.to_json_file(tmp_path / "copy.json", use_diff=False)
    saved = json.loads((tmp_path / "config.json").read_text())
    return (c.index_topk, c.use_cache, full["index_topk"], diff["index_topk"], c.to_diff_dict()["use_cache"],
            saved["index_topk"], json.loads((tmp_path / "copy.json").read_text())["use_cache"])  # fmt: skip


def test_transformers_serialisation_methods(tmp_path):
    """transformers 5.23 (measured): ``update``, ``to_json_string(use_diff=...)``, ``to_diff_dict``,
    ``save_pretrained(dir, push_to_hub=False)``, ``to_json_file`` give (4, False, 4, 4, False, 4, False)."""
    assert _api_calls(_hf(), tmp_path) == (4, False, 4, 4, False, 4, False)


def test_serialisation_methods_take_transformers_arguments(tmp_path):
    """Before: ``to_json_string(use_diff=False)`` and ``save_pretrained(dir, push_to_hub=False)`` raised
    TypeError, ``update`` / ``to_diff_dict`` / ``to_json_file`` AttributeError. transformers:
    (4, False, 4, 4, False, 4, False). Both ``use_diff`` give the file's keys (to_dict)."""
    assert _api_calls(GlmMoeDsaConfig, tmp_path) == (4, False, 4, 4, False, 4, False)
    c = GlmMoeDsaConfig.from_pretrained(tmp_path)
    assert c.to_json_string(use_diff=True) == c.to_json_string(use_diff=False) == c.to_json_string()
    assert c.to_diff_dict() == c.to_dict()
    with pytest.raises(ValueError, match=r"`num_experts_per_tok`: 9 must be in \[1, n_routed_experts=8\]"):
        c.update({"num_experts_per_tok": 9})
    with pytest.raises(NotImplementedError, match="push_to_hub"):
        c.save_pretrained(tmp_path, push_to_hub=True)


def test_transformers_loads_what_update_and_save_pretrained_wrote(tmp_path):
    """The saved file (after ``update``) reads back in transformers with the updated values."""
    hf = _hf()
    c = GlmMoeDsaConfig.from_pretrained(TINY_CONFIG.parent)
    c.update({"index_topk": 4, "num_local_experts": 4, "num_experts_per_tok": 1})
    c.save_pretrained(tmp_path)
    h = hf.from_pretrained(tmp_path)
    assert (h.index_topk, h.n_routed_experts, h.num_experts_per_tok) == (4, 4, 1)
    assert GlmMoeDsaConfig.from_pretrained(tmp_path) == c


# ------------------------------------------------------------------ a config built in Python

_BUILT = [  # keywords -> (full layers, rope base) in transformers 5.23, measured
    ({}, (list(range(78)), 10000.0)),
    ({"num_hidden_layers": 8}, (list(range(8)), 10000.0)),
    ({"num_hidden_layers": 8, "index_topk_freq": 4}, ([0, 1, 5], 10000.0)),
    ({"num_hidden_layers": 8, "index_topk_freq": 4, "index_skip_topk_offset": 3}, ([0, 1, 2, 6], 10000.0)),
    ({"num_hidden_layers": 8, "rope_theta": 5e5}, (list(range(8)), 5e5)),
]


def _built(cls, kw) -> tuple:
    c = cls(**copy.deepcopy(kw))
    rope = c.rope_parameters if cls is not GlmMoeDsaConfig else c.rope
    return [i for i, t in enumerate(c.indexer_types) if t == "full"], float(rope["rope_theta"])


@pytest.mark.parametrize("kw,want", _BUILT, ids=lambda v: "+".join(v) if isinstance(v, dict) else None)
def test_transformers_defaults_of_a_config_built_in_python(kw, want):
    """transformers 5.23 (measured): without schedule keywords every layer runs the indexer (freq 1),
    a frequency alone takes offset 2, and the rope base is its default_theta 10000."""
    assert _built(_hf(), kw) == want


@pytest.mark.parametrize("kw,want", _BUILT, ids=lambda v: "+".join(v) if isinstance(v, dict) else None)
def test_a_config_built_in_python_has_transformers_defaults(kw, want, tmp_path):
    """Before: ``GlmMoeDsaConfig(**kw)`` took GLM-5.2's schedule (freq 4, offset 3: full layers
    [0, 1, 2, 6] of 8 where transformers runs all 8) and rope base 8e6 (transformers: 10000), so
    the same keywords built another model than transformers' ``GlmMoeDsaConfig(**kw)``."""
    assert _built(GlmMoeDsaConfig, kw) == want
    c = GlmMoeDsaConfig(**copy.deepcopy(kw))
    c.save_pretrained(tmp_path)
    assert GlmMoeDsaConfig.from_pretrained(tmp_path) == c  # a save of it reads back the same


# ------------------------------------------------------------------ dtype / torch_dtype


def _dtype_spellings(cls) -> tuple:
    base = {k: v for k, v in _tiny().items() if k != "dtype"}
    older = cls.from_dict(base | {"torch_dtype": "float32"})  # an older file's spelling
    read = str(older.dtype).replace("torch.", "")
    older.dtype = "float16"
    saved_older = {k: v for k, v in older.to_dict().items() if k in ("dtype", "torch_dtype")}
    newer = cls.from_dict(base | {"dtype": "float32"})
    read_torch = str(newer.torch_dtype).replace("torch.", "")
    newer.torch_dtype = "float16"
    return read, saved_older, read_torch, newer.to_dict()["dtype"]


def test_transformers_reads_dtype_and_torch_dtype_as_one_setting():
    """transformers 5.23 (measured): a file with ``torch_dtype: float32`` reads ``dtype`` float32, and a
    ``dtype`` set after loading is saved (as ``dtype``: its spelling); a file with ``dtype`` reads
    ``torch_dtype`` as it, and setting ``torch_dtype`` sets the saved ``dtype``."""
    assert _dtype_spellings(_hf()) == ("float32", {"dtype": "float16"}, "float32", "float16")


def test_dtype_and_torch_dtype_are_one_setting():
    """Before: a file with only ``torch_dtype: float32`` read ``config.dtype`` as 'bfloat16', and
    ``config.dtype = "float16"`` was ignored (the model dtype and the save stayed float32);
    ``config.torch_dtype`` read None on a ``dtype`` file and setting it was ignored. transformers:
    ("float32", {"dtype": "float16"}, "float32", "float16"); the file's own spelling is kept here."""
    assert _dtype_spellings(GlmMoeDsaConfig) == ("float32", {"torch_dtype": "float16"}, "float32", "float16")
    older = GlmMoeDsaConfig.from_dict({k: v for k, v in _tiny().items() if k != "dtype"} | {"torch_dtype": "float32"})
    older.dtype = "float16"
    older.validate()  # (what the model reads is normalised by validate(), as after any attribute)
    assert older.model_dtype == "float16"
    both = _tiny(dtype=None, torch_dtype="float32")  # transformers: dtype unless null; null written back
    assert GlmMoeDsaConfig.from_dict(copy.deepcopy(both)).to_dict() == both
    assert GlmMoeDsaConfig.from_dict(copy.deepcopy(both)).model_dtype == "float32"
    with pytest.raises(ValueError, match=r"`torch_dtype`: 'float32' disagrees with `dtype` 'float16'"):
        GlmMoeDsaConfig.from_dict(_tiny(dtype="float16", torch_dtype="float32"))


# ------------------------------------------------------------------ the mapping / accessor protocol


def _protocol(cls) -> tuple:
    c = cls.from_json_file(TINY_CONFIG)
    names = list(c)
    return (
        c == cls.from_pretrained(TINY_CONFIG.parent),
        "hidden_size" in c,
        "foo" in c,
        "ep_size" in c,  # a key of the file the class does not define
        "num_local_experts" in c,  # an alias is no attribute of its own
        c.get_text_config() is c and c.get_text_config(decoder=True) is c,
        all(n in names for n in ("vocab_size", "indexer_types", "rope_parameters", "ep_size")),
    )


def test_transformers_config_protocol():
    """transformers 5.23 (measured): ``from_json_file`` equals ``from_pretrained``; ``in`` and iteration
    cover the attributes (``ep_size`` of the file included, not ``num_local_experts``);
    ``get_text_config()`` is the config itself."""
    assert _protocol(_hf()) == (True, True, False, True, False, True, True)


def test_config_protocol_as_transformers():
    """Before: ``from_json_file`` and ``get_text_config`` raised AttributeError, ``"hidden_size" in
    config`` and ``list(config)`` TypeError (not iterable). transformers: (True, True, False, True,
    False, True, True)."""
    assert _protocol(GlmMoeDsaConfig) == (True, True, False, True, False, True, True)


# ------------------------------------------------------------------ a rope without a base

_NO_BASE = [  # file keys replacing the tiny file's rope_parameters -> transformers 5.23's rope (measured)
    ({}, {"rope_theta": 10000.0, "rope_type": "default"}),
    ({"rope_parameters": None}, {"rope_theta": 10000.0, "rope_type": "default"}),
    ({"rope_scaling": None}, {"rope_theta": 10000.0, "rope_type": "default"}),
    ({"rope_parameters": {"rope_type": "default"}}, {"rope_theta": 10000.0, "rope_type": "default"}),
    (
        {"rope_scaling": {"type": "linear", "factor": 2.0}},
        {"factor": 2.0, "rope_theta": 10000.0, "rope_type": "linear"},
    ),
    (
        {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024}},
        {"factor": 4.0, "original_max_position_embeddings": 1024, "rope_theta": 10000.0, "rope_type": "yarn"},
    ),
]


def _no_base_file(keys: dict) -> dict:
    return {k: v for k, v in _tiny().items() if k != "rope_parameters"} | copy.deepcopy(keys)


@pytest.mark.parametrize("keys,want", _NO_BASE, ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_transformers_gives_a_rope_without_a_base_its_default_theta(keys, want):
    """transformers 5.23 (measured): a file whose rope names no base (none of rope_parameters.rope_theta,
    rope_scaling.rope_theta, a top-level rope_theta) takes PreTrainedConfig.default_theta, 10000."""
    rope = _hf().from_dict(_no_base_file(keys)).rope_parameters
    assert {k: v for k, v in rope.items() if k != "type"} == want


@pytest.mark.parametrize("keys,want", _NO_BASE, ids=lambda v: json.dumps(v) if isinstance(v, dict) else None)
def test_a_rope_without_a_base_takes_transformers_default_theta(keys, want):
    """Before: each of these files was refused ("`rope_scaling`: no rope_theta: give
    rope_parameters.rope_theta or a top-level rope_theta") where transformers reads base 10000; as
    ``GlmMoeDsaConfig(rope_parameters={"rope_type": "default"})`` built in Python. The file round-trips."""
    d = _no_base_file(keys)
    c = GlmMoeDsaConfig.from_dict(copy.deepcopy(d))
    assert {k: v for k, v in c.rope.items() if k != "type"} == want
    assert c.to_dict() == d
    assert GlmMoeDsaConfig(rope_parameters={"rope_type": "default"}).rope["rope_theta"] == 10000.0


# ------------------------------------------------------------------ a new attribute


def _new_attributes_saved(cls, tmp_path) -> tuple:
    c = cls.from_pretrained(TINY_CONFIG.parent)
    c.quantization_config = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    c.my_flag = 3
    c.save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    built = cls(num_hidden_layers=4)
    built.my_flag = 3
    return saved.get("quantization_config"), saved.get("my_flag"), built.to_dict().get("my_flag")


def test_transformers_saves_an_attribute_set_on_the_config(tmp_path):
    """transformers 5.23 (measured): an attribute set on a loaded (or built) config is saved."""
    want = ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 3, 3)
    assert _new_attributes_saved(_hf(), tmp_path) == want


def test_an_attribute_set_on_the_config_is_saved(tmp_path):
    """Before: ``config.quantization_config = {...}`` (or any new key) was readable but dropped by
    ``save_pretrained`` / ``to_dict`` (None, None, None). transformers: the dict, 3, 3. It is written
    after the file's keys, and the saved file loads back equal."""
    want = ({"quant_method": "fp8", "weight_block_size": [128, 128]}, 3, 3)
    assert _new_attributes_saved(GlmMoeDsaConfig, tmp_path) == want
    c = GlmMoeDsaConfig.from_pretrained(tmp_path)
    assert list(c.to_dict())[-2:] == ["quantization_config", "my_flag"]
    assert GlmMoeDsaConfig.from_pretrained(tmp_path) == c and copy.deepcopy(c) == c


def _absent_keys_set(cls, tmp_path) -> tuple:
    d = _tiny()
    for k in ("pad_token_id", "index_topk", "max_position_embeddings"):
        d.pop(k)
    (tmp_path / "config.json").write_text(json.dumps(d))
    c = cls.from_pretrained(tmp_path)
    c.pad_token_id = 3
    c.update({"index_topk": 4})
    c.max_position_embeddings = 512
    c.save_pretrained(tmp_path / "saved")
    back = cls.from_pretrained(tmp_path / "saved")
    return back.pad_token_id, back.index_topk, back.max_position_embeddings


def test_transformers_saves_a_model_key_the_file_lacked_once_set(tmp_path):
    """transformers 5.23 (measured): a model key missing from config.json, set after loading, is saved."""
    assert _absent_keys_set(_hf(), tmp_path) == (3, 4, 512)


def test_a_model_key_the_file_lacked_is_saved_once_set(tmp_path):
    """Before: set in memory (the model read it) but left out of to_dict(), so the reload had the
    default (pad None, index_topk 2048, max_position_embeddings 202752): another model. What the
    config derives itself (indexer_types, mlp_layer_types, qk_head_dim) is still not written."""
    assert _absent_keys_set(GlmMoeDsaConfig, tmp_path) == (3, 4, 512)
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    assert list(saved)[-3:] == ["pad_token_id", "index_topk", "max_position_embeddings"]
    assert not {"indexer_types", "mlp_layer_types", "qk_head_dim"} & (set(saved) - set(_tiny()))


_YARN = {"rope_type": "yarn", "factor": 2.0, "rope_theta": 1e6}


def _rope_set(cls) -> tuple:
    """(a) ``rope_scaling`` set on a rope_parameters file, (b) ``rope_parameters`` set on a GLM-5.1-style
    file (top-level rope_theta): the saved rope keys and the rope in use."""
    out = []
    legacy = {k: v for k, v in _tiny(rope_theta=1e6).items() if k != "rope_parameters"}
    for d, key, rope in (
        (_tiny(), "rope_scaling", _YARN),
        (legacy, "rope_parameters", {"rope_type": "default", "rope_theta": 5e5}),
    ):
        c = cls.from_dict(d)
        setattr(c, key, dict(rope))
        saved = c.to_dict()
        back = cls.from_dict(saved)
        rope_now = back.rope if cls is GlmMoeDsaConfig else back.rope_parameters
        out.append(
            (
                {k for k in ("rope_parameters", "rope_scaling", "rope_theta") if k in saved},
                rope_now["rope_type"],
                rope_now["rope_theta"],
            )
        )
    return out


def test_transformers_replaces_the_rope_set_as_either_key():
    want = [({"rope_parameters"}, "yarn", 1e6), ({"rope_parameters"}, "default", 5e5)]
    assert _rope_set(_hf()) == want


def test_a_rope_set_as_either_key_replaces_the_rope_and_is_saved():
    """transformers 5.23 (measured): a rope set as rope_scaling or rope_parameters replaces the rope and
    is saved as rope_parameters. Before: the save kept the old rope (the reload was another model)
    and config.rope raised "rope_scaling.rope_theta disagrees with rope_parameters.rope_theta"."""
    want = [({"rope_parameters"}, "yarn", 1e6), ({"rope_parameters"}, "default", 5e5)]
    assert _rope_set(GlmMoeDsaConfig) == want


def test_an_assignment_of_a_wrong_type_is_refused_and_sets_nothing():
    """transformers 5.23 (measured) refuses ``config.hidden_size = "128"`` and keeps 64; ours took it
    and save_pretrained wrote a config.json it then refused to load."""
    c = GlmMoeDsaConfig.from_dict(_tiny())
    before = c.to_dict()
    for key, value in (("hidden_size", "128"), ("num_hidden_layers", 0), ("num_local_experts", 2.5)):
        with pytest.raises(ValueError, match="expected an integer"):
            setattr(c, key, value)
    assert c.to_dict() == before and c.hidden_size == before["hidden_size"]


def test_attn_implementation_is_saved_as_the_file_spelled_it(tmp_path):
    """A config.json holding transformers' "eager" / "sdpa" was saved as this library's form name
    ("reference" / "auto"), which transformers refuses to build a model from (measured: ValueError
    'Specified attn_implementation="reference" is not supported'); a form set since is written as set."""
    for given in ("eager", "sdpa"):
        c = GlmMoeDsaConfig.from_dict(_tiny(attn_implementation=given))
        assert c.attn_implementation == {"eager": "reference", "sdpa": "auto"}[given]
        assert c.to_dict()["attn_implementation"] == given
    c.attn_implementation = "dense"
    assert c.to_dict()["attn_implementation"] == "dense"


# ------------------------------------------------------------------ num_key_value_heads


@pytest.mark.parametrize("kv,works", [(4, True), (3, True), (2, False), (8, False)])
def test_transformers_computes_mla_only_with_one_kv_group(kv, works):
    """transformers 5.23 (measured, tiny fixture, 4 heads): num_key_value_heads 3 gives the logits of 4
    (4 // 3 = 1 group: MLA has a key and value per head); 2 and 8 raise RuntimeError in the forward
    ("The size of tensor a (4) must match the size of tensor b (8)" / "(0)")."""
    torch = pytest.importorskip("torch")
    hf = _hf()
    from transformers import GlmMoeDsaForCausalLM

    def logits(n):
        c = hf.from_dict(_tiny(num_key_value_heads=n))
        c._attn_implementation = "eager"
        torch.manual_seed(0)
        with torch.no_grad():
            return GlmMoeDsaForCausalLM(c).eval()(torch.tensor([[1, 2, 3, 4, 5]])).logits

    if works:
        assert torch.equal(logits(kv), logits(4))
    else:
        with pytest.raises(RuntimeError, match="must match the size"):
            logits(kv)


def test_num_key_value_heads_is_refused_where_transformers_cannot_compute():
    """Before: 2 (divides 4 heads) was accepted and computed as 4 (transformers fails), 3 was refused
    ("3 does not divide num_attention_heads", no head count) where transformers computes 4's logits."""
    assert GlmMoeDsaConfig.from_dict(_tiny(num_key_value_heads=3)).num_key_value_heads == 3
    for kv in (2, 8):
        with pytest.raises(ValueError, match=rf"`num_key_value_heads`: expected an integer in \[3, 4\] .* got {kv}$"):
            GlmMoeDsaConfig.from_dict(_tiny(num_key_value_heads=kv))


# ------------------------------------------------------------------ the rope / dtype changed after loading


def _rope_after_mutation(cls):
    c = cls.from_pretrained(TINY_CONFIG.parent)
    c.rope_parameters["rope_theta"] = 1e6  # transformers' idiom: edit the dict, then build the model
    return c


def test_transformers_model_reads_the_rope_parameters_as_they_are_when_built():
    """transformers 5.23 (measured): after ``config.rope_parameters["rope_theta"] = 1e6`` the model's
    inv_freq is 1 / 1e6 ** (arange(0, 16, 2) / 16) (the file says 8e6)."""
    torch = pytest.importorskip("torch")
    _hf()
    from transformers import GlmMoeDsaForCausalLM

    c = _rope_after_mutation(_hf())
    inv = GlmMoeDsaForCausalLM(c).model.rotary_emb.inv_freq
    want = 1.0 / (1e6 ** (torch.arange(0, 16, 2, dtype=torch.float) / 16))
    assert torch.allclose(inv, want)


def test_rope_and_dtype_are_read_as_the_settings_are_now():
    """Before: ``config.rope`` (what the model's rope tables are made from) kept the loaded base 8e6
    after ``config.rope_parameters["rope_theta"] = 1e6`` (transformers' model uses 1e6), and
    ``model_dtype`` kept the loaded dtype after ``config.dtype = "float32"``, until ``validate()``."""
    np = pytest.importorskip("numpy")
    from paddleformers_glm.modeling.rope import rope_inv_freq

    c = _rope_after_mutation(GlmMoeDsaConfig)
    assert c.rope["rope_theta"] == 1e6
    inv, _ = rope_inv_freq(c)
    np.testing.assert_allclose(inv, 1.0 / (1e6 ** (np.arange(0, 16, 2) / 16)), rtol=1e-6)
    c.dtype = "float32"
    assert c.model_dtype == "float32"
    c.rope_parameters = {"rope_type": "spiral", "rope_theta": 1e6}  # still checked, naming the key
    with pytest.raises(ValueError, match=r"`rope_parameters.rope_type`: unknown rope type 'spiral'"):
        _ = c.rope
