"""PaddleFormers integration: its Auto classes resolve a ``glm_moe_dsa`` folder to this package and its
``Trainer`` trains our model, opt-in with :func:`register` (docs/model.md, "PaddleFormers").  Importing
this module registers nothing and does not import PaddleFormers.

Why these hooks: PaddleFormers' ``AutoConfig`` has a registry (``AutoConfig.register``) that wins
over its own mapping, so the config goes through it. Its ``AutoModelForCausalLM`` picks the class
from the ``architectures`` of config.json and imports PaddleFormers' module for it, consulting its
registry only when that fails, and its ``AutoTokenizer`` is transformers' (``tokenizer_class`` of
tokenizer_config.json); for those two the ``from_pretrained`` / ``from_config`` class methods are
wrapped: a local folder whose config.json says ``glm_moe_dsa`` loads ours, anything else goes to
PaddleFormers unchanged.  Tested with PaddleFormers 1.2.0 (``tests/test_paddleformers.py``).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
import os
import warnings
from typing import Any

from .._io import read_json

__all__ = [
    "PADDLEFORMERS_TESTED",
    "CheckpointCallback",
    "ReplacementWarning",
    "is_registered",
    "paddleformers_model_runs",
    "register",
    "unregister",
]

PADDLEFORMERS_TESTED = "1.2.0"
MODEL_TYPE = "glm_moe_dsa"

# PaddleFormers' loading arguments that say where to download from, which carry no meaning for a
# local folder (``from_pretrained`` of ours reads local folders only)
_LOADER_KWARGS = frozenset(
    "cache_dir download_hub from_hf_hub from_aistudio from_modelscope force_download local_files_only "
    "revision token use_auth_token trust_remote_code return_unused_kwargs _from_auto _commit_hash use_fast "
    "convert_from_hf convert_from_torch load_checkpoint_format low_cpu_mem_usage use_safetensors proxies "
    "resume_download load_state_as_np load_via_cpu ignore_mismatched_sizes".split()
)
# PaddleFormers' tensor-parallel arguments of from_pretrained / from_config (1.2.0's names and the
# older tensor_parallel_degree): one process is all this class builds (no value but one process's
# is honoured; glm52 train has the parallel layouts)
_ONE_PROCESS = {
    "tensor_model_parallel_size": (-1, 0, 1),
    "tensor_parallel_degree": (-1, 0, 1),
    "tensor_parallel_rank": (-1, 0),
}


class ReplacementWarning(UserWarning):
    """A PaddleFormers resolution now gives this package's class instead of PaddleFormers' own."""


def paddleformers_model_runs() -> bool:
    """Whether PaddleFormers' own GLM-5.2 model can be built here (it needs ``paddlefleet``)."""
    return importlib.util.find_spec("paddlefleet") is not None


def _glm_folder(path: Any, subfolder: str | None = None) -> bool:
    """A local checkpoint folder (or its ``subfolder``) whose config.json says ``model_type: glm_moe_dsa``."""
    try:
        data = read_json(os.path.join(os.fspath(path), subfolder or "", "config.json"), "the model config")
    except (TypeError, ValueError):  # not a path, no such file, not a JSON object
        return False
    return data.get("model_type") == MODEL_TYPE


def _split_kwargs(kwargs: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in kwargs.items() if k not in _LOADER_KWARGS}


def _one_process(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` without PaddleFormers' tensor-parallel arguments, refusing a split over ranks."""
    for key, single in _ONE_PROCESS.items():
        value = kwargs.pop(key, single[0])
        if value not in single:
            raise ValueError(
                f"GlmMoeDsaForCausalLM: {key}={value!r}: PaddleFormers' tensor parallelism is not supported "
                "here (one process; `glm52 train --tp N` trains split over ranks)"
            )
    return kwargs


# --------------------------------------------------------------------------- the classes PaddleFormers gets
# PaddleFormers' tokenizer methods (its PaddleTokenizerMixin) that its SFT data pipeline calls
_PADDLEFORMERS_TOKENIZER_METHODS = (
    "encode_chat_inputs", "encode_chat_inputs_with_no_template", "_encode_chat_inputs", "_encode_chat_inputs_oneturn",
    "_encode_chat_inputs_openai_format", "_extract_non_learnable_parts", "decode_token",
)  # fmt: skip


@functools.cache
def _classes() -> dict[str, Any]:
    """Config, model and output classes for PaddleFormers (built once: they subclass PaddleFormers'
    ``ModelOutput``, which is imported only here)."""
    from dataclasses import dataclass, fields

    import paddle
    from paddleformers.transformers.model_outputs import ModelOutput

    from ..configuration import GlmMoeDsaConfig as _Config
    from ..modeling import GlmMoeDsaForCausalLM as _Model
    from ..modeling.packing import check_pack_offsets, check_packed_mask

    class GlmMoeDsaConfig(_Config):
        """Our config, read by PaddleFormers' ``AutoConfig`` (its loading arguments dropped)."""

        # the Trainer's evaluation gathers every other output as predictions: the logits only, as
        # transformers' model gives (its outputs beyond loss and logits are None there); a
        # per-batch 0-d loss cannot be concatenated over batches
        keys_to_ignore_at_inference = ["past_key_values", "mtp_loss", "indexer_loss", "last_hidden_state"]

        @classmethod
        def from_dict(cls, config_dict: dict[str, Any], **kwargs: Any):
            """As PaddleFormers' (and transformers') ``from_dict``: keywords naming a config key
            override it; the others are left out, returned with ``return_unused_kwargs=True``
            as ``(config, unused)``."""
            want_unused = kwargs.pop("return_unused_kwargs", False)
            # our from_dict says what it did not take (an attribute the config merely answers, such
            # as num_labels, is not a key of this model: returned as unused, not dropped)
            config, unused = super().from_dict(config_dict, return_unused_kwargs=True, **_split_kwargs(kwargs))
            return (config, unused) if want_unused else config

        @classmethod
        def from_pretrained(cls, path: Any, *args: Any, **kwargs: Any):
            want_unused = kwargs.pop("return_unused_kwargs", False)
            return super().from_pretrained(path, return_unused_kwargs=want_unused, **_split_kwargs(kwargs))

    def _our_config(config: Any) -> GlmMoeDsaConfig:
        """``config`` as this class's config: ours as it is, the core package's read from its keys.
        PaddleFormers' own ``GlmMoeDsaConfig`` (its AutoConfig's before :func:`register`) is refused
        by name: its ``to_dict`` holds its defaults beside the file's keys (``rope_theta`` 10000
        beside ``rope_parameters``' 8e6 on the official config), no faithful copy of the file."""
        if isinstance(config, GlmMoeDsaConfig):
            return config
        if isinstance(config, _Config):
            return GlmMoeDsaConfig.from_dict(config.to_dict())
        raise TypeError(
            f"GlmMoeDsaForCausalLM: a config of class {type(config).__module__}.{type(config).__name__} "
            f"(model_type {getattr(config, 'model_type', None)!r}) is not paddleformers_glm's; read the "
            "checkpoint's config with AutoConfig after register() (or paddleformers_glm.GlmMoeDsaConfig)"
        )

    @dataclass
    class GlmCausalLMOutput(ModelOutput):
        """The forward's outputs as PaddleFormers' ``ModelOutput`` (a dict: ``out["loss"]``)."""

        loss: paddle.Tensor | None = None
        logits: paddle.Tensor | None = None
        past_key_values: Any = None
        mtp_loss: paddle.Tensor | None = None
        indexer_loss: paddle.Tensor | None = None
        last_hidden_state: paddle.Tensor | None = None
        hidden_states: tuple[paddle.Tensor, ...] | None = None  # output_hidden_states (generate's too)
        attentions: tuple[paddle.Tensor, ...] | None = None  # output_attentions
        router_logits: tuple[paddle.Tensor, ...] | None = None  # output_router_logits

    class GlmMoeDsaForCausalLM(_Model):
        """Our model as PaddleFormers' ``Trainer`` and ``AutoModelForCausalLM`` use it."""

        config_class = GlmMoeDsaConfig

        @classmethod
        def from_pretrained(cls, path: Any, *model_args: Any, **kwargs: Any):
            if model_args:
                raise TypeError(f"GlmMoeDsaForCausalLM.from_pretrained: unexpected positional arguments {model_args}")
            kwargs = _one_process(_split_kwargs(kwargs))
            if kwargs.get("subfolder"):  # the folder's subfolder holds the checkpoint, as transformers
                path = os.path.join(path, kwargs.pop("subfolder"))
            kwargs.pop("subfolder", None)
            if "paddle_dtype" in kwargs:  # PaddleFormers' older name
                kwargs.setdefault("dtype", kwargs.pop("paddle_dtype"))
            if kwargs.get("config") is not None:
                kwargs["config"] = _our_config(kwargs["config"])
            else:
                # the other keywords override the config's keys, as transformers' and PaddleFormers'
                # from_pretrained do (use_cache=False ...); one that is no config key is refused
                own = inspect.signature(_Model.from_pretrained).parameters
                overrides = {k: kwargs.pop(k) for k in list(kwargs) if k not in own}
                # what the config does not take (not a key, nor an output flag) is refused, not dropped:
                # an attribute the config merely answers (num_labels, id2label) is no key of this model
                config, unused = GlmMoeDsaConfig.from_pretrained(path, return_unused_kwargs=True, **overrides)
                if unused:
                    raise TypeError(
                        f"GlmMoeDsaForCausalLM.from_pretrained: unexpected keyword arguments {sorted(unused)} "
                        "(neither loading options nor keys of the model config)"
                    )
                kwargs["config"] = config
            return super().from_pretrained(path, **kwargs)

        @classmethod
        def _from_config(cls, config: Any, **kwargs: Any):
            """The base ``_from_config`` (a dtype by any name Paddle, numpy or PaddleFormers spells it;
            none: float32, where PaddleFormers' own takes the config's) on our config of ``config``."""
            kwargs = _one_process(_split_kwargs(kwargs))
            kwargs.pop("subfolder", None)  # a folder's part: nothing to read from a config
            dtype, older = kwargs.pop("dtype", None), kwargs.pop("paddle_dtype", None)  # PaddleFormers' older name
            return super()._from_config(_our_config(config), dtype=dtype if dtype is not None else older, **kwargs)

        def forward(
            self,
            input_ids: paddle.Tensor | None = None,
            attention_mask: paddle.Tensor | None = None,
            position_ids: paddle.Tensor | None = None,
            labels: paddle.Tensor | None = None,
            inputs_embeds: paddle.Tensor | None = None,
            past_key_values: Any = None,
            use_cache: bool | None = None,
            return_dict: bool | None = None,
            logits_to_keep: int = 0,
            attn_mask_startend_row_indices: paddle.Tensor | None = None,
            nbatch_pack_offset: paddle.Tensor | None = None,
            **kwargs: Any,
        ):
            """PaddleFormers' label convention, as its own causal LMs and data pipelines have it
            (its criterion does not shift; SFTDataset and the pretraining workflows feed input
            tokens[:-1] with labels tokens[1:]): ``labels[i]`` is position i's target, -100 ignored.
            ``attention_mask``: [B, S] key padding (1 real, 0 padding), or the 4-D block-diagonal
            mask of PaddleFormers' packed sequences; ``attn_mask_startend_row_indices`` (FlashMask's
            form of that mask) and ``nbatch_pack_offset`` (1 at each packed sequence's last token but
            the row's last) come with packed sequences too. Packed, each sequence attends and selects
            its top-k within itself, by the sequences its ``position_ids`` restart at (the forward's
            packed sequences, modeling/packing.py); a mask that disagrees with them is refused.
            The base forward's other keywords (``output_hidden_states``, ``output_attentions``,
            ``output_router_logits``, ``cache_position``, ``num_items_in_batch`` ..., which
            ``generate`` passes) go to it as they are; labels are always shifted already here."""
            if not kwargs.pop("labels_shifted", True):
                raise ValueError(
                    "GlmMoeDsaForCausalLM (PaddleFormers): labels_shifted=False: this class takes PaddleFormers' "
                    "labels (position i's target); paddleformers_glm.GlmMoeDsaForCausalLM shifts them as HF"
                )
            packed = attn_mask_startend_row_indices is not None or (
                attention_mask is not None and attention_mask.ndim == 4
            )
            if packed:
                if position_ids is None:
                    raise ValueError(
                        "GlmMoeDsaForCausalLM: packed sequences (a 4-D attention_mask or attn_mask_startend_row_"
                        "indices) need PaddleFormers' position_ids, restarting at each sequence"
                    )
                four_d = attention_mask if attention_mask is not None and attention_mask.ndim == 4 else None
                check_packed_mask(position_ids, dense=four_d, startend=attn_mask_startend_row_indices)
                if nbatch_pack_offset is not None:
                    check_pack_offsets(position_ids, nbatch_pack_offset)
                attention_mask, use_cache = None, False  # the forward reads the sequences from position_ids
            elif attention_mask is not None and attention_mask.ndim != 2:
                raise ValueError(
                    f"GlmMoeDsaForCausalLM: attention_mask of shape {list(attention_mask.shape)}: this model takes "
                    "the [batch, seq] key-padding mask (1 real, 0 padding) or the 4-D mask of packed sequences"
                )
            out = super().forward(
                input_ids,
                attention_mask,
                position_ids,
                labels=labels,
                add_mtp_loss=kwargs.pop("add_mtp_loss", self.training and labels is not None),
                past_key_values=past_key_values,
                use_cache=use_cache,
                inputs_embeds=inputs_embeds,
                logits_to_keep=logits_to_keep,
                labels_shifted=True,
                **kwargs,
            )
            result = GlmCausalLMOutput(**{f.name: getattr(out, f.name) for f in fields(GlmCausalLMOutput)})
            return result if return_dict is None or return_dict else result.to_tuple()

        @property
        def enable_recompute(self) -> bool:
            """PaddleFormers' switch: its Trainer sets it True on the layers that have it when
            ``TrainingArguments.recompute_granularity`` is set (any granularity); True recomputes
            every decoder layer in backward (``glm52 train --recompute full``)."""
            return self.recompute != "none"

        @enable_recompute.setter
        def enable_recompute(self, value: bool) -> None:
            self.recompute = "full" if value else "none"

        def recompute_enable(self) -> None:
            """PaddleFormers' models' method (its workflows call it): recompute every decoder layer."""
            self.enable_recompute = True

        def recompute_disable(self) -> None:
            """PaddleFormers' models' method: no recompute."""
            self.enable_recompute = False

        def get_model_flops(self, *args: Any, **kwargs: Any) -> float:
            """The Trainer's speed log asks; no FLOP count is claimed (the Trainer then logs none)."""
            raise NotImplementedError("paddleformers_glm does not report FLOPs per token")

        get_hardware_flops = get_model_flops

        def save_pretrained(self, save_directory: Any, *args: Any, **kwargs: Any) -> str | None:
            """Our save (official HF layout, atomic, in the dtype the model computes in, so a save
            of fp32 training reloads bit for bit) behind the Trainer's call: ``is_main_process``
            (second positional or keyword) False writes nothing; ``state_dict`` (the Trainer's
            sharding path) is saved instead of the model's own tensors; ``max_shard_size`` is kept;
            the Trainer's other options (``save_function``, ``merge_tensor_parallel``,
            ``save_to_hf``, ``save_checkpoint_format``, ``variant`` ...) do not apply to one
            process writing the HF layout and are ignored."""
            is_main = kwargs.pop("is_main_process", args[0] if args else True)
            if not is_main:
                return None
            own = {k: kwargs.pop(k) for k in ("layout", "quantization", "max_shard_size", "dtype") if k in kwargs}
            state = kwargs.pop("state_dict", None)
            if state is not None and set(state) != set(self.state_dict()):
                raise ValueError(
                    "GlmMoeDsaForCausalLM.save_pretrained: the Trainer's state_dict does not hold this model's "
                    f"tensors (missing {sorted(set(self.state_dict()) - set(state))[:5]})"
                )
            if own.get("max_shard_size") in ("1024GB",):  # PaddleFormers' "no sharding" default
                own.pop("max_shard_size")
            own.setdefault("dtype", self.compute_dtype)  # what was trained, not the release's bf16
            if state is not None:  # the Trainer's tensors (e.g. gathered from its sharded optimizer), not ours
                from ..checkpoint import save_pretrained_state

                own.setdefault("carry_from", getattr(self, "source_path", None))
                own.setdefault("generation_config", self._changed_generation_config())
                return save_pretrained_state(state, self.config, save_directory, **own)
            return super().save_pretrained(save_directory, **own)

    from paddleformers.transformers.tokenizer_utils import PaddleTokenizerMixin

    from ..tokenizer import GlmTokenizer as _Tokenizer

    class GlmTokenizer(_Tokenizer):
        """Our tokenizer with the chat encodings PaddleFormers' data pipeline calls on the tokenizer its
        ``AutoTokenizer`` gives (SFTDataset's ``encode_chat_inputs``, the stream's ``decode_token``):
        PaddleFormers' own methods, which read the template through ``apply_chat_template``."""

    for name in _PADDLEFORMERS_TOKENIZER_METHODS:
        setattr(GlmTokenizer, name, getattr(PaddleTokenizerMixin, name))
    out = {"config": GlmMoeDsaConfig, "model": GlmMoeDsaForCausalLM, "output": GlmCausalLMOutput}
    return out | {"tokenizer": GlmTokenizer}


def CheckpointCallback() -> Any:  # noqa: N802 (a class factory: PaddleFormers is imported on call)
    """A PaddleFormers ``TrainerCallback`` for the Trainer's checkpoints of our model (docs/model.md,
    "PaddleFormers"): ``Trainer(..., callbacks=[CheckpointCallback()])``.

    - Each checkpoint folder (``save_steps`` / ``save_strategy``: ``output_dir/checkpoint-N``)
      becomes one ``from_pretrained`` reads: at each save the model is written there in the
      official HF layout (config.json, safetensors, tokenizer files; ``save_pretrained``), beside the
      Trainer's own files, which ``resume_from_checkpoint`` reads and which stay as they are.
      PaddleFormers' Trainer calls ``save_pretrained`` only on its own ``PretrainedModel``
      subclasses; for any other model its checkpoints hold the parameters alone
      (``model_state/*.distcp`` by default, ``model_state.pdparams``) and no config.json.
    - ``resume_from_checkpoint`` of the default format (``flex_checkpoint``) works in one process:
      PaddleFormers 1.2.0 loads it through fleet's hybrid group, which its ``TrainingArguments``
      sets up for one process (all degrees 1) only when ``paddlefleet`` is installed; without it the
      resume raised ``AttributeError: 'Fleet' object has no attribute '_hcg'``. At the Trainer's
      start the callback makes that same one-process setup when nothing set fleet up."""
    from paddleformers.trainer import TrainerCallback

    class _CheckpointCallback(TrainerCallback):
        def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
            import paddle.distributed as dist
            from paddle.distributed import fleet

            if dist.get_world_size() > 1 or getattr(fleet.fleet, "_hcg", None) is not None:
                return
            strategy = fleet.DistributedStrategy()
            strategy.hybrid_configs = {"dp_degree": 1, "mp_degree": 1, "pp_degree": 1, "sharding_degree": 1}
            fleet.init(is_collective=True, strategy=strategy)

        def on_save(self, args: Any, state: Any, control: Any, model: Any = None, **kwargs: Any) -> None:
            if model is None or not getattr(args, "should_save", True):
                return
            model = getattr(model, "_layers", model)  # paddle.DataParallel's wrapped layer
            model.save_pretrained(os.path.join(args.output_dir, f"checkpoint-{state.global_step}"))

    return _CheckpointCallback()


# --------------------------------------------------------------------------- registration
_ORIGINALS: dict[str, Any] = {}
_REPLACED = ("AutoConfig", "AutoModelForCausalLM", "AutoTokenizer")


def is_registered() -> bool:
    """Whether :func:`register` has replaced PaddleFormers' resolution (and not been undone)."""
    return bool(_ORIGINALS)


def register(replace: bool | None = None) -> list[str]:
    """Make PaddleFormers' ``AutoConfig``, ``AutoModelForCausalLM`` and ``AutoTokenizer`` resolve
    a local ``glm_moe_dsa`` folder to this package's classes.

    ``replace=None`` (default): only when PaddleFormers' own GLM-5.2 model cannot run here
    (``paddlefleet`` missing); ``True``: always; ``False``: never (returns ``[]``). Returns the
    PaddleFormers entry points now resolved to ours; each replacement is announced with a
    :class:`ReplacementWarning`. Calling it again changes nothing."""
    if importlib.util.find_spec("paddleformers") is None:
        raise ImportError(
            "paddleformers_glm.integrations.paddleformers: PaddleFormers is not installed; "
            f"pip install -e '.[paddleformers]' in a checkout, in its own virtualenv (it pins NumPy 1.26; tested "
            f"with paddleformers=={PADDLEFORMERS_TESTED})"
        )
    if replace is None:
        replace = not paddleformers_model_runs()
        reason = "PaddleFormers' own GlmMoeDsaForCausalLM needs paddlefleet, which is not installed"
    else:
        reason = "register(replace=True) was called"
    if not replace:
        return []
    if is_registered():
        return list(_REPLACED)
    from paddleformers.transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    from paddleformers.transformers.auto.configuration import CONFIG_MAPPING

    c = _classes()
    _ORIGINALS["AutoConfig"] = CONFIG_MAPPING._extra_content.get(MODEL_TYPE)
    AutoConfig.register(MODEL_TYPE, c["config"], exist_ok=True)

    def _wrap(auto: Any, name: str, ours: Any) -> None:
        own = auto.__dict__.get(name)  # None: inherited from PaddleFormers' base Auto class
        _ORIGINALS[f"{auto.__name__}.{name}"] = (auto, name, own)
        func = inspect.getattr_static(auto, name).__func__

        first = "config" if name == "from_config" else "pretrained_model_name_or_path"  # PaddleFormers' name

        def wrapped(cls: Any, *args: Any, **kwargs: Any) -> Any:
            # the path (the config) by position or by PaddleFormers' keyword; the call goes on as it was made
            if args and first in kwargs:  # as Python's own call of PaddleFormers' method says it
                raise TypeError(f"{auto.__name__}.{name}() got multiple values for argument '{first}'")
            path = args[0] if args else kwargs.get(first)
            if name == "from_config":
                mine = getattr(path, "model_type", None) == MODEL_TYPE
            else:
                mine = _glm_folder(path, kwargs.get("subfolder"))
            if not mine:
                return func(cls, *args, **kwargs)
            rest = {k: v for k, v in kwargs.items() if k != first}
            return ours(path, *args[1:], **rest)

        wrapped.__doc__ = (
            f"{func.__doc__ or ''}\n(paddleformers_glm: a local glm_moe_dsa folder loads {ours.__qualname__})"
        )
        setattr(auto, name, classmethod(wrapped))

    _wrap(AutoModelForCausalLM, "from_pretrained", c["model"].from_pretrained)
    _wrap(AutoModelForCausalLM, "from_config", c["model"]._from_config)
    _wrap(
        AutoTokenizer,
        "from_pretrained",
        lambda path, *a, **kw: c["tokenizer"].from_pretrained(path, **_split_kwargs(kw)),
    )
    pf = "paddleformers.transformers.glm_moe_dsa."
    replaced = {  # PaddleFormers' class -> ours
        "AutoConfig": (f"{pf}GlmMoeDsaConfig", "paddleformers_glm GlmMoeDsaConfig"),
        "AutoModelForCausalLM": (f"{pf}GlmMoeDsaForCausalLM", "paddleformers_glm GlmMoeDsaForCausalLM"),
        "AutoTokenizer": ("transformers' tokenizer for the folder", "paddleformers_glm GlmTokenizer"),
    }
    for auto, (theirs, ours) in replaced.items():
        warnings.warn(
            f"paddleformers_glm: PaddleFormers' {auto} now resolves model_type 'glm_moe_dsa' folders to {ours} "
            f"instead of {theirs} ({reason}); paddleformers_glm.integrations.paddleformers.unregister() undoes it",
            ReplacementWarning,
            stacklevel=2,
        )
    return list(_REPLACED)


def unregister() -> None:
    """Undo :func:`register`: PaddleFormers resolves ``glm_moe_dsa`` as it did before."""
    if not _ORIGINALS:
        return
    from paddleformers.transformers.auto.configuration import CONFIG_MAPPING

    previous = _ORIGINALS.pop("AutoConfig", None)
    if previous is None:
        CONFIG_MAPPING._extra_content.pop(MODEL_TYPE, None)
    else:
        CONFIG_MAPPING._extra_content[MODEL_TYPE] = previous
    for key in list(_ORIGINALS):
        auto, name, own = _ORIGINALS.pop(key)
        if own is None:
            delattr(auto, name)
        else:
            setattr(auto, name, own)
