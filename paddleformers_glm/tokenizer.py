"""The checkpoint's tokenizer and chat template, read from the checkpoint folder without network; the
call, ``pad``, ``batch_decode`` and ``apply_chat_template`` follow transformers 5 (docs/model.md,
"Tokenizer and chat").
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import json
import os
import re
import warnings
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

from ._io import read_json, read_text
from .configuration import HF_DOWNLOAD_KWARGS
from .tokenizer_files import (
    CONFIG_FILE,
    SPECIAL_TOKENS_MAP_FILE,
    TEMPLATE_DIR,
    TEMPLATE_FILE,
    TOKENIZER_FILE,
    TokenizerError,
    finish_pending,
    finish_pending_save,
    read_set,
    write_set,
)

_ADDED_TOKEN_FIELDS = ("content", "single_word", "lstrip", "rstrip", "normalized", "special")


def _added_token(value: Any, special: bool | None = None) -> Any:
    """A ``tokenizers.AddedToken`` from a token string or transformers' serialised AddedToken dict
    (a string is special and not normalized, as transformers adds it); None for anything else."""
    from tokenizers import AddedToken

    if isinstance(value, str):
        return AddedToken(value, special=True, normalized=False)
    if isinstance(value, dict) and isinstance(value.get("content"), str):
        fields = {k: value[k] for k in _ADDED_TOKEN_FIELDS if k in value}
        if special is not None and "special" not in fields:
            fields["special"] = special
        return AddedToken(**fields)
    return None


def _merge_special_tokens_map(config: dict, special_map: Any) -> None:
    """special_tokens_map.json over ``config``, in place, as transformers 5 reads it for a config
    without ``added_tokens_decoder`` (``_from_pretrained``): each key's value replaces the config's
    (a token dict becomes special), an ``extra_special_tokens`` list is appended to the config's."""
    if not isinstance(special_map, dict):
        raise TokenizerError(f"{SPECIAL_TOKENS_MAP_FILE}: expected a JSON object")
    # transformers 5 first reads the config's additional_special_tokens as extra_special_tokens
    if "additional_special_tokens" in config and not config.get("extra_special_tokens"):
        config["extra_special_tokens"] = config.pop("additional_special_tokens")
    for key, value in special_map.items():
        if isinstance(value, dict) and key != "extra_special_tokens":
            value = {**value, "special": True}
        elif key == "extra_special_tokens" and isinstance(value, list):
            existing = list(config.get("extra_special_tokens") or [])
            value = existing + [t for t in value if t not in existing]
        config[key] = value


def _template_text(value: Any, where: str) -> str | None:
    """The chat template: a string, or HF's list of ``{"name", "template"}`` (the "default" one, None
    without one: transformers then wants a name); anything else is an error naming where it came from."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
            raise TokenizerError(f'{where}: a list of chat templates must hold {{"name", "template": string}} objects')
        return {t.get("name"): t["template"] for t in value}.get("default")
    raise TokenizerError(f"{where}: the chat template must be a string, got a {type(value).__name__}")


# AutoTokenizer.from_pretrained's arguments that say where to download from or which class to build:
# nothing for a local tokenizer.json (transformers ignores them for a local folder too)
_HUB_LOAD_OPTIONS = frozenset(HF_DOWNLOAD_KWARGS) | frozenset(
    "use_auth_token use_fast tokenizer_type config resume_download user_agent _is_local".split()
)
# ones that would read another file than tokenizer.json
_UNSUPPORTED_LOAD_OPTIONS = frozenset({"gguf_file", "tokenizer_file", "tokenizer_object", "vocab_file"})


def _plain_token(value: Any) -> Any:
    """A keyword's ``tokenizers.AddedToken`` (or a list of them) as transformers serialises it in
    tokenizer_config.json, so the config stays JSON; anything else unchanged."""
    if type(value).__name__ == "AddedToken" and hasattr(value, "content"):
        return {"__type": "AddedToken", **{k: getattr(value, k) for k in _ADDED_TOKEN_FIELDS}}
    if isinstance(value, (list, tuple)):
        return [_plain_token(v) for v in value]
    return value


TENSOR_TYPES = ("pd", "paddle", "np")
# transformers' "no limit" value of model_max_length (int(1e30))
_VERY_LARGE = int(1e30)


# __call__'s arguments that are not _encode_call's options
_TARGET_ARGS = frozenset(("self", "text", "text_pair", "text_target", "text_pair_target", "max_target_length"))


class BatchEncoding(dict):
    """What the tokenizer call returns: a dict (``input_ids``, ``attention_mask``) whose keys are
    also attributes, so ``model.generate(**enc)`` and ``enc.input_ids`` both work."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(
                f"'BatchEncoding' object has no attribute {name!r} (its keys, also readable as attributes: "
                f"{sorted(self)})"
            ) from None

    def to(self, device: Any, *, non_blocking: bool = False) -> BatchEncoding:
        """transformers' ``BatchEncoding.to(device)``, the idiom ``tok(text, return_tensors="pd").to(model.device)``:
        every Paddle tensor value moves to ``device`` (a place such as ``model.device``, a name such as
        ``"gpu:0"``, or a GPU number), the other values (lists, NumPy arrays) stay as they are; -> this
        encoding, changed in place, as there. Anything else (a dtype: casting the ids would break them) is
        not a device: a warning, nothing moved, as transformers does."""
        import paddle

        place = any(c.__name__.endswith("Place") for c in type(device).__mro__)  # paddle's places (CPUPlace ...)
        if isinstance(device, bool) or not (place or isinstance(device, (str, int))):
            warnings.warn(f"Attempting to cast a BatchEncoding to type {device}. This is not supported.", stacklevel=2)
            return self
        if isinstance(device, int):
            device = f"gpu:{device}"
        for key, value in self.items():
            if isinstance(value, paddle.Tensor):
                self[key] = value.to(device, blocking=not non_blocking)
        return self


# the keys tokenizer.pad pads (transformers' _pad); the others pass through as given
_PADDED_KEYS = ("input_ids", "attention_mask", "token_type_ids", "special_tokens_mask")


def _passed_tensor(key: str, values: Any, return_tensors: str) -> Any:
    """A key ``pad`` does not pad, as one tensor (transformers converts it as given: a label per row
    [B], float weights stay float); rows of different lengths are named."""
    import numpy as np

    rows = values.tolist() if hasattr(values, "tolist") else list(values)
    lengths = {len(r) for r in rows if hasattr(r, "__len__") and not isinstance(r, str)}
    if len(lengths) > 1:
        raise ValueError(
            f"pad: {key!r} rows have different lengths ({sorted(lengths)}) and cannot form one tensor: pad pads "
            "input_ids and attention_mask only, as in transformers (a collator pads labels, with -100: "
            "DataCollatorForSeq2Seq)"
        )
    arr = np.asarray(rows)
    if return_tensors == "np":
        return arr
    if arr.dtype.kind not in "biuf":
        raise ValueError(f"pad: {key!r} holds {arr.dtype} values, which make no Paddle tensor")
    import paddle

    return paddle.to_tensor(arr)


def _as_tensor(rows: list[list[int]], return_tensors: str, what: str) -> Any:
    if return_tensors not in TENSOR_TYPES:
        raise ValueError(f"return_tensors must be one of {TENSOR_TYPES} or None, got {return_tensors!r}")
    import numpy as np

    if len({len(r) for r in rows if not isinstance(r, int)}) > 1:
        raise ValueError(
            f"{what}: rows of different lengths ({sorted({len(r) for r in rows})}) cannot form one tensor; "
            "pass padding=True (or truncation with max_length)"
        )
    arr = np.asarray(rows, dtype=np.int64)  # [B, S], or [B, S, 2] for offset_mapping; [B] for a number per row
    if arr.ndim < 2 and not all(isinstance(r, int) for r in rows):
        arr = arr.reshape(len(rows), -1)
    if return_tensors == "np":
        return arr
    import paddle

    return paddle.to_tensor(arr)


# transformers' clean_up_tokenization, in its order: the space before punctuation and contractions goes
_CLEANUP = tuple((" " + t, t) for t in (".", "?", "!", ",")) + ((" ' ", "'"),)
_CLEANUP += tuple((" " + t, t) for t in ("n't", "'m", "'s", "'ve", "'re"))


def _pair_batch(text: Any) -> bool:
    """Whether ``text`` is a batch of (text, pair) couples, which transformers' call encodes as pairs."""
    return (
        isinstance(text, (list, tuple))
        and bool(text)
        and all(isinstance(t, (list, tuple)) and len(t) == 2 and all(isinstance(x, str) for x in t) for t in text)
    )


def _plain(value: Any) -> Any:
    """``value`` rebuilt from JSON's types for a chat template: a subclass of str / int / float (an enum,
    a numpy number) as its plain value, mappings, lists, tuples, dataclasses and pydantic models
    member by member, anything else as an inert placeholder naming its type ("<ndarray>"), as
    transformers 5.23 hands its templates their data (they never read media values, only keys)."""
    import numpy as np

    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):  # the str's own text: a str enum's value, not "Role.USER"
        return str.__str__(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, np.generic):
        return _plain(value.item())
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, tuple):
        return tuple(_plain(v) for v in value)
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if callable(getattr(value, "model_dump", None)):
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _id_list(ids: Any) -> list[int]:
    """Token ids of one sequence from a list, a NumPy array or a Paddle tensor (a floating-point one
    by its values, as transformers takes a float tensor here: ``numpy()`` of bfloat16 gives bit patterns)."""
    if hasattr(ids, "numpy") and not isinstance(ids, (list, tuple)):
        ids = (ids.astype("float32") if "bfloat16" in str(getattr(ids, "dtype", "")) else ids).numpy()
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


def _py_ids(ids: Any) -> Any:
    """``ids`` as plain Python values, element by element, as transformers' ``to_py_obj`` converts them:
    a Paddle tensor or NumPy array (of any rank, inside a list too: a sampling loop appends 0-d
    tensors) to its list or number. A floating-point tensor is refused here: ``numpy()`` of a
    bfloat16 tensor gives its raw 16-bit patterns, integers that would decode to plausible text."""
    import numpy as np

    if isinstance(ids, (list, tuple)):
        return list(ids) if all(type(i) is int for i in ids) else [_py_ids(i) for i in ids]
    if hasattr(ids, "numpy") and hasattr(ids, "dtype") and not isinstance(ids, np.ndarray):  # a Paddle tensor
        if "float" in str(ids.dtype):
            raise TypeError(f"GlmTokenizer.decode: expected integer token ids, got a tensor of {ids.dtype}")
        ids = ids.numpy()
    return ids.tolist() if isinstance(ids, (np.ndarray, np.generic)) else ids


def _decode_ids(ids: Any) -> list[int]:
    """The ids of one sequence to decode (plain values, after :func:`_py_ids`): integers only (a bool
    is an int, as transformers takes it), else TypeError, as transformers 5.23's decode, whose
    ``tokenizers`` backend refuses a float or a string id: cut to integers, a float tensor (sampled
    ids cast to float, or logits passed by mistake) would decode to plausible text (1.7 as id 1)."""
    seq = [ids] if isinstance(ids, int) else ids
    if isinstance(seq, str) or not hasattr(seq, "__iter__"):
        raise TypeError(f"GlmTokenizer.decode: expected integer token ids, got {type(ids).__name__} {ids!r}")
    seq = list(seq)
    for i in seq:
        if not isinstance(i, int):
            raise TypeError(f"GlmTokenizer.decode: expected integer token ids, got {type(i).__name__} {i!r}")
    return seq


def _no_empty_pair(text_pair: Any) -> Any:
    """``text_pair`` of one text, None where it is empty ("" or no words), as transformers 5.23's call
    (``[(text, text_pair)] if text_pair else [text]``): an empty second text is no pair, so the
    post-processor's pair template (a [SEP], type ids 1) is not applied to it."""
    return None if isinstance(text_pair, (str, list, tuple)) and not text_pair else text_pair


# a `{% generation %}` block: what HF's return_assistant_tokens_mask marks (utils/chat_template_utils.py)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


@functools.lru_cache(maxsize=1)
def _generation_extension() -> Any:
    """transformers' ``AssistantTracker``: ``{% generation %}...{% endgeneration %}`` renders its body
    unchanged and, while ``tracking`` holds (rendered blocks, spans), records the body's character span."""
    import jinja2
    from jinja2.ext import Extension

    class GenerationBlocks(Extension):
        tags = {"generation"}

        def __init__(self, environment: Any) -> None:
            super().__init__(environment)
            environment.extend(generation_blocks=self)
            self.tracking: tuple[list[str], list[tuple[int, int]]] | None = None

        def parse(self, parser: Any) -> Any:
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
            return jinja2.nodes.CallBlock(self.call_method("_block"), [], [], body).set_lineno(lineno)

        def _block(self, caller: Any) -> str:
            text = caller()
            if self.tracking is not None:
                blocks, spans = self.tracking
                start = sum(len(b) for b in blocks)
                spans.append((start, start + len(text)))
            return text

    return GenerationBlocks


@functools.lru_cache(maxsize=8)
def _compile_template(text: str, source: str) -> Any:
    """``text`` compiled once in jinja2's sandbox with HF's environment (its options, extensions and
    globals: transformers' ``_cached_compile_jinja_template``; a conversation renders it many times);
    a syntax error names ``source``."""
    from datetime import datetime

    from jinja2.exceptions import TemplateError, TemplateSyntaxError
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message: str) -> None:
        raise TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: Any = None, separators: Any = None, sort_keys: bool = False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    # keep_trailing_newline stays jinja's False, as in HF: a template's final newline is not rendered
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[_generation_extension(), loopcontrols]
    )
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(text)
    except TemplateSyntaxError as err:
        raise TokenizerError(f"{source}: chat template syntax error at line {err.lineno}: {err.message}") from err


# transformers' named special tokens (SPECIAL_TOKENS_ATTRIBUTES); a chat template sees those set, and the
# model-specific ``*_token`` ones (its special_tokens_map)
_SPECIAL_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# a message's reasoning, under each name transformers gives it (chat_template_utils._alias_reasoning_fields)
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def _alias_reasoning(message: dict) -> dict:
    """The message with its reasoning (the first of ``_REASONING_FIELDS`` set) also under
    ``thinking`` and ``reasoning_content``, as transformers renders it."""
    reasoning = next((message[k] for k in _REASONING_FIELDS if message.get(k) is not None), None)
    return message if reasoning is None else {"thinking": reasoning, **message, "reasoning_content": reasoning}


def _tag_final_message(chat: list[dict], template: str, field: bool | str) -> str:
    """Mark the end of the final message's ``field`` (``content`` for True) with transformers' tag, in
    place; returns the text before the tag."""
    field = field if isinstance(field, str) else "content"
    final = chat[-1].get(field) if chat else None
    if final is None:
        raise TokenizerError(f'continue_final_message: the final message has no "{field}" to continue')
    fields = [field]
    if field in _REASONING_FIELDS:
        fields = [f for f in _REASONING_FIELDS if chat[-1].get(f) == final]
    if not any(f in template for f in fields):
        raise TokenizerError(f'continue_final_message: the chat template does not read "{field}"')
    if isinstance(final, (list, tuple)):
        for block in reversed(final):
            if "text" in block:
                final, block["text"] = block["text"], block["text"] + _CONTINUE_TAG
                return final
        raise TokenizerError("continue_final_message: the final message has no text to continue")
    for f in fields:
        chat[-1][f] = chat[-1][f] + _CONTINUE_TAG
    return final


def _block_mask(enc: Any, blocks: list[tuple[int, int]]) -> list[int]:
    """1 on the tokens of ``enc`` (a ``tokenizers`` encoding) that transformers'
    ``return_assistant_tokens_mask`` marks for the ``{% generation %}`` character spans ``blocks``:
    from the token holding a block's first character to the one holding its last
    (tokenization_utils_base.apply_chat_template's loop)."""
    mask = [0] * len(enc.ids)
    for start, end in blocks:
        first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
        if first is None:
            break
        for t in range(first, last + 1 if last else len(mask)):
            mask[t] = 1
    return mask


def train_turn_ends(
    ids: list[int],
    mine: list[bool],
    offsets: Sequence[tuple[int, int]],
    turns: Sequence[tuple[int, int]],
    stop_ids: Iterable[int],
    eos_id: int | None,
) -> tuple[list[int], list[bool]]:
    """The end of each assistant turn trained, so a fine-tuned model learns to stop: GLM's templates
    close no turn themselves (the next message's role token follows it, or nothing) and its generation
    stops on ``<|endoftext|>``, ``<|user|>``, ``<|observation|>`` (generation_config.json). As GLM's
    fine-tuning script does (THUDM/GLM-4 finetune_demo/finetune.py, ``process_batch``: each assistant
    message's loss mask shifted one token right, an EOS appended to the conversation), for each turn
    (``turns``: character spans of the rendered text; ``offsets``: each token's) whose trained tokens
    hold no stop token (``stop_ids``; ChatML's ``<|im_end|>`` inside the turn already ends it): the
    token that follows the turn is trained when it is a stop token, and a turn that ends the text gets
    ``eos_id`` appended, trained. Returns (ids, mine), new lists."""
    ids, mine, stop = list(ids), list(mine), set(stop_ids)
    starts = [a for a, _ in offsets]
    ends = [b for _, b in offsets]
    for a, b in turns:
        lo, nxt = bisect_left(ends, a + 1), bisect_left(starts, b)  # the turn's tokens [lo, nxt), the next one
        if any(mine[t] and ids[t] in stop for t in range(lo, nxt)):
            continue
        if nxt < len(offsets):
            mine[nxt] = mine[nxt] or ids[nxt] in stop
        elif eos_id is not None and len(ids) == len(offsets):  # the conversation ends with this turn
            ids.append(eos_id)
            mine.append(True)
    return ids, mine


def _token_property(key: str) -> property:
    """A named special token (``key``) as transformers reads and sets it: its string, None when unset."""

    def get(self: GlmTokenizer) -> str | None:
        return self._special(key)

    def set(self: GlmTokenizer, value: Any) -> None:
        if value is not None and not isinstance(value, str) and type(value).__name__ != "AddedToken":
            raise ValueError(f"Cannot set a non-string value as the {key}")
        self.config[key] = _plain_token(value)

    return property(get, set, doc=f"The {key} (transformers'), None when unset.")


def _id_property(key: str) -> property:
    """The id of a named special token: ``unk_token_id`` for one outside the vocabulary, as transformers;
    setting an id sets the token of that id."""

    def get(self: GlmTokenizer) -> int | None:
        token = self._special(key)
        return None if token is None else self.convert_tokens_to_ids(token)

    def set(self: GlmTokenizer, value: int | None) -> None:
        setattr(self, key, None if value is None else self.convert_ids_to_tokens(value))

    return property(get, set, doc=f"The id of the {key} (transformers'), None when unset.")


class GlmTokenizer:
    """`tokenizers.Tokenizer` plus the special tokens and chat template of tokenizer_config.json."""

    def __init__(
        self,
        tokenizer: Any,
        config: dict | None = None,
        chat_template: str | None = None,
        *,
        template_source: str = "tokenizer_config.json 'chat_template'",
        padding_side: str | None = None,
        truncation_side: str | None = None,
        model_max_length: int | None = None,
    ) -> None:
        self.tokenizer = tokenizer
        self.config = dict(config or {})
        self.model_input_names = ["input_ids", "attention_mask"]  # transformers' (the call's keys)
        # truncation / padding saved in tokenizer.json: transformers turns them off for every call that
        # does not ask for them (TokenizersBackend.set_truncation_and_padding), so they are never applied;
        # their direction and pad token are defaults under the config's (TokenizersBackend.__init__'s setdefault)
        saved_sides = {}
        if tokenizer.truncation is not None:
            saved_sides["truncation_side"] = tokenizer.truncation.get("direction")
            tokenizer.no_truncation()
        if tokenizer.padding is not None:
            saved_sides["padding_side"] = tokenizer.padding.get("direction")
            if self.config.get("pad_token") is None and tokenizer.padding.get("pad_token"):
                self.config["pad_token"] = tokenizer.padding["pad_token"]
            tokenizer.no_padding()
        self._register_special_tokens()
        # split_special_tokens: special tokens in a text are split as plain text (transformers sets
        # the backend's encode_special_tokens from it, chat templates' output included)
        tokenizer.encode_special_tokens = bool(self.config.get("split_special_tokens", False))
        self.template_source = template_source  # where the template came from, named by its errors
        raw = chat_template if chat_template is not None else self.config.get("chat_template")
        self.chat_template = _template_text(raw, self.template_source)
        # HF's named templates (a list in the config): apply_chat_template(chat_template=NAME) picks one,
        # and tools pick "tool_use" (transformers' get_chat_template)
        self.chat_templates = {t.get("name"): t["template"] for t in raw} if isinstance(raw, list) else {}
        self.padding_side = (
            padding_side or self.config.get("padding_side") or saved_sides.get("padding_side") or "right"
        )
        self.truncation_side = (
            truncation_side or self.config.get("truncation_side") or saved_sides.get("truncation_side") or "right"
        )
        for name, side in (("padding_side", self.padding_side), ("truncation_side", self.truncation_side)):
            if side not in ("left", "right"):
                raise TokenizerError(f"{name} must be 'left' or 'right', got {side!r}")
        mml = model_max_length if model_max_length is not None else self.config.get("model_max_length")
        self.model_max_length = int(mml) if isinstance(mml, (int, float)) and not isinstance(mml, bool) else _VERY_LARGE

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **options: Any) -> GlmTokenizer:
        """Load from a checkpoint folder (or a tokenizer.json path); never touches the network.
        ``options``, as transformers' ``AutoTokenizer.from_pretrained`` takes them: its download and
        class-choice arguments (``use_fast``, ``trust_remote_code``, ``revision``, ...) mean nothing
        for a local folder and are ignored, ``subfolder`` names the folder inside ``path``; every other
        keyword is a tokenizer_config.json key over the file's (``padding_side``, ``truncation_side``,
        ``model_max_length``, special tokens such as ``pad_token`` or ``extra_special_tokens``,
        ``chat_template``, ``split_special_tokens``, ...), and ``add_bos_token`` / ``add_eos_token``
        replace tokenizer.json's post-processor with transformers' (the bos / eos token around
        each text, where set)."""
        refused = sorted(set(options) & _UNSUPPORTED_LOAD_OPTIONS)
        if refused:
            raise TypeError(f"GlmTokenizer.from_pretrained: {refused} not supported (a local tokenizer.json is read)")
        options = {k: _plain_token(v) for k, v in options.items() if k not in _HUB_LOAD_OPTIONS}
        sides = {k: options.pop(k) for k in ("padding_side", "truncation_side", "model_max_length") if k in options}
        if "model_max_length" in sides and sides["model_max_length"] is None:
            sides["model_max_length"] = _VERY_LARGE  # transformers: model_max_length=None is no limit
        bos_eos = {k: bool(options.pop(k)) for k in ("add_bos_token", "add_eos_token") if k in options}
        from tokenizers import Tokenizer

        p = Path(path)
        subfolder = options.pop("subfolder", None)
        if subfolder:
            p = p / subfolder
        folder, tok_file = (p.parent, p) if p.is_file() else (p, p / TOKENIZER_FILE)
        files: dict[str, bytes] = {}
        if folder.is_dir():
            finish_pending_save(folder)  # a killed save's set put in place, where this process may
            files = read_set(folder)  # the files of one save (a pending one's read through)
        if tok_file != folder / TOKENIZER_FILE:  # a tokenizer file named otherwise
            files.pop(TOKENIZER_FILE, None)
            with contextlib.suppress(OSError):
                files[TOKENIZER_FILE] = tok_file.read_bytes()
        if TOKENIZER_FILE not in files:
            raise TokenizerError(f"{tok_file}: no tokenizer.json in {folder} (the checkpoint has no tokenizer)")
        try:
            tok = Tokenizer.from_str(files[TOKENIZER_FILE].decode("utf-8"))
        except Exception as err:  # the library's own message says what is wrong
            raise TokenizerError(f"{tok_file}: not a tokenizers file: {err}") from err
        cfg_file = folder / CONFIG_FILE
        config = {}
        if CONFIG_FILE in files:
            config = read_json(cfg_file, "the tokenizer config", error=TokenizerError, data=files[CONFIG_FILE])
        if not isinstance(config, dict):
            raise TokenizerError(f"{cfg_file}: expected a JSON object, got a {type(config).__name__}")
        # with a tokenizer.json, transformers ignores the file's add_bos_token / add_eos_token (only
        # the caller's rebuild the post-processor); the caller's keywords go over the file's keys
        config.pop("add_bos_token", None)
        config.pop("add_eos_token", None)
        config.update(options)
        map_file = folder / SPECIAL_TOKENS_MAP_FILE
        if "added_tokens_decoder" not in config and SPECIAL_TOKENS_MAP_FILE in files:
            special_map = read_json(
                map_file, "the special tokens map", error=TokenizerError, data=files[SPECIAL_TOKENS_MAP_FILE]
            )
            if isinstance(special_map, dict):  # the caller's keywords win over the map, as in transformers
                special_map = {k: v for k, v in special_map.items() if not options.get(k)}
            _merge_special_tokens_map(config, special_map)
        template, source = None, f"{cfg_file} 'chat_template'"
        # chat_template.jinja ("default") and additional_chat_templates/NAME.jinja (transformers' named
        # templates, as its save_pretrained writes them) win over the config's template(s)
        names = {"default": TEMPLATE_FILE} if TEMPLATE_FILE in files else {}
        names.update(
            {n.split("/", 1)[1].removesuffix(".jinja"): n for n in sorted(files) if n.startswith(TEMPLATE_DIR + "/")}
        )
        if "chat_template" in options:
            template, source = config.pop("chat_template"), "from_pretrained(chat_template=...)"
        elif list(names) == ["default"]:
            source = str(folder / TEMPLATE_FILE)
            template = read_text(source, "the chat template", TokenizerError, data=files[TEMPLATE_FILE])
        elif names:
            source = str(folder / TEMPLATE_DIR)
            template = [
                {
                    "name": name,
                    "template": read_text(str(folder / f), "the chat template", TokenizerError, data=files[f]),
                }
                for name, f in names.items()
            ]
        out = cls(tok, config, template, template_source=source, **sides)
        out.name_or_path = str(path)
        if bos_eos:
            out._add_bos_eos = (bos_eos.get("add_bos_token", False), bos_eos.get("add_eos_token", False))
            out._update_post_processor()
        return out

    # transformers' add_bos_token / add_eos_token: setting either rebuilds the post-processor
    _add_bos_eos: tuple[bool, bool] = (False, False)

    @property
    def add_bos_token(self) -> bool:
        return self._add_bos_eos[0]

    @add_bos_token.setter
    def add_bos_token(self, value: bool) -> None:
        self._add_bos_eos = (bool(value), self._add_bos_eos[1])
        self._update_post_processor()

    @property
    def add_eos_token(self) -> bool:
        return self._add_bos_eos[1]

    @add_eos_token.setter
    def add_eos_token(self, value: bool) -> None:
        self._add_bos_eos = (self._add_bos_eos[0], bool(value))
        self._update_post_processor()

    def _update_post_processor(self) -> None:
        """transformers' ``TokenizersBackend.update_post_processor``: the post-processor becomes
        ``[bos] $A [eos]`` (pairs ``[bos] $A [eos] [bos] $B [eos]``), each where its flag is on and the
        token is set (a flag without its token turns off)."""
        from tokenizers import processors

        bos, eos = self.bos_token, self.eos_token
        self._add_bos_eos = (self._add_bos_eos[0] and bos is not None, self._add_bos_eos[1] and eos is not None)
        add_bos, add_eos = self._add_bos_eos
        single = f"{f'{bos}:0 ' if add_bos else ''}$A:0{f' {eos}:0' if add_eos else ''}"
        pair = f"{single}{f' {bos}:1' if add_bos else ''} $B:1{f' {eos}:1' if add_eos else ''}"
        specials = ([(bos, self.bos_token_id)] if add_bos else []) + ([(eos, self.eos_token_id)] if add_eos else [])
        self.tokenizer.post_processor = processors.TemplateProcessing(single=single, pair=pair, special_tokens=specials)

    def save_pretrained(
        self,
        folder: str | os.PathLike,
        legacy_format: bool | None = None,
        filename_prefix: str | None = None,
        push_to_hub: bool = False,
        save_format: str | None = None,
        **hub_options: Any,
    ) -> list[str]:
        """Write tokenizer.json and tokenizer_config.json (with the chat template and the padding /
        truncation side and model_max_length in use), all the files as one unit (a failure or a kill
        leaves the folder's old tokenizer whole or the new one, never a mix; its other files are not
        touched: docs/checkpoints.md, "Saving a tokenizer"); a chat_template.jinja already in
        ``folder`` is rewritten with the template too (it wins over the config's on loading, in
        transformers as here, so a stale one would shadow the template saved), and removed, as the old
        tokenizer's other files are (special_tokens_map.json, named templates), where this one has none. transformers' arguments:
        ``filename_prefix`` names the files ``PREFIX-tokenizer.json`` ..., ``legacy_format`` (a
        tokenizer.json is always written) and the hub's options are ignored, ``push_to_hub=True`` and a
        ``save_format`` but "hf" are refused."""
        if push_to_hub:
            raise TokenizerError("save_pretrained: push_to_hub is not supported (this package never uses the network)")
        if save_format not in (None, "hf"):
            raise ValueError(f"save_pretrained: save_format {save_format!r} is not supported (None or 'hf')")
        prefix = f"{filename_prefix}-" if filename_prefix else ""  # transformers' file names: PREFIX-tokenizer.json
        config = dict(self.config)
        if self.chat_templates:  # the named templates, the default one as in use
            named = {**self.chat_templates, **({"default": self.chat_template} if self.chat_template else {})}
            config["chat_template"] = [{"name": k, "template": v} for k, v in named.items()]
        elif self.chat_template is not None:
            config["chat_template"] = self.chat_template
        # the settings in use, where they differ from what the file says (transformers writes them too)
        for key in ("padding_side", "truncation_side"):
            if getattr(self, key) != (config.get(key) or "right"):
                config[key] = getattr(self, key)
        mml = config.get("model_max_length")
        if self.model_max_length != (
            mml if isinstance(mml, (int, float)) and not isinstance(mml, bool) else _VERY_LARGE
        ):
            config["model_max_length"] = self.model_max_length
        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        finish_pending(folder, saving=True)  # the folder's tokenizer as its last save left it
        texts = {
            prefix + TOKENIZER_FILE: self.tokenizer.to_str(pretty=True),
            prefix + CONFIG_FILE: json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n",
        }
        if self.chat_template is not None and (folder / (prefix + TEMPLATE_FILE)).is_file():
            texts[prefix + TEMPLATE_FILE] = self.chat_template
        if (folder / (prefix + TEMPLATE_DIR)).is_dir():  # transformers' named template files win on loading
            texts.update(
                {f"{prefix}{TEMPLATE_DIR}/{n}.jinja": t for n, t in self.chat_templates.items() if n != "default"}
            )
        # one unit: the old set's other files (a chat_template.jinja or named templates this tokenizer
        # lacks, a special_tokens_map.json) go with it, and a failure leaves the old set or the new one
        write_set(folder, texts, prefix)
        written = [str(folder / name) for name in texts]
        return written

    # ------------------------------------------------------------------ special tokens
    def _register_special_tokens(self) -> None:
        """Make the backend's added tokens what transformers' ``TokenizersBackend`` makes them: the
        config's ``added_tokens_decoder`` entries that differ from tokenizer.json's (their ``special``
        flag included) are added over them, then every named, model-specific (``*_token``) and extra
        special token of the config that is not yet an added token is added as a special one (a new id
        where the vocabulary lacks it), as its ``__init__`` does; an added token keeps its flag."""

        tok = self.tokenizer
        atd = self.config.get("added_tokens_decoder")
        given = (
            [_added_token(v) for _, v in sorted(atd.items(), key=lambda kv: int(kv[0]))]
            if isinstance(atd, dict)
            else []
        )
        present = {repr(t) for t in tok.get_added_tokens_decoder().values()}
        to_add = [t for t in given if repr(t) not in present]
        encoder = {t.content for t in tok.get_added_tokens_decoder().values()} | {t.content for t in to_add}
        named = [t for t in self._named_special_tokens().values() if t is not None]
        extras = self._extra_special_tokens()
        named_contents = {t.content for t in named}
        for t in named + extras:
            if t.content not in encoder and t.content:
                if t.content in named_contents and not t.special:
                    t = _added_token({**t.__getstate__(), "special": True})
                to_add.append(t)
                encoder.add(t.content)
        if to_add:
            tok.add_tokens(to_add)

    def _named_special_tokens(self) -> dict[str, Any]:
        """The named special tokens (transformers' SPECIAL_TOKENS_ATTRIBUTES, then the model-specific
        ``*_token`` keys and a dict of ``extra_special_tokens``) as ``AddedToken``s, None where unset."""
        out = {k: _added_token(self.config.get(k), special=True) for k in _SPECIAL_NAMES}
        for k, v in self.config.items():
            if k.endswith("_token") and k not in out and isinstance(v, (str, dict)):
                out[k] = _added_token(v, special=True)
        extra = self.config.get("extra_special_tokens")
        if isinstance(extra, dict):
            out.update({k: _added_token(v, special=True) for k, v in extra.items()})
        return out

    def _extra_special_tokens(self) -> list[Any]:
        """The config's list of extra special tokens (``extra_special_tokens``, else
        ``additional_special_tokens`` as transformers 5 reads it: also where ``extra_special_tokens`` is
        a dict of model-specific tokens, such as GLM's ``{}``) as ``AddedToken``s."""
        extra = self.config.get("extra_special_tokens")
        if not (isinstance(extra, (list, tuple)) and extra):
            extra = self.config.get("additional_special_tokens")
        if not isinstance(extra, (list, tuple)):
            return []
        return [t for t in (_added_token(v, special=True) for v in extra) if t is not None]

    def __getattr__(self, name: str) -> Any:
        """A model-specific special token (a ``*_token`` key of the config or of its
        ``extra_special_tokens`` dict, e.g. ``image_token``) and its ``*_token_id``, as transformers."""
        config = self.__dict__.get("config")
        key = name.removesuffix("_id")
        if config is None or name.startswith("__") or not key.endswith("_token"):
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        token = self._named_special_tokens().get(key)
        if token is None:
            raise AttributeError(f"{type(self).__name__!r} object has no attribute {name!r}")
        return self.convert_tokens_to_ids(token.content) if name != key else token.content

    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):  # AddedToken serialised by transformers
            return v.get("content")
        return v if isinstance(v, str) else None

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    # the named special tokens and their ids, read and set as transformers' (``tok.pad_token = tok.eos_token``,
    # ``tok.pad_token_id = 1``): setting one changes what the tokenizer names, adding nothing to the vocabulary;
    # the id of a token outside the vocabulary is ``unk_token_id``, as there
    bos_token = _token_property("bos_token")
    eos_token = _token_property("eos_token")
    unk_token = _token_property("unk_token")
    sep_token = _token_property("sep_token")
    pad_token = _token_property("pad_token")
    cls_token = _token_property("cls_token")
    mask_token = _token_property("mask_token")
    bos_token_id = _id_property("bos_token")
    eos_token_id = _id_property("eos_token")
    sep_token_id = _id_property("sep_token")
    pad_token_id = _id_property("pad_token")
    cls_token_id = _id_property("cls_token")
    mask_token_id = _id_property("mask_token")

    @property
    def unk_token_id(self) -> int | None:
        return self.token_to_id(self.unk_token)

    @unk_token_id.setter
    def unk_token_id(self, value: int | None) -> None:
        self.unk_token = None if value is None else self.convert_ids_to_tokens(value)

    @property
    def extra_special_tokens(self) -> list[str]:
        """The extra special tokens (``extra_special_tokens``, else ``additional_special_tokens``)."""
        return [t.content for t in self._extra_special_tokens()]

    @extra_special_tokens.setter
    def extra_special_tokens(self, value: Sequence[Any] | None) -> None:
        if value is not None and not isinstance(value, (list, tuple)):
            raise ValueError(f"extra_special_tokens must be a list or tuple, got {type(value)}")
        self.config.pop("additional_special_tokens", None)
        self.config["extra_special_tokens"] = _plain_token(list(value or []))

    @property
    def extra_special_tokens_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.extra_special_tokens)

    # as transformers: ``vocab_size`` is the model's vocabulary without the added tokens, ``len`` counts them
    vocab_size = property(lambda self: self.tokenizer.get_vocab_size(with_added_tokens=False))

    def __len__(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    def get_vocab(self) -> dict[str, int]:
        """Token -> id, the added tokens included (transformers' ``get_vocab``)."""
        return self.tokenizer.get_vocab(with_added_tokens=True)

    vocab = property(get_vocab, doc="transformers' ``vocab``: ``get_vocab()``.")

    @property
    def backend_tokenizer(self) -> Any:
        """The ``tokenizers.Tokenizer`` underneath (transformers' fast tokenizers' name for it)."""
        return self.tokenizer

    def get_added_vocab(self) -> dict[str, int]:
        """The added tokens' content -> id, by id (transformers' ``get_added_vocab``)."""
        return {t.content: i for i, t in self.added_tokens_decoder.items()}

    @property
    def max_len_single_sentence(self) -> int:
        """``model_max_length`` less the tokens the post-processor adds to one text (transformers')."""
        return self.model_max_length - self.num_special_tokens_to_add(pair=False)

    @property
    def max_len_sentences_pair(self) -> int:
        """``model_max_length`` less the tokens the post-processor adds to a pair (transformers')."""
        return self.model_max_length - self.num_special_tokens_to_add(pair=True)

    def add_tokens(self, new_tokens: Any, special_tokens: bool = False) -> int:
        """Add tokens (strings or ``tokenizers.AddedToken``s) to the vocabulary, as transformers'
        ``add_tokens``: the number of new ones; ``save_pretrained`` writes them (in tokenizer.json)."""
        if not new_tokens:
            return 0
        new_tokens = list(new_tokens) if isinstance(new_tokens, (list, tuple)) else [new_tokens]
        if special_tokens:
            return self.tokenizer.add_special_tokens(new_tokens)
        return self.tokenizer.add_tokens(new_tokens)

    def add_special_tokens(self, special_tokens_dict: dict, replace_extra_special_tokens: bool = True) -> int:
        """transformers' ``add_special_tokens``: each named special token (``pad_token``, ...) set, the
        ``extra_special_tokens`` list replaced (``replace_extra_special_tokens=False``: extended), all
        added as special tokens; the number of new ones."""
        from tokenizers import AddedToken

        tokens = dict(special_tokens_dict or {})
        if "additional_special_tokens" in tokens and not tokens.get("extra_special_tokens"):
            tokens["extra_special_tokens"] = tokens.pop("additional_special_tokens")
        to_add = []
        for key, value in tokens.items():
            values = list(value) if key == "extra_special_tokens" and isinstance(value, (list, tuple)) else [value]
            if (key not in _SPECIAL_NAMES and key != "extra_special_tokens") or not all(
                isinstance(v, (str, AddedToken)) for v in values
            ):
                raise ValueError(
                    f"add_special_tokens: {key}={value!r}: keys are {', '.join(_SPECIAL_NAMES)} (a token each) "
                    "or extra_special_tokens (a list of tokens)"
                )
            added = [AddedToken(v, special=True, normalized=False) if isinstance(v, str) else v for v in values]
            if key == "extra_special_tokens":
                kept = [] if replace_extra_special_tokens else self.extra_special_tokens
                self.extra_special_tokens = list(dict.fromkeys(kept + [t.content for t in added]))
            else:
                self.config[key] = added[0].content
            to_add.extend(added)
        return self.add_tokens(to_add, special_tokens=True)

    def convert_tokens_to_ids(self, tokens: str | Sequence[str]) -> Any:
        """The id of a token (or a list of them), ``unk_token_id`` (None without an unk_token) for a
        token outside the vocabulary, as transformers does."""
        if isinstance(tokens, str):
            found = self.tokenizer.token_to_id(tokens)
            return self.unk_token_id if found is None else found
        return [self.convert_tokens_to_ids(t) for t in tokens]

    def convert_ids_to_tokens(self, ids: Any, skip_special_tokens: bool = False) -> Any:
        """The token of an id (or a list of them; None outside the vocabulary; ``skip_special_tokens``
        leaves out ``all_special_ids``), as transformers."""
        if isinstance(ids, int):
            return self.tokenizer.id_to_token(ids)
        skip = set(self.all_special_ids) if skip_special_tokens else set()
        return [self.tokenizer.id_to_token(i) for i in _id_list(ids) if i not in skip]

    def convert_tokens_to_string(self, tokens: Sequence[str]) -> str:
        """The text of ``tokens`` by tokenizer.json's decoder (joined with spaces without one), as transformers."""
        decoder = self.tokenizer.decoder
        return decoder.decode(list(tokens)) if decoder is not None else " ".join(tokens)

    def tokenize(
        self, text: Any, pair: Any = None, add_special_tokens: bool = False, is_split_into_words: bool = False
    ) -> list[str]:
        """The tokens (strings) of ``text`` (and ``pair``), as transformers' ``tokenize``."""
        return list(
            self._encode_batch(
                [text],
                add_special_tokens,
                None,
                None if _no_empty_pair(pair) is None else [pair],
                "longest_first",
                0,
                is_split_into_words,
            )[0].tokens
        )

    # transformers' attributes of a fast tokenizer that callers read (collators, Trainer, pipelines)
    is_fast = True
    pad_token_type_id = 0
    name_or_path = ""

    @property
    def special_tokens_map(self) -> dict[str, str]:
        """The named special tokens that are set (model-specific ones included), as transformers 5's."""
        return {k: t.content for k, t in self._named_special_tokens().items() if t is not None}

    @property
    def all_special_tokens(self) -> list[str]:
        """The named special tokens, then the extra ones, each once, as transformers 5's."""
        out = list(self.special_tokens_map.values()) + [t.content for t in self._extra_special_tokens()]
        return list(dict.fromkeys(out))

    @property
    def all_special_ids(self) -> list[int]:
        return self.convert_tokens_to_ids(self.all_special_tokens)

    @property
    def added_tokens_decoder(self) -> dict[int, Any]:
        """Id -> ``tokenizers.AddedToken`` of the added tokens, by id, as transformers."""
        return dict(sorted(self.tokenizer.get_added_tokens_decoder().items()))

    @property
    def added_tokens_encoder(self) -> dict[str, int]:
        return self.get_added_vocab()

    def num_special_tokens_to_add(self, pair: bool = False) -> int:
        """How many tokens the post-processor adds to a text (a pair), as transformers."""
        return self.tokenizer.num_special_tokens_to_add(pair)

    def get_special_tokens_mask(
        self, token_ids_0: Any, token_ids_1: Any = None, already_has_special_tokens: bool = False
    ) -> list[int]:
        """1 on the ids of ``all_special_ids`` in ``token_ids_0`` (a sequence with its special tokens,
        ``already_has_special_tokens=True``), as transformers' fast tokenizers (data collators call it)."""
        if not already_has_special_tokens:
            raise NotImplementedError(
                "GlmTokenizer.get_special_tokens_mask: only already_has_special_tokens=True (as transformers' "
                "fast tokenizers); the call's return_special_tokens_mask gives the mask of an encoding"
            )
        if token_ids_1 is not None:
            raise ValueError(
                "You should not supply a second sequence if the provided sequence of ids is already formatted "
                "with special tokens for the model."
            )
        special = set(self.all_special_ids)
        return [1 if i in special else 0 for i in _id_list(token_ids_0)]

    # ------------------------------------------------------------------ text
    def encode(self, text: Any, text_pair: Any = None, add_special_tokens: bool = True, **kwargs: Any) -> Any:
        """The ids of ``text`` (and ``text_pair`` after it: transformers' second argument, the
        post-processor's pair template); ``add_special_tokens`` (transformers' default True) applies
        tokenizer.json's post-processor (a BOS prefix, an EOS). Other keywords are the call's
        (``truncation``, ``max_length``, ``padding``, ``return_tensors``: a [1, S] tensor,
        ``is_split_into_words``, ...): its ``input_ids``, as transformers' ``encode``."""
        if kwargs or not isinstance(text, str):  # a batch too: the call's rows, as transformers' encode
            return self(text, text_pair, add_special_tokens=add_special_tokens, **kwargs)["input_ids"]
        text_pair = _no_empty_pair(text_pair)
        if text_pair is not None and not isinstance(text_pair, str):
            raise TypeError(f"GlmTokenizer.encode: text_pair must be a string, got {type(text_pair).__name__}")
        return list(self.tokenizer.encode(text, text_pair, add_special_tokens=add_special_tokens).ids)

    def decode(
        self,
        ids: Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **ignored: Any,
    ) -> Any:
        """Text of one sequence (a list, NumPy array or Paddle tensor of ids); rows of ids (a list of
        lists, a 2-D array or tensor) give a list of texts, as transformers' ``decode`` does.
        ``clean_up_tokenization_spaces`` (else the config's): transformers ignores it for a BPE
        tokenizer (GLM's), as here; for another model it removes the space before punctuation and
        English contractions (``_CLEANUP``), as here. Other keywords (``spaces_between_special_tokens``,
        a streamer's decode_kwargs, ...) are ignored, as transformers' fast tokenizer ignores them.
        A float or string id raises TypeError, as in transformers (:func:`_decode_ids`); an encoding (a
        mapping) decodes its ``input_ids``, as transformers does."""
        cleanup = clean_up_tokenization_spaces
        if cleanup is None:
            cleanup = self.config.get("clean_up_tokenization_spaces")
        rows = _py_ids(ids["input_ids"] if isinstance(ids, Mapping) else ids)  # an encoding: its input_ids
        if isinstance(rows, list) and rows and isinstance(rows[0], list):  # a batch: one text per row
            return [self.decode(row, skip_special_tokens, cleanup) for row in rows]
        text = self.tokenizer.decode(_decode_ids(rows), skip_special_tokens=skip_special_tokens)
        if cleanup and type(self.tokenizer.model).__name__ != "BPE":
            text = self.clean_up_tokenization(text)
        return text

    @staticmethod
    def clean_up_tokenization(text: str) -> str:
        """transformers' ``clean_up_tokenization``: the space before punctuation and English
        contractions removed (``_CLEANUP``, in its order)."""
        for old, new in _CLEANUP:
            text = text.replace(old, new)
        return text

    def batch_decode(
        self,
        sequences: Any,
        skip_special_tokens: bool = False,
        clean_up_tokenization_spaces: bool | None = None,
        **ignored: Any,
    ) -> list[str]:
        """Text of each row of ``sequences`` ([B, S] tensor or array, or a list of id lists); one
        sequence of ids gives a list of its one text, as in transformers."""
        out = self.decode(sequences, skip_special_tokens, clean_up_tokenization_spaces)
        return [out] if isinstance(out, str) else out

    def _max_length(self, max_length: int | None) -> int | None:
        """``max_length``, else ``model_max_length``; None where the tokenizer has none (transformers 5.23
        then neither truncates nor pads to a max_length, silently)."""
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
                raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}")
            return max_length
        if self.model_max_length >= _VERY_LARGE:
            return None
        return self.model_max_length

    def __call__(
        self,
        text: str | Sequence[str] | None = None,
        text_pair: str | Sequence[str] | None = None,
        padding: bool | str = False,
        truncation: bool | str | None = None,
        max_length: int | None = None,
        return_tensors: str | None = None,
        add_special_tokens: bool = True,
        return_attention_mask: bool | None = None,
        padding_side: str | None = None,
        pad_to_multiple_of: int | None = None,
        return_offsets_mapping: bool = False,
        stride: int = 0,
        is_split_into_words: bool = False,
        return_token_type_ids: bool | None = None,
        return_special_tokens_mask: bool = False,
        return_overflowing_tokens: bool = False,
        return_length: bool = False,
        verbose: bool = True,
        split_special_tokens: bool | None = None,
        text_target: str | Sequence[str] | None = None,
        text_pair_target: str | Sequence[str] | None = None,
        max_target_length: int | None = None,
    ) -> BatchEncoding:
        """transformers' call (docs/model.md, "Tokenizer and chat"). ``text_target`` (with
        ``text_pair_target``) is encoded with the same options (``max_target_length`` for its
        ``max_length``) and its ids returned as ``labels`` (padding with the pad id, as transformers), or,
        without ``text``, its encoding alone. See :meth:`_encode_call` for the rest."""
        options = {k: v for k, v in locals().items() if k not in _TARGET_ARGS}
        if text is None and text_target is None:
            raise ValueError("You need to specify either `text` or `text_target`.")  # transformers' message
        enc = None if text is None else self._encode_call(text, text_pair, **options)
        if text_target is None:
            return enc
        if max_target_length is not None:
            options["max_length"] = max_target_length
        target = self._encode_call(text_target, text_pair_target, **options)
        if enc is None:
            return target
        enc["labels"] = target["input_ids"]
        return enc

    def _encode_call(
        self,
        text: str | Sequence[str],
        text_pair: str | Sequence[str] | None,
        padding: bool | str,
        truncation: bool | str | None,
        max_length: int | None,
        return_tensors: str | None,
        add_special_tokens: bool,
        return_attention_mask: bool | None,
        padding_side: str | None,
        pad_to_multiple_of: int | None,
        return_offsets_mapping: bool,
        stride: int,
        is_split_into_words: bool,
        return_token_type_ids: bool | None,
        return_special_tokens_mask: bool,
        return_overflowing_tokens: bool,
        return_length: bool,
        verbose: bool,
        split_special_tokens: bool | None,
    ) -> BatchEncoding:
        """One text (or batch) as transformers' call encodes it; ``truncation=True`` cuts to
        ``max_length`` (default ``model_max_length``) on ``truncation_side``; ``max_length`` alone
        (``padding=False``, ``truncation`` not given) truncates, as transformers does. ``text_pair``
        (transformers' second argument): the second text of each pair, encoded by the post-processor's
        pair template; ``truncation`` "longest_first" (True), "only_first" or "only_second" cuts them
        as transformers has the ``tokenizers`` library cut them. ``return_offsets_mapping``: each token's
        (start, end) characters in its text, (0, 0) on padding, as transformers gives them.
        ``is_split_into_words``: a text is a list of words (a batch a list of those), each word
        tokenized alone. ``return_overflowing_tokens``: what truncation cut off becomes more rows
        (each ``stride`` tokens overlapping the row before), ``overflow_to_sample_mapping`` naming each
        row's text; the rows are a batch even for one text. ``return_token_type_ids`` (0 for the first
        text, 1 for the pair's), ``return_special_tokens_mask`` (1 on the post-processor's tokens and on
        padding) and ``return_length`` (each row's length, padding included; a list for one text too)
        are transformers'. ``verbose`` is accepted and ignored. ``split_special_tokens`` (this call only,
        over the config's): special tokens written in the text are tokenized as plain text."""
        word = (
            (lambda t: isinstance(t, (list, tuple)) and all(isinstance(w, str) for w in t))
            if (is_split_into_words)
            else (lambda t: isinstance(t, str))
        )
        what = "a list of words (a list of strings)" if is_split_into_words else "a string"
        if not is_split_into_words and text_pair is None and _pair_batch(text):  # transformers' (text, pair) rows
            text, text_pair = [t[0] for t in text], [t[1] for t in text]
        single = word(text)
        if single:  # one text: an empty pair is none (a batch keeps its empty pairs, as transformers)
            text_pair = _no_empty_pair(text_pair)
        texts = [text] if single else list(text)
        if not all(word(t) for t in texts):
            raise TypeError(f"GlmTokenizer: text must be {what} or a list of them")
        pairs = None
        if text_pair is not None:
            pairs = [text_pair] if word(text_pair) else list(text_pair)
            if word(text_pair) != single or len(pairs) != len(texts):
                one = "a list of words for a list of words" if is_split_into_words else "a string for a string text"
                raise ValueError(f"GlmTokenizer: text_pair must be {one}, a list as long as a list")
            if not all(word(t) for t in pairs):
                raise TypeError(f"GlmTokenizer: text_pair must be {what} or a list of them")
        if isinstance(stride, bool) or not isinstance(stride, int) or stride < 0:
            raise ValueError(f"stride must be an integer >= 0, got {stride!r}")
        limit = None
        if max_length is not None and padding is False and truncation is None:
            truncation = True  # transformers' _get_padding_truncation_strategies: max_length alone truncates
        if truncation not in (False, "do_not_truncate", None):
            if truncation not in (True, "longest_first", "only_first", "only_second"):
                raise ValueError(
                    "truncation must be True, False, 'longest_first', 'only_first' or 'only_second', "
                    f"got {truncation!r}"
                )
            limit = self._max_length(max_length)
            padded = padding not in (False, "do_not_pad", None)
            if padded and pad_to_multiple_of and limit is not None and limit % pad_to_multiple_of:
                raise ValueError(  # transformers' message: padding to a multiple would undo the truncation
                    "Truncation and padding are both activated but "
                    f"truncation length ({limit}) is not a multiple of pad_to_multiple_of ({pad_to_multiple_of})."
                )
        strategy = "longest_first" if truncation is True else truncation
        saved_split = self.tokenizer.encode_special_tokens
        if split_special_tokens is not None:  # this call only, as transformers' keyword
            self.tokenizer.encode_special_tokens = bool(split_special_tokens)
        try:
            encodings = self._encode_batch(
                texts, add_special_tokens, limit, pairs, strategy, stride, is_split_into_words
            )
        finally:
            self.tokenizer.encode_special_tokens = saved_split
        sample = list(range(len(encodings)))
        if return_overflowing_tokens:  # each text's rows, then the next text's (transformers' order)
            rows_of = [[e, *e.overflowing] for e in encodings]
            sample = [i for i, r in enumerate(rows_of) for _ in r]
            encodings = [e for r in rows_of for e in r]
            single = False
        given = {"input_ids": [list(e.ids) for e in encodings]}
        if return_token_type_ids:
            given["token_type_ids"] = [list(e.type_ids) for e in encodings]
        if return_special_tokens_mask:
            given["special_tokens_mask"] = [list(e.special_tokens_mask) for e in encodings]
        enc = self.pad(given, padding, max_length, pad_to_multiple_of, padding_side=padding_side)
        if return_attention_mask is not None and not return_attention_mask:  # None: the default, a mask
            enc.pop("attention_mask")
        if return_offsets_mapping:  # padded with (0, 0) on the side the ids were
            side = padding_side or self.padding_side
            offsets = []
            for row, e in zip(enc["input_ids"], encodings):
                n = len(row) - len(e.offsets)
                offsets.append([(0, 0)] * n + list(e.offsets) if side == "left" else list(e.offsets) + [(0, 0)] * n)
            enc["offset_mapping"] = offsets
        if return_length:
            enc["length"] = [len(r) for r in enc["input_ids"]]
        if return_overflowing_tokens:
            enc["overflow_to_sample_mapping"] = sample
        if return_tensors is not None:
            return BatchEncoding({k: _as_tensor(v, return_tensors, "GlmTokenizer") for k, v in enc.items()})
        if single:  # one text: its row (``length`` stays a list, as in transformers)
            return BatchEncoding({k: v if k == "length" else v[0] for k, v in enc.items()})
        return enc

    def _encode_batch(
        self,
        texts: list[str],
        add_special_tokens: bool,
        limit: int | None,
        pairs: list[str] | None = None,
        strategy: Any = "longest_first",
        stride: int = 0,
        is_pretokenized: bool = False,
    ) -> list[Any]:
        """``tokenizers``' encodings of ``texts`` (with ``pairs``: of each pair), cut to ``limit`` tokens
        on ``truncation_side`` by the library's own truncation (its ``strategy`` for pairs), as
        transformers does: it keeps the tokens the post-processor adds (a BOS prefix, an EOS) and cuts
        the text."""
        inputs = texts if pairs is None else list(zip(texts, pairs))
        if limit is None:
            return self.tokenizer.encode_batch(
                inputs, add_special_tokens=add_special_tokens, is_pretokenized=is_pretokenized
            )
        self.tokenizer.enable_truncation(
            limit, stride=stride, direction=self.truncation_side, strategy=strategy or "longest_first"
        )
        try:
            return self.tokenizer.encode_batch(
                inputs, add_special_tokens=add_special_tokens, is_pretokenized=is_pretokenized
            )
        except BaseException as err:  # max_length below the special tokens; a stride as long as a row (a Rust panic)
            if not isinstance(err, Exception) and type(err).__name__ != "PanicException":
                raise
            raise ValueError(f"truncation to max_length={limit} (stride {stride}): {err}") from None
        finally:
            self.tokenizer.no_truncation()

    def pad(
        self,
        encoded_inputs: Any,
        padding: bool | str = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        return_tensors: str | None = None,
        padding_side: str | None = None,
        return_attention_mask: bool | None = None,
        verbose: bool = True,
    ) -> BatchEncoding:
        """Pad already tokenized rows (a dict of lists, or a list of dicts as data collators give),
        as transformers' ``tokenizer.pad``: ``input_ids`` and ``attention_mask``; other keys of
        equal length are passed through, ``token_type_ids`` padded with 0 and ``special_tokens_mask``
        with 1, as transformers pads them. One row (``{"input_ids": [ids]}``) gives one row back, as in
        transformers. ``return_attention_mask=False`` leaves out the mask the inputs did not have
        (PaddleFormers' DataCollatorForSeq2Seq passes the argument)."""
        if isinstance(encoded_inputs, (list, tuple)):
            if not encoded_inputs:
                raise ValueError("pad: nothing to pad")
            encoded_inputs = {k: [f[k] for f in encoded_inputs] for k in encoded_inputs[0]}
        if "input_ids" not in encoded_inputs:
            raise ValueError(f"pad: no 'input_ids' in the inputs (keys {sorted(encoded_inputs)})")
        first = encoded_inputs["input_ids"]
        first = first.tolist() if hasattr(first, "tolist") else first
        single = isinstance(first, (list, tuple)) and bool(first) and not hasattr(first[0], "__len__")
        if single:  # one row, as transformers' pad takes it: padded as a batch of one, returned as one row
            encoded_inputs = {k: [v] for k, v in encoded_inputs.items()}
        # fresh lists of what pad pads, padded in place; every other key (labels, weights, offsets) as given
        given = {k: [_id_list(r) for r in v] for k, v in encoded_inputs.items() if k in _PADDED_KEYS}
        passed = {k: v for k, v in encoded_inputs.items() if k not in _PADDED_KEYS}
        rows = given["input_ids"]
        masks = given["attention_mask"] if "attention_mask" in given else [[1] * len(r) for r in rows]
        if padding in (True, "longest"):
            target = max((len(r) for r in rows), default=0)
        elif padding == "max_length":
            target = self._max_length(max_length)
        elif padding in (False, "do_not_pad", None):
            target = None
        else:
            raise ValueError(f"padding must be True, False, 'longest', 'max_length' or 'do_not_pad', got {padding!r}")
        if target is not None:
            if pad_to_multiple_of:
                target = -(-target // pad_to_multiple_of) * pad_to_multiple_of
            side = padding_side or self.padding_side
            if side not in ("left", "right"):
                raise ValueError(f"padding_side must be 'left' or 'right', got {side!r}")
            pad_id = self.pad_token_id
            if pad_id is None or pad_id < 0:  # asked to pad, whether or not these rows need it, as transformers
                raise TokenizerError(
                    "padding needs a pad token (tokenizer_config.json 'pad_token'; or set one: "
                    "`tokenizer.pad_token = tokenizer.eos_token`), as transformers asks for one whenever padding "
                    "is asked for"
                )
            for i, r in enumerate(rows):
                n = target - len(r)
                if n > 0:
                    rows[i] = [pad_id] * n + r if side == "left" else r + [pad_id] * n
                    masks[i] = [0] * n + masks[i] if side == "left" else masks[i] + [0] * n
                    for key, value in (("token_type_ids", 0), ("special_tokens_mask", 1)):  # transformers' values
                        if key in given and len(given[key][i]) == len(r):
                            row = given[key][i]
                            given[key][i] = [value] * n + row if side == "left" else row + [value] * n
        out = BatchEncoding(input_ids=rows, attention_mask=masks)
        if return_attention_mask is False and "attention_mask" not in given:
            del out["attention_mask"]
        out.update({k: v for k, v in given.items() if k not in out})
        if return_tensors is not None:
            padded = {k: _as_tensor(v, return_tensors, "pad") for k, v in out.items()}
            out = BatchEncoding({**padded, **{k: _passed_tensor(k, v, return_tensors) for k, v in passed.items()}})
        else:
            out.update(passed)
        return BatchEncoding({k: v[0] for k, v in out.items()}) if single else out

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False, **extra: Any) -> str:
        """The conversation as text, per the chat template."""
        return self._render(messages, add_generation_prompt, extra)[0]

    def _render(
        self,
        messages: Sequence[dict],
        add_generation_prompt: bool,
        extra: dict,
        track: bool = False,
        chat_template: str | None = None,
        continue_final_message: bool | str = False,
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of the template's ``{% generation %}`` blocks; [] unless ``track``),
        rendered as transformers' ``render_jinja_template``: the special tokens that are set, then
        ``extra`` over them, ``tools`` and ``documents`` always defined (None when not given), each
        message a copy without its None-valued keys and with its reasoning under all of HF's names, and ``continue_final_message``
        cutting the text after the final message's ``content`` (or the field it names)."""
        tools = extra.get("tools")
        if isinstance(tools, (list, tuple)) and any(callable(t) for t in tools):
            raise TokenizerError(  # transformers' get_json_schema reads the signature and docstring
                "tools: a Python function is not supported (transformers builds its JSON schema from its "
                'signature and docstring); pass the JSON schema ({"type": "function", "function": {...}})'
            )
        # what the template sees is rebuilt from plain JSON types, as transformers does (a numpy number
        # or a str enum renders as its value; an array or an image as "<ndarray>" ...)
        messages, extra = _plain(list(messages)), _plain(extra)
        tools = extra.get("tools")
        if tools is not None and not (isinstance(tools, (list, tuple)) and all(isinstance(t, dict) for t in tools)):
            raise TokenizerError(
                f"tools: each tool must be a JSON schema object, as transformers requires; got {tools!r:.80}"
            )
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise TokenizerError(f"message {i}: expected an object with 'role' and 'content', got {m!r}")
        docs = extra.get("documents")
        if docs is not None and not (isinstance(docs, (list, tuple)) and all(isinstance(d, dict) for d in docs)):
            raise TokenizerError(
                f"documents: expected a list of objects (title, text), as transformers requires; got {docs!r:.80}"
            )
        text = self.get_chat_template(chat_template, extra.get("tools"))
        template = _compile_template(text, self.template_source if chat_template is None else "chat_template=")
        # a key whose value is None is dropped, as transformers does (OpenAI's ``content=None``, ``tool_calls=None``)
        chat = [_alias_reasoning({k: v for k, v in m.items() if v is not None}) for m in messages]
        final = None
        if continue_final_message:
            final = _tag_final_message(chat, text, continue_final_message)
        variables = {k: t.content for k, t in self._named_special_tokens().items() if t is not None}
        variables.update(extra)
        variables.update(
            messages=chat,
            tools=extra.get("tools"),
            documents=extra.get("documents"),
            add_generation_prompt=add_generation_prompt,
        )
        spans: list[tuple[int, int]] = []
        if not track:
            rendered = template.render(**variables)
        else:
            blocks: list[str] = []
            tracker = template.environment.generation_blocks
            tracker.tracking = (blocks, spans)
            try:
                for block in template.generate(**variables):
                    blocks.append(block)
            finally:
                tracker.tracking = None
            rendered = "".join(blocks)
        if final is not None:  # transformers' cut after the tagged final message
            tag = _CONTINUE_TAG
            if final.strip() not in rendered or tag.strip() not in rendered:
                raise TokenizerError(
                    "continue_final_message: the final message does not appear in the rendered conversation"
                )
            at = rendered.rindex(tag.strip())
            rendered = rendered[:at] if rendered[at : at + len(tag)] == tag else rendered[:at].rstrip()
        return rendered, spans

    def get_chat_template(self, chat_template: str | None = None, tools: Any = None) -> str:
        """The template to render, as transformers' ``get_chat_template``: ``chat_template`` (a named
        template's name, or a template's text), else "tool_use" of the named templates when tools are
        given, else the default one; none: TokenizerError (a ValueError, as transformers raises)."""
        if chat_template is not None:
            return self.chat_templates.get(chat_template, chat_template)
        if tools is not None and "tool_use" in self.chat_templates:
            return self.chat_templates["tool_use"]
        if not self.chat_template:
            if self.chat_templates:
                raise TokenizerError(
                    f"{self.template_source}: several chat templates and none named 'default': pass "
                    f"chat_template= one of {sorted(map(str, self.chat_templates))}"
                )
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json 'chat_template')")
        return self.chat_template

    def apply_chat_template(
        self,
        conversation: Sequence[dict] | Sequence[Sequence[dict]],
        tokenize: bool = True,
        add_generation_prompt: bool = False,
        padding: bool | str = False,
        truncation: bool = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        return_dict: bool = True,
        chat_template: str | None = None,
        continue_final_message: bool | str = False,
        return_assistant_tokens_mask: bool = False,
        tokenizer_kwargs: dict | None = None,
        **extra: Any,
    ) -> Any:
        """transformers 5's call (docs/model.md, "Tokenizer and chat"): a conversation or a list of them,
        rendered by the chat template (``chat_template``: another template's text) and
        (``tokenize=True``) encoded; template variables go in ``extra``. ``continue_final_message``
        and ``return_assistant_tokens_mask`` (``assistant_masks``: the ``{% generation %}`` blocks'
        tokens) are transformers'; ``tokenizer_kwargs`` go to the tokenizer call, as in transformers."""
        if return_assistant_tokens_mask and not (return_dict and tokenize):
            raise ValueError("`return_assistant_tokens_mask=True` requires `return_dict=True` and `tokenize=True`")
        tokenizer_kwargs = dict(tokenizer_kwargs or {})
        if not conversation:
            raise TokenizerError("apply_chat_template: the conversation is empty")
        if extra.get("sanitize_control_tokens"):
            raise TokenizerError("apply_chat_template: sanitize_control_tokens=True is not supported")
        extra.pop("sanitize_control_tokens", None)
        if continue_final_message and (add_generation_prompt or return_assistant_tokens_mask):
            raise ValueError(
                "continue_final_message and add_generation_prompt are not compatible"
                if add_generation_prompt
                else "continue_final_message is not compatible with return_assistant_tokens_mask."
            )
        batched = isinstance(conversation[0], (list, tuple))
        convs = list(conversation) if batched else [conversation]
        track = bool(tokenize and return_dict and return_assistant_tokens_mask)
        rendered = [
            self._render(c, add_generation_prompt, extra, track, chat_template, continue_final_message) for c in convs
        ]
        texts = [r[0] for r in rendered]
        text = texts if batched else texts[0]
        if not tokenize:
            return text
        enc = self(
            text,
            padding=padding,
            truncation=truncation,
            max_length=max_length,
            add_special_tokens=False,
            **tokenizer_kwargs,
        )
        if track:  # transformers' loop: from the token holding a block's first character to its last one's
            # on the encodings as truncated (where a block's start was cut off, HF's loop stops there)
            limit = self._max_length(max_length) if truncation else None
            rows = enc["input_ids"] if batched else [enc["input_ids"]]
            masks = []
            for row, e, (_, blocks) in zip(rows, self._encode_batch(texts, False, limit), rendered):
                mask = _block_mask(e, blocks)
                pad = [0] * (len(row) - len(mask))
                side = tokenizer_kwargs.get("padding_side") or self.padding_side
                masks.append(pad + mask if side == "left" else mask + pad)
            enc["assistant_masks"] = masks if batched else masks[0]
        if return_tensors is not None:
            enc = BatchEncoding(
                {k: _as_tensor(v if batched else [v], return_tensors, "apply_chat_template") for k, v in enc.items()}
            )
        return enc if return_dict else enc["input_ids"]

    def assistant_spans(self, messages: Sequence[dict], **extra: Any) -> tuple[str, list[tuple[int, int]]]:
        """(rendered conversation, character spans written by the assistant): for each assistant
        message, from the end of the generation prompt before it to the end of its turn. Found by
        rendering growing prefixes, so the template's rendering of a prefix must be a prefix of the
        whole (true of GLM's and most chat templates); the error says so when it is not. ``extra``:
        template variables (``tools``, ``documents``), as for ``apply_chat_template``."""
        full = self.render_chat(messages, **extra)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render_chat(messages[:i], add_generation_prompt=True, **extra)
            upto = self.render_chat(messages[: i + 1], **extra)
            if not upto.startswith(before) or not full.startswith(upto):
                raise TokenizerError(
                    f"message {i}: the chat template does not render this conversation prefix by prefix (GLM's "
                    "drops the reasoning of turns before the last user message), so the assistant's tokens cannot "
                    "be located: mark them in the template with {% generation %}...{% endgeneration %}, as "
                    "transformers' return_assistant_tokens_mask needs"
                )
            spans.append((len(before), len(upto)))
        return full, spans

    def encode_chat_for_training(
        self, messages: Sequence[dict], *, stop_ids: Iterable[int] = (), **extra: Any
    ) -> tuple[list[int], list[bool]]:
        """(token ids of the rendered conversation, per token True when it is trained).

        A template with ``{% generation %}`` blocks: the tokens HF's ``apply_chat_template(...,
        return_assistant_tokens_mask=True)`` marks, from the token holding a block's first character
        to the one holding its last. Otherwise a token belongs to the assistant when it starts inside
        an ``assistant_spans`` span. Then each turn's end (:func:`train_turn_ends`; the stop tokens:
        the eos_token and ``stop_ids``, the checkpoint's generation eos_token_id): the stop token that
        follows a turn is trained, and a conversation that ends with an assistant turn gets the
        eos_token appended, trained; a turn already holding a stop token gets nothing. The whole
        conversation is tokenized at once, so the ids are exactly those of the rendered text (plus
        that EOS). ``extra``: template variables (``tools``, ``documents``)."""
        stop = {*stop_ids, *([self.eos_token_id] if self.eos_token_id is not None else [])}
        if _GENERATION_TAG.search(self.get_chat_template(None, extra.get("tools"))):
            text, turns = self._render(messages, False, extra, track=True)
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            mine = [bool(m) for m in _block_mask(enc, turns)]
        else:
            text, turns = self.assistant_spans(messages, **extra)
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            mine = [end > start and any(a <= start < b for a, b in turns) for start, end in enc.offsets]
        return train_turn_ends(list(enc.ids), mine, enc.offsets, turns, stop, self.eos_token_id)
