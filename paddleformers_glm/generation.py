"""Text generation for GlmMoeDsaForCausalLM with transformers' ``generate`` contract: a prefill into
the decoding cache, then one token per step. Options, defaults, padding and the on-device draw are
described in docs/model.md ("Decoding"); HF options not implemented here are refused by name, never
silently ignored.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any

import numpy as np

from ._io import read_json, write_json_atomic

if TYPE_CHECKING:
    import paddle
# paddle is imported inside the functions: the CLI imports this module at start-up

__all__ = [
    "GENERATION_CONFIG_FILE",
    "GenerateDecoderOnlyOutput",
    "CudaGraphDecodeStep",
    "GenerationConfig",
    "check_generation_length",
    "derived_from_model_config",
    "derived_generation_file",
    "generate",
    "generation_config_to_save",
    "generate_speculative",
    "resolve_settings",
]

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
        (False, "output_attentions token_healing"),
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
    extra: dict[str, Any] = field(default_factory=dict)

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
        return cls(**{k: v for k, v in d.items() if k in known}, extra=extra)

    @classmethod
    def from_model_config(cls, config: Any) -> GenerationConfig:
        """What transformers derives for a model built from ``config`` (no checkpoint folder): from the
        config object, whose class defaults (``bos_token_id`` 0, ``use_cache``) and PreTrainedConfig's
        ``output_attentions`` / ``output_hidden_states`` (false) it holds beside the file's keys."""
        held = {"output_attentions": False, "output_hidden_states": False}
        held |= {k: getattr(config, k, None) for k in (*_SPECIAL_TOKENS, "use_cache")}
        return cls.from_dict(derived_from_model_config(held | config.to_dict()), source="the model config")

    @classmethod
    def from_pretrained(cls, folder: str | os.PathLike, config: Any = None) -> GenerationConfig:
        """``folder/generation_config.json``, special tokens it does not set from ``config``. A folder
        without one: what transformers derives from its config.json as written
        (:func:`derived_from_model_config`; ``config``'s keys where the folder has no config.json)."""
        path = os.path.join(os.fspath(folder), GENERATION_CONFIG_FILE)
        if not os.path.isfile(path):
            model_file = os.path.join(os.fspath(folder), "config.json")
            held = read_json(model_file, "the model config") if os.path.isfile(model_file) else None
            held = held if isinstance(held, dict) else config.to_dict() if config is not None else {}
            return cls.from_dict(derived_from_model_config(held), source=f"{model_file} (no {GENERATION_CONFIG_FILE})")
        gc = cls.from_dict(read_json(path, "the generation config"), source=path)
        for k in _SPECIAL_TOKENS:  # no config: getattr(None, k, None) leaves them unset
            if getattr(gc, k) is None:
                setattr(gc, k, getattr(config, k, None))
        return gc

    def to_dict(self) -> dict[str, Any]:
        """The set keys (and the file's other keys), as HF writes them."""
        out = {k: getattr(self, k) for k in self.keys() if getattr(self, k) is not None}
        out.update({k: v for k, v in self.extra.items() if not k.startswith("_source")})
        return out

    def save_pretrained(self, folder: str | os.PathLike) -> str:
        """Write ``folder/generation_config.json`` atomically; returns its path."""
        path = os.path.join(os.fspath(folder), GENERATION_CONFIG_FILE)
        write_json_atomic(path, self.to_dict(), indent=2, sort_keys=True)
        return path

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


# --------------------------------------------------------------------------- resolution
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


def _eos_list(v: Any, name: str = "eos_token_id") -> list[int]:
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
    unknown = [k for k in kwargs if k not in GenerationConfig.keys() and k not in UNSUPPORTED_OFF]
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

    flags = "do_sample use_cache return_dict_in_generate output_scores output_logits output_hidden_states use_mtp"
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
    if beams > 1:  # transformers' beam search (with do_sample: beam sampling)
        if nrs > beams:  # transformers refuses it too
            raise ValueError(f"generate: num_return_sequences={nrs} must be <= num_beams={beams}")
        r["length_penalty"] = _number("length_penalty", get("length_penalty"), lambda v: True, "finite")
        r["early_stopping"] = stop = get("early_stopping")
        if stop not in (True, False, "never") or not isinstance(stop, (bool, str)):
            raise ValueError(f"generate: early_stopping must be True, False or 'never', got {stop!r}")
    elif nrs > 1 and not r["do_sample"]:
        raise ValueError(
            f"generate: num_return_sequences={nrs} needs do_sample=True or num_beams >= {nrs} (greedy decoding "
            "returns one sequence per prompt)"
        )
    eos = r["eos_token_id"] = _eos_list(get("eos_token_id"))
    pad = get("pad_token_id")
    if pad is None:
        pad = eos[0] if eos else 0  # HF: pad with the first EOS id
    if not _is_int(pad):
        raise ValueError(f"generate: pad_token_id must be an int, got {pad!r}")
    stops = get("stop_strings") or []
    stops = [stops] if isinstance(stops, str) else list(stops)
    if not all(isinstance(s, str) and s for s in stops):
        raise ValueError(f"generate: stop_strings must be non-empty strings, got {stops!r}")
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
        ids = _eos_list(get(k), k)
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
    if r["forced_eos_token_id"] and set(r["forced_eos_token_id"]) <= set(r["suppress_tokens"] or []):
        raise ValueError(  # as transformers: the forced step would have every logit -inf
            f"generate: every token in forced_eos_token_id {r['forced_eos_token_id']} is also in suppress_tokens"
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


# --------------------------------------------------------------------------- processors (on the device)
def _warp(logits: paddle.Tensor, s: GenerationConfig, keep: int = 1) -> paddle.Tensor:
    """Temperature, then top-k (ties with the k-th kept), then top-p (the smallest set of most
    likely tokens whose probability reaches top_p), min-p, typical-p, the cutoffs, as HF's warpers:
    removed tokens get -inf, at least ``keep`` tokens stay (HF's min_tokens_to_keep: 1 + #EOS in
    beam sampling)."""
    import paddle

    neg_inf = paddle.full_like(logits, -math.inf)
    x = logits / s.temperature if s.temperature != 1.0 else logits
    if s.top_h is not None:
        x = paddle.where(_entropy_tail(x, s.top_h), neg_inf, x)
    if s.top_k and max(s.top_k, keep) < x.shape[-1]:
        kth = paddle.topk(x, max(s.top_k, keep), axis=-1)[0][:, -1:]
        x = paddle.where(x < kth, neg_inf, x)
    if s.top_p < 1.0:
        # as HF's TopPLogitsWarper: from the least likely up, a token goes while the probability summed
        # to it is <= 1 - top_p; the most likely always stays. Probabilities and their sum in float64:
        # float32 ones over a 150k vocabulary (summed most likely first, near 1.0) moved the cut by tens of tokens
        order = paddle.argsort(x, axis=-1)  # ascending
        p = paddle.nn.functional.softmax(x.astype("float64"), axis=-1)
        cum = paddle.cumsum(paddle.take_along_axis(p, order, axis=-1), axis=-1)
        drop_sorted = (cum <= 1.0 - s.top_p).astype("float64")
        drop_sorted[:, -keep:] = 0.0
        drop = paddle.put_along_axis(paddle.zeros_like(p), order, drop_sorted, axis=-1) > 0
        x = paddle.where(drop, neg_inf, x)
    if s.min_p is not None:  # HF's MinPLogitsWarper: a token goes below min_p x the top probability
        p = paddle.nn.functional.softmax(x, axis=-1)
        x = paddle.where(_below_top(p < s.min_p * p.max(axis=-1, keepdim=True), x, keep), neg_inf, x)
    if s.typical_p is not None and s.typical_p < 1.0:
        x = paddle.where(_atypical(x, s.typical_p, keep), neg_inf, x)
    for cutoff, scaled in ((s.epsilon_cutoff, False), (s.eta_cutoff, True)):
        if cutoff:
            x = paddle.where(_below_top(_below_cutoff(x, cutoff, scaled), x, keep), neg_inf, x)
    return x


def _entropy_tail(x: paddle.Tensor, top_h: float) -> paddle.Tensor:
    """The tokens HF's TopHLogitsWarper removes: of the 100 most likely (renormalised among
    themselves), those after the entropy summed from the most likely passes top_h x their entropy
    (the most likely always stays), and every other token."""
    import paddle

    top, idx = paddle.topk(x, min(100, x.shape[-1]), axis=-1)
    logp, p, ent = _entropy(top)
    terms = paddle.where(p > 0, -p * logp, paddle.zeros_like(p))
    keep = ((paddle.cumsum(terms, axis=-1) <= ent * top_h) & (p > 0)).astype("int32")
    keep[:, 0] = 1
    return paddle.put_along_axis(paddle.zeros_like(x, dtype="int32"), idx, keep, axis=-1) == 0


def _below_top(remove: paddle.Tensor, x: paddle.Tensor, keep: int) -> paddle.Tensor:
    """``remove`` [N, V] less each row's ``keep`` highest scores (HF's min_tokens_to_keep)."""
    import paddle

    return remove & (x < paddle.topk(x, min(keep, x.shape[-1]), axis=-1)[0][:, -1:])


def _entropy(x: paddle.Tensor) -> tuple[paddle.Tensor, paddle.Tensor, paddle.Tensor]:
    """log-probabilities, probabilities and entropy [N, 1] of logits x (removed tokens: -inf, no share)."""
    import paddle

    from .ops import log_softmax

    logp = log_softmax(x, axis=-1)
    kept, zero = paddle.isfinite(logp), paddle.zeros_like(logp)
    p = paddle.where(kept, paddle.exp(logp), zero)  # Paddle's vectorised CPU exp(-inf) is 2.9e-39, not 0
    return logp, p, -paddle.where(kept, p * logp, zero).sum(-1, keepdim=True)


def _atypical(x: paddle.Tensor, mass: float, keep: int = 1) -> paddle.Tensor:
    """Tokens outside the locally typical set (HF's TypicalLogitsWarper): ranked by how far their
    information -log p lies from the entropy, the closest tokens are kept until their probability
    summed in that order reaches ``mass`` (the token that reaches it included, and any token as
    close as it; the ``keep`` closest always stay)."""
    import paddle

    logp, _, ent = _entropy(x)
    distance = paddle.abs(-logp - ent)
    order = paddle.argsort(distance, axis=-1)  # closest first
    probs = paddle.nn.functional.softmax(paddle.take_along_axis(x, order, axis=-1), axis=-1)
    reached = (paddle.cumsum(probs, axis=-1) < mass).astype("int64").sum(-1, keepdim=True)
    last = paddle.clip(reached, min=keep - 1, max=x.shape[-1] - 1)
    return distance > paddle.take_along_axis(paddle.take_along_axis(distance, order, axis=-1), last, axis=-1)


def _below_cutoff(x: paddle.Tensor, cutoff: float, entropy_scaled: bool) -> paddle.Tensor:
    """Tokens whose probability is below ``cutoff`` (HF's EpsilonLogitsWarper) or, entropy-scaled,
    below min(cutoff, sqrt(cutoff) * exp(-entropy)) (its EtaLogitsWarper)."""
    import paddle

    _, p, ent = _entropy(x)
    bar = (
        paddle.minimum(paddle.full_like(ent, cutoff), math.sqrt(cutoff) * paddle.exp(-ent))
        if entropy_scaled
        else cutoff
    )
    return p < bar


def _banned(x: paddle.Tensor, pairs: list[tuple[int, int]]) -> paddle.Tensor:
    """``x`` [B, V] with -inf at each (row, token) of ``pairs`` (the host-side processors' bans)."""
    import paddle

    if not pairs:
        return x
    rows, cols = (paddle.to_tensor(np.asarray(v, dtype=np.int64)) for v in zip(*pairs))
    return paddle.index_put(x, (rows, cols), paddle.full([len(pairs)], -math.inf, dtype=x.dtype))


class _HostRows:
    """Each row's ids on the host (the prompt's, padding included, then the chosen ones), for the
    processors that look at how a row ends."""

    def __init__(self, prompt: np.ndarray) -> None:
        self.rows = [[int(t) for t in row] for row in prompt]

    def append(self, ids: np.ndarray) -> None:
        for row, t in zip(self.rows, ids.tolist()):
            row.append(int(t))

    def reorder(self, idx: np.ndarray) -> None:
        """Row ``i`` becomes a copy of row ``idx[i]`` (beam search)."""
        self.rows = [list(self.rows[i]) for i in idx.tolist()]

    def ending_with(self, head: list[int]) -> list[int]:
        """The rows whose ids end with ``head``."""
        return [b for b, row in enumerate(self.rows) if len(row) >= len(head) and row[len(row) - len(head) :] == head]


class _NGrams(_HostRows):
    """transformers' NoRepeatNGramLogitsProcessor on the host: each row's n-grams so far (the whole
    ``input_ids``, padding included, as HF's; then the chosen ids), and the tokens that would repeat
    one after the row's last n - 1 tokens."""

    def __init__(self, n: int, prompt: np.ndarray) -> None:
        super().__init__(prompt)
        self.n = n
        self.seen: list[dict[tuple, set]] = [{} for _ in self.rows]
        for row, seen in zip(self.rows, self.seen):
            for i in range(len(row) - n + 1):
                seen.setdefault(tuple(row[i : i + n - 1]), set()).add(row[i + n - 1])

    def append(self, ids: np.ndarray) -> None:
        for row, seen, t in zip(self.rows, self.seen, ids.tolist()):
            row.append(int(t))
            if len(row) >= self.n:
                seen.setdefault(tuple(row[len(row) - self.n : -1]), set()).add(int(t))

    def reorder(self, idx: np.ndarray) -> None:
        super().reorder(idx)
        self.seen = [{k: set(v) for k, v in self.seen[i].items()} for i in idx.tolist()]

    def ban(self, x: paddle.Tensor) -> paddle.Tensor:
        if len(self.rows[0]) + 1 < self.n:  # HF: no n-gram can be completed yet
            return x
        pairs = [
            (b, t)
            for b, (row, seen) in enumerate(zip(self.rows, self.seen))
            for t in sorted(seen.get(tuple(row[len(row) - self.n + 1 :]), ()))
        ]
        return _banned(x, pairs)


class _SequenceBias(_HostRows):
    """transformers' SequenceBiasLogitsProcessor (the first of its processors): a one-token
    sequence's bias is added at every step, a longer one's to its last token where the row's ids
    (the prompt's, padding included, then the chosen ones) end with the rest; biases on one token add."""

    def __init__(self, biases: list[tuple[list[int], float]], prompt: np.ndarray, vocab: int) -> None:
        import paddle

        super().__init__(prompt)
        single = np.zeros(vocab, np.float32)
        for ids, bias in biases:
            if len(ids) == 1:
                single[ids[0]] = bias
        self.single = paddle.to_tensor(single)
        self.multi = [(ids[:-1], ids[-1], bias) for ids, bias in biases if len(ids) > 1]

    def apply(self, x: paddle.Tensor) -> paddle.Tensor:
        import paddle

        bias = paddle.zeros_like(x) + self.single
        hits = [(b, last, value) for head, last, value in self.multi for b in self.ending_with(head)]
        if hits:
            rows, cols, values = zip(*hits)
            index = tuple(paddle.to_tensor(np.asarray(v, dtype=np.int64)) for v in (rows, cols))
            bias = paddle.index_put(bias, index, paddle.to_tensor(np.asarray(values, np.float32)), accumulate=True)
        return x + bias


class _BadWords(_HostRows):
    """transformers' NoBadWordsLogitsProcessor: a one-token bad word gets -inf at every step, the
    last token of a longer one where the row's ids end with the rest (prompt ids included)."""

    def __init__(self, words: list[list[int]], prompt: np.ndarray, vocab: int) -> None:
        import paddle

        super().__init__(prompt)
        single = [w[0] for w in words if len(w) == 1]
        self.single = paddle.to_tensor(np.isin(np.arange(vocab), single)) if single else None
        self.multi = [(w[:-1], w[-1]) for w in words if len(w) > 1]

    def ban(self, x: paddle.Tensor) -> paddle.Tensor:
        import paddle

        if self.single is not None:
            x = paddle.where(self.single, paddle.full_like(x, -math.inf), x)
        return _banned(x, [(b, last) for head, last in self.multi for b in self.ending_with(head)])


def _draw(scores: paddle.Tensor, uniforms: np.ndarray) -> paddle.Tensor:
    """One token per row from the softmax of ``scores`` [B, V] by inverting its CDF at the given
    uniform numbers [B] in [0, 1): the only host data is those B numbers."""
    import paddle

    # float64: a float32 CDF steps by 6e-8 near 1.0, so over a 150k vocabulary the many tokens below
    # that after the bulk of the mass got probability 0 or a whole step
    p = paddle.nn.functional.softmax(scores.astype("float64"), axis=-1)
    # exact zeros for removed tokens (Paddle's CPU softmax gives exp(-inf) as ~1e-28, not 0)
    p = paddle.where(paddle.isinf(scores), paddle.zeros_like(p), p)
    cdf = paddle.cumsum(p, axis=-1)
    target = paddle.to_tensor(np.asarray(uniforms, dtype=np.float64)[:, None]) * cdf[:, -1:]
    idx = paddle.searchsorted(cdf, target, right=True).squeeze(-1)  # first token whose CDF exceeds the target
    # rounding can put the target at the CDF's end: take the last token with probability then
    V = p.shape[-1]
    last = (V - 1) - paddle.argmax(paddle.flip((p > 0).astype("int32"), axis=[-1]), axis=-1)
    return paddle.where(idx >= V, last, idx).astype("int64")


@dataclass
class GenerateDecoderOnlyOutput:
    """``return_dict_in_generate=True``: ``sequences`` [B, S + n] (beam search: also ``sequences_scores``
    [B * num_return_sequences] and ``beam_indices``, as HF's beam output); per step the processed scores
    (``output_scores``) and the raw logits (``output_logits``), each [B, V], as HF returns them. Read as
    HF's ModelOutput: ``out["scores"]`` / ``out[1]`` / ``keys()`` / ``to_tuple()`` see the fields that are
    set (``hidden_states`` with ``output_hidden_states``: per step the forward's tuple of num_hidden_layers
    + 1 [B, L, H], L the prompt's length first, then 1, or the whole sequence without a cache; ``attentions``
    never: ``output_attentions`` is refused, the sparse attention forms keep no probabilities)."""

    sequences: Any
    sequences_scores: Any = None
    scores: tuple | None = None
    logits: tuple | None = None
    beam_indices: Any = None
    attentions: None = None
    hidden_states: tuple | None = None
    past_key_values: Any = None

    def keys(self) -> list[str]:
        return [f.name for f in fields(self) if getattr(self, f.name) is not None]

    def to_tuple(self) -> tuple:
        return tuple(getattr(self, k) for k in self.keys())

    def __getitem__(self, key: str | int) -> Any:
        if isinstance(key, str):
            if key not in self.keys():
                raise KeyError(key)
            return getattr(self, key)
        return self.to_tuple()[key]


# --------------------------------------------------------------------------- generate
def generate(
    model: paddle.nn.Layer,
    input_ids: paddle.Tensor | None = None,
    attention_mask: paddle.Tensor | None = None,
    generation_config: GenerationConfig | dict | None = None,
    *,
    seed: int | None = None,
    streamer: Callable[[np.ndarray], None] | Any | None = None,
    tokenizer: Any = None,
    decode_step: Callable[..., paddle.Tensor] | None = None,
    inputs_embeds: paddle.Tensor | None = None,
    logits_processor: Sequence[Callable[[paddle.Tensor, paddle.Tensor], paddle.Tensor]] | None = None,
    stopping_criteria: Sequence[Callable[[paddle.Tensor, Any], Any]] | None = None,
    prefix_allowed_tokens_fn: Callable[[int, paddle.Tensor], Sequence[int]] | None = None,
    stats: dict | None = None,
    negative_prompt_ids: paddle.Tensor | None = None,
    negative_prompt_attention_mask: paddle.Tensor | None = None,
    assistant_model: paddle.nn.Layer | None = None,
    **kwargs: Any,
) -> paddle.Tensor | GenerateDecoderOnlyOutput:
    """The prompt and up to ``max_new_tokens`` new tokens per row, [B * num_return_sequences, S + n] int64
    (a :class:`GenerateDecoderOnlyOutput` with ``return_dict_in_generate=True``); ``kwargs``: HF's options
    (docs/model.md, "Decoding"). Each token after the first goes through ``model.decode_step`` (or
    ``decode_step``, same arguments: its ``paddle.jit.to_static`` capture, a :class:`CudaGraphDecodeStep`)
    on a cache allocated once for the whole generation, so the step's shapes never change.
    ``inputs_embeds`` [B, S, H] (as transformers'): the prompt's embeddings are what the model reads;
    without ``input_ids`` only the new tokens are returned [B, n], and the prompt is nothing the
    repetition penalty or a stop string sees (HF's rules).
    ``logits_processor`` / ``stopping_criteria`` / ``prefix_allowed_tokens_fn``: transformers' hooks with
    Paddle tensors (``proc(input_ids [N, L], scores [N, V]) -> scores``, ``crit(input_ids, scores) -> bool
    or [N] bool``, ``fn(batch_id, row_ids) -> allowed ids``), called where transformers calls them.
    ``stats`` (a dict) receives a drafter's counts (``use_mtp`` / ``prompt_lookup_num_tokens``):
    drafted, accepted, acceptance_rate, main_forwards. ``negative_prompt_ids`` / ``_attention_mask``
    [B, L]: what ``guidance_scale`` conditions away from (default: each row's last prompt token).
    ``assistant_model``: a smaller GLM model of the same vocabulary that drafts (transformers' assisted
    decoding; ``num_assistant_tokens``, its schedule and ``assistant_confidence_threshold``).
    """
    import paddle

    started = time.time()  # max_time counts from here, as transformers' MaxTimeCriteria from generate's start
    hooks = _Hooks.checked(logits_processor, stopping_criteria, prefix_allowed_tokens_fn)

    if inputs_embeds is not None:
        if inputs_embeds.ndim != 3:
            raise ValueError(f"generate: inputs_embeds must be [batch, seq, hidden], got {list(inputs_embeds.shape)}")
        if input_ids is not None and list(input_ids.shape) != list(inputs_embeds.shape[:2]):
            raise ValueError(
                f"generate: input_ids shape {list(input_ids.shape)} != inputs_embeds' [batch, seq] "
                f"{list(inputs_embeds.shape[:2])}"
            )
        if input_ids is None:  # transformers: an empty prompt of ids; the output holds the new tokens only
            input_ids = paddle.zeros([inputs_embeds.shape[0], 0], dtype="int64")
    elif input_ids is None:
        raise ValueError("generate: give input_ids or inputs_embeds")
    if input_ids.ndim != 2:
        raise ValueError(f"generate: input_ids must be [batch, seq], got shape {list(input_ids.shape)}")
    B, S = input_ids.shape if inputs_embeds is None else inputs_embeds.shape[:2]
    ids_given = input_ids.shape[1] == S  # False: inputs_embeds alone
    own = getattr(model, "generation_config", None)  # the model's defaults fill what a passed config leaves unset (HF)
    own = GenerationConfig.from_dict(own, "model.generation_config") if isinstance(own, dict) else own
    own = own if isinstance(own, GenerationConfig) else generation_config_of(model)
    if not isinstance(generation_config, (GenerationConfig, dict, type(None))) and hasattr(
        generation_config, "to_dict"
    ):
        generation_config = generation_config.to_dict()  # transformers' GenerationConfig: its None keys are unset
    if isinstance(generation_config, dict):
        generation_config = GenerationConfig.from_dict(generation_config, source="generation_config argument")
    gc = own if generation_config is None else generation_config.over(own)
    s = resolve_settings(model.config, gc, kwargs, S)  # before any allocation
    if attention_mask is not None and list(attention_mask.shape) != [B, S]:
        raise ValueError(f"generate: attention_mask shape {list(attention_mask.shape)} != input_ids shape {[B, S]}")
    if s.stop_strings and tokenizer is None:
        raise ValueError("generate: stop_strings need tokenizer= (the tokenizer that decodes the new tokens)")
    if s.num_beams > 1 and (streamer is not None or s.stop_strings):  # as transformers for a streamer
        raise ValueError("generate: beam search (num_beams > 1) takes no streamer and no stop_strings")
    input_ids = input_ids.astype("int64")
    copies = s.num_beams if s.num_beams > 1 else s.num_return_sequences  # rows per prompt
    if copies > 1:
        input_ids = paddle.repeat_interleave(input_ids, copies, axis=0)
        if attention_mask is not None:
            attention_mask = paddle.repeat_interleave(attention_mask, copies, axis=0)
        if inputs_embeds is not None:
            inputs_embeds = paddle.repeat_interleave(inputs_embeds, copies, axis=0)
        B = input_ids.shape[0]
    # right padding: each row's first new token follows its last real token, not the padded end
    # (HF continues from the pad position and warns); later tokens are real, the pads stay masked
    last_real = None
    if attention_mask is not None:
        real = attention_mask.numpy() != 0  # one host read of the mask, before any step
        if not real[:, -1].all():
            last_real = paddle.to_tensor(np.where(real.any(1), S - 1 - np.argmax(real[:, ::-1], axis=1), S - 1))
    tails = None
    if s.stop_strings:  # HF matches a stop string against the sequence's end, prompt included: each row's
        # last real prompt tokens (as many as the longest stop string has characters) and their text
        k, host_ids = max(map(len, s.stop_strings)), input_ids.numpy()
        real_rows = (
            np.ones(host_ids.shape, bool) if attention_mask is None or not ids_given else attention_mask.numpy() != 0
        )
        tails = [[int(t) for t in row[keep][-k:]] for row, keep in zip(host_ids, real_rows)]
        tails = [(t, len(tokenizer.decode(t))) for t in tails]
    rng = np.random.default_rng(seed)
    # transformers' streamer protocol (TextStreamer): put() the prompt, then each step's ids, then end();
    # a plain callable gets each step's ids
    put, end = getattr(streamer, "put", streamer), getattr(streamer, "end", lambda: None)
    if hasattr(streamer, "put"):
        put(input_ids.numpy())
    V = int(model.config.vocab_size)
    procs = _Processors(s, input_ids, attention_mask, ids_given, V, hooks, started)
    if s.guidance_scale is not None:
        procs.guidance = _unconditional(
            model, s, input_ids, negative_prompt_ids, negative_prompt_attention_mask, copies
        )
    elif negative_prompt_ids is not None:
        raise ValueError("generate: negative_prompt_ids is read by guidance_scale (not 1), which is not set")
    if assistant_model is not None and (s.prompt_lookup_num_tokens or s.use_mtp or s.num_beams > 1 or copies > 1):
        raise ValueError(
            "generate: assistant_model drafts for one sequence; it takes no num_beams or num_return_sequences, "
            "and one drafter (prompt_lookup_num_tokens, use_mtp or assistant_model)"
        )
    if assistant_model is not None and s.guidance_scale is not None:
        raise ValueError("generate: guidance_scale takes no drafter (assistant_model)")
    if s.prompt_lookup_num_tokens or s.use_mtp or assistant_model is not None:
        name = (
            "prompt_lookup_num_tokens" if s.prompt_lookup_num_tokens else "use_mtp" if s.use_mtp else "assistant_model"
        )
        if B != 1 or not s.use_cache or inputs_embeds is not None or s.output_hidden_states:
            raise ValueError(  # transformers: "assisted generate is only supported for batch_size = 1"
                f"generate: {name} drafts from one row's ids: one prompt of ids, use_cache=True, "
                f"no output_hidden_states (got {B} rows, use_cache={s.use_cache})"
            )
        if s.prompt_lookup_num_tokens:
            decoder = _LookupDecoder(model, input_ids, attention_mask, last_real, s)
        elif s.use_mtp:
            decoder = _MtpDecoder(model, input_ids, attention_mask)
        else:
            decoder = _AssistantDecoder(model, assistant_model, input_ids, attention_mask, last_real, s)
    else:
        decoder = _Decoder(model, s.use_cache, input_ids, attention_mask, inputs_embeds, decode_step, last_real)
    decoder.hidden = [] if s.return_dict_in_generate and s.output_hidden_states else None
    with _inference(model):
        if s.num_beams > 1:
            out = _beam_search(decoder, procs, s, input_ids, rng)
        else:
            out = _sample(decoder, procs, s, input_ids, rng, put, tokenizer, tails)
    if stats is not None and isinstance(decoder, (_DraftingDecoder, _MtpDecoder)):
        stats.update(_counts(decoder.stats))
    end()
    return out


@contextlib.contextmanager
def _inference(model: paddle.nn.Layer):
    """The model in eval mode without autograd for a generation, its training mode given back."""
    import paddle

    was_training = model.training
    model.eval()
    try:
        with paddle.no_grad():
            yield
    finally:
        if was_training:
            model.train()


def _counts(stats: dict) -> dict:
    """A drafting decoder's counts with its acceptance rate."""
    return stats | {"acceptance_rate": stats["accepted"] / max(stats["drafted"], 1)}


@dataclass
class _Hooks:
    """The caller's own logits processors, stopping criteria and prefix constraint (transformers'
    ``logits_processor`` / ``stopping_criteria`` / ``prefix_allowed_tokens_fn``, on Paddle tensors)."""

    processors: list
    criteria: list
    prefix_fn: Callable | None

    @classmethod
    def checked(cls, processors: Any, criteria: Any, prefix_fn: Any) -> _Hooks:
        lists = []
        for name, given in (("logits_processor", processors), ("stopping_criteria", criteria)):
            items = [] if given is None else given
            if not isinstance(items, (list, tuple)) or not all(callable(x) for x in items):
                raise TypeError(f"generate: {name} must be a list of callables (input_ids, scores), got {given!r}")
            lists.append(list(items))
        if prefix_fn is not None and not callable(prefix_fn):
            raise TypeError(
                f"generate: prefix_allowed_tokens_fn must be callable (batch_id, input_ids), got {prefix_fn!r}"
            )
        return cls(*lists, prefix_fn)


class _Processors:
    """transformers' logits processors, in its order, for every row of a generation (greedy,
    sampling and beam search alike): sequence bias, repetition penalty, n-gram and bad-word bans,
    minimum length, the prefix constraint, forced BOS / EOS, the removal of NaN / inf, the EOS
    length boost, suppressed and begin-suppressed tokens, the caller's processors, then (sampling)
    the warpers and the final renormalisation; and its stopping criteria beyond EOS."""

    def __init__(
        self,
        s: GenerationConfig,
        input_ids: paddle.Tensor,
        mask: paddle.Tensor | None,
        ids_given: bool,
        V: int,
        hooks: _Hooks,
        started: float,
    ):
        import paddle

        self.s, self.hooks, self.started = s, hooks, started
        self.stops = bool(hooks.criteria) or s.max_time is not None
        self.keep = len(s.eos_token_id) + 1 if s.num_beams > 1 else 1  # HF's min_tokens_to_keep for the warpers
        uses_eos = s.min_new_tokens or s.exponential_decay_length_penalty
        self.eos_vocab = (
            paddle.to_tensor(np.isin(np.arange(V), s.eos_token_id)) if s.eos_token_id and uses_eos else None
        )
        # [V] masks: forced BOS / EOS (one step), suppressed (every step), begin-suppressed (the first)
        token_sets = {"forced_bos_token_id": [] if s.forced_bos_token_id is None else [s.forced_bos_token_id]}
        token_sets |= {
            k: getattr(s, k) or [] for k in ("forced_eos_token_id", "suppress_tokens", "begin_suppress_tokens")
        }
        self.vocab_mask = {k: paddle.to_tensor(np.isin(np.arange(V), ids)) for k, ids in token_sets.items() if ids}
        B, S = input_ids.shape
        # transformers' forced BOS comes where its input_ids are 1 long (they hold no embedded prompt),
        # and then the begin-suppressed tokens one step later
        held = S if ids_given else 0
        self.bos_step = 1 - held if s.forced_bos_token_id is not None and held <= 1 else None
        self.begin_step = 0 if self.bos_step is None else 1
        self.ids = input_ids if hooks.processors or hooks.criteria or hooks.prefix_fn else None  # for the hooks
        self.guidance: _Decoder | None = None  # guidance_scale's unconditional sequence (set by generate)
        self.last = None  # the ids chosen last
        self.seen = None
        if s.repetition_penalty != 1.0:  # [B, V]: which tokens a row holds (padding excluded)
            self.seen = paddle.zeros([B, V], dtype="bool")
            if ids_given and S:
                valid = paddle.ones_like(input_ids) if mask is None else (mask != 0).astype("int64")
                zero = paddle.zeros([B, V], dtype="int64")
                self.seen = paddle.put_along_axis(zero, input_ids, valid, axis=1, reduce="add") > 0
        # the prompt read back to the host only for the processors that track rows there
        host = input_ids.numpy() if s.no_repeat_ngram_size or s.bad_words_ids or s.sequence_bias else None
        self.ngrams = _NGrams(s.no_repeat_ngram_size, host) if s.no_repeat_ngram_size else None
        self.bad_words = _BadWords(s.bad_words_ids, host, V) if s.bad_words_ids else None
        self.biases = _SequenceBias(s.sequence_bias, host, V) if s.sequence_bias else None
        # the processors that read the chosen ids on the host each step
        self.host_held = [p for p in (self.ngrams, self.bad_words, self.biases) if p is not None]

    def __call__(self, x: paddle.Tensor, step: int) -> paddle.Tensor:
        import paddle

        from .ops import log_softmax

        s, masks = self.s, self.vocab_mask
        neg_inf = paddle.full_like(x, -math.inf) if masks or self.eos_vocab is not None else None
        if self.guidance is not None:  # HF's first: g (log p - log p_uncond) + log p_uncond
            free = self.guidance.prefill(s.max_new_tokens) if step == 0 else self.guidance.next(self.last)
            free = log_softmax(free.astype(x.dtype), axis=-1)
            x = s.guidance_scale * (log_softmax(x, axis=-1) - free) + free
        if self.biases is not None:
            x = self.biases.apply(x)
        if self.seen is not None:  # HF's repetition penalty: a seen logit / penalty if positive, * if negative
            rp = s.repetition_penalty
            x = paddle.where(self.seen, paddle.where(x < 0, x * rp, x / rp), x)
        for ban in (self.ngrams, self.bad_words):  # after the repetition penalty, before the minimum length
            if ban is not None:
                x = ban.ban(x)
        if self.eos_vocab is not None and step < s.min_new_tokens:
            x = paddle.where(self.eos_vocab, neg_inf, x)
        if self.hooks.prefix_fn is not None:
            x = self._prefix_allowed(x)
        if step == self.bos_step:
            x = paddle.where(masks["forced_bos_token_id"], paddle.zeros_like(x), neg_inf)
        if "forced_eos_token_id" in masks and step == s.max_new_tokens - 1:  # max_length - 1 tokens
            x = paddle.where(masks["forced_eos_token_id"], paddle.zeros_like(x), neg_inf)
        if s.remove_invalid_values:  # HF's InfNanRemoveLogitsProcessor: NaN 0, +-inf the largest finite
            x = paddle.nan_to_num(x)
        decay = s.exponential_decay_length_penalty
        if decay is not None and step > decay[0]:  # HF's boost of the EOS scores: |score| (factor^n - 1)
            lift = paddle.abs(x) * (decay[1] ** (step - decay[0]) - 1)
            x = x + paddle.where(paddle.logical_and(self.eos_vocab, paddle.isfinite(x)), lift, paddle.zeros_like(x))
        if "suppress_tokens" in masks:
            x = paddle.where(masks["suppress_tokens"], neg_inf, x)
        if "begin_suppress_tokens" in masks and step == self.begin_step:
            x = paddle.where(masks["begin_suppress_tokens"], neg_inf, x)
        for proc in self.hooks.processors:
            out = proc(self.ids, x)
            if not isinstance(out, paddle.Tensor) or list(out.shape) != list(x.shape):
                got = list(out.shape) if isinstance(out, paddle.Tensor) else type(out).__name__
                raise TypeError(f"generate: logits_processor {proc!r} must return scores {list(x.shape)}, got {got}")
            x = out.astype(x.dtype)
        if s.do_sample:
            x = _warp(x, s, self.keep)
        if s.renormalize_logits:  # HF's LogitNormalization, always the last (-inf stays -inf, as ops'
            # log_softmax keeps it: Paddle's CPU one makes it finite, a score a beam could pick)
            x = log_softmax(x, axis=-1)
        return x

    def _prefix_allowed(self, x: paddle.Tensor) -> paddle.Tensor:
        """HF's PrefixConstrainedLogitsProcessor: each row keeps the tokens ``fn(batch id, row ids)``
        allows; a prompt whose every row has all its allowed tokens at -inf gets score 0 on them."""
        import paddle

        N, V = x.shape
        group = self.s.num_beams
        rows, cols = [], []
        for r in range(N):
            allowed = [int(t) for t in self.hooks.prefix_fn(r // group, self.ids[r])]
            if not allowed or not all(0 <= t < V for t in allowed):
                raise ValueError(
                    f"generate: prefix_allowed_tokens_fn returned {allowed!r} for batch id {r // group}: it must "
                    f"name at least one token id of the vocabulary ({V})"
                )
            rows += [r] * len(allowed)
            cols += allowed
        index = tuple(paddle.to_tensor(np.asarray(v, dtype=np.int64)) for v in (rows, cols))
        mask = paddle.index_put(paddle.full_like(x, -math.inf), index, paddle.zeros([len(rows)], dtype=x.dtype))
        out = x + mask
        unmet = (out.max(axis=-1) == -math.inf).reshape([N // group, group]).all(axis=-1, keepdim=True)
        return paddle.where(paddle.repeat_interleave(unmet.astype("int32"), group, axis=0) > 0, mask, out)

    def stopped(self, ids: paddle.Tensor | None, scores: tuple | None, rows: int) -> paddle.Tensor | None:
        """Which of ``rows`` rows the stopping criteria end (transformers' StoppingCriteriaList: any
        criterion; ``max_time`` ends all); ``ids`` [rows, L] what the caller's criteria read."""
        import paddle

        if self.s.max_time is not None and time.time() - self.started > self.s.max_time:
            return paddle.ones([rows], dtype="bool")
        done = None
        for crit in self.hooks.criteria:
            hit = crit(ids, scores)
            hit = hit if isinstance(hit, paddle.Tensor) else paddle.to_tensor(np.asarray(hit))
            if hit.ndim == 0:
                hit = paddle.full([rows], bool(hit), dtype="bool")
            if list(hit.shape) != [rows]:
                raise TypeError(f"generate: stopping criterion {crit!r} must return a bool or [{rows}] bools")
            done = hit.astype("bool") if done is None else paddle.logical_or(done, hit.astype("bool"))
        return done

    def append(self, nxt: paddle.Tensor, host: np.ndarray | None) -> None:
        """The chosen ids [B] (on the device; ``host``: the same read back, when ``host_held``)."""
        import paddle

        if self.seen is not None:
            self.seen = paddle.logical_or(self.seen, paddle.nn.functional.one_hot(nxt, self.seen.shape[1]) > 0)
        if self.ids is not None:
            self.ids = paddle.concat([self.ids, nxt[:, None].astype(self.ids.dtype)], axis=1)
        self.last = nxt
        for held in self.host_held:
            held.append(host)

    def reorder(self, idx: np.ndarray) -> None:
        """Row ``i`` continues row ``idx[i]`` (beam search)."""
        import paddle

        rows = paddle.to_tensor(idx)
        if self.seen is not None:
            self.seen = paddle.index_select(self.seen, rows, axis=0)
        if self.ids is not None:
            self.ids = paddle.index_select(self.ids, rows, axis=0)
        for held in self.host_held:
            held.reorder(idx)


class _Decoder:
    """The model's side of a generation: the prompt's forward (``prefill``), then one new token per
    row per step (``next``), through the cache allocated once (``model.decode_step`` or a capture of
    it) or, with ``use_cache=False``, the whole sequence again; ``reorder`` for beam search.
    ``hidden`` (a list, when the caller asks for hidden states): each forward's
    ``out.hidden_states``; the steps then run the model's forward on the cache, not ``decode_step``."""

    def __init__(self, model, use_cache, input_ids, mask, inputs_embeds, decode_step, last_real) -> None:
        self.model, self.use_cache, self.input_ids, self.mask = model, use_cache, input_ids, mask
        self.inputs_embeds, self.step_fn, self.last_real = inputs_embeds, decode_step or model.decode_step, last_real
        self.cache, self.hidden = None, None

    def _kept(self, out: Any) -> Any:
        if self.hidden is not None:
            self.hidden.append(out.hidden_states)
        return out

    def prefill(self, new_tokens: int) -> paddle.Tensor:
        """The logits [B, V] after each row's last prompt token (the cache sized for ``new_tokens`` more)."""
        from .modeling.cache import DSACache

        model, states = self.model, self.hidden is not None
        if self.use_cache:
            prompt = self.input_ids if self.inputs_embeds is None else self.inputs_embeds
            capacity = prompt.shape[1] + new_tokens
            self.cache = DSACache.for_config(model.config, prompt.shape[0], capacity=capacity)
            prompt = self.input_ids if self.inputs_embeds is None else None
            kw = {"inputs_embeds": self.inputs_embeds, "logits_to_keep": 1, "output_hidden_states": states}
            out = self._kept(model(prompt, self.mask, past_key_values=self.cache, use_cache=True, **kw))
        else:
            self.seq = self.input_ids if self.inputs_embeds is None else self.inputs_embeds
            out = self._kept(_full_forward(model, self.seq, self.mask, states))
        if self.last_real is None:
            return out.logits[:, -1]
        return _logits_at(model, out.last_hidden_state, self.last_real)

    def next(self, nxt: paddle.Tensor) -> paddle.Tensor:
        """The logits [B, V] after each row's new token ``nxt`` [B]."""
        import paddle

        if self.use_cache and self.hidden is not None:  # the forward on the filled cache keeps them
            kw = {"use_cache": True, "output_hidden_states": True, "logits_to_keep": 1}
            return self._kept(self.model(nxt[:, None], past_key_values=self.cache, **kw)).logits[:, -1]
        if self.use_cache:
            positions, _ = self.cache.begin(None, 1)
            logits = self.step_fn(nxt[:, None], positions, self.cache.slots, self.cache)
            self.cache.advance(1)
            return logits
        step_in = nxt[:, None] if self.inputs_embeds is None else self.model.model.embedding(nxt[:, None])
        self.seq = paddle.concat([self.seq, step_in.astype(self.seq.dtype)], axis=1)
        if self.mask is not None:
            self.mask = paddle.concat([self.mask, paddle.ones([self.seq.shape[0], 1], dtype=self.mask.dtype)], axis=1)
        return self._kept(_full_forward(self.model, self.seq, self.mask, self.hidden is not None)).logits[:, -1]

    def reorder(self, idx: paddle.Tensor) -> None:
        """Row ``i`` continues row ``idx[i]``."""
        import paddle

        if self.use_cache:
            self.cache.reorder_cache(idx)
            return
        self.seq = paddle.index_select(self.seq, idx, axis=0)
        if self.mask is not None:
            self.mask = paddle.index_select(self.mask, idx, axis=0)


def _unconditional(model, s: GenerationConfig, input_ids, ids, mask, copies: int) -> _Decoder:
    """guidance_scale's second sequence per row, as transformers': ``negative_prompt_ids`` [B, L]
    (and its mask), else each row's last prompt token, then the chosen tokens; its own cache."""
    import paddle

    if ids is None:
        if not input_ids.shape[1]:
            raise ValueError("generate: guidance_scale with embeddings alone needs negative_prompt_ids")
        ids, mask = input_ids[:, -1:], None
    else:
        rows = input_ids.shape[0] // copies
        if ids.ndim != 2 or ids.shape[0] != rows or (mask is not None and list(mask.shape) != list(ids.shape)):
            got = list(ids.shape) if mask is None else f"{list(ids.shape)} (mask {list(mask.shape)})"
            raise ValueError(
                f"generate: negative_prompt_ids must be [{rows}, length] like the prompt's rows, got {got}"
            )
        ids = paddle.repeat_interleave(ids.astype("int64"), copies, axis=0) if copies > 1 else ids.astype("int64")
        if mask is not None and copies > 1:
            mask = paddle.repeat_interleave(mask, copies, axis=0)
    return _Decoder(model, s.use_cache, ids, mask, None, None, None)


class _DraftingDecoder(_Decoder):
    """One row whose fed token is followed in the same forward by up to ``most`` drafts (``_draft``),
    the logits after each kept: a later token equal to the next draft takes its kept logits without a
    forward; one that differs rolls the unused drafts out of the cache. The tokens are chosen as
    without drafts (the same processors, draw and stops), so they are plain decoding's; only the
    number of forwards changes (``stats``)."""

    def __init__(self, model, input_ids, mask, last_real, most: int) -> None:
        super().__init__(model, True, input_ids, mask, None, None, last_real)
        self.row = [int(t) for t in input_ids.numpy()[0]]  # the prompt's ids, then the chosen ones
        self.drafts, self.most, self.prompt_len = [], most, len(self.row)
        self.stats = {"drafted": 0, "accepted": 0, "main_forwards": 1}  # the prompt's forward

    def next(self, nxt: paddle.Tensor) -> paddle.Tensor:
        import paddle

        token = int(nxt.numpy()[0])
        self.row.append(token)
        if self.drafts and self.drafts[0][0] == token:  # the draft was right: its logits are known
            self.stats["accepted"] += 1
            return self.drafts.pop(0)[1]
        self._round_ended(all_taken=not self.drafts)
        self.cache.rollback(len(self.drafts))  # the unused drafts' rows
        drafts = self._draft(min(self.most, self.cache.capacity - self.cache.length - 1))
        out = self.model(paddle.to_tensor([[token, *drafts]]), past_key_values=self.cache, use_cache=True)
        self.stats["drafted"] += len(drafts)
        self.stats["main_forwards"] += 1
        logits = out.logits[0].astype("float32")
        self.drafts = [(t, logits[i + 1 : i + 2]) for i, t in enumerate(drafts)]
        return logits[:1]

    def _round_ended(self, all_taken: bool) -> None:
        """Before the next drafts: whether every draft of the last round was taken."""

    def _draft(self, most: int) -> list[int]:
        raise NotImplementedError


class _LookupDecoder(_DraftingDecoder):
    """Prompt lookup decoding (transformers' ``prompt_lookup_num_tokens``): the drafts are what
    followed the first earlier occurrence of the row's last n ids (n = ``max_matching_ngram_size``
    (2) down to 1), cut before an EOS, as transformers' PromptLookupCandidateGenerator proposes them."""

    def __init__(self, model, input_ids, mask, last_real, s: GenerationConfig) -> None:
        super().__init__(model, input_ids, mask, last_real, s.prompt_lookup_num_tokens)
        self.ngram, self.eos = s.max_matching_ngram_size or 2, set(s.eos_token_id)

    def _draft(self, most: int) -> list[int]:
        return self._lookup(most)

    def _lookup(self, most: int) -> list[int]:
        """Up to ``most`` ids that followed the first earlier occurrence of the row's last n ids."""
        row = self.row
        for n in range(min(self.ngram, len(row) - 1), 0, -1):
            tail = row[-n:]
            for start in range(len(row) - n):
                if row[start : start + n] == tail:  # the first match decides, as transformers'
                    drafts = row[start + n : start + n + most]
                    return drafts[: next((i for i, t in enumerate(drafts) if t in self.eos), len(drafts))]
        return []


class _AssistantDecoder(_DraftingDecoder):
    """Assisted decoding (transformers' ``assistant_model``): a smaller model of the same vocabulary,
    with its own cache, drafts up to ``num_assistant_tokens`` greedy tokens (stopping after one it
    gives less than ``assistant_confidence_threshold``), its cache first rolled back to the row's
    tokens. ``heuristic``: 2 more drafts after a round all taken, 1 fewer otherwise (transformers
    also moves its threshold by a fitted curve; that changes how many forwards run, never the tokens)."""

    def __init__(self, model, assistant, input_ids, mask, last_real, s: GenerationConfig) -> None:
        super().__init__(model, input_ids, mask, last_real, s.num_assistant_tokens)
        V, W = int(model.config.vocab_size), int(getattr(getattr(assistant, "config", None), "vocab_size", -1))
        if V != W or not hasattr(assistant, "decode_step"):
            raise ValueError(f"generate: assistant_model must be a GLM model of the same vocabulary ({V}), got {W}")
        self.helper, self.fed, self.last_round, self.s = (
            _Decoder(assistant, True, input_ids, mask, None, None, last_real),
            [],
            0,
            s,
        )

    def prefill(self, new_tokens: int) -> paddle.Tensor:
        self.helper.prefill(new_tokens + self.most + 1)  # room for the drafts past the last token
        return super().prefill(new_tokens)

    def _round_ended(self, all_taken: bool) -> None:
        if self.s.num_assistant_tokens_schedule != "constant" and self.last_round:
            self.most = self.most + 2 if all_taken else max(1, self.most - 1)

    def _draft(self, most: int) -> list[int]:
        """The assistant's greedy tokens after the row; its cache holds ``fed`` after the prompt."""
        import paddle

        new, same = self.row[self.prompt_len :], 0
        while same < min(len(self.fed), len(new)) and self.fed[same] == new[same]:
            same += 1
        self.helper.cache.rollback(len(self.fed) - same)
        self.fed, feed, drafts = self.fed[:same], new[same:], []
        room = self.helper.cache.capacity - self.helper.cache.length
        while feed and len(drafts) < most and len(feed) <= room:
            out = self.helper.model(paddle.to_tensor([feed]), past_key_values=self.helper.cache, use_cache=True)
            self.fed += feed
            room -= len(feed)
            p = paddle.nn.functional.softmax(out.logits[0, -1].astype("float32"))
            drafts.append(int(p.argmax()))
            if float(p.max()) < self.s.assistant_confidence_threshold:
                break
            feed = drafts[-1:]
        self.last_round = len(drafts)
        return drafts


class _MtpDecoder(_Decoder):
    """Speculative decoding with the first MTP layer drafting (``use_mtp``, one row without padding):
    each fed token t is followed in the same forward by the MTP head's greedy guess for the token
    after it (from the main model's hidden state that predicted t, t, and that position's top-k); a
    later token equal to the draft takes the logits kept for it, another rolls the draft out of the
    main cache. The MTP layer's own cache holds the rows of the kept tokens only. The tokens are
    chosen as without drafts; ``stats`` counts drafts, accepted drafts and main forwards."""

    def __init__(self, model, input_ids, mask) -> None:
        super().__init__(model, True, input_ids, mask, None, None, None)
        if not model.model.mtp_layers:
            raise ValueError("generate: use_mtp needs an MTP layer (num_nextn_predict_layers = 0)")
        if mask is not None and not bool(mask.astype("bool").all()):
            raise ValueError("generate: use_mtp drafts for one row without padding (the mask holds zeros)")
        self.mtp, self.draft = model.model.mtp_layers[0], None
        self.stats = {"drafted": 0, "accepted": 0, "main_forwards": 0}

    def prefill(self, new_tokens: int) -> paddle.Tensor:
        from .modeling.cache import DSACache

        model, ids = self.model, self.input_ids
        S = ids.shape[1]  # one capacity for both caches: a main top-k's slots address the MTP cache's rows
        self.cache = DSACache.for_config(model.config, 1, capacity=S + new_tokens + 2)
        self.cache.keep_topk = True  # the main top-k of each forward, for the MTP layer (_mtp_step)
        self.mtp_cache = DSACache(1, 1, capacity=self.cache.capacity)
        out = model(ids, self.mask, past_key_values=self.cache, use_cache=True)
        self.stats["main_forwards"] += 1
        h, topk = out.last_hidden_state, self.cache.topk  # [1, S, H], [1, S, k]
        if S > 1:  # MTP positions 0 .. S-2: (h_i, token i+1)
            _mtp_step(model, self.mtp, self.mtp_cache, h[:, :-1], ids[:, 1:], topk[:, :-1])
        self.h_last, self.topk_last = h[:, -1:], topk[:, -1:]  # what predicts the next token
        return out.logits[:, -1]

    def next(self, nxt: paddle.Tensor) -> paddle.Tensor:
        import paddle

        token, model = nxt[:, None], self.model
        if self.draft is not None:
            draft, kept, hs, topk = self.draft
            self.draft = None
            if int(nxt.numpy()[0]) == draft:  # right: its MTP row, then the state after it
                self.stats["accepted"] += 1
                _mtp_step(model, self.mtp, self.mtp_cache, hs[:, :1], token, topk[:, :1])
                self.h_last, self.topk_last = hs[:, 1:2], topk[:, 1:2]
                return kept
            self.cache.rollback(1)
            self.h_last, self.topk_last = hs[:, :1], topk[:, :1]
        guess = _mtp_step(model, self.mtp, self.mtp_cache, self.h_last, token, self.topk_last)
        draft = int(guess[0].argmax())
        self.stats["drafted"] += 1
        out = model(paddle.concat([token, paddle.to_tensor([[draft]])], axis=1), past_key_values=self.cache)
        self.stats["main_forwards"] += 1
        logits = out.logits[0].astype("float32")
        self.draft = (draft, logits[1:2], out.last_hidden_state, self.cache.topk)
        return logits[:1]


def _beam_search(
    decoder: _Decoder, procs: _Processors, s: GenerationConfig, input_ids: paddle.Tensor, rng: np.random.Generator
) -> paddle.Tensor | GenerateDecoderOnlyOutput:
    """transformers 5.23's beam search (``num_beams`` K > 1, no sampling), its rules on the host:
    each step the processed log-probabilities plus each beam's score, the best max(2, 1 + #EOS) x K
    continuations over all K beams; those ending in an EOS or at the length limit are finished
    (among the first K, scored / generated length ** length_penalty, the K best finished kept), the
    K best others run on (the cache and the processors' rows reordered to them). Stops as
    transformers: every continuation finished, all K finished with ``early_stopping=True``, or (its
    heuristic, with ``"never"`` judging by the longest length when length_penalty > 0) no running
    beam can beat the worst finished one. With ``do_sample`` (beam sampling) the continuations are
    drawn without replacement from the softmax of those sums (the warpers applied to the
    log-probabilities, keeping 1 + #EOS tokens), in the order drawn, as transformers' multinomial."""
    import paddle

    from .ops import log_softmax

    BK, S = input_ids.shape
    K, n_new, lp, stop = s.num_beams, s.max_new_tokens, s.length_penalty, s.early_stopping
    B, max_len = BK // K, S + n_new
    eos = s.eos_token_id or []
    keep = max(2, 1 + len(eos)) * K
    top_mask = np.arange(keep) < K  # only the first K continuations can finish
    # what fills a sequence that finished early: transformers' `pad or eos[0]` (pad 0 counts as unset)
    fill = (s.pad_token_id or eos[0]) if eos else -1
    run_seq = np.full((B, K, max_len), fill, np.int64)
    run_seq[:, :, :S] = input_ids.numpy().reshape(B, K, S)
    run_scores = np.zeros((B, K), np.float32)
    run_scores[:, 1:] = -1e9  # the copies of the prompt: one beam starts
    run_src = np.full((B, K, n_new), -1, np.int64)  # per new token: the flat row it continued
    fin_seq, fin_src = run_seq.copy(), run_src.copy()
    fin_scores, fin_done = np.full((B, K), -1e9, np.float32), np.zeros((B, K), bool)
    improvable = np.ones((B, 1), bool)  # the heuristic: a running beam may still beat a finished one
    rows = np.arange(B)[:, None]
    scores, raw = [], []
    last = decoder.prefill(n_new)
    for step in range(n_new):
        cur = S + step
        logits = last.astype("float32")
        if s.output_logits:
            raw.append(logits)
        logp = procs(log_softmax(logits, axis=-1), step)
        if s.output_scores:
            scores.append(logp)
        V = logp.shape[-1]
        total = logp.reshape([B, K, V]) + paddle.to_tensor(run_scores).unsqueeze(-1)
        total = total.reshape([B, K * V])
        if s.do_sample:
            idx = _draw_without_replacement(total, keep, rng)
            vals = paddle.take_along_axis(total, paddle.to_tensor(idx), axis=-1).numpy()
            if not np.isfinite(vals).all():  # transformers' multinomial raises here too
                raise ValueError(
                    f"generate: beam sampling draws {keep} continuations per prompt, but fewer have a probability "
                    f"after the warpers (top_k={s.top_k}, top_p={s.top_p} ...); keep more tokens or use fewer beams"
                )
        else:
            vals, idx = (t.numpy() for t in paddle.topk(total, keep, axis=-1))
        beam, tok = idx // V, idx % V
        cand_seq, cand_src = run_seq[rows, beam], run_src[rows, beam]
        cand_seq[:, :, cur] = tok
        cand_src[:, :, step] = beam + rows * K
        hits = np.isin(tok, eos) | (cur + 1 >= max_len)
        if procs.stops:  # the caller's criteria and max_time end continuations too, as in transformers
            cand = (
                paddle.to_tensor(cand_seq[:, :, : cur + 1].reshape(B * keep, cur + 1))
                if procs.ids is not None
                else None
            )
            hit = procs.stopped(
                cand, tuple(scores) if s.return_dict_in_generate and s.output_scores else None, B * keep
            )
            hits = hits if hit is None else hits | hit.numpy().reshape(B, keep)
        # the running beams: the K best continuations that did not finish
        running = vals + hits.astype(np.float32) * np.float32(-1e9)
        pick = _top(running, K)
        run_seq, run_scores, run_src = cand_seq[rows, pick], running[rows, pick], cand_src[rows, pick]
        # the finished: the K best of those kept and those just finished (length-normalised)
        done_now = hits & top_mask
        ended = vals / np.float32((cur + 1 - S) ** lp)
        ended += (fin_done.all(1, keepdims=True) & (stop is True)).astype(np.float32) * np.float32(-1e9)
        ended += (~improvable).astype(np.float32) * np.float32(-1e9)
        ended += (~done_now).astype(np.float32) * np.float32(-1e9)
        merged = np.concatenate([fin_scores, ended], axis=1)
        pick = _top(merged, K)
        fin_seq = np.concatenate([fin_seq, cand_seq], axis=1)[rows, pick]
        fin_src = np.concatenate([fin_src, cand_src], axis=1)[rows, pick]
        fin_done = np.concatenate([fin_done, done_now], axis=1)[rows, pick]
        fin_scores = merged[rows, pick]
        # the rows continue the beams they extend
        src = run_src[:, :, step].reshape(BK)
        procs.reorder(src)
        decoder.reorder(paddle.to_tensor(src))
        nxt_host = run_seq[:, :, cur].reshape(BK)
        nxt = paddle.to_tensor(nxt_host)
        procs.append(nxt, nxt_host)
        best_len = (max_len - S) if stop == "never" and lp > 0.0 else (cur + 1 - S)
        best = run_scores[:, :1] / np.float32(best_len**lp)
        worst = np.where(fin_done, fin_scores.min(1, keepdims=True), np.float32(-1e9))
        improvable = improvable & (best > worst).any(1, keepdims=True)
        if not improvable.any() or (fin_done.all() and stop is True) or hits.all():
            break
        last = decoder.next(nxt)
    nrs = s.num_return_sequences
    seq, src = fin_seq[:, :nrs].reshape(B * nrs, max_len), fin_src[:, :nrs].reshape(B * nrs, n_new)
    made = int((src >= 0).sum(1).max())
    sequences = paddle.to_tensor(seq[:, : S + made])
    if not s.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        sequences_scores=paddle.to_tensor(fin_scores[:, :nrs].reshape(-1)) if s.output_scores else None,
        scores=tuple(scores) if s.output_scores else None,
        logits=tuple(raw) if s.output_logits else None,
        beam_indices=paddle.to_tensor(src[:, :made]),
        hidden_states=None if decoder.hidden is None else tuple(decoder.hidden),
        past_key_values=decoder.cache,
    )


def _draw_without_replacement(scores: paddle.Tensor, k: int, rng: np.random.Generator) -> np.ndarray:
    """k indices per row [B, k] drawn without replacement from softmax(``scores``) [B, N], in the
    order drawn (the Gumbel top-k: the k largest of scores + Gumbel noise, a sequential draw's law);
    the noise from ``rng`` (float64, so no key ties), -inf scores never drawn."""
    import paddle

    noise = -np.log(-np.log(rng.random(scores.shape)))  # Gumbel(0, 1)
    keys = scores.astype("float64") + paddle.to_tensor(noise)
    return paddle.topk(keys, k, axis=-1)[1].numpy()


def _top(x: np.ndarray, k: int) -> np.ndarray:
    """The indices of each row's k largest values, largest first (ties: the earlier first)."""
    return np.argsort(-x, axis=1, kind="stable")[:, :k]


def _sample(
    decoder: _Decoder,
    procs: _Processors,
    s: GenerationConfig,
    input_ids: paddle.Tensor,
    rng: np.random.Generator,
    put: Callable[[np.ndarray], None] | None,
    tokenizer: Any,
    tails: list | None,
) -> paddle.Tensor | GenerateDecoderOnlyOutput:
    """Greedy decoding or sampling, one token per row per step."""
    import paddle

    B = input_ids.shape[0]
    eos_t = paddle.to_tensor(s.eos_token_id, dtype="int64") if s.eos_token_id else None
    scores, raw, new, host_new = [], [], [], []  # per step: processed scores, raw logits, ids (device, host)
    last = decoder.prefill(s.max_new_tokens)
    finished = paddle.zeros([B], dtype="bool")
    for step in range(s.max_new_tokens):
        logits = last.astype("float32")  # [B, V], stays on the device
        if s.output_logits:
            raw.append(logits)
        x = procs(logits, step)
        if s.do_sample:
            nxt = _draw(x, rng.random(B))
        else:
            nxt = paddle.argmax(x, axis=-1).astype("int64")
        if s.output_scores:
            scores.append(x)
        nxt = paddle.where(finished, paddle.full_like(nxt, s.pad_token_id), nxt)
        if eos_t is not None:
            finished = paddle.logical_or(finished, paddle.isin(nxt, eos_t))
        new.append(nxt)
        host = None
        if put is not None or s.stop_strings or procs.host_held:
            host = nxt.numpy()  # the chosen ids only
            host_new.append(host)
            if put is not None:
                put(host)
            if s.stop_strings:  # per row: a stop string in its text that ends after the prompt's
                texts = [
                    (tokenizer.decode(tail + [int(t) for t in row]), n)
                    for row, (tail, n) in zip(np.stack(host_new, axis=1), tails)
                ]
                stopped = [
                    any(text.find(stop, max(n - len(stop) + 1, 0)) >= 0 for stop in s.stop_strings) for text, n in texts
                ]
                finished = paddle.logical_or(finished, paddle.to_tensor(stopped))
        procs.append(nxt, host)
        if procs.stops:  # the caller's criteria and max_time, on the rows with this step's token
            hit = procs.stopped(procs.ids, tuple(scores) if s.return_dict_in_generate and s.output_scores else None, B)
            finished = finished if hit is None else paddle.logical_or(finished, hit)
        if step == s.max_new_tokens - 1 or (
            (eos_t is not None or s.stop_strings or procs.stops) and bool(finished.all())
        ):
            break
        last = decoder.next(nxt)
    sequences = paddle.concat([input_ids, paddle.stack(new, axis=1)], axis=1)
    if not s.return_dict_in_generate:
        return sequences
    return GenerateDecoderOnlyOutput(
        sequences=sequences,
        scores=tuple(scores) if s.output_scores else None,
        logits=tuple(raw) if s.output_logits else None,
        hidden_states=None if decoder.hidden is None else tuple(decoder.hidden),
        past_key_values=decoder.cache,
    )


def _logits_at(model: paddle.nn.Layer, hidden: paddle.Tensor, pos: paddle.Tensor) -> paddle.Tensor:
    """The logits [B, V] of row b's position ``pos[b]`` from the final-normed hidden states [B, S, H]."""
    import paddle

    B, H = hidden.shape[0], hidden.shape[2]
    rows = paddle.take_along_axis(hidden, pos.astype("int64").reshape([B, 1, 1]).expand([B, 1, H]), axis=1)
    return model.logits(rows)[:, 0]


def _full_forward(model: paddle.nn.Layer, seq: paddle.Tensor, mask: paddle.Tensor | None, states: bool = False):
    """``use_cache=False``: the whole sequence again (ids [B, S], or embeddings [B, S, H]), positions
    counting each row's real tokens (as HF's prepare_inputs_for_generation makes them from the mask)."""
    import paddle

    pos = None if mask is None else paddle.clip(paddle.cumsum(mask.astype("int64"), axis=1) - 1, min=0)
    ids, embeds = (seq, None) if seq.ndim == 2 else (None, seq)
    kw = {"position_ids": pos, "logits_to_keep": 1, "use_cache": False, "inputs_embeds": embeds}
    kw["output_hidden_states"] = states
    return model(ids, attention_mask=mask, **kw)  # no cache built


class CudaGraphDecodeStep:
    """`model.decode_step` captured once as a CUDA graph and replayed for every later step:
    ``generate(model, ids, decode_step=CudaGraphDecodeStep(model))`` on a GPU.

    The step's shapes follow the cache's capacity and it reads nothing back to the host (the
    cache writes by device-side index_put, MoE in its static-shape form while capturing), so one
    capture serves the whole generation; each call copies the step's inputs into the captured
    ones. The first call runs eagerly (its logits are returned) and captures; it binds to that
    call's cache. Not exercised without a GPU (the CPU build has no CUDA graphs).
    """

    def __init__(self, model: paddle.nn.Layer) -> None:
        self.model = model
        self.cache: object = None
        self.graph: object = None

    def __call__(self, input_ids: paddle.Tensor, positions: paddle.Tensor, slots: paddle.Tensor, cache: object):
        import paddle
        from paddle.device.cuda.graphs import CUDAGraph

        if self.graph is None:
            self.cache = cache
            self.inputs = [input_ids.clone(), positions.clone(), slots.clone()]
            logits = self.model.decode_step(*self.inputs, cache)
            graph = CUDAGraph()
            graph.capture_begin()
            self.logits = self.model.decode_step(*self.inputs, cache)
            graph.capture_end()
            self.graph = graph
            return logits
        if cache is not self.cache:
            raise ValueError("CudaGraphDecodeStep: captured for another cache; make one per generation")
        for held, new in zip(self.inputs, (input_ids, positions, slots)):
            paddle.assign(new, output=held)
        self.graph.replay()
        return self.logits


# --------------------------------------------------------------------------- speculative decoding
def _mtp_step(
    model: paddle.nn.Layer,
    mtp: paddle.nn.Layer,
    cache: object,
    hidden: paddle.Tensor,
    ids: paddle.Tensor,
    main_topk: paddle.Tensor,
):
    """The MTP layer on n new positions i (main hidden h_i [B, n, H], token i+1 ids [B, n]) through
    its own one-layer cache; -> logits of the last position (the draft for token i+2) [B, V].
    ``main_topk`` [B, n, k]: the main model's last top-k at the same positions (its cache slots are
    the MTP cache's), which the layer attends with under index_share_for_mtp_iteration, as the
    model's forward runs it; otherwise its own indexer selects."""
    n = ids.shape[1]
    prefill = cache.length == 0
    positions, key_valid = cache.begin(None, n)
    cos, sin = model.model.rotary_emb(positions)
    x, _, _ = mtp(
        hidden, model.model.embedding(ids), cos, sin, None if prefill else key_valid, main_topk, cache=cache.layers[0]
    )
    cache.advance(n)
    return model.logits(mtp.norm(x[:, -1:]))[:, -1]


def generate_speculative(
    model: paddle.nn.Layer,
    input_ids: paddle.Tensor,
    max_new_tokens: int = 20,
    eos_token_id: int | Sequence[int] | None = None,
) -> tuple[paddle.Tensor, dict]:
    """Greedy decoding with the first MTP layer drafting (one row, no padding; docs/model.md): the
    loop of ``generate(..., use_mtp=True)`` without the model's generation_config.json, returning
    (prompt + new tokens [1, S + n], {"drafted", "accepted", "acceptance_rate", "main_forwards"});
    the tokens are greedy decoding's."""

    if input_ids.ndim != 2 or input_ids.shape[0] != 1:
        raise ValueError(f"generate_speculative: one row [1, seq] expected, got shape {list(input_ids.shape)}")
    input_ids = input_ids.astype("int64")
    eos = _eos_list(model.config.eos_token_id if eos_token_id is None else eos_token_id)
    options = {"max_new_tokens": max_new_tokens, "eos_token_id": eos, "use_mtp": True}
    s = resolve_settings(model.config, GenerationConfig(), options, input_ids.shape[1])
    procs = _Processors(s, input_ids, None, True, int(model.config.vocab_size), _Hooks([], [], None), time.time())
    decoder = _MtpDecoder(model, input_ids, None)
    with _inference(model):
        out = _sample(decoder, procs, s, input_ids, np.random.default_rng(0), None, None, None)
    return out, _counts(decoder.stats)
