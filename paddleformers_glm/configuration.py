"""GlmMoeDsaConfig: the GLM-5.2 (`glm_moe_dsa`) model configuration.

Not a plain attribute bag: a ``config.json`` from any producer (transformers, PaddleFormers, a
PaddleFleet run) must survive load -> save as the *same JSON object* (every key at its place and in
the file's own spelling, nothing invented); files in the wild describe the same model differently,
so what the model reads is normalised once here and two spellings of one setting must agree; a
run's layout may ride along for ``to_fleet_config()``, but whether it fits is checked by the run.
docs/config.md gives the contract and the semantics of every derived field.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

from ._io import atomic_write_text, read_json

__all__ = ["IGNORE_INDEX", "GlmMoeDsaConfig", "indexer_types_from_schedule"]

# The label no loss counts (HF's convention): padding, and what a chat sample does not train on.
IGNORE_INDEX = -100

# HF-file keys and defaults (transformers 5.2x `GlmMoeDsaConfig`; GLM-5.2 values where HF has none;
# HF's rope base 10000 and index schedule, every layer full, are set in __init__ as HF reads them).
_FILE_DEFAULTS: dict[str, Any] = {
    "architectures": ["GlmMoeDsaForCausalLM"],
    "attention_bias": False,
    "attention_dropout": 0.0,
    "dtype": "bfloat16",
    "eos_token_id": 1,
    "bos_token_id": 0,
    "pad_token_id": None,
    "first_k_dense_replace": 3,
    "head_dim": 64,
    "hidden_act": "silu",
    "hidden_size": 6144,
    "index_head_dim": 128,
    "index_n_heads": 32,
    "index_share_for_mtp_iteration": True,
    "index_skip_topk_offset": 2,
    "index_topk": 2048,
    "index_topk_freq": 1,
    "index_topk_pattern": None,
    "indexer_rope_interleave": True,
    "indexer_types": None,
    "initializer_range": 0.02,
    "intermediate_size": 12288,
    "kv_lora_rank": 512,
    "max_position_embeddings": 202752,
    "mlp_layer_types": None,
    "model_type": "glm_moe_dsa",
    "moe_intermediate_size": 2048,
    "moe_layer_freq": 1,
    "moe_router_dtype": "float32",
    "n_group": 1,
    "n_routed_experts": 256,
    "n_shared_experts": 1,
    "norm_topk_prob": True,
    "num_attention_heads": 64,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 78,
    "num_key_value_heads": 64,
    "num_nextn_predict_layers": 1,
    "q_lora_rank": 2048,
    "qk_head_dim": None,
    "qk_nope_head_dim": 192,
    "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-5,
    "rope_interleave": True,
    "rope_parameters": None,
    "routed_scaling_factor": 2.5,
    "scoring_func": "sigmoid",
    "tie_word_embeddings": False,
    "topk_group": 1,
    "topk_method": "noaux_tc",
    "use_cache": True,
    "v_head_dim": 256,
    "vocab_size": 154880,
}

# Other producers' names for a setting this config holds under its transformers name (file key ->
# attribute). A file may carry either spelling or both; both must agree, and to_dict() writes each
# key the file had under the file's own name. PaddleFleet's TransformerConfig / ModelParallelConfig
# names are listed in docs/config.md with the source revision they were read from.
_KEY_ALIASES: dict[str, str] = {
    "expert_tensor_parallel_size": "expert_tensor_model_parallel_size",
    "rotary_interleaved": "rope_interleave",
    "dsa_indexer_rotary_interleaved": "indexer_rope_interleave",
    "indexer_rotary_interleaved": "indexer_rope_interleave",
    "dsa_index_n_heads": "index_n_heads",
    "dsa_index_head_dim": "index_head_dim",
    "dsa_index_topk": "index_topk",
    "dsa_indexer_topk_freq": "index_topk_freq",
    "dsa_indexer_skip_topk_offset": "index_skip_topk_offset",
    "dsa_indexer_types": "indexer_types",
    "dsa_index_share_for_mtp_iteration": "index_share_for_mtp_iteration",
    "dsa_indexer_loss_coeff": "indexer_loss_coeff",
    "num_experts": "n_routed_experts",  # transformers' backward-compatible name
    "num_local_experts": "n_routed_experts",  # transformers' attribute_map name
}
# PaddleFleet's spellings of the rope base and type; checked against the normalised rope settings.
_ROPE_ALIASES = ("rotary_base", "rope_type")
_FLEET_ROPE_TYPES = {"default": "rope"}  # Fleet says "rope" where transformers says "default"

# Settings of this library (model behaviour the HF file has no key for). Saved to config.json only
# when changed from the default, so the official file round-trips unchanged.
_LIBRARY_DEFAULTS: dict[str, Any] = {
    "use_qk_norm": True,
    "fp32_residual_connection": False,
    "mtp_loss_scaling_factor": 0.1,
    "indexer_loss_coeff": 0.0,
    "indexer_k_norm_eps": 1e-6,
    "attention_chunk_size": 1024,
    # which form of the sparse attention runs: auto (by size) | reference | dense | sparse | latent
    "attn_implementation": "auto",
}

# Parallel / training layout: carried (written back only when the file had the key), form-checked.
_PARALLEL_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_model_parallel_size": 1,
    "sequence_parallel": False,
    "context_parallel_size": 1,
}

# Per-key form of the settings the model reads: checked before any is used, so a wrong type or range
# is named with its key, the expected and the actual value instead of failing deep in a layer.
# ("int", lo, hi): an integer (bools are not) in [lo, hi]; ("num", lo, hi, lo_open): a finite number;
# ("bool",); ("str",); "|None" suffix: null allowed. Sizes stop at MAX_DIM (one tensor axis) and the
# layer count at MAX_LAYERS: per-layer lists are built from it, and a value like 10**9 would spin.
MAX_DIM = 2**31 - 1
MAX_LAYERS = 10_000
_DEFAULTS = {**_FILE_DEFAULTS, **_LIBRARY_DEFAULTS}
_POSITIVE, _NONNEGATIVE = ("num", 0.0, math.inf, True), ("num", 0.0, math.inf, False)
_KEY_FORMS: dict[str, tuple[Any, ...]] = {
    # by the default's type: sizes in [1, MAX_DIM] (eos_token_id may be a list: validate checks it)
    **{k: ("int", 1, MAX_DIM) for k, v in _DEFAULTS.items() if type(v) is int and k != "eos_token_id"},
    **{k: ("bool",) for k, v in _DEFAULTS.items() if isinstance(v, bool)},
    "num_hidden_layers": ("int", 1, MAX_LAYERS),
    **dict.fromkeys(("first_k_dense_replace", "n_shared_experts"), ("int", 0, MAX_DIM)),
    "num_nextn_predict_layers": ("int|None", 0, MAX_LAYERS),
    "qk_head_dim": ("int|None", 1, MAX_DIM),
    "index_topk_freq": ("int|None", -MAX_DIM, MAX_DIM),  # <= 0: every layer full, as transformers reads it
    **dict.fromkeys(("index_skip_topk_offset", "bos_token_id", "pad_token_id"), ("int|None", 0, MAX_DIM)),
    **dict.fromkeys(("rms_norm_eps", "indexer_k_norm_eps", "routed_scaling_factor"), _POSITIVE),
    **dict.fromkeys(("initializer_range", "mtp_loss_scaling_factor", "indexer_loss_coeff"), _NONNEGATIVE),
    "attention_dropout": ("num", 0.0, 1.0, False),
    **{k: ("str",) for k in ("hidden_act", "topk_method", "scoring_func", "moe_router_dtype", "attn_implementation")},
    "dtype": ("str|None",),
    "rope_theta": ("num|None", 0.0, math.inf, True),  # a top-level base (rope settings: _normalise_rope)
    # The layout fields: only their form. Whether a layout works for this model and a world size is
    # decided in one place, when a run is launched: `parallel.topology.ParallelConfig.validate`.
    **{k: ("bool",) if k == "sequence_parallel" else ("int", 1, MAX_DIM) for k in _PARALLEL_DEFAULTS},
}

# transformers' from_pretrained download options (nothing to do on a local folder; the model's
# from_pretrained drops them too) and from_dict telemetry: consumed, never config keys
HF_DOWNLOAD_KWARGS = ("cache_dir", "force_download", "proxies", "token", "local_files_only", "revision")
HF_DOWNLOAD_KWARGS += ("trust_remote_code", "_from_auto", "_from_pipeline", "_commit_hash")
_HF_TELEMETRY_KWARGS = ("_from_auto", "_from_pipeline")
_DTYPE_KEYS = ("dtype", "torch_dtype")
# the rope's spellings: one file holds one form of them, so setting another is not a key of its own
_ROPE_KEYS = ("rope_parameters", "rope_theta", "rope_scaling", "partial_rotary_factor")
# transformers' base-config output flags: a loading keyword sets them on the config (and its save
# writes them) though the file has no such key; the forward reads them when its keyword is not given
_HF_OUTPUT_FLAGS = ("output_hidden_states", "output_attentions", "output_router_logits", "return_dict")

# transformers' PreTrainedConfig attributes every config there answers, with their values for this
# model (measured on transformers 5.23's GlmMoeDsaConfig): read here when the file does not set them,
# never written by a save (a value set since is a key of the config, as any attribute set)
_HF_BASE_ATTRIBUTES: dict[str, Any] = {
    "is_encoder_decoder": False,
    "return_dict": True,
    "output_attentions": False,
    "output_hidden_states": False,
    "output_router_logits": False,
    "torchscript": False,
    "num_labels": 2,
    "id2label": {0: "LABEL_0", 1: "LABEL_1"},
    "label2id": {"LABEL_0": 0, "LABEL_1": 1},
    "_name_or_path": "",  # a model's from_pretrained reads it as the folder read (never saved: set_loaded_from)
}

_ROPE_TYPES = ("default", "linear", "yarn", "dynamic")
_HF_DEFAULT_THETA = 10000.0  # transformers' PreTrainedConfig.default_theta: its base when a file gives none
# The values of `attn_implementation`: the attention forms (modeling/attention_forms.py, which imports them)
ATTN_IMPLEMENTATIONS = ("auto", "reference", "dense", "sparse", "latent")
# transformers' names of this model's attention kernels, taken as the form with their arithmetic:
# eager's full S x S masked softmax is the reference form; sdpa (its default) the form chosen by size
HF_ATTN_IMPLEMENTATIONS = {"eager": "reference", "sdpa": "auto"}
_DTYPES = ("float32", "bfloat16", "float16")


def indexer_types_from_schedule(num_layers: int, freq: int, offset: int) -> list[str]:
    """The index-sharing rule: 0-based layer i is full iff max(i - offset + 1, 0) % freq == 0 (offset 0 acts as 1)."""
    if not 0 <= num_layers <= MAX_LAYERS:
        raise _err("num_hidden_layers", f"expected an integer in [0, {MAX_LAYERS}], got {num_layers!r}")
    offset = max(int(offset), 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """Yarn's magnitude correction for a rope scaled by ``scale``."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _check_form(key: str, value: Any, form: tuple[Any, ...]) -> None:
    """``value`` of ``key`` has the form ``form`` (see _KEY_FORMS), else an error naming both."""
    kind = form[0].removesuffix("|None")
    if value is None and kind != form[0]:
        return
    text = repr(value)
    actual = f"{text if len(text) <= 60 else text[:60] + '...'} ({type(value).__name__})"
    if kind == "int":
        lo, hi = form[1:]
        if not isinstance(value, int) or isinstance(value, bool) or not lo <= value <= hi:
            raise _err(key, f"expected an integer in [{lo}, {hi}], got {actual}")
    elif kind == "num":
        lo, hi, lo_open = form[1:]
        ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
        if not ok or value < lo or (lo_open and value == lo) or value > hi:
            upper = f" and <= {hi}" if hi != math.inf else ""
            raise _err(key, f"expected a finite number {'>' if lo_open else '>='} {lo}{upper}, got {actual}")
    elif not isinstance(value, {"bool": bool, "str": str}[kind]):
        raise _err(key, f"expected {'true or false' if kind == 'bool' else 'a string'}, got {actual}")


def _rope_type(rope: dict[str, Any]) -> Any:
    return rope.get("rope_type", rope.get("type", "default"))  # older files say "type"


def _err(key: str, msg: str) -> ValueError:
    return ValueError(f"GlmMoeDsaConfig: `{key}`: {msg}")


def _layer_list(key: str, given: Any, kinds: tuple[str, str], L: int) -> list[str]:
    """A per-layer list from the config file, checked: one of ``kinds`` per decoder layer."""
    if not isinstance(given, (list, tuple)) or not all(isinstance(t, str) for t in given) or set(given) - set(kinds):
        raise _err(key, f"must be a list of '{kinds[0]}'/'{kinds[1]}', got {given!r}")
    if len(given) != L:
        raise _err(key, f"has {len(given)} entries, num_hidden_layers is {L}")
    return list(given)


def _resolve_aliases(d: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """Move other producers' spellings onto this config's names; two spellings must agree.

    Returns the dict with canonical names and the alias keys' own values (to write them back
    unchanged). Why refuse rather than pick one: the same setting under two names with two values
    is the bug class that loses a flag silently (e.g. the indexer's interleave read into MLA's).
    """
    out = {k: v for k, v in d.items() if k not in _KEY_ALIASES and k not in _ROPE_ALIASES}
    aliases = {k: v for k, v in d.items() if k in _KEY_ALIASES or k in _ROPE_ALIASES}
    came_from: dict[str, str] = {}
    for alias, value in aliases.items():
        name = _KEY_ALIASES.get(alias)  # None: a rope alias, checked against the normalised rope
        if name in out and out[name] != value:
            raise _err(
                alias, f"{value!r} disagrees with `{came_from.get(name, name)}` {out[name]!r} (both name `{name}`)"
            )
        if name is not None and name not in out:
            out[name], came_from[name] = value, alias
    if "rotary_base" in aliases and not {"rope_parameters", "rope_theta", "rope_scaling"} & set(out):
        out["rope_theta"] = aliases["rotary_base"]
    return out, aliases


class _RopeScaling:
    """``config.rope_scaling``, read as transformers 5.23 reads it: the file's own ``rope_scaling``
    where it has one (not null), else an alias of the rope in use (``rope_parameters``, the same dict,
    so a change through it is a change of the rope, as there; a file with only a top-level
    ``rope_theta`` gets a copy of the normalised rope). Code that detects yarn by
    ``config.rope_scaling["rope_type"]`` or reads its ``factor`` saw None on the official file, which
    spells only ``rope_parameters``. The stored value is the file's (null stays null on save)."""

    def __get__(self, obj: Any, owner: Any = None) -> Any:
        if obj is None:
            return self
        raw = obj.__dict__.get("rope_scaling")
        if raw is not None or "_rope" not in obj.__dict__:  # (while __init__ runs: the stored value)
            return raw
        if obj.rope_parameters is not None:
            return obj.rope_parameters
        return copy.deepcopy(obj.rope)

    def __set__(self, obj: Any, value: Any) -> None:
        obj.__dict__["rope_scaling"] = value


class GlmMoeDsaConfig:
    """Configuration of a GLM-5.2 model; see the module docstring for the round-trip contract."""

    model_type = "glm_moe_dsa"
    rope_scaling = _RopeScaling()

    def __init__(self, **kwargs: Any) -> None:
        kwargs = copy.deepcopy(kwargs)
        from_file = kwargs.pop("_from_file", False)
        overrides = kwargs.pop("_overrides", None) or {}
        file_order = list(kwargs)
        kwargs, self._alias_values = _resolve_aliases(kwargs)
        for key, value in overrides.items():  # an override wins over the file's value, in either spelling
            if key in _ROPE_ALIASES:
                raise _err(key, "override the rope through `rope_parameters` (or `rope_theta`), not PaddleFleet's name")
            if key in _DTYPE_KEYS and (spelled := [k for k in _DTYPE_KEYS if k in kwargs]):
                for k in spelled:  # as transformers: the override is the dtype, in the file's spelling(s)
                    kwargs[k] = value
                continue
            kwargs[_KEY_ALIASES.get(key, key)] = value
        # Keys that to_dict() writes back, in the source's order. A config built in Python writes the
        # full canonical key set; one loaded from a file writes exactly the file's keys (parallel and
        # library keys included, at their place), plus overrides of model keys the file lacked.
        skip = set(_PARALLEL_DEFAULTS) | set(_LIBRARY_DEFAULTS) | set(_KEY_ALIASES) | set(_ROPE_ALIASES)
        if from_file:
            skip |= set(_DTYPE_KEYS) if set(_DTYPE_KEYS) & set(file_order) else set()  # written in the file's spelling
            self._file_keys = file_order + [k for k in overrides if k not in file_order and k not in skip]
        else:
            canon = [k for k in _FILE_DEFAULTS if k not in ("qk_head_dim",)] + ["qk_head_dim"]
            if any(k in kwargs for k in ("rope_theta", "rope_scaling")) and "rope_parameters" not in kwargs:
                canon.remove("rope_parameters")
            if "torch_dtype" in kwargs and "dtype" not in kwargs:
                canon.remove("dtype")
            if kwargs.get("indexer_types") is not None and "index_topk_freq" not in kwargs:
                # the list alone, as transformers writes it: a schedule written beside it was read back
                # as given, and a list it does not describe was then refused (the saved file loaded not)
                canon = [k for k in canon if k not in ("index_topk_freq", "index_skip_topk_offset")]
            self._file_keys = canon + [k for k in kwargs if k not in skip and k not in canon]
            if not {"rope_parameters", "rope_theta", "rope_scaling"} & set(kwargs):
                # transformers' default base (PreTrainedConfig.default_theta), not GLM-5.2's 8e6
                kwargs["rope_parameters"] = {"rope_theta": _HF_DEFAULT_THETA, "rope_type": "default"}
        self._given_keys = frozenset(kwargs)
        # keys given as null: "derive it" (transformers reads them so too); written back null while derived
        self._null_keys = frozenset(k for k, v in kwargs.items() if v is None)
        # as transformers reads its keywords (a file's keys, or a config built in Python alike): no
        # schedule has every layer full; a frequency without an offset takes offset 2
        if "index_topk_freq" not in kwargs:
            kwargs["index_topk_freq"] = 1
        elif kwargs["index_topk_freq"] is not None and "index_skip_topk_offset" not in kwargs:
            kwargs["index_skip_topk_offset"] = 2  # HF's offset for a file that gives only the frequency

        # `dtype` and `torch_dtype` (older files) are one setting, held as `dtype` (transformers: dtype
        # unless null, else torch_dtype); each key the file had is written back under its spelling
        self._dtype_written = {k: kwargs[k] for k in _DTYPE_KEYS if k in kwargs}
        if None not in (kwargs.get("dtype"), kwargs.get("torch_dtype")):
            a, b = (str(kwargs[k]).replace("torch.", "") for k in _DTYPE_KEYS)
            if a != b:
                raise _err("torch_dtype", f"{kwargs['torch_dtype']!r} disagrees with `dtype` {kwargs['dtype']!r}")
        if self._dtype_written:
            given = kwargs.pop("torch_dtype", None)
            kwargs["dtype"] = kwargs["dtype"] if kwargs.get("dtype") is not None else given
        self._dtype_at_load = kwargs.get("dtype", _FILE_DEFAULTS["dtype"])

        for key, default in {**_DEFAULTS, **_PARALLEL_DEFAULTS}.items():
            setattr(self, key, kwargs.pop(key, copy.deepcopy(default)))
        for key in ("rope_theta", "rope_scaling", "partial_rotary_factor"):  # other producers' keys
            setattr(self, key, kwargs.pop(key, None))
        # Everything else is preserved verbatim (and readable as an attribute).
        self._extra: dict[str, Any] = kwargs
        self._given_indexer_types = self.indexer_types
        self._given_mlp_layer_types = self.mlp_layer_types
        self._given_qk_head_dim = self.qk_head_dim
        self.validate()
        self._check_rope_aliases()

    # ------------------------------------------------------------------ normalised views
    def __getattr__(self, name: str) -> Any:  # only called for missing attributes
        if name == "_name_or_path" and "_loaded_from" in self.__dict__:  # a model's from_pretrained: not a key
            return self.__dict__["_loaded_from"]
        extra = self.__dict__.get("_extra", {})
        if name in extra:
            return extra[name]
        if name in _KEY_ALIASES and "_extra" in self.__dict__:
            return getattr(self, _KEY_ALIASES[name])
        if name == "torch_dtype" and "dtype" in self.__dict__:  # transformers' older name of `dtype`
            return self.dtype
        if name in _HF_BASE_ATTRIBUTES and "_extra" in self.__dict__:  # transformers' base-config values
            return copy.deepcopy(_HF_BASE_ATTRIBUTES[name])
        if name == "use_return_dict" and "_extra" in self.__dict__:  # transformers: return_dict, not torchscript
            return bool(self.return_dict) and not self.torchscript
        raise AttributeError(f"GlmMoeDsaConfig has no attribute {name!r}")

    def set_loaded_from(self, path: str | os.PathLike) -> None:
        """What a model's ``from_pretrained`` read: ``_name_or_path`` / ``name_or_path`` answer it, as
        transformers sets them, but it is no key of the config: a save writes the file's own
        ``_name_or_path`` (a transformers-4 file's hub id) back as it was, never this machine's path."""
        self.__dict__["_loaded_from"] = os.fspath(path)

    @property
    def name_or_path(self) -> str:
        """transformers' ``name_or_path``: the folder a model's ``from_pretrained`` read ("" for a
        config read on its own or built in Python, as there); not a key of the saved file."""
        return self._name_or_path

    @name_or_path.setter
    def name_or_path(self, value: Any) -> None:
        self._name_or_path = str(value)

    @property
    def _attn_implementation(self) -> str:
        """transformers' ``config._attn_implementation`` (what PEFT, TRL and other tools read): the
        attention form in use under transformers' name where it has one ("eager" for the reference
        form, "sdpa" for "auto", its default), else this library's form name. Setting it sets
        ``attn_implementation``, as :meth:`GlmMoeDsaForCausalLM.set_attn_implementation`."""
        own = self.attn_implementation
        return next((hf for hf, form in HF_ATTN_IMPLEMENTATIONS.items() if form == own), own)

    @_attn_implementation.setter
    def _attn_implementation(self, value: Any) -> None:
        form = HF_ATTN_IMPLEMENTATIONS.get(value, value) if isinstance(value, str) else value
        if form not in ATTN_IMPLEMENTATIONS:
            raise _err(
                "_attn_implementation",
                f"must be one of {ATTN_IMPLEMENTATIONS} (or transformers' {tuple(HF_ATTN_IMPLEMENTATIONS)}), "
                f"got {value!r}",
            )
        self.attn_implementation = form

    def __setattr__(self, name: str, value: Any) -> None:
        """As transformers' attribute_map: setting another producer's name sets the setting it names
        (``config.num_local_experts = 16`` is ``n_routed_experts``); a key of the file this config
        does not know is set where ``to_dict()`` reads it (else a save wrote the loaded value back),
        and, as in transformers, a new public attribute (``config.quantization_config = ...``) is a
        key of the config from then on: saved, after the file's keys."""
        extra = self.__dict__.get("_extra")
        if extra is not None:
            if name in _KEY_ALIASES:
                name = _KEY_ALIASES[name]
            elif name == "torch_dtype":
                name = "dtype"
            elif name in extra:
                extra[name] = value
                return
            elif not name.startswith("_") and name not in self.__dict__ and not hasattr(type(self), name):
                extra[name] = value
                self._file_keys.append(name)
                return
            elif name in ("rope_parameters", "rope_scaling") and isinstance(value, dict):
                self._set_rope(dict(value))
                return
            if name in _KEY_FORMS and name not in _PARALLEL_DEFAULTS:
                # as transformers checks an assignment: a wrong type is refused, nothing set (the layout
                # fields excepted: PaddleFormers' set_llm_config writes its -1 "unset" into them)
                _check_form(name, value, _KEY_FORMS[name])
            if name in _FILE_DEFAULTS and name not in _ROPE_KEYS and not self._written(name):
                self._file_keys.append(name)  # a model key the file lacked, set now: saved (transformers writes it)
        object.__setattr__(self, name, value)

    def _set_rope(self, rope: dict[str, Any]) -> None:
        """As transformers 5: a rope set as ``rope_parameters`` or ``rope_scaling`` replaces the rope
        (its base, when it names none, is the rope's in use) and is saved as ``rope_parameters``, where
        the file's rope keys were (measured: the rope_scaling of a rope_parameters file, the
        rope_parameters of a rope_theta file)."""
        rope.setdefault("rope_theta", self.rope["rope_theta"])
        spelled = ("rope_parameters", "rope_scaling", "rope_theta")
        keys = self._file_keys
        at = next((i for i, k in enumerate(keys) if k in spelled), len(keys))
        self._file_keys = [k for k in keys if k not in spelled]
        self._file_keys.insert(at, "rope_parameters")
        self._null_keys = self._null_keys - set(spelled)
        object.__setattr__(self, "rope_parameters", rope)
        object.__setattr__(self, "rope_scaling", None)
        object.__setattr__(self, "rope_theta", None)

    def _derive(self, name: str, value: Any) -> None:
        """Set a setting the config derives from others: written only where the file has it (a
        key set by the caller is a key of the file from then on)."""
        object.__setattr__(self, name, value)

    def _written(self, name: str) -> bool:
        """Whether to_dict() writes the setting ``name`` under some spelling."""
        spellings = {name, *(k for k, v in _KEY_ALIASES.items() if v == name)}
        if name == "dtype":
            spellings |= set(_DTYPE_KEYS)
        return bool(spellings & set(self._file_keys))

    def _rope_inputs(self) -> tuple:
        return copy.deepcopy(
            (self.rope_parameters, self._rope_scaling_given, self.rope_theta, self.max_position_embeddings)
        )

    @property
    def _rope_scaling_given(self) -> Any:
        """The stored ``rope_scaling`` (the file's or one set since), not the alias ``config.rope_scaling`` reads."""
        return self.__dict__.get("rope_scaling")

    @property
    def rope(self) -> dict[str, Any]:
        """The rope settings in one normalised dict (transformers-5 `rope_parameters` form), from the
        current `rope_parameters` / `rope_scaling` / `rope_theta`: one changed since the last check
        (``config.rope_parameters["rope_theta"] = ...``, as transformers' model reads it) is read again."""
        if self._rope_inputs() != self.__dict__.get("_rope_from"):
            self._normalise_rope()
            self._check_rope_aliases()
        return self._rope

    @property
    def model_dtype(self) -> str:
        """The checkpoint / compute dtype name (`dtype`, a file's `torch_dtype`, else bfloat16), as
        `dtype` is now (a dtype set since the last check is read again)."""
        if self.dtype != self.__dict__.get("_dtype_from", object()):
            self._normalise_dtype()
        return self._model_dtype

    @property
    def num_mtp_layers(self) -> int:
        return int(self.num_nextn_predict_layers or 0)

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    def full_layer_for(self, layer_idx: int) -> int:
        """The full layer whose top-k a (shared) layer uses: the nearest full layer at or before it
        (layer 0 is always full: validate refuses a first layer that is not)."""
        return max(i for i in self.full_layer_ids if i <= layer_idx)

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5, times mscale^2 for yarn with `mscale_all_dim`."""
        scale = self.qk_head_dim**-0.5
        rope = self.rope
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            m = yarn_mscale(float(rope["factor"]), float(rope["mscale_all_dim"]))
            scale = scale * m * m
        return scale

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Normalise derived fields and refuse inconsistent settings with the key named."""
        for name in ("indexer_types", "mlp_layer_types"):
            # a per-layer list set since the last validation (``copy(indexer_types=...)``, an attribute)
            # is the given one now; else the derived list would silently replace it
            if name in self.__dict__.get("_derived_lists", {}) and getattr(self, name) != self._derived_lists[name]:
                setattr(self, f"_given_{name}", copy.deepcopy(getattr(self, name)))
        for key, form in _KEY_FORMS.items():
            _check_form(key, getattr(self, key), form)
        eos = self.eos_token_id
        if isinstance(eos, list):
            for i, e in enumerate(eos):
                _check_form(f"eos_token_id[{i}]", e, ("int", 0, MAX_DIM))
        else:
            _check_form("eos_token_id", eos, ("int|None", 0, MAX_DIM))
        if "_attn_written" not in self.__dict__:  # the file's spelling (transformers' "eager"), written back
            self._attn_written = self.attn_implementation
        self.attn_implementation = HF_ATTN_IMPLEMENTATIONS.get(self.attn_implementation, self.attn_implementation)
        for key, allowed, what in (
            ("hidden_act", ("silu",), "only 'silu' is supported (the experts and dense MLP are SwiGLU)"),
            ("scoring_func", ("sigmoid",), "only 'sigmoid' is supported"),
            # transformers reads no topk_method and routes as noaux_tc whatever the file says
            ("topk_method", ("noaux_tc",), "only 'noaux_tc' (top-k over bias-corrected group scores) is supported"),
            ("moe_router_dtype", ("float32", "fp32"), "only float32 routers are supported"),
            (
                "attn_implementation",
                ATTN_IMPLEMENTATIONS,
                f"must be one of {ATTN_IMPLEMENTATIONS} (or transformers' {tuple(HF_ATTN_IMPLEMENTATIONS)})",
            ),
        ):
            if getattr(self, key) not in allowed:
                raise _err(key, f"{what}, got {getattr(self, key)!r}")
        self._normalise_rope()
        self._normalise_dtype()
        L = self.num_hidden_layers
        # head dims
        expect_qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self._given_qk_head_dim is not None and self._given_qk_head_dim != expect_qk:
            raise _err(
                "qk_head_dim",
                f"{self._given_qk_head_dim} != qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim} = {expect_qk})",
            )
        self._derive("qk_head_dim", expect_qk)
        if self.qk_rope_head_dim % 2:
            raise _err("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise _err(
                "index_head_dim",
                f"{self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim} (rope is applied to that many channels)",
            )
        H, kv = self.num_attention_heads, self.num_key_value_heads
        if H // kv != 1:  # MLA: every head has its own key and value (transformers repeats them H // kv times)
            raise _err(
                "num_key_value_heads",
                f"expected an integer in [{H // 2 + 1}, {H}] (num_attention_heads {H}: every MLA head has its own "
                f"key and value; transformers 5.23 fails for num_attention_heads // num_key_value_heads != 1), got {kv}",
            )
        self._derive_indexer_types(L)
        # as transformers' glm_moe_dsa (5.23, measured): the first `first_k_dense_replace` layers are
        # dense, every later one MoE; `moe_layer_freq` is kept for a round trip but places no layer
        k = min(int(self.first_k_dense_replace), L)
        self._derive("mlp_layer_types", ["dense" if i < k else "sparse" for i in range(L)])
        if self._given_mlp_layer_types is not None:
            self.mlp_layer_types = _layer_list("mlp_layer_types", self._given_mlp_layer_types, ("dense", "sparse"), L)
        # MoE
        E, G = self.n_routed_experts, self.n_group
        if E % G:
            raise _err("n_routed_experts", f"{E} is not divisible by n_group {G}")
        if not 1 <= self.topk_group <= G:
            raise _err("topk_group", f"{self.topk_group} must be in [1, n_group={G}]")
        if not 1 <= self.num_experts_per_tok <= E:
            raise _err("num_experts_per_tok", f"{self.num_experts_per_tok} must be in [1, n_routed_experts={E}]")
        if E // G < 2 and G > 1:
            raise _err("n_group", f"groups of {E // G} expert(s): group scores need >= 2 experts per group")
        if self.num_experts_per_tok > self.topk_group * (E // G):
            raise _err(
                "num_experts_per_tok",
                f"{self.num_experts_per_tok} > experts in the chosen groups (topk_group {self.topk_group} x {E // G})",
            )
        self._derived_lists = {n: list(getattr(self, n)) for n in ("indexer_types", "mlp_layer_types")}
        if not self.use_qk_norm:
            raise _err("use_qk_norm", "GLM-5.2 always applies the MLA latent norms (q_a_layernorm, kv_a_layernorm)")
        if self.tie_word_embeddings:
            # transformers ties lm_head to the embedding (and its save_pretrained omits lm_head.weight);
            # this model always has its own lm_head, so a tied model would be computed (and trained) untied
            raise _err(
                "tie_word_embeddings",
                "true is not supported: the model keeps a separate lm_head (GLM-5.2 sets false), "
                "got true (transformers would share the embedding as the output head)",
            )

    def check_model_support(self) -> None:
        """Refuse, naming the key, the settings a config keeps (and round-trips) but the model cannot
        compute as transformers 5.23 does (called when an attention layer is built). transformers'
        MLA and DSA indexer apply interleaved rope whatever `rope_interleave` / `indexer_rope_interleave`
        say, while PaddleFleet reads false as half-split pairs: no computation agrees with both."""
        if self.rope["rope_type"] == "dynamic":
            src = "rope_parameters" if self.rope_parameters is not None else "rope_scaling"
            raise _err(
                f"{src}.rope_type",
                "'dynamic' is not supported by the model: transformers rescales the frequencies whenever a "
                "call's positions pass the longest seen so far (state kept across calls); up to "
                "max_position_embeddings it equals 'default', which this model computes",
            )
        for key in ("rope_interleave", "indexer_rope_interleave"):
            if not getattr(self, key):
                raise _err(
                    key,
                    "false is not supported by the model: transformers' glm_moe_dsa applies interleaved rope "
                    "whatever this flag says (PaddleFleet would rotate half-split pairs), so no reading of it "
                    "agrees with both; GLM-5.2 sets true",
                )

    def check_training_support(self) -> None:
        """Refuse, naming the key, a setting that changes only the training forward and that the
        model does not apply (called by a training forward of an attention layer)."""
        if self.attention_dropout:
            raise _err(
                "attention_dropout",
                f"{self.attention_dropout} is not applied in training (the attention forms have no dropout; "
                "transformers drops attention probabilities in training mode); set it to 0.0 to train "
                "(GLM-5.2 sets 0.0), inference ignores it as transformers does",
            )

    def _normalise_rope(self) -> None:
        given = {"rope_scaling": self._rope_scaling_given, "rope_parameters": self.rope_parameters}
        for key, value in given.items():
            if not isinstance(value, (dict, type(None))):
                raise _err(key, f"must be a dict or null, got {type(value).__name__}")
        if self.rope_parameters is not None:
            rope, src = dict(self.rope_parameters), "rope_parameters"
            if self._rope_scaling_given:  # PaddleFormers writes both; they must describe one rope
                # transformers 5.23 builds its rope from a non-null rope_scaling alone (its base from a
                # top-level rope_theta, else its default 10000), so every field must agree, a field in
                # only one of the two included; partial_rotary_factor enters no table here (see below)
                scaling = dict(self._rope_scaling_given)
                scaling.setdefault("rope_theta", self.rope_theta if self.rope_theta is not None else _HF_DEFAULT_THETA)
                a_all, b_all = {**rope, "rope_type": _rope_type(rope)}, {**scaling, "rope_type": _rope_type(scaling)}
                if "rope_theta" not in rope:  # both take the top-level base, else transformers' default
                    a_all["rope_theta"] = self.rope_theta if self.rope_theta is not None else _HF_DEFAULT_THETA
                for key in dict.fromkeys([*a_all, *b_all]):
                    a, b = a_all.get(key), b_all.get(key)
                    if key not in ("type", "partial_rotary_factor") and a != b:
                        raise _err(
                            f"rope_scaling.{key}",
                            f"{b!r} disagrees with `rope_parameters.{key}` {a!r} (transformers reads rope_scaling "
                            "in place of rope_parameters"
                            + (", its base from a top-level rope_theta, else 10000)" if key == "rope_theta" else ")"),
                        )
        else:
            rope, src = dict(self._rope_scaling_given or {}), "rope_scaling"
        rope["rope_type"] = _rope_type(rope)
        forms = {"rope_theta": _POSITIVE, "factor": _POSITIVE, "original_max_position_embeddings": ("int", 1, MAX_DIM)}
        forms |= dict.fromkeys(("beta_fast", "beta_slow", "mscale", "mscale_all_dim"), _NONNEGATIVE)
        for key, form in forms.items():
            if rope.get(key) is not None:
                _check_form(f"{src}.{key}", rope[key], form)
        if "rope_theta" not in rope:  # the top-level base, else transformers' default_theta (measured: 10000)
            rope["rope_theta"] = self.rope_theta if self.rope_theta is not None else _HF_DEFAULT_THETA
        elif self.rope_theta is not None and float(self.rope_theta) != float(rope["rope_theta"]):
            raise _err("rope_theta", f"{self.rope_theta} disagrees with `{src}.rope_theta` {rope['rope_theta']}")
        # A top-level `partial_rotary_factor` is kept for the round trip but does not enter `rope`:
        # PaddleFormers writes its default (0.5) for GLM-5.2 too, and the rope dimension here is
        # always `qk_rope_head_dim` (docs/config.md).
        rtype = rope["rope_type"]
        if not isinstance(rtype, str) or rtype not in _ROPE_TYPES:
            raise _err(f"{src}.rope_type", f"unknown rope type {rtype!r}; expected one of {_ROPE_TYPES}")
        if rtype != "default" and rope.get("factor") is None:
            raise _err(f"{src}.factor", f"rope type {rtype!r} needs a `factor`")
        if rtype == "yarn":
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        self._rope, self._rope_from = rope, self._rope_inputs()

    def _check_rope_aliases(self) -> None:
        """PaddleFleet's `rotary_base` / top-level `rope_type` must say what the rope settings say."""
        values, base, rtype = self._alias_values, self._rope["rope_theta"], self._rope["rope_type"]
        if "rotary_base" in values and float(values["rotary_base"]) != float(base):
            raise _err("rotary_base", f"{values['rotary_base']} disagrees with the rope base {base}")
        if "rope_type" in values and values["rope_type"] not in (_FLEET_ROPE_TYPES.get(rtype, rtype), rtype):
            raise _err(
                "rope_type",
                f"{values['rope_type']!r} disagrees with the rope settings ({rtype!r}); "
                "a yarn rope needs its fields in rope_parameters",
            )

    def _derived(self, name: str) -> bool:
        """Whether the setting ``name`` is still derived (a null in the file stays null on save):
        the per-layer lists unless one was given or set since, `qk_head_dim` always (nope + rope),
        the rope settings unless `rope_parameters` was set."""
        if name in ("indexer_types", "mlp_layer_types"):  # (a list set since validation is a given one)
            return getattr(self, f"_given_{name}") is None and getattr(self, name) == self._derived_lists[name]
        return name == "qk_head_dim" or (name == "rope_parameters" and self.rope_parameters is None)

    def _alias_value(self, key: str) -> Any:
        """The current value of an alias key: the file's own value unless the setting changed."""
        written, rtype = self._alias_values[key], self.rope["rope_type"]
        if written is None and key in _KEY_ALIASES and self._derived(_KEY_ALIASES[key]):
            return None
        if key == "rotary_base":
            current = self.rope["rope_theta"]
        elif key == "rope_type":  # either spelling of the current type stays as written
            current = written if written == rtype else _FLEET_ROPE_TYPES.get(rtype, rtype)
        else:
            current = getattr(self, _KEY_ALIASES[key])
        return copy.deepcopy(written if written == current else current)

    def _normalise_dtype(self) -> None:
        name = str(self.dtype or "bfloat16").replace("torch.", "")
        if name not in _DTYPES:
            raise _err("dtype", f"unsupported dtype {name!r}; expected one of {_DTYPES}")
        self._model_dtype, self._dtype_from = name, self.dtype

    def _derive_indexer_types(self, L: int) -> None:
        given, pattern = self._given_indexer_types, self.index_topk_pattern
        # a schedule is a frequency the file gives (an offset alone means nothing); a null one is none
        # (transformers writes both keys null beside the list, and its list wins)
        has_schedule = "index_topk_freq" in self._given_keys and self.index_topk_freq is not None
        if isinstance(pattern, (list, tuple)):  # transformers takes a list as the layers' types themselves
            derived, source = _layer_list("index_topk_pattern", pattern, ("full", "shared"), L), "index_topk_pattern"
        elif pattern is not None:
            if not isinstance(pattern, str) or set(pattern) - {"F", "S"}:
                raise _err("index_topk_pattern", f"must be a string of 'F'/'S' letters, got {pattern!r}")
            if len(pattern) != L:
                raise _err("index_topk_pattern", f"has {len(pattern)} letters, num_hidden_layers is {L}")
            derived, source = ["full" if c == "F" else "shared" for c in pattern], "index_topk_pattern"
        elif has_schedule or given is None:
            freq = max(int(self.index_topk_freq or 1), 1)  # transformers: max(freq, 1)
            offset = int(self.index_skip_topk_offset if self.index_skip_topk_offset is not None else 1)
            derived, source = indexer_types_from_schedule(L, freq, offset), "index_topk_freq/index_skip_topk_offset"
        else:
            derived, source = None, None
        if given is not None:
            given = _layer_list("indexer_types", given, ("full", "shared"), L)
            if derived is not None and given != derived:
                diff = [i for i, (a, b) in enumerate(zip(given, derived)) if a != b]
                raise _err(
                    "indexer_types",
                    f"disagrees with {source} at layers {diff[:8]}{'...' if len(diff) > 8 else ''} "
                    f"(list says {given[diff[0]]!r} at layer {diff[0]}, {source} says {derived[diff[0]]!r}); "
                    "transformers 5.23 takes the list, a reader of the schedule keys the rule: drop the keys "
                    f"that are stale ({source} after an edit of the list, as transformers' save_pretrained keeps "
                    "them), or set them to agree",
                )
            derived = given
        if derived[0] != "full":
            raise _err("indexer_types", "layer 0 is 'shared' but must be 'full' (no earlier top-k to reuse)")
        self._derive("indexer_types", derived)

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any) -> Any:
        """Build from a config.json dict; `to_dict()` gives the same dict back.

        As transformers' ``from_dict``: a keyword naming a key of this config (or of the file)
        overrides it, transformers' output flags (``output_hidden_states``, ...) are set as
        attributes; the others are not set, and ``return_unused_kwargs=True`` returns them as
        ``(config, unused)``. ``dtype="auto"`` (``torch_dtype``) keeps the file's dtype."""
        if config_dict.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
            raise _err("model_type", f"expected 'glm_moe_dsa', got {config_dict.get('model_type')!r}")
        want_unused = kwargs.pop("return_unused_kwargs", False)
        for key in _HF_TELEMETRY_KWARGS:
            kwargs.pop(key, None)
        known = set(_DEFAULTS) | set(_PARALLEL_DEFAULTS) | set(_KEY_ALIASES) | set(_ROPE_ALIASES) | set(config_dict)
        known |= {"rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype"}
        overrides = {k: v for k, v in kwargs.items() if k in known and not (k in _DTYPE_KEYS and v == "auto")}
        flags = {k: v for k, v in kwargs.items() if k in _HF_OUTPUT_FLAGS and k not in known}
        unused = {k: v for k, v in kwargs.items() if k not in known and k not in flags}
        config = cls(**config_dict, _from_file=True, _overrides=overrides)  # an override wins over the file's value
        for key, value in flags.items():
            setattr(config, key, value)
        return (config, unused) if want_unused else config

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **kwargs: Any) -> Any:
        """Load `path/config.json` (`path/subfolder/config.json`) or a JSON file given directly.

        The keywords are transformers' ``from_pretrained``'s: config keys override the file's
        (:meth:`from_dict`, ``return_unused_kwargs`` included); its download options
        (``cache_dir``, ``revision``, ``local_files_only``, ...) have nothing to do on a local
        folder and are dropped, never written into the config."""
        subfolder = kwargs.pop("subfolder", None) or ""
        for key in HF_DOWNLOAD_KWARGS:
            kwargs.pop(key, None)
        folder = os.path.join(path, subfolder) if subfolder else os.fspath(path)
        file = os.path.join(folder, "config.json") if os.path.isdir(folder) else os.fspath(folder)
        if not os.path.isfile(file):
            raise FileNotFoundError(f"GlmMoeDsaConfig: no config file at {file}")
        data = read_json(file, "the model config")
        try:
            return cls.from_dict(data, **kwargs)
        except ValueError as e:
            raise ValueError(f"{e} (in {file})") from e

    @classmethod
    def from_json_file(cls, json_file: str | os.PathLike) -> GlmMoeDsaConfig:
        """transformers' name: the config of a JSON file (:meth:`from_pretrained` on the file)."""
        return cls.from_pretrained(os.fspath(json_file))

    def _setting_names(self) -> list[str]:
        """The settings readable as attributes: the model, library and layout keys, the rope and
        dtype spellings, and every other key of the file (not the other producers' aliases)."""
        names = [*_DEFAULTS, *_PARALLEL_DEFAULTS, "rope_theta", "rope_scaling", "partial_rotary_factor"]
        return names + [k for k in self._extra if k not in names]

    def __iter__(self):
        """As transformers' config: iterating gives the names of its settings."""
        return iter(self._setting_names())

    def __contains__(self, name: object) -> bool:
        """``"hidden_size" in config``, as transformers' config (which iterates its attributes)."""
        return isinstance(name, str) and name in self._setting_names()

    def get_text_config(self, decoder: bool | None = None, encoder: bool | None = None) -> GlmMoeDsaConfig:
        """transformers' accessor for a composite model's text part: this config (a text-only model)."""
        return self

    def to_dict(self) -> dict[str, Any]:
        """The config.json object: the source's keys, in its order and spelling, nothing invented
        (docs/config.md, "Round trip", says which library and parallel keys are added or left out)."""
        out: dict[str, Any] = {}
        for key in self._file_keys:
            if key in self._alias_values:
                out[key] = self._alias_value(key)
            elif key in self._extra:
                out[key] = copy.deepcopy(self._extra[key])
            elif key in _DTYPE_KEYS:  # the file's value (null, "torch.bfloat16" ...) while the dtype is unchanged
                unchanged = key in self._dtype_written and self.dtype == self._dtype_at_load
                out[key] = copy.deepcopy(self._dtype_written[key] if unchanged else self.dtype)
            elif key in self._null_keys and self._derived(key):
                out[key] = None
            elif key == "rope_parameters":
                out[key] = copy.deepcopy(self.rope_parameters if self.rope_parameters is not None else self.rope)
            elif key == "rope_scaling":  # the stored value, not the alias read as config.rope_scaling
                out[key] = copy.deepcopy(self._rope_scaling_given)
            elif key == "attn_implementation":
                out[key] = self._attn_spelled()
            else:
                out[key] = copy.deepcopy(getattr(self, key))
        for key, default in _LIBRARY_DEFAULTS.items():
            if key not in out and getattr(self, key) != default:
                out[key] = self._attn_spelled() if key == "attn_implementation" else getattr(self, key)
        return out

    def _attn_spelled(self) -> str:
        """``attn_implementation`` as given (transformers' "eager") while it names the form in use."""
        given = self._attn_written
        return (
            given if HF_ATTN_IMPLEMENTATIONS.get(given, given) == self.attn_implementation else self.attn_implementation
        )

    def to_transformers_dict(self) -> dict[str, Any]:
        """config.json of an official-layout checkpoint (checkpoint/saver.py): :meth:`to_dict` plus the
        transformers key of every setting the source file spelled only as another producer does
        (PaddleFleet's ``rotary_base`` for the rope, ``dsa_index_topk``, ...: transformers reads only its
        own names and would build the model from its defaults), the other spellings kept beside them;
        without ``attn_implementation``, this library's attention form, which transformers never writes
        and refuses on load (it names its own kernels: eager, sdpa, ...); with ``architectures`` (the
        model class, as transformers' ``save_pretrained`` writes it) where the file has none."""
        d = self.to_dict()
        if not {"rope_parameters", "rope_theta", "rope_scaling"} & set(d):
            d["rope_parameters"] = copy.deepcopy(self.rope)
        for alias, key in _KEY_ALIASES.items():
            if alias in d and key not in d and key not in _PARALLEL_DEFAULTS and key not in _LIBRARY_DEFAULTS:
                d[key] = copy.deepcopy(getattr(self, key))
        d.pop("attn_implementation", None)
        if not d.get("architectures"):  # transformers' save_pretrained names the model class
            d["architectures"] = ["GlmMoeDsaForCausalLM"]
        return d

    def to_diff_dict(self) -> dict[str, Any]:
        """transformers' name for the saved form (its keys differing from ``PreTrainedConfig``'s
        defaults): here :meth:`to_dict`, which already holds only the file's keys (docs/config.md)."""
        return self.to_dict()

    def to_json_string(self, use_diff: bool = True) -> str:
        """config.json's text; ``use_diff`` (transformers') gives the same text either way."""
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike, use_diff: bool = True) -> None:
        atomic_write_text(os.fspath(json_file_path), self.to_json_string(use_diff))

    def update(self, config_dict: dict[str, Any]) -> None:
        """As transformers' ``update``: set each key (another producer's name sets its setting),
        then check the result (an inconsistent value is refused naming the key). A refused update
        changes nothing: the config is put back as it was (else it would hold the refused value, and
        its own ``to_dict()`` would no longer load)."""
        before = copy.deepcopy(self.__dict__)
        try:
            for key, value in config_dict.items():
                setattr(self, key, value)
            self.validate()
        except BaseException:
            self.__dict__.clear()
            self.__dict__.update(before)
            raise

    def update_from_string(self, update_str: str) -> None:
        """transformers' ``update_from_string``: ``"key=value,key=value"``, each key one the config
        answers, each value read as the current value's type (a bool from true/false, 1/0, y/n,
        yes/no; an int; a float; a string as it is), then set as :meth:`update` sets it (checked).
        Every pair is read before any is set and a refused result is undone: a bad one changes
        nothing (transformers sets those before it)."""
        changes: dict[str, Any] = {}
        for pair in update_str.split(","):
            key, sep, text = pair.partition("=")
            if not sep or "=" in text:
                raise ValueError(f"update_from_string: {pair!r} is not key=value (pairs are separated by commas)")
            if not hasattr(self, key):
                raise ValueError(f"key {key} isn't in the original config dict")
            old = getattr(self, key)
            if isinstance(old, bool):
                if text.lower() not in ("true", "1", "y", "yes", "false", "0", "n", "no"):
                    raise ValueError(f"can't derive true or false from {text} (key {key})")
                changes[key] = text.lower() in ("true", "1", "y", "yes")
            elif isinstance(old, int):
                changes[key] = int(text)
            elif isinstance(old, float):
                changes[key] = float(text)
            elif isinstance(old, str):
                changes[key] = text
            else:
                raise TypeError(
                    f"You can only update int, float, bool or string values in the config, got {text} for key {key}"
                )
        self.update(changes)

    def save_pretrained(self, save_directory: str | os.PathLike, push_to_hub: bool = False, **kwargs: Any) -> str:
        """Write `config.json` atomically (temp file + rename); returns its path. ``push_to_hub``
        (transformers') is refused: this library does not upload."""
        if push_to_hub:
            raise NotImplementedError("GlmMoeDsaConfig.save_pretrained: push_to_hub=True is not supported (no upload)")
        path = os.path.join(save_directory, "config.json")  # atomic_write_text makes the folder
        atomic_write_text(path, self.to_json_string())
        return path

    def parallel_settings(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _PARALLEL_DEFAULTS}

    def copy(self, **changes: Any) -> GlmMoeDsaConfig:
        new = copy.deepcopy(self)
        for k, v in changes.items():
            setattr(new, _KEY_ALIASES.get(k, k), v)
        new.validate()
        return new

    def to_fleet_config(self, layout: Any = None) -> dict[str, Any]:
        """The model as PaddleFleet `TransformerConfig` / `ModelParallelConfig` fields, the layout from
        ``layout`` (a ``ParallelConfig``) else the file's (docs/config.md, "PaddleFleet mapping"). The rope
        spans `qk_rope_head_dim` channels; Fleet requires `rotary_base` equal to `rope_theta`, so both are given.
        """
        rope = self.rope

        def same(*keys: str) -> dict[str, Any]:  # fields Fleet names as this config does (bools validated)
            return {k: getattr(self, k) for k in keys}

        d: dict[str, Any] = {
            **same("num_hidden_layers", "hidden_size", "num_attention_heads", "num_key_value_heads"),
            **same("intermediate_size", "vocab_size", "hidden_act"),
            "gated_linear_unit": True,
            "normalization": "RMSNorm",
            **same("rms_norm_eps", "attention_bias", "tie_word_embeddings"),
            "params_dtype": self.model_dtype,
            "fp32_residual_connection": self.fp32_residual_connection,
            # MLA (latent norms on the compressed q and kv: `use_qk_norm`)
            "multi_latent_attention": True,
            **same("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "use_qk_norm"),
            # RoPE
            "position_embedding_type": "rope",
            "rope_type": _FLEET_ROPE_TYPES.get(rope["rope_type"], rope["rope_type"]),
            "rope_theta": rope["rope_theta"],
            "rotary_base": rope["rope_theta"],
            "rotary_percent": 1.0,
            "rotary_interleaved": self.rope_interleave,
        }
        if rope["rope_type"] == "yarn":
            d |= {
                "rotary_scaling_factor": rope["factor"],
                "original_max_position_embeddings": rope["original_max_position_embeddings"],
                "beta_fast": rope.get("beta_fast") or 32,
                "beta_slow": rope.get("beta_slow") or 1,
                "mscale": rope.get("mscale", 1.0),
                "mscale_all_dim": rope.get("mscale_all_dim", 0.0),
            }
        elif rope["rope_type"] != "default":
            raise _err("rope_parameters.rope_type", f"{rope['rope_type']!r} has no PaddleFleet equivalent")
        d |= {
            # MoE
            **same("n_routed_experts", "n_shared_experts", "num_experts_per_tok", "moe_intermediate_size"),
            **same("scoring_func", "topk_method", "n_group", "topk_group", "routed_scaling_factor"),
            **same("norm_topk_prob", "first_k_dense_replace"),
            "moe_layer_freq": [0 if t == "dense" else 1 for t in self.mlp_layer_types],
            # MTP
            "num_nextn_predict_layers": self.num_mtp_layers,
            "mtp_loss_scaling_factor": self.mtp_loss_scaling_factor,
            # DSA indexer and cross-layer top-k sharing: Fleet's dsa_* names are those of _KEY_ALIASES
            "experimental_attention_variant": "dsa",
            **{a: copy.deepcopy(getattr(self, k)) for a, k in _KEY_ALIASES.items() if a.startswith("dsa_")},
            "dsa_indexer_topk_freq": max(int(self.index_topk_freq or 1), 1),  # null, 0, < 0: 1, every layer full
            "dsa_indexer_skip_topk_offset": int(self.index_skip_topk_offset or 0),
        }
        p = self.parallel_settings()  # the layout the file carried, unless the run's is given
        if layout is not None:
            p = dict(zip(p, (layout.tp, layout.pp, layout.ep, layout.etp, layout.sp, layout.cp)))
        p["sequence_parallel"] = bool(p["sequence_parallel"])
        p["expert_tensor_parallel_size"] = p.pop("expert_tensor_model_parallel_size")  # Fleet's name
        d.update(p)
        return d

    def __repr__(self) -> str:
        return f"GlmMoeDsaConfig {self.to_json_string()}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GlmMoeDsaConfig) and self.to_dict() == other.to_dict()
