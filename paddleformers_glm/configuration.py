"""GlmMoeDsaConfig: the GLM-5.2 (`glm_moe_dsa`) model configuration.

Why this is not a plain attribute bag:

* the official ``config.json`` must survive load -> save as the *same JSON object*: keys we do not
  know are kept, keys the file did not have are not invented, and the file's own spelling of rope
  settings (``rope_parameters`` vs top-level ``rope_theta`` vs ``rope_scaling``) is written back;
* several files in the wild describe the same model differently, so everything the model reads is
  normalised once here (``rope``, ``model_dtype``, ``indexer_types``, ``mlp_layer_types``);
* parallel/training settings live on the same object (the Fleet way) but never go into the HF file.

See docs/config.md for the semantics of every derived field.
"""

from __future__ import annotations

import copy
import json
import math
import os
from typing import Any

__all__ = ["GlmMoeDsaConfig", "indexer_types_from_schedule"]

# HF-file keys and defaults (transformers 5.2x `GlmMoeDsaConfig`; GLM-5.2 values where HF has none).
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
    "index_skip_topk_offset": 3,
    "index_topk": 2048,
    "index_topk_freq": 4,
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

# Keys that older / other exports use for settings we hold under another name.
_ALIAS_KEYS = ("rope_theta", "rope_scaling", "partial_rotary_factor", "torch_dtype", "num_experts")

# Settings of this library (model behaviour the HF file has no key for). Saved to config.json only
# when changed from the default, so the official file round-trips unchanged.
_LIBRARY_DEFAULTS: dict[str, Any] = {
    "use_qk_norm": True,
    "fp32_residual_connection": False,
    "mtp_loss_scaling_factor": 0.1,
    "indexer_loss_coeff": 0.0,
    "indexer_k_norm_eps": 1e-6,
    "attention_chunk_size": 1024,
}

# Parallel / training layout: accepted and validated, never written to the HF config.json.
_PARALLEL_DEFAULTS: dict[str, Any] = {
    "tensor_model_parallel_size": 1,
    "pipeline_model_parallel_size": 1,
    "expert_model_parallel_size": 1,
    "expert_tensor_model_parallel_size": 1,
    "sequence_parallel": False,
    "context_parallel_size": 1,
}

_ROPE_TYPES = ("default", "linear", "yarn", "dynamic")
_DTYPES = ("float32", "bfloat16", "float16")


def indexer_types_from_schedule(num_layers: int, freq: int, offset: int) -> list[str]:
    """REFERENCE §3: 0-based layer i is full iff max(i - offset + 1, 0) % freq == 0 (offset 0 acts as 1)."""
    offset = max(int(offset), 1)
    return ["full" if max(i - offset + 1, 0) % freq == 0 else "shared" for i in range(num_layers)]


def _err(key: str, msg: str) -> ValueError:
    return ValueError(f"GlmMoeDsaConfig: `{key}`: {msg}")


class GlmMoeDsaConfig:
    """Configuration of a GLM-5.2 model; see the module docstring for the round-trip contract."""

    model_type = "glm_moe_dsa"

    def __init__(self, **kwargs: Any) -> None:
        kwargs = copy.deepcopy(kwargs)
        from_file = kwargs.pop("_from_file", False)
        # Keys that to_dict() writes back, in the source's order. A config built in Python writes the
        # full canonical key set; one loaded from a file writes exactly the file's keys.
        src_keys = [k for k in kwargs if k not in _PARALLEL_DEFAULTS and k not in _LIBRARY_DEFAULTS]
        if from_file:
            self._file_keys = src_keys
        else:
            canon = [k for k in _FILE_DEFAULTS if k not in ("qk_head_dim",)] + ["qk_head_dim"]
            if any(k in kwargs for k in ("rope_theta", "rope_scaling")) and "rope_parameters" not in kwargs:
                canon.remove("rope_parameters")
            if "torch_dtype" in kwargs and "dtype" not in kwargs:
                canon.remove("dtype")
            self._file_keys = canon + [k for k in src_keys if k not in canon]
            if not {"rope_parameters", "rope_theta", "rope_scaling"} & set(kwargs):
                kwargs["rope_parameters"] = {"rope_theta": 8000000, "rope_type": "default"}
        self._library_keys_in_file = [k for k in kwargs if k in _LIBRARY_DEFAULTS]
        self._given_keys = frozenset(kwargs)
        if from_file and "index_topk_freq" not in kwargs:
            kwargs["index_topk_freq"] = 1  # HF: a file without the schedule has every layer full

        for key, default in _FILE_DEFAULTS.items():
            setattr(self, key, kwargs.pop(key, copy.deepcopy(default)))
        for key, default in {**_LIBRARY_DEFAULTS, **_PARALLEL_DEFAULTS}.items():
            setattr(self, key, kwargs.pop(key, default))
        self.rope_theta = kwargs.pop("rope_theta", None)
        self.rope_scaling = kwargs.pop("rope_scaling", None)
        self.partial_rotary_factor = kwargs.pop("partial_rotary_factor", None)
        self.torch_dtype = kwargs.pop("torch_dtype", None)
        num_experts = kwargs.pop("num_experts", None)
        if num_experts is not None:  # HF BC alias
            self.n_routed_experts = num_experts
        # Everything else is preserved verbatim (and readable as an attribute).
        self._extra: dict[str, Any] = kwargs
        self._given_indexer_types = self.indexer_types
        self._given_mlp_layer_types = self.mlp_layer_types
        self._given_qk_head_dim = self.qk_head_dim
        self.validate()

    # ------------------------------------------------------------------ normalised views
    def __getattr__(self, name: str) -> Any:  # only called for missing attributes
        extra = self.__dict__.get("_extra", {})
        if name in extra:
            return extra[name]
        raise AttributeError(f"GlmMoeDsaConfig has no attribute {name!r}")

    @property
    def rope(self) -> dict[str, Any]:
        """The rope settings in one normalised dict (transformers-5 `rope_parameters` form)."""
        return self._rope

    @property
    def model_dtype(self) -> str:
        """The checkpoint / compute dtype name (`dtype`, else `torch_dtype`, else bfloat16)."""
        return self._model_dtype

    @property
    def num_mtp_layers(self) -> int:
        return int(self.num_nextn_predict_layers or 0)

    @property
    def full_layer_ids(self) -> list[int]:
        return [i for i, t in enumerate(self.indexer_types) if t == "full"]

    def full_layer_for(self, layer_idx: int) -> int:
        """The full layer whose top-k a (shared) layer uses: the nearest full layer at or before it."""
        for i in range(layer_idx, -1, -1):
            if self.indexer_types[i] == "full":
                return i
        raise _err("indexer_types", f"layer {layer_idx} has no full layer at or before it")

    @property
    def softmax_scale(self) -> float:
        """MLA softmax scale: qk_head_dim^-0.5, times mscale^2 for yarn with `mscale_all_dim`."""
        scale = self.qk_head_dim**-0.5
        rope = self._rope
        if rope["rope_type"] != "default" and rope.get("mscale_all_dim"):
            factor = float(rope["factor"])
            m = 1.0 if factor <= 1 else 0.1 * float(rope["mscale_all_dim"]) * math.log(factor) + 1.0
            scale = scale * m * m
        return scale

    # ------------------------------------------------------------------ validation
    def validate(self) -> None:
        """Normalise derived fields and refuse inconsistent settings with the key named."""
        self._normalise_rope()
        self._normalise_dtype()
        L = int(self.num_hidden_layers)
        if L < 1:
            raise _err("num_hidden_layers", f"must be >= 1, got {L}")
        # head dims
        expect_qk = self.qk_nope_head_dim + self.qk_rope_head_dim
        if self._given_qk_head_dim is not None and self._given_qk_head_dim != expect_qk:
            raise _err(
                "qk_head_dim",
                f"{self._given_qk_head_dim} != qk_nope_head_dim + qk_rope_head_dim "
                f"({self.qk_nope_head_dim} + {self.qk_rope_head_dim} = {expect_qk})",
            )
        self.qk_head_dim = expect_qk
        if self.qk_rope_head_dim % 2:
            raise _err("qk_rope_head_dim", f"must be even, got {self.qk_rope_head_dim}")
        if self.index_head_dim < self.qk_rope_head_dim:
            raise _err(
                "index_head_dim",
                f"{self.index_head_dim} < qk_rope_head_dim {self.qk_rope_head_dim} (rope is applied to that many channels)",
            )
        if self.num_attention_heads % self.num_key_value_heads:
            raise _err("num_key_value_heads", f"{self.num_key_value_heads} does not divide num_attention_heads")
        if self.index_topk < 1:
            raise _err("index_topk", f"must be >= 1, got {self.index_topk}")
        self._derive_indexer_types(L)
        self._derive_mlp_layer_types(L)
        # MoE
        E, G = self.n_routed_experts, self.n_group
        if G < 1:
            raise _err("n_group", f"must be >= 1, got {G}")
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
        if self.scoring_func != "sigmoid":
            raise _err("scoring_func", f"only 'sigmoid' is supported, got {self.scoring_func!r}")
        if self.moe_router_dtype not in ("float32", "fp32"):
            raise _err("moe_router_dtype", f"only float32 routers are supported, got {self.moe_router_dtype!r}")
        if self.num_mtp_layers < 0:
            raise _err("num_nextn_predict_layers", f"must be >= 0, got {self.num_nextn_predict_layers}")
        if not self.use_qk_norm:
            raise _err("use_qk_norm", "GLM-5.2 always applies the MLA latent norms (q_a_layernorm, kv_a_layernorm)")
        self._validate_parallel()

    def _normalise_rope(self) -> None:
        if self.rope_parameters is not None:
            if not isinstance(self.rope_parameters, dict):
                raise _err("rope_parameters", f"must be a dict, got {type(self.rope_parameters).__name__}")
            rope = dict(self.rope_parameters)
            src = "rope_parameters"
        else:
            rope = dict(self.rope_scaling or {})
            src = "rope_scaling"
        if "rope_type" not in rope:
            rope["rope_type"] = rope.get("type", "default")
        if "rope_theta" not in rope:
            if self.rope_theta is None:
                raise _err(src, "no rope_theta: give rope_parameters.rope_theta or a top-level rope_theta")
            rope["rope_theta"] = self.rope_theta
        if self.partial_rotary_factor is not None:
            rope.setdefault("partial_rotary_factor", self.partial_rotary_factor)
        rtype = rope["rope_type"]
        if rtype not in _ROPE_TYPES:
            raise _err(f"{src}.rope_type", f"unknown rope type {rtype!r}; expected one of {_ROPE_TYPES}")
        if rtype != "default" and rope.get("factor") is None:
            raise _err(f"{src}.factor", f"rope type {rtype!r} needs a `factor`")
        if rtype == "yarn":
            rope.setdefault("original_max_position_embeddings", self.max_position_embeddings)
        if float(rope["rope_theta"]) <= 0:
            raise _err(f"{src}.rope_theta", f"must be > 0, got {rope['rope_theta']}")
        self._rope = rope

    def _normalise_dtype(self) -> None:
        name = self.dtype if self.dtype is not None else self.torch_dtype
        if "dtype" not in self._file_keys and self.torch_dtype is not None:
            name = self.torch_dtype
        name = str(name or "bfloat16").replace("torch.", "")
        if name not in _DTYPES:
            raise _err("dtype", f"unsupported dtype {name!r}; expected one of {_DTYPES}")
        self._model_dtype = name

    def _derive_indexer_types(self, L: int) -> None:
        given = self._given_indexer_types
        pattern = self.index_topk_pattern
        has_schedule = bool({"index_topk_freq", "index_skip_topk_offset"} & self._given_keys)
        if self.index_topk_freq is not None and int(self.index_topk_freq) < 1:
            raise _err("index_topk_freq", f"must be >= 1, got {self.index_topk_freq}")
        if self.index_skip_topk_offset is not None and int(self.index_skip_topk_offset) < 0:
            raise _err("index_skip_topk_offset", f"must be >= 0, got {self.index_skip_topk_offset}")
        if pattern is not None:
            if not isinstance(pattern, str) or set(pattern) - {"F", "S"}:
                raise _err("index_topk_pattern", f"must be a string of 'F'/'S' letters, got {pattern!r}")
            if len(pattern) != L:
                raise _err("index_topk_pattern", f"has {len(pattern)} letters, num_hidden_layers is {L}")
            derived, source = ["full" if c == "F" else "shared" for c in pattern], "index_topk_pattern"
        elif has_schedule or given is None:
            freq = int(self.index_topk_freq or 1)
            offset = int(self.index_skip_topk_offset if self.index_skip_topk_offset is not None else 1)
            derived, source = indexer_types_from_schedule(L, freq, offset), "index_topk_freq/index_skip_topk_offset"
        else:
            derived, source = None, None
        if given is not None:
            if not isinstance(given, (list, tuple)) or set(given) - {"full", "shared"}:
                raise _err("indexer_types", f"must be a list of 'full'/'shared', got {given!r}")
            if len(given) != L:
                raise _err("indexer_types", f"has {len(given)} entries, num_hidden_layers is {L}")
            if derived is not None and list(given) != derived:
                diff = [i for i, (a, b) in enumerate(zip(given, derived)) if a != b]
                raise _err(
                    "indexer_types",
                    f"disagrees with {source} at layers {diff[:8]}{'...' if len(diff) > 8 else ''} "
                    f"(list says {given[diff[0]]!r} at layer {diff[0]}, {source} says {derived[diff[0]]!r})",
                )
            derived = list(given)
        if derived[0] != "full":
            raise _err("indexer_types", "layer 0 is 'shared' but must be 'full' (no earlier top-k to reuse)")
        self.indexer_types = derived

    def _derive_mlp_layer_types(self, L: int) -> None:
        k = min(int(self.first_k_dense_replace), L)
        freq = int(self.moe_layer_freq or 1)
        derived = ["dense" if i < k or (i - k) % freq else "sparse" for i in range(L)]
        given = self._given_mlp_layer_types
        if given is not None:
            if not isinstance(given, (list, tuple)) or set(given) - {"dense", "sparse"}:
                raise _err("mlp_layer_types", f"must be a list of 'dense'/'sparse', got {given!r}")
            if len(given) != L:
                raise _err("mlp_layer_types", f"has {len(given)} entries, num_hidden_layers is {L}")
            derived = list(given)
        self.mlp_layer_types = derived

    def _validate_parallel(self) -> None:
        for key in _PARALLEL_DEFAULTS:
            if key == "sequence_parallel":
                continue
            v = getattr(self, key)
            if not isinstance(v, int) or v < 1:
                raise _err(key, f"must be an integer >= 1, got {v!r}")
        tp, ep, etp = (
            self.tensor_model_parallel_size,
            self.expert_model_parallel_size,
            self.expert_tensor_model_parallel_size,
        )
        if self.num_attention_heads % tp:
            raise _err(
                "tensor_model_parallel_size", f"{tp} does not divide num_attention_heads {self.num_attention_heads}"
            )
        if self.vocab_size % tp:
            raise _err("tensor_model_parallel_size", f"{tp} does not divide vocab_size {self.vocab_size}")
        if self.n_routed_experts % ep:
            raise _err("expert_model_parallel_size", f"{ep} does not divide n_routed_experts {self.n_routed_experts}")
        if self.moe_intermediate_size % etp:
            raise _err(
                "expert_tensor_model_parallel_size",
                f"{etp} does not divide moe_intermediate_size {self.moe_intermediate_size}",
            )
        if self.sequence_parallel and tp == 1:
            raise _err("sequence_parallel", "needs tensor_model_parallel_size > 1")
        if self.context_parallel_size != 1:
            raise _err(
                "context_parallel_size", f"context parallel is not supported yet, got {self.context_parallel_size}"
            )

    # ------------------------------------------------------------------ (de)serialisation
    @classmethod
    def from_dict(cls, config_dict: dict[str, Any], **overrides: Any) -> GlmMoeDsaConfig:
        """Build from a config.json dict; `to_dict()` gives the same dict back."""
        if config_dict.get("model_type", "glm_moe_dsa") != "glm_moe_dsa":
            raise _err("model_type", f"expected 'glm_moe_dsa', got {config_dict.get('model_type')!r}")
        return cls(**{**config_dict, **overrides}, _from_file=True)  # an override wins over the file's value

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **overrides: Any) -> GlmMoeDsaConfig:
        """Load `path/config.json` or a JSON file given directly."""
        path = os.fspath(path)
        file = os.path.join(path, "config.json") if os.path.isdir(path) else path
        if not os.path.isfile(file):
            raise FileNotFoundError(f"GlmMoeDsaConfig: no config file at {file}")
        with open(file, encoding="utf-8") as f:
            try:
                data = json.load(f)
            except json.JSONDecodeError as e:
                raise ValueError(f"GlmMoeDsaConfig: {file} is not valid JSON: {e}") from e
        if not isinstance(data, dict):
            raise ValueError(f"GlmMoeDsaConfig: {file} holds a {type(data).__name__}, expected a JSON object")
        try:
            return cls.from_dict(data, **overrides)
        except ValueError as e:
            raise ValueError(f"{e} (in {file})") from e

    def to_dict(self) -> dict[str, Any]:
        """The HF config.json object: the source's keys in the source's spelling, nothing invented."""
        out: dict[str, Any] = {}
        for key in self._file_keys:
            if key in self._extra:
                out[key] = copy.deepcopy(self._extra[key])
            elif key == "rope_parameters":
                out[key] = copy.deepcopy(self.rope_parameters if self.rope_parameters is not None else self._rope)
            else:
                out[key] = copy.deepcopy(getattr(self, key))
        for key in _LIBRARY_DEFAULTS:
            if key in self._library_keys_in_file or getattr(self, key) != _LIBRARY_DEFAULTS[key]:
                out[key] = getattr(self, key)
        return out

    def to_json_string(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=False) + "\n"

    def save_pretrained(self, save_directory: str | os.PathLike) -> str:
        """Write `config.json` atomically (temp file + rename); returns its path."""
        save_directory = os.fspath(save_directory)
        os.makedirs(save_directory, exist_ok=True)
        path = os.path.join(save_directory, "config.json")
        tmp = f"{path}.tmp.{os.getpid()}"
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(self.to_json_string())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        return path

    def parallel_settings(self) -> dict[str, Any]:
        return {k: getattr(self, k) for k in _PARALLEL_DEFAULTS}

    def copy(self, **changes: Any) -> GlmMoeDsaConfig:
        new = copy.deepcopy(self)
        for k, v in changes.items():
            setattr(new, k, v)
        new.validate()
        return new

    def to_fleet_config(self) -> dict[str, Any]:
        """PaddleFleet `TransformerConfig` fields for this model (REFERENCE §5)."""
        rope = self._rope
        d = {
            "num_layers": self.num_hidden_layers,
            "hidden_size": self.hidden_size,
            "ffn_hidden_size": self.intermediate_size,
            "num_attention_heads": self.num_attention_heads,
            "num_query_groups": self.num_key_value_heads,
            "kv_channels": self.v_head_dim,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            "normalization": "RMSNorm",
            "layernorm_epsilon": self.rms_norm_eps,
            "add_bias_linear": bool(self.attention_bias),
            "gated_linear_unit": True,
            "activation_func": self.hidden_act,
            "untie_embeddings_and_output_weights": not self.tie_word_embeddings,
            "multi_latent_attention": True,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_head_dim": self.qk_nope_head_dim,
            "qk_pos_emb_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "qk_layernorm": bool(self.use_qk_norm),
            "rotary_interleaved": bool(self.rope_interleave),
            "rotary_base": rope["rope_theta"],
            "rope_type": rope["rope_type"],
            "rotary_scaling_factor": rope.get("factor", 1.0),
            "mscale": rope.get("mscale", 1.0),
            "mscale_all_dim": rope.get("mscale_all_dim", 0.0),
            "original_max_position_embeddings": rope.get(
                "original_max_position_embeddings", self.max_position_embeddings
            ),
            "num_moe_experts": self.n_routed_experts,
            "moe_ffn_hidden_size": self.moe_intermediate_size,
            "moe_shared_expert_intermediate_size": self.moe_intermediate_size * self.n_shared_experts,
            "moe_router_topk": self.num_experts_per_tok,
            "moe_router_num_groups": self.n_group,
            "moe_router_group_topk": self.topk_group,
            "moe_router_score_function": self.scoring_func,
            "moe_router_enable_expert_bias": self.topk_method == "noaux_tc",
            "moe_router_topk_scaling_factor": self.routed_scaling_factor,
            "moe_router_pre_softmax": False,
            "moe_router_dtype": "fp32",
            "moe_layer_freq": [0 if t == "dense" else 1 for t in self.mlp_layer_types],
            "moe_router_norm_topk_prob": bool(self.norm_topk_prob),
            "mtp_num_layers": self.num_mtp_layers or None,
            "mtp_loss_scaling_factor": self.mtp_loss_scaling_factor,
            "dsa_index_n_heads": self.index_n_heads,
            "dsa_index_head_dim": self.index_head_dim,
            "dsa_index_topk": self.index_topk,
            "dsa_indexer_topk_freq": self.index_topk_freq,
            "dsa_indexer_skip_topk_offset": self.index_skip_topk_offset,
            "dsa_indexer_types": list(self.indexer_types),
            "dsa_index_share_for_mtp_iteration": bool(self.index_share_for_mtp_iteration),
            "dsa_indexer_rotary_interleaved": bool(self.indexer_rope_interleave),
            "dsa_indexer_loss_coeff": self.indexer_loss_coeff,
            "params_dtype": self.model_dtype,
            "fp32_residual_connection": bool(self.fp32_residual_connection),
            "tensor_model_parallel_size": self.tensor_model_parallel_size,
            "pipeline_model_parallel_size": self.pipeline_model_parallel_size,
            "expert_model_parallel_size": self.expert_model_parallel_size,
            "expert_tensor_parallel_size": self.expert_tensor_model_parallel_size,
            "sequence_parallel": bool(self.sequence_parallel),
            "context_parallel_size": self.context_parallel_size,
        }
        return d

    def __repr__(self) -> str:
        return f"GlmMoeDsaConfig {self.to_json_string()}"

    def __eq__(self, other: object) -> bool:
        return isinstance(other, GlmMoeDsaConfig) and self.to_dict() == other.to_dict()
