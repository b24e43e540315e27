"""The checkpoint's tokenizer and chat template, read from the checkpoint folder without network; the
call, ``pad``, ``batch_decode`` and ``apply_chat_template`` follow transformers 5 (docs/model.md,
"Tokenizer and chat").
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ._io import atomic_write_text, read_json, read_text

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
    """A tokenizer folder or a conversation that cannot be used (the message names the file or message)."""


def _template_text(value: Any, where: str) -> str | None:
    """The chat template: a string, or HF's list of ``{"name", "template"}`` (the "default" one, else
    the first); anything else is an error naming where it came from."""
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, list):
        if not all(isinstance(t, dict) and isinstance(t.get("template"), str) for t in value):
            raise TokenizerError(f'{where}: a list of chat templates must hold {{"name", "template": string}} objects')
        named = {t.get("name"): t["template"] for t in value}
        return named.get("default") or next(iter(named.values()), None)
    raise TokenizerError(f"{where}: the chat template must be a string, got a {type(value).__name__}")


TENSOR_TYPES = ("pd", "paddle", "np")
# transformers' "no limit" value of model_max_length (int(1e30))
_VERY_LARGE = int(1e30)


class BatchEncoding(dict):
    """What the tokenizer call returns: a dict (``input_ids``, ``attention_mask``) whose keys are
    also attributes, so ``model.generate(**enc)`` and ``enc.input_ids`` both work."""

    def __getattr__(self, name: str) -> Any:
        try:
            return self[name]
        except KeyError:
            raise AttributeError(name) from None


def _as_tensor(rows: list[list[int]], return_tensors: str, what: str) -> Any:
    if return_tensors not in TENSOR_TYPES:
        raise ValueError(f"return_tensors must be one of {TENSOR_TYPES} or None, got {return_tensors!r}")
    import numpy as np

    if len({len(r) for r in rows}) > 1:
        raise ValueError(
            f"{what}: rows of different lengths ({sorted({len(r) for r in rows})}) cannot form one tensor; "
            "pass padding=True (or truncation with max_length)"
        )
    arr = np.asarray(rows, dtype=np.int64).reshape(len(rows), -1)
    if return_tensors == "np":
        return arr
    import paddle

    return paddle.to_tensor(arr)


def _id_list(ids: Any) -> list[int]:
    """Token ids of one sequence from a list, a NumPy array or a Paddle tensor."""
    if hasattr(ids, "numpy") and not isinstance(ids, (list, tuple)):
        ids = ids.numpy()
    if hasattr(ids, "tolist"):
        ids = ids.tolist()
    if isinstance(ids, int):
        return [ids]
    return [int(i) for i in ids]


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
        self.template_source = template_source  # where the template came from, named by its errors
        self.chat_template = _template_text(
            chat_template if chat_template is not None else self.config.get("chat_template"), self.template_source
        )
        self.padding_side = padding_side or self.config.get("padding_side") or "right"
        self.truncation_side = truncation_side or self.config.get("truncation_side") or "right"
        for name, side in (("padding_side", self.padding_side), ("truncation_side", self.truncation_side)):
            if side not in ("left", "right"):
                raise TokenizerError(f"{name} must be 'left' or 'right', got {side!r}")
        mml = model_max_length if model_max_length is not None else self.config.get("model_max_length")
        self.model_max_length = int(mml) if isinstance(mml, (int, float)) and not isinstance(mml, bool) else _VERY_LARGE

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike, **options: Any) -> GlmTokenizer:
        """Load from a checkpoint folder (or a tokenizer.json path); never touches the network.
        ``options``: ``padding_side``, ``truncation_side``, ``model_max_length`` (over the files')."""
        unknown = set(options) - {"padding_side", "truncation_side", "model_max_length"}
        if unknown:
            raise TypeError(
                f"GlmTokenizer.from_pretrained: unknown options {sorted(unknown)} "
                "(padding_side, truncation_side, model_max_length)"
            )
        from tokenizers import Tokenizer

        p = Path(path)
        folder, tok_file = (p.parent, p) if p.is_file() else (p, p / TOKENIZER_FILE)
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: no tokenizer.json in {folder} (the checkpoint has no tokenizer)")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as err:  # the library's own message says what is wrong
            raise TokenizerError(f"{tok_file}: not a tokenizers file: {err}") from err
        cfg_file = folder / CONFIG_FILE
        config = read_json(cfg_file, "the tokenizer config", error=TokenizerError) if cfg_file.is_file() else {}
        template, source = None, f"{cfg_file} 'chat_template'"
        if (folder / TEMPLATE_FILE).is_file():
            source = str(folder / TEMPLATE_FILE)
            template = read_text(source, "the chat template", TokenizerError)
        return cls(tok, config, template, template_source=source, **options)

    def save_pretrained(self, folder: str | os.PathLike) -> list[str]:
        """Write tokenizer.json and tokenizer_config.json (with the chat template and the padding /
        truncation side and model_max_length in use), atomically."""
        config = dict(self.config)
        if self.chat_template is not None:
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
        written = [str(Path(folder) / TOKENIZER_FILE), str(Path(folder) / CONFIG_FILE)]
        atomic_write_text(written[0], self.tokenizer.to_str(pretty=True))
        atomic_write_text(written[1], json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n")
        return written

    # ------------------------------------------------------------------ special tokens
    def _special(self, key: str) -> str | None:
        v = self.config.get(key)
        if isinstance(v, dict):  # AddedToken serialised by transformers
            return v.get("content")
        return v if isinstance(v, str) else None

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    eos_token = property(lambda self: self._special("eos_token"))
    pad_token = property(lambda self: self._special("pad_token"))
    eos_token_id = property(lambda self: self.token_to_id(self.eos_token))
    pad_token_id = property(lambda self: self.token_to_id(self.pad_token))
    vocab_size = property(lambda self: self.tokenizer.get_vocab_size(with_added_tokens=True))

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Any, skip_special_tokens: bool = False) -> str:
        """Text of one sequence (a list, NumPy array or Paddle tensor of ids)."""
        return self.tokenizer.decode(_id_list(ids), skip_special_tokens=skip_special_tokens)

    def batch_decode(self, sequences: Any, skip_special_tokens: bool = False) -> list[str]:
        """Text of each row of ``sequences`` ([B, S] tensor or array, or a list of id lists)."""
        if hasattr(sequences, "numpy") and not isinstance(sequences, (list, tuple)):
            sequences = sequences.numpy()
        return [self.decode(row, skip_special_tokens=skip_special_tokens) for row in sequences]

    def _max_length(self, max_length: int | None, why: str) -> int | None:
        if max_length is not None:
            if isinstance(max_length, bool) or not isinstance(max_length, int) or max_length < 1:
                raise ValueError(f"max_length must be an integer >= 1, got {max_length!r}")
            return max_length
        if self.model_max_length >= _VERY_LARGE:
            raise ValueError(f"{why} needs max_length (the tokenizer has no model_max_length)")
        return self.model_max_length

    def __call__(
        self,
        text: str | Sequence[str],
        padding: bool | str = False,
        truncation: bool | str = False,
        max_length: int | None = None,
        return_tensors: str | None = None,
        add_special_tokens: bool = True,
        return_attention_mask: bool = True,
        padding_side: str | None = None,
        pad_to_multiple_of: int | None = None,
    ) -> BatchEncoding:
        """transformers' call (docs/model.md, "Tokenizer and chat"); ``truncation=True`` cuts to
        ``max_length`` (default ``model_max_length``) on ``truncation_side``."""
        single = isinstance(text, str)
        texts = [text] if single else list(text)
        if not all(isinstance(t, str) for t in texts):
            raise TypeError("GlmTokenizer: text must be a string or a list of strings")
        rows = [list(e.ids) for e in self.tokenizer.encode_batch(texts, add_special_tokens=add_special_tokens)]
        if truncation not in (False, "do_not_truncate", None):
            if truncation not in (True, "longest_first", "only_first"):
                raise ValueError(f"truncation must be True, False, 'longest_first' or 'only_first', got {truncation!r}")
            limit = self._max_length(max_length, "truncation=True")
            rows = [r[-limit:] if self.truncation_side == "left" else r[:limit] for r in rows]
        enc = self.pad({"input_ids": rows}, padding, max_length, pad_to_multiple_of, padding_side=padding_side)
        if not return_attention_mask:
            enc.pop("attention_mask")
        if return_tensors is not None:
            return BatchEncoding({k: _as_tensor(v, return_tensors, "GlmTokenizer") for k, v in enc.items()})
        if single:
            return BatchEncoding({k: v[0] for k, v in enc.items()})
        return enc

    def pad(
        self,
        encoded_inputs: Any,
        padding: bool | str = True,
        max_length: int | None = None,
        pad_to_multiple_of: int | None = None,
        return_tensors: str | None = None,
        padding_side: str | None = None,
    ) -> BatchEncoding:
        """Pad already tokenized rows (a dict of lists, or a list of dicts as data collators give),
        as transformers' ``tokenizer.pad``: ``input_ids`` and ``attention_mask``; other keys of
        equal length are passed through."""
        if isinstance(encoded_inputs, (list, tuple)):
            if not encoded_inputs:
                raise ValueError("pad: nothing to pad")
            encoded_inputs = {k: [f[k] for f in encoded_inputs] for k in encoded_inputs[0]}
        if "input_ids" not in encoded_inputs:
            raise ValueError(f"pad: no 'input_ids' in the inputs (keys {sorted(encoded_inputs)})")
        given = {k: [_id_list(r) for r in v] for k, v in encoded_inputs.items()}  # fresh lists, padded in place
        rows = given["input_ids"]
        masks = given["attention_mask"] if "attention_mask" in given else [[1] * len(r) for r in rows]
        if padding in (True, "longest"):
            target = max((len(r) for r in rows), default=0)
        elif padding == "max_length":
            target = self._max_length(max_length, "padding='max_length'")
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
            if pad_id is None and any(len(r) < target for r in rows):
                raise TokenizerError("padding needs a pad token (tokenizer_config.json 'pad_token')")
            for i, r in enumerate(rows):
                n = target - len(r)
                if n > 0:
                    rows[i] = [pad_id] * n + r if side == "left" else r + [pad_id] * n
                    masks[i] = [0] * n + masks[i] if side == "left" else masks[i] + [0] * n
        out = BatchEncoding(input_ids=rows, attention_mask=masks)
        out.update({k: v for k, v in given.items() if k not in out})  # other keys as given
        if return_tensors is not None:
            return BatchEncoding({k: _as_tensor(v, return_tensors, "pad") for k, v in out.items()})
        return out

    # ------------------------------------------------------------------ chat
    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False, **extra: Any) -> str:
        """The conversation as text, per the chat template."""
        return self._render(messages, add_generation_prompt, extra)[0]

    def _render(
        self, messages: Sequence[dict], add_generation_prompt: bool, extra: dict, track: bool = False
    ) -> tuple[str, list[tuple[int, int]]]:
        """(text, character spans of the template's ``{% generation %}`` blocks; [] unless ``track``)."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise TokenizerError(f"message {i}: expected an object with 'role' and 'content', got {m!r}")
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json 'chat_template')")
        specials = {k: self._special(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        template = _compile_template(self.chat_template, self.template_source)
        variables = dict(messages=list(messages), add_generation_prompt=add_generation_prompt, **specials, **extra)
        if not track:
            return template.render(**variables), []
        blocks: list[str] = []
        spans: list[tuple[int, int]] = []
        tracker = template.environment.generation_blocks
        tracker.tracking = (blocks, spans)
        try:
            for block in template.generate(**variables):
                blocks.append(block)
        finally:
            tracker.tracking = None
        return "".join(blocks), spans

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
        **extra: Any,
    ) -> Any:
        """transformers 5's call (docs/model.md, "Tokenizer and chat"): a conversation or a list of them,
        rendered by the chat template and (``tokenize=True``) encoded; template variables go in ``extra``."""
        if not conversation:
            raise TokenizerError("apply_chat_template: the conversation is empty")
        batched = isinstance(conversation[0], (list, tuple))
        convs = list(conversation) if batched else [conversation]
        texts = [self.render_chat(c, add_generation_prompt=add_generation_prompt, **extra) for c in convs]
        text = texts if batched else texts[0]
        if not tokenize:
            return text
        enc = self(text, padding, truncation, max_length, return_tensors, add_special_tokens=False)
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
                    f"message {i}: the chat template does not render this conversation prefix by prefix, "
                    "so the assistant's tokens cannot be located"
                )
            spans.append((len(before), len(upto)))
        return full, spans

    def encode_chat_for_training(self, messages: Sequence[dict], **extra: Any) -> tuple[list[int], list[bool]]:
        """(token ids of the rendered conversation, per token True when the assistant wrote it).

        A template with ``{% generation %}`` blocks: the tokens HF's ``apply_chat_template(...,
        return_assistant_tokens_mask=True)`` marks, from the token holding a block's first character
        to the one holding its last. Otherwise a token belongs to the assistant when it starts inside
        an ``assistant_spans`` span. The whole conversation is tokenized at once, so the ids are
        exactly those of the rendered text. ``extra``: template variables (``tools``, ``documents``)."""
        if self.chat_template and _GENERATION_TAG.search(self.chat_template):
            text, blocks = self._render(messages, False, extra, track=True)
            enc = self.tokenizer.encode(text, add_special_tokens=False)
            mask = [False] * len(enc.ids)
            for start, end in blocks:  # transformers' loop (tokenization_utils_base.apply_chat_template)
                first, last = enc.char_to_token(start), enc.char_to_token(end - 1)
                if first is None:
                    break
                for t in range(first, last + 1 if last else len(mask)):
                    mask[t] = True
            return list(enc.ids), mask
        text, spans = self.assistant_spans(messages, **extra)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        return list(enc.ids), [end > start and any(a <= start < b for a, b in spans) for start, end in enc.offsets]
