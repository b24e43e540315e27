"""Generation settings with transformers' key names: ``GenerationConfig`` (generation_config.json
read, derived from config.json and saved as transformers 5.23 writes it) and ``resolve_settings``, which
layers the call's options over the model's defaults over HF's, checks them and refuses the options not
implemented by name."""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import Any

import numpy as np

from .._io import atomic_write_text, dumps_json, read_json, write_json_atomic

GENERATION_CONFIG_FILE = "generation_config.json"

# HF's global defaults (transformers GenerationConfig._get_default_generation_params) for the keys
# this generate implements; a key unset by the call and by generation_config.json takes these.
HF_DEFAULTS: dict[str, Any] = {
    "max_length": 20,
    "min_length": 0,
    "do_sample": False,
    "temperature": 1.0,
    "top_k": 50,
    "top_p": 1.0,
    "typical_p": 1.0,
    "epsilon_cutoff": 0.0,
    "eta_cutoff": 0.0,
    "repetition_penalty": 1.0,
    "num_return_sequences": 1,
    "num_beams": 1,
    "length_penalty": 1.0,
    "early_stopping": False,
    "use_cache": True,
    "return_dict_in_generate": False,
    "output_scores": False,
    "output_logits": False,
    "output_hidden_states": False,
    "output_attentions": False,
    "use_mtp": False,
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}

# HF generation options this generate does not implement, with the value that turns each off: a
# generation_config.json may carry them at that value or null (HF 5.23's default for every one of them);
# anything else is refused by name. Grouped by off value.
UNSUPPORTED_OFF: dict[str, Any] = {
    name: off
    for off, names in (
        (1, "num_beam_groups"),
        (0, "encoder_no_repeat_ngram_size"),
        (0.0, "diversity_penalty"),
        (1.0, "encoder_repetition_penalty"),
        (False, "token_healing"),
        (
            None,
            "penalty_alpha dola_layers force_words_ids constraints watermarking_config",
        ),
    )
    for name in names.split()
}
_SPECIAL_TOKENS = ("eos_token_id", "pad_token_id", "bos_token_id")

# The version a generation_config.json this package writes names, as transformers' save_pretrained
# writes its own: the reference this package follows.
REFERENCE_TRANSFORMERS_VERSION = "5.23.0"
# Every option of transformers 5.23's GenerationConfig (its to_dict() less the metadata): the keys
# it takes from a model config when it derives a generation config from one (from_model_config).
HF_GENERATION_KEYS = frozenset(
    """assistant_confidence_threshold assistant_early_exit assistant_ensemble_weight assistant_lookbehind
    bad_words_ids begin_suppress_tokens bos_token_id cache_config cache_implementation compile_config constraints
    continuous_batching_config decoder_start_token_id disable_compile diversity_penalty do_sample dola_layers
    early_stopping encoder_no_repeat_ngram_size encoder_repetition_penalty eos_token_id epsilon_cutoff eta_cutoff
    exponential_decay_length_penalty force_words_ids forced_bos_token_id forced_eos_token_id guidance_scale
    is_assistant length_penalty low_memory max_cache_len max_length max_matching_ngram_size max_new_tokens max_time
    min_length min_new_tokens min_p no_repeat_ngram_size num_assistant_tokens num_assistant_tokens_schedule
    num_beam_groups num_beams num_return_sequences output_attentions output_hidden_states output_logits
    output_scores pad_token_id penalty_alpha prefill_chunk_size prompt_lookup_num_tokens remove_invalid_values
    renormalize_logits repetition_penalty return_dict_in_generate sequence_bias speculation_type stop_strings
    suppress_tokens target_lookbehind temperature token_healing top_h top_k top_p typical_p use_cache use_mtp
    watermarking_config""".split()
)
# transformers 5.23's options that change no token of a decoder-only model (measured: its tokens and
# scores with and without each); the others it has and this generate lacks change tokens or are refused there
TOKEN_NEUTRAL = frozenset(
    "compile_config disable_compile continuous_batching_config decoder_start_token_id max_cache_len prefill_chunk_size".split()
)
_EXTRA_OUTPUT_FLAGS = ("output_attentions", "output_hidden_states", "output_scores", "output_logits")


def derived_from_model_config(config_dict: dict[str, Any]) -> dict[str, Any]:
    """What transformers 5.23 derives from a model config (``GenerationConfig.from_model_config``):
    its generation keys that are not null, ``return_dict_in_generate`` set when an ``output_*`` flag is,
    marked ``_from_model_config``. A model loaded from a folder without generation_config.json takes it
    from the folder's config.json as written; one built from a config, from the config object."""
    out = {k: v for k, v in config_dict.items() if k in HF_GENERATION_KEYS and v is not None}
    if not out.get("return_dict_in_generate") and any(out.get(k) for k in _EXTRA_OUTPUT_FLAGS):
        out["return_dict_in_generate"] = True
    return out | {"_from_model_config": True}


# the generation options transformers 5.23's PreTrainedConfig drops when it reads a model config (its
# GenerationConfig._get_default_generation_params(), less use_cache: a key of this model's config), so
# a config object carries none of them into from_model_config (a folder's config.json, read as written,
# does: from_pretrained)
_DROPPED_BY_MODEL_CONFIG = frozenset(
    """max_length min_length do_sample early_stopping num_beams temperature top_k top_p typical_p
    repetition_penalty length_penalty no_repeat_ngram_size encoder_no_repeat_ngram_size bad_words_ids
    num_return_sequences output_scores return_dict_in_generate forced_bos_token_id forced_eos_token_id
    remove_invalid_values exponential_decay_length_penalty suppress_tokens begin_suppress_tokens epsilon_cutoff
    eta_cutoff encoder_repetition_penalty num_assistant_tokens num_assistant_tokens_schedule
    assistant_confidence_threshold assistant_lookbehind target_lookbehind num_beam_groups diversity_penalty""".split()
)


@dataclass
class GenerationConfig:
    """Generation defaults with HF's key names; ``None`` means "not set here" (a lower layer, and
    finally HF's global default, decides). ``extra`` keeps the file's other keys, so a save writes
    back what was read."""

    max_new_tokens: int | None = None
    max_length: int | None = None
    min_new_tokens: int | None = None
    min_length: int | None = None
    do_sample: bool | None = None
    temperature: float | None = None
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None
    num_return_sequences: int | None = None
    num_beams: int | None = None
    length_penalty: float | None = None
    early_stopping: bool | str | None = None
    use_cache: bool | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    bos_token_id: int | None = None
    stop_strings: str | list[str] | None = None
    min_p: float | None = None
    top_h: float | None = None
    typical_p: float | None = None
    epsilon_cutoff: float | None = None
    eta_cutoff: float | None = None
    no_repeat_ngram_size: int | None = None
    bad_words_ids: list[list[int]] | None = None
    sequence_bias: list | dict | None = None
    suppress_tokens: list[int] | None = None
    begin_suppress_tokens: list[int] | None = None
    forced_eos_token_id: int | list[int] | None = None
    forced_bos_token_id: int | None = None
    remove_invalid_values: bool | None = None
    exponential_decay_length_penalty: list | tuple | None = None
    renormalize_logits: bool | None = None
    max_time: float | None = None
    prompt_lookup_num_tokens: int | None = None
    max_matching_ngram_size: int | None = None
    use_mtp: bool | None = None
    num_assistant_tokens: int | None = None
    num_assistant_tokens_schedule: str | None = None
    assistant_confidence_threshold: float | None = None
    guidance_scale: float | None = None
    return_dict_in_generate: bool | None = None
    output_scores: bool | None = None
    output_logits: bool | None = None
    output_hidden_states: bool | None = None
    output_attentions: bool | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __eq__(self, other: object) -> bool:
        """As transformers': equal options, wherever each config was read from (``to_dict``, not the
        source name kept for messages)."""
        return isinstance(other, GenerationConfig) and self.to_dict() == other.to_dict()

    def __hash__(self) -> int:
        return hash(dumps_json(self.to_dict(), sort_keys=True))

    # ------------------------------------------------------------------ construction
    @classmethod
    def keys(cls) -> tuple[str, ...]:
        """The generation options this package implements (HF's names)."""
        return tuple(f.name for f in fields(cls) if f.name != "extra")

    @classmethod
    def from_dict(cls, d: dict[str, Any], source: str = "generation config") -> GenerationConfig:
        """Known keys into fields, the rest into ``extra`` (checked when used, see :meth:`check_supported`)."""
        if not isinstance(d, dict):
            raise ValueError(f"{source}: expected a JSON object, got {type(d).__name__}")
        known = set(cls.keys())
        extra = {"_source": source} | {k: v for k, v in d.items() if k not in known}
        return cls(**{k: v for k, v in d.items() if k in known}, extra=extra)._mark_read()

    def _mark_read(self) -> GenerationConfig:
        """Remember the options as read (a file, a model config): transformers' save refuses a config
        with issues only when it was changed since (``_original_object_hash``), so that a published
        file can always be saved back."""
        self.__dict__["_as_read"] = copy.deepcopy(self.to_dict())
        return self

    @classmethod
    def from_model_config(cls, config: Any) -> GenerationConfig:
        """What transformers derives for a model built from ``config`` (no checkpoint folder): from the
        config object, whose class defaults (``bos_token_id`` 0, ``use_cache``) and PreTrainedConfig's
        ``output_attentions`` / ``output_hidden_states`` (false) it holds beside the file's keys."""
        held = {"output_attentions": False, "output_hidden_states": False}
        held |= {k: getattr(config, k, None) for k in (*_SPECIAL_TOKENS, "use_cache")}
        read = {k: v for k, v in config.to_dict().items() if k not in _DROPPED_BY_MODEL_CONFIG}
        return cls.from_dict(derived_from_model_config(held | read), source="the model config")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, config: Any = None, **overrides: Any) -> GenerationConfig:
        """``folder/generation_config.json``, special tokens it does not set from ``config``. A folder
        without one: what transformers derives from its config.json as written
        (:func:`derived_from_model_config`; ``config``'s keys where the folder has no config.json).
        As transformers' call: ``config`` given as a file name is its ``config_file_name`` (that file,
        which must exist), and keyword options override the file's."""
        name = GENERATION_CONFIG_FILE
        if isinstance(config, (str, os.PathLike)):
            name, config = os.fspath(config), None
            if not os.path.isfile(os.path.join(os.fspath(folder), name)):
                raise FileNotFoundError(f"{os.path.join(os.fspath(folder), name)}: no such generation config file")
        path = os.path.join(os.fspath(folder), name)
        if not os.path.isfile(path):
            model_file = os.path.join(os.fspath(folder), "config.json")
            held = read_json(model_file, "the model config") if os.path.isfile(model_file) else None
            held = held if isinstance(held, dict) else config.to_dict() if config is not None else {}
            derived = derived_from_model_config(held) | overrides
            return cls.from_dict(derived, source=f"{model_file} (no {GENERATION_CONFIG_FILE})")
        d = read_json(path, "the generation config")
        gc = cls.from_dict(d | overrides if isinstance(d, dict) else d, source=path)
        for k in _SPECIAL_TOKENS:  # no config: getattr(None, k, None) leaves them unset
            if getattr(gc, k) is None:
                setattr(gc, k, getattr(config, k, None))
        return gc._mark_read()

    def to_dict(self) -> dict[str, Any]:
        """The set keys (and the file's other keys), as HF writes them."""
        out = {k: getattr(self, k) for k in self.keys() if getattr(self, k) is not None}
        out.update({k: v for k, v in self.extra.items() if not k.startswith("_source")})
        return out

    def to_diff_dict(self) -> dict[str, Any]:
        """transformers' ``to_diff_dict``: the keys that differ from a default ``GenerationConfig()``
        (every default there is unset: the set keys here) and ``transformers_version``."""
        return self.to_dict() | {"transformers_version": REFERENCE_TRANSFORMERS_VERSION}

    def to_json_string(self, use_diff: bool = True, ignore_metadata: bool = False) -> str:
        """transformers' ``to_json_string``: ``to_diff_dict()`` (``use_diff=False``: every generation
        option, null where unset) as sorted, indented JSON; ``ignore_metadata`` leaves out
        ``transformers_version`` and ``_from_model_config``."""
        d = self.to_diff_dict()
        if not use_diff:
            d = dict.fromkeys((*HF_GENERATION_KEYS, "_from_model_config")) | d
        if ignore_metadata:
            for key in ("_from_model_config", "_commit_hash", "_original_object_hash", "transformers_version"):
                d.pop(key, None)
        return dumps_json(d, indent=2, sort_keys=True) + "\n"

    def to_json_file(self, json_file_path: str | os.PathLike, use_diff: bool = True) -> None:
        """``to_json_string(use_diff)`` written to ``json_file_path`` atomically."""
        atomic_write_text(os.fspath(json_file_path), self.to_json_string(use_diff))

    def __repr__(self) -> str:
        return f"GenerationConfig {self.to_json_string(ignore_metadata=True)}"

    def save_pretrained(self, folder: str | os.PathLike) -> str:
        """Write ``folder/generation_config.json`` atomically; returns its path. As transformers 5.23,
        a config with an issue :meth:`validate` names is refused when it was built or changed here
        (a sampling option without ``do_sample=True`` ...), an unchanged one read from a file is
        written back as it is (its errors refused all the same)."""
        self.check_before_save()
        path = os.path.join(os.fspath(folder), GENERATION_CONFIG_FILE)
        write_json_atomic(path, self.to_dict(), indent=2, sort_keys=True)
        return path

    def update(self, defaults_only: bool = False, allow_custom_entries: bool = False, **kwargs: Any) -> dict[str, Any]:
        """transformers' ``update``: each key that is a generation option (HF's, implemented here or not:
        the others are kept as a file's keys and refused by ``generate`` unless off) or a key the config
        already holds is set, with ``defaults_only`` only where it is unset; other keys only with
        ``allow_custom_entries``.
        -> the keys not used, as there. The values are checked when ``generate`` uses them."""
        used = []
        for key, value in kwargs.items():
            own = key in self.keys()
            held = own or key in HF_GENERATION_KEYS or key in self.extra  # transformers' hasattr
            if held and defaults_only and (getattr(self, key) if own else self.extra.get(key)) is not None:
                continue
            if held or allow_custom_entries:
                if own:
                    setattr(self, key, value)
                else:
                    self.extra[key] = value
                used.append(key)
        return {k: v for k, v in kwargs.items() if k not in used}

    def over(self, lower: GenerationConfig) -> GenerationConfig:
        """This config with its unset keys (and the file keys it lacks) taken from ``lower``: what HF's
        generate does with a ``generation_config=`` argument over the model's own."""
        if lower is self:
            return self
        src = (
            f"{self.extra.get('_source', 'generation config')} (unset keys: {lower.extra.get('_source', 'the model')})"
        )
        values = {k: getattr(lower, k) if getattr(self, k) is None else getattr(self, k) for k in self.keys()}
        return GenerationConfig(**values, extra=lower.extra | self.extra | {"_source": src})

    # ------------------------------------------------------------------ checks
    def _issues(self, user_set_attributes: set[str] | None = None) -> dict[str, str]:
        """transformers 5.23's ``GenerationConfig.validate`` checks: a setting no generation can run
        with raises ValueError (its words); the "minor issues" (an option the mode set ignores:
        ``temperature`` without ``do_sample=True``, ``length_penalty`` without beams, an ``output_*``
        flag without ``return_dict_in_generate`` ...) are returned, option -> what is wrong."""
        if self.early_stopping not in (None, True, False, "never"):
            raise ValueError(f"`early_stopping` must be a boolean or 'never', but is {self.early_stopping}.")
        if self.max_new_tokens is not None and self.max_new_tokens <= 0:
            raise ValueError(f"`max_new_tokens` must be greater than 0, but is {self.max_new_tokens}.")
        minor: dict[str, str] = {}
        if _is_int(self.pad_token_id) and self.pad_token_id < 0:
            minor["pad_token_id"] = (
                f"`pad_token_id` should be positive but got {self.pad_token_id}. This will cause errors when batch "
                "generating, if there is padding. Please set `pad_token_id` explicitly as "
                "`model.generation_config.pad_token_id=PAD_TOKEN_ID` to avoid errors in generation"
            )

        def warn(outer: str, inner: str) -> bool:  # transformers' _should_warn
            if user_set_attributes is None:
                return True
            return inner in user_set_attributes or outer not in user_set_attributes

        if self.do_sample is not True:
            greedy = (
                "`do_sample` is not set to `True`. However, `{0}` is set to `{1}` -- this flag is only used in "
                "sample-based generation modes. You should set `do_sample=True` or unset `{0}`."
            )
            for name, off in (
                ("temperature", 1.0),
                ("top_p", 1.0),
                ("min_p", None),
                ("top_h", None),
                ("typical_p", 1.0),
                ("top_k", 50),
                ("epsilon_cutoff", 0.0),
                ("eta_cutoff", 0.0),
            ):
                value = getattr(self, name)
                if value is not None and value != off and warn("do_sample", name):
                    minor[name] = greedy.format(name, value)
        if self.num_beams is None or self.num_beams == 1:
            single = (
                "`num_beams` is set to {0}. However, `{1}` is set to `{2}` -- this flag is only used in beam-based "
                "generation modes. You should set `num_beams>1` or unset `{1}`."
            )
            for name, off in (("early_stopping", False), ("length_penalty", 1.0)):
                value = getattr(self, name)
                if value is not None and value is not off and value != off and warn("num_beams", name):
                    minor[name] = single.format(self.num_beams, name, value)
        if self.num_return_sequences is not None and self.num_return_sequences > 1:
            if self.num_beams is None or self.num_beams == 1:
                if not self.do_sample:
                    raise ValueError(
                        "Greedy methods (do_sample != True) without beam search do not support "
                        f"`num_return_sequences` different than 1 (got {self.num_return_sequences})."
                    )
            elif self.num_return_sequences > self.num_beams:
                raise ValueError(
                    f"`num_return_sequences` ({self.num_return_sequences}) has to be smaller or equal to `num_beams` "
                    f"({self.num_beams})."
                )
        if self.return_dict_in_generate is not True:
            for name in _EXTRA_OUTPUT_FLAGS:
                if getattr(self, name) is True:
                    minor[name] = (
                        f"`return_dict_in_generate` is NOT set to `True`, but `{name}` is. When "
                        f"`return_dict_in_generate` is not `True`, `{name}` is ignored."
                    )
        if self.suppress_tokens is not None:
            suppressed = set(self.suppress_tokens)
            for name in ("forced_bos_token_id", "forced_eos_token_id"):
                forced = getattr(self, name)
                forced = set() if forced is None else {forced} if _is_int(forced) else set(forced)
                if forced and forced <= suppressed:
                    raise ValueError(
                        f"Every token in `{name}` ({sorted(forced)}) is also in `suppress_tokens`. Forcing a token "
                        "while suppressing it sets all logits to `-inf` at the forcing step, which produces `nan` "
                        f"probabilities and crashes generation. Remove the overlapping token(s) from either `{name}` "
                        "or `suppress_tokens` (if you meant to prevent an early EOS token, use `min_new_tokens` instead)."
                    )
        return minor

    def validate(self, strict: bool = False, user_set_attributes: set[str] | None = None) -> None:
        """transformers' ``validate``: ValueError for a setting no generation can run with; the
        options the chosen mode ignores (``temperature`` with ``do_sample`` not True, ...) are one
        warning naming them, or with ``strict`` a ValueError listing each with what is wrong.
        ``user_set_attributes``: the options the caller set (an ignored option inherited from a
        file is then not reported, as there). ``generate`` checks the values it uses itself."""
        minor = self._issues(user_set_attributes)
        if not minor:
            return
        info = "\n".join(f"- `{name}`: {what}" for name, what in minor.items())
        info += (
            "\nIf you're using a pretrained model, note that some of these attributes may be set through the "
            "model's `generation_config.json` file."
        )
        if strict:
            raise ValueError("GenerationConfig is invalid: \n" + info)
        warnings.warn(f"The following generation flags are not valid and may be ignored: {list(minor)}.", stacklevel=2)

    def check_before_save(self) -> None:
        """What transformers' ``save_pretrained`` checks before it writes this config: ``validate``,
        strict unless the options are those read from a file or a model config (a published config
        with ignored options is written back; one built or changed here is refused)."""
        changed = self.__dict__.get("_as_read") != self.to_dict()
        try:
            minor = self._issues()
            if changed and minor:
                self.validate(strict=True)
        except ValueError as e:
            raise ValueError(f"{e}\n\nFix these issues to save the configuration.") from None

    def check_supported(self) -> None:
        """Refuse options this generate does not implement (group beam search, ...), naming where they
        were set and what is supported."""
        src, supported = self.extra.get("_source", "generation config"), f"supported options: {', '.join(self.keys())}"
        for k, v in self.extra.items():
            if k in UNSUPPORTED_OFF and v is not None and v != UNSUPPORTED_OFF[k]:  # None: HF's default, off
                raise ValueError(
                    f"{src}: {k}={v!r} is not supported (only its off value {UNSUPPORTED_OFF[k]!r}); {supported}"
                )


def generation_config_of(model: Any) -> GenerationConfig:
    """The model's generation defaults: the checkpoint folder's generation_config.json when the
    model was loaded from one (``model.source_path``; a folder without one: what transformers derives
    from its config.json), else what transformers derives from its config."""
    src = getattr(model, "source_path", None)
    if src and os.path.isdir(src):
        return GenerationConfig.from_pretrained(src, model.config)
    return GenerationConfig.from_model_config(model.config)


def derived_generation_file(folder: str | os.PathLike, config: Any) -> dict[str, Any] | None:
    """The generation_config.json transformers' ``save_pretrained`` writes for a model loaded from
    ``folder`` and left unchanged: None when the folder has one (carried as it is), else the one it
    derives from the folder's config.json, naming ``transformers_version``."""
    if os.path.isfile(os.path.join(os.fspath(folder), GENERATION_CONFIG_FILE)):
        return None
    derived = GenerationConfig.from_pretrained(folder, config).to_dict()
    return derived | {"transformers_version": REFERENCE_TRANSFORMERS_VERSION}


def generation_config_to_save(model: Any) -> dict[str, Any] | None:
    """The generation_config.json a save of ``model`` writes, as transformers' ``save_pretrained``
    writes the model's ``generation_config`` (naming ``transformers_version``): None when the folder the
    model was loaded from has one and the model's is what it gives (the file is carried as it is)."""
    own = generation_config_of(model)
    held = model.__dict__.get("_generation_config")
    now = own.to_dict() if held is None else held.to_dict() if hasattr(held, "to_dict") else dict(held)
    src = getattr(model, "source_path", None)
    if src and os.path.isfile(os.path.join(src, GENERATION_CONFIG_FILE)) and now == own.to_dict():
        return None
    return now | {"transformers_version": REFERENCE_TRANSFORMERS_VERSION}


def _is_int(v: Any) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)


def _integer(name: str, v: Any, least: int, note: str = "") -> int:
    if not _is_int(v) or v < least:
        raise ValueError(f"generate: {name} must be an integer >= {least}{note}, got {v!r}")
    return int(v)


def _number(name: str, v: Any, ok: Callable[[float], bool], need: str) -> float:
    """``v`` as a finite float for which ``ok`` holds; else an error saying it must be ``need``."""
    if isinstance(v, bool) or not isinstance(v, (int, float, np.integer, np.floating)) or not math.isfinite(float(v)):
        raise ValueError(f"generate: {name} must be a finite number, got {v!r}")
    if not ok(float(v)):
        raise ValueError(f"generate: {name} must be {need}, got {float(v)}")
    return float(v)


def eos_list(v: Any, name: str = "eos_token_id") -> list[int]:
    ids = [] if v is None else [v] if _is_int(v) else v
    if not isinstance(ids, (list, tuple)) or not all(_is_int(e) for e in ids):
        raise ValueError(f"generate: {name} must be an int or a list of ints, got {v!r}")
    return [int(e) for e in ids]


def check_generation_length(
    config: Any, prompt_len: int, max_new_tokens: int | None = None, max_length: int | None = None
) -> int:
    """The number of new tokens for a prompt of ``prompt_len`` tokens (``max_new_tokens`` wins
    over ``max_length``; neither: HF's 20, cut to what ``max_position_embeddings`` leaves after the
    prompt, as transformers 5.23 cuts its default length), refused when prompt + new tokens exceed the
    model's ``max_position_embeddings`` or an explicit ``max_length``. No tensor exists yet when this runs."""
    if max_new_tokens is not None:
        n = _integer("max_new_tokens", max_new_tokens, 1, " (transformers refuses 0 too)")
    elif max_length is not None:
        if _integer("max_length", max_length, 1) <= prompt_len:
            raise ValueError(
                f"generate: max_length {max_length} leaves no room after the {prompt_len}-token prompt "
                "(max_length counts the prompt; use max_new_tokens to count new tokens only)"
            )
        n = int(max_length) - prompt_len
    else:
        n = HF_DEFAULTS["max_length"]
    limit = getattr(config, "max_position_embeddings", None)
    if max_new_tokens is None and max_length is None and _is_int(limit):
        if prompt_len >= limit:  # transformers: its max_length min(20 + S, limit) = limit <= S, refused
            raise ValueError(
                f"generate: the {prompt_len}-token prompt leaves no room before the model's "
                f"max_position_embeddings {limit}"
            )
        n = min(n, limit - prompt_len)  # transformers' default length: min(prompt + 20, max_position_embeddings)
    if _is_int(limit) and prompt_len + n > limit:
        raise ValueError(
            f"generate: prompt ({prompt_len} tokens) + {n} new tokens = {prompt_len + n} exceeds the model's "
            f"max_position_embeddings {limit}; ask for at most {max(limit - prompt_len, 0)} new tokens"
        )
    return n


def resolve_settings(
    config: Any, generation_config: GenerationConfig | dict, kwargs: dict, prompt_len: int
) -> GenerationConfig:
    """Every option with its value for one call (call > ``generation_config`` > HF default): the
    lengths as ``max_new_tokens`` / ``min_new_tokens``, ``eos_token_id`` a list, ``stop_strings`` a list.
    ``generate`` and ``glm52 generate --speculative`` both resolve through it, so they agree."""
    # transformers' options that change no token of a decoder-only model (compile switches, its cache's
    # size and prefill chunking, an encoder-decoder's start token): taken and left unused as in a
    # generation_config.json; its other options (an assistant's ensemble or early exit, ...) are unknown here
    unknown = [
        k for k in kwargs if k not in GenerationConfig.keys() and k not in UNSUPPORTED_OFF and k not in TOKEN_NEUTRAL
    ]
    if unknown:
        raise TypeError(
            f"generate: unknown option {unknown[0]!r}; supported options: {', '.join(GenerationConfig.keys())} "
            "(and seed, streamer, tokenizer, generation_config)"
        )
    GenerationConfig.from_dict(kwargs, source="generate").check_supported()  # the call's options, as a file's
    base = generation_config
    if isinstance(base, dict):
        base = GenerationConfig.from_dict(base, source="generation_config argument")
    base.check_supported()
    call = {k: v for k, v in kwargs.items() if k in GenerationConfig.keys() and v is not None}

    def get(k: str) -> Any:
        if k in call:
            return call[k]
        v = getattr(base, k)
        return HF_DEFAULTS.get(k) if v is None else v

    # lengths: the call's own max_* beats the file's; within one layer max_new_tokens wins (HF)
    if "max_new_tokens" in call or "max_length" in call:
        mnt, ml = call.get("max_new_tokens"), call.get("max_length")
        if mnt is not None and ml is not None:
            warnings.warn(
                f"generate: both max_new_tokens ({mnt}) and max_length ({ml}) given; max_new_tokens wins", stacklevel=3
            )
    else:
        mnt, ml = base.max_new_tokens, base.max_length
    new = check_generation_length(config, prompt_len, mnt, ml)
    mn = call.get("min_new_tokens", base.min_new_tokens if "min_length" not in call else None)
    mn = None if mn is None else _integer("min_new_tokens", mn, 0)
    min_length = _integer("min_length", get("min_length"), 0)
    min_new = max(0, min_length - prompt_len) if mn is None else mn

    flags = "do_sample use_cache return_dict_in_generate output_scores output_logits output_hidden_states"
    flags += " output_attentions use_mtp"
    r = {k: get(k) for k in flags.split()}
    for k, v in r.items():
        if not isinstance(v, bool):
            raise ValueError(f"generate: {k} must be True or False, got {v!r}")
    if r["do_sample"]:
        r["temperature"] = _number(
            "temperature", get("temperature"), lambda t: t > 0, "> 0 (use do_sample=False for greedy)"
        )
        r["top_k"] = _integer("top_k", get("top_k"), 0, " (0: off)")
        # [0, 1] as transformers' TopPLogitsWarper takes it; 0: only the most likely token stays
        r["top_p"] = _number("top_p", get("top_p"), lambda p: 0.0 <= p <= 1.0, "in [0, 1] (1: off)")
    else:  # greedy uses none of the warpers, so their settings (temperature 0.0 ...) are not checked, as in HF
        r |= {"temperature": 1.0, "top_k": 0, "top_p": 1.0}
    r["repetition_penalty"] = _number("repetition_penalty", get("repetition_penalty"), lambda v: v > 0, "> 0 (1: off)")
    nrs = r["num_return_sequences"] = _integer("num_return_sequences", get("num_return_sequences"), 1)
    beams = r["num_beams"] = _integer("num_beams", get("num_beams"), 1)
    stop = get("early_stopping")  # checked without beams too, as transformers' GenerationConfig.validate
    if isinstance(stop, (int, float)) and not isinstance(stop, bool) and stop in (0, 1):
        stop = bool(stop)  # transformers' check is `in {None, True, False, "never"}`: 0 and 1 pass it
    if stop not in (True, False, "never") or not isinstance(stop, (bool, str)):
        raise ValueError(f"generate: early_stopping must be True, False or 'never', got {stop!r}")
    if beams > 1:  # transformers' beam search (with do_sample: beam sampling)
        if nrs > beams:  # transformers refuses it too
            raise ValueError(f"generate: num_return_sequences={nrs} must be <= num_beams={beams}")
        r["length_penalty"] = _number("length_penalty", get("length_penalty"), lambda v: True, "finite")
        r["early_stopping"] = stop
    elif nrs > 1 and not r["do_sample"]:
        raise ValueError(
            f"generate: num_return_sequences={nrs} needs do_sample=True or num_beams >= {nrs} (greedy decoding "
            "returns one sequence per prompt)"
        )
    eos = r["eos_token_id"] = eos_list(get("eos_token_id"))
    pad = get("pad_token_id")
    if pad is None:
        pad = eos[0] if eos else 0  # HF: pad with the first EOS id
    if not _is_int(pad):
        raise ValueError(f"generate: pad_token_id must be an int, got {pad!r}")
    # "" is a stop string as in transformers (StopStringCriteria: every token completes it), not "off"
    stops = get("stop_strings")
    stops = [] if stops is None else [stops] if isinstance(stops, str) else list(stops)
    if not all(isinstance(s, str) for s in stops):
        raise ValueError(f"generate: stop_strings must be strings, got {stops!r}")
    # transformers' MinPLogitsWarper (a sampling warper, after top-p) takes min_p in [0, 1]
    min_p = get("min_p") if r["do_sample"] else None  # greedy: unused and unchecked, as the other warpers
    r["min_p"] = None if min_p is None else _number("min_p", min_p, lambda p: 0.0 <= p <= 1.0, "in [0, 1]")
    top_h = get("top_h") if r["do_sample"] else None  # transformers' TopHLogitsWarper refuses outside (0, 1]
    r["top_h"] = None if top_h is None else _number("top_h", top_h, lambda h: 0.0 < h <= 1.0, "in (0, 1]")
    # transformers applies typical_p below 1 (its warper refuses <= 0) and a cutoff in (0, 1); a value
    # it would skip silently (typical_p > 1, a cutoff < 0 or >= 1) is refused here
    for k, ok, need in (
        ("typical_p", lambda p: 0.0 < p <= 1.0, "in (0, 1] (1: off)"),
        ("epsilon_cutoff", lambda c: 0.0 <= c < 1.0, "in [0, 1) (0: off)"),
        ("eta_cutoff", lambda c: 0.0 <= c < 1.0, "in [0, 1) (0: off)"),
    ):  # greedy: unused and unchecked
        r[k] = _number(k, get(k), ok, need) if r["do_sample"] else HF_DEFAULTS[k]
    r["no_repeat_ngram_size"] = _integer("no_repeat_ngram_size", get("no_repeat_ngram_size") or 0, 0, " (0: off)")
    # token lists (an int alone as transformers' forced EOS takes it); [] or None: off
    vocab = int(getattr(config, "vocab_size", 2**63))
    for k in ("suppress_tokens", "begin_suppress_tokens", "forced_eos_token_id"):
        ids = eos_list(get(k), k)
        bad = [i for i in ids if not 0 <= i < vocab]
        if bad:
            raise ValueError(f"generate: {k} holds {bad[0]}, not a token id of the vocabulary")
        r[k] = ids or None
    bad = get("bad_words_ids")
    if bad is not None:  # transformers' NoBadWordsLogitsProcessor: a non-empty list of non-empty id lists
        if (
            not isinstance(bad, (list, tuple))
            or not bad
            or not all(
                isinstance(w, (list, tuple)) and w and all(_is_int(t) and 0 <= t < vocab for t in w) for w in bad
            )
        ):
            raise ValueError(f"generate: bad_words_ids must be a non-empty list of lists of token ids, got {bad!r}")
        # HF drops a bad word that is one EOS token alone
        bad = [[int(t) for t in w] for w in bad if not (len(w) == 1 and int(w[0]) in eos)] or None
    r["bad_words_ids"] = bad
    r["sequence_bias"] = _sequence_bias(get("sequence_bias"), vocab)
    r["forced_bos_token_id"] = bos = get("forced_bos_token_id")
    if bos is not None and not (_is_int(bos) and 0 <= bos < vocab):
        raise ValueError(f"generate: forced_bos_token_id must be a token id of the vocabulary ({vocab}), got {bos!r}")
    for k in ("remove_invalid_values", "renormalize_logits"):  # None: off, transformers' default
        if not isinstance(get(k), (bool, type(None))):
            raise ValueError(f"generate: {k} must be True or False, got {get(k)!r}")
        r[k] = bool(get(k))
    decay = get("exponential_decay_length_penalty")
    if decay is not None:  # transformers' ExponentialDecayLengthPenalty: (start_index, decay_factor)
        ok = isinstance(decay, (list, tuple)) and len(decay) == 2 and _is_int(decay[0])
        if (
            not ok
            or isinstance(decay[1], bool)
            or not isinstance(decay[1], (int, float))
            or not math.isfinite(decay[1])
        ):
            raise ValueError(
                f"generate: exponential_decay_length_penalty must be [start_index, decay_factor] (an int and a "
                f"finite number), got {decay!r}"
            )
        if not eos:  # transformers fails inside the processor
            raise ValueError(
                "generate: exponential_decay_length_penalty raises the EOS scores; it needs an eos_token_id"
            )
        decay = (int(decay[0]), float(decay[1]))
    r["exponential_decay_length_penalty"] = decay
    # prompt lookup decoding (transformers' PromptLookupCandidateGenerator: drafts copied from the row's
    # own ids after its last n-gram's earlier occurrence, checked by one forward)
    for k in ("prompt_lookup_num_tokens", "max_matching_ngram_size"):
        r[k] = None if get(k) is None else _integer(k, get(k), 1)
    r["num_assistant_tokens"] = _integer("num_assistant_tokens", get("num_assistant_tokens"), 1)
    r["num_assistant_tokens_schedule"] = schedule = get("num_assistant_tokens_schedule")
    if schedule not in ("constant", "heuristic", "heuristic_transient"):
        raise ValueError(f"generate: num_assistant_tokens_schedule must be 'constant' or 'heuristic', got {schedule!r}")
    confidence = get("assistant_confidence_threshold")
    r["assistant_confidence_threshold"] = _number(
        "assistant_confidence_threshold", confidence, lambda c: 0 <= c <= 1, "in [0, 1]"
    )
    drafter = "prompt_lookup_num_tokens" if r["prompt_lookup_num_tokens"] else "use_mtp" if r["use_mtp"] else None
    if drafter and (beams > 1 or nrs > 1 or (r["prompt_lookup_num_tokens"] and r["use_mtp"])):
        raise ValueError(  # transformers' assisted decoding is one sequence too
            f"generate: {drafter} drafts for one sequence; it takes no num_beams or num_return_sequences, and "
            "one drafter (prompt_lookup_num_tokens, use_mtp or assistant_model)"
        )
    # classifier-free guidance (transformers' UnbatchedClassifierFreeGuidanceLogitsProcessor); 1: off
    scale = get("guidance_scale")
    r["guidance_scale"] = None if scale is None or scale == 1 else _number("guidance_scale", scale, lambda g: True, "")
    if r["guidance_scale"] is not None and (beams > 1 or drafter):
        raise ValueError(  # transformers keeps the unconditional rows in their first order under beams
            "generate: guidance_scale runs a second, unconditional sequence per row; it takes no num_beams "
            "(transformers does not reorder it with the beams) and no drafter"
        )
    # transformers' MaxTimeCriteria: rows stop once more than max_time seconds passed since generate began
    r["max_time"] = None if get("max_time") is None else _number("max_time", get("max_time"), lambda t: True, "")
    for name in ("forced_bos_token_id", "forced_eos_token_id"):
        forced = r[name] if isinstance(r[name], list) else [] if r[name] is None else [r[name]]
        if forced and set(forced) <= set(r["suppress_tokens"] or []):
            raise ValueError(  # as transformers: the forced step would have every logit -inf
                f"generate: every token in {name} {r[name]} is also in suppress_tokens"
            )
    return GenerationConfig(max_new_tokens=new, min_new_tokens=min_new, pad_token_id=int(pad), stop_strings=stops, **r)


def _sequence_bias(given: Any, vocab: int) -> list[tuple[list[int], float]] | None:
    """transformers' ``sequence_bias`` (a list of ``[[ids], bias]``, or a dict of id tuples to biases)
    as [(ids, bias)], a later duplicate winning as in HF's dict; ids within the vocabulary, biases
    finite numbers (HF refuses an int bias; taken here)."""
    if given is None:
        return None
    pairs = list(given.items()) if isinstance(given, dict) else given
    ok = isinstance(pairs, (list, tuple)) and len(pairs) > 0
    for item in pairs if ok else ():
        ids, bias = item if isinstance(item, (list, tuple)) and len(item) == 2 else ((), None)
        ok = ok and isinstance(ids, (list, tuple)) and len(ids) > 0 and all(_is_int(t) and 0 <= t < vocab for t in ids)
        ok = ok and not isinstance(bias, bool) and isinstance(bias, (int, float)) and math.isfinite(bias)
    if not ok:
        raise ValueError(
            "generate: sequence_bias must be a non-empty list of [[token ids], bias] (or a dict of id tuples to "
            f"biases), the ids within the vocabulary ({vocab}) and the biases finite, got {given!r}"
        )
    merged = {tuple(int(t) for t in ids): float(bias) for ids, bias in pairs}
    return [(list(ids), bias) for ids, bias in merged.items()]
