"""The checkpoint's tokenizer and chat template, read from the checkpoint folder without network.

Files (the HF layout): ``tokenizer.json`` (required; the ``tokenizers`` library's format),
``tokenizer_config.json`` (special tokens, ``chat_template``), and ``chat_template.jinja`` (newer
exports keep the template there; it wins over the config's). The template is rendered with jinja2
in a sandbox, with the variables HF passes (``messages``, ``add_generation_prompt``, the special
tokens, ``tools``), and ``raise_exception`` for template-side validation.

``assistant_mask`` finds which tokens of a conversation the assistant wrote, for training with loss
on those tokens only: the template is rendered for growing prefixes of the conversation, and an
assistant message's span is what its turn adds after the generation prompt. It needs a template
whose rendering of a prefix is a prefix of the whole (true of GLM's and of most chat templates) and
says so when it is not.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class TokenizerError(ValueError):
    """A tokenizer folder or a conversation that cannot be used (the message names the file or message)."""


def _utf8_text(path: Path) -> str:
    """A text file of the tokenizer folder; bytes that are not UTF-8 are an error naming the file."""
    data = path.read_bytes()
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as err:
        line = data[: err.start].count(b"\n") + 1
        raise TokenizerError(f"{path}: not UTF-8 text (line {line}, byte {err.start})") from err


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


def _token_text(v: Any) -> str | None:
    if isinstance(v, dict):  # AddedToken serialised by transformers
        return v.get("content")
    return v if isinstance(v, str) else None


class GlmTokenizer:
    """`tokenizers.Tokenizer` plus the special tokens and chat template of tokenizer_config.json."""

    def __init__(
        self,
        tokenizer: Any,
        config: dict | None = None,
        chat_template: str | None = None,
        *,
        template_source: str = "tokenizer_config.json 'chat_template'",
    ) -> None:
        self.tokenizer = tokenizer
        if config is not None and not isinstance(config, dict):
            raise TokenizerError(f"tokenizer config: expected a JSON object, got a {type(config).__name__}")
        self.config = dict(config or {})
        self.template_source = template_source  # where the template came from, named by its errors
        self.chat_template = _template_text(
            chat_template if chat_template is not None else self.config.get("chat_template"), self.template_source
        )

    # ------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path: str | os.PathLike) -> GlmTokenizer:
        """Load from a checkpoint folder (or a tokenizer.json path); never touches the network."""
        from tokenizers import Tokenizer

        p = Path(path)
        folder = p.parent if p.is_file() else p
        tok_file = p if p.is_file() else p / TOKENIZER_FILE
        if not tok_file.is_file():
            raise TokenizerError(f"{tok_file}: no tokenizer.json in {folder} (the checkpoint has no tokenizer)")
        try:
            tok = Tokenizer.from_file(str(tok_file))
        except Exception as err:  # the library's own message says what is wrong
            raise TokenizerError(f"{tok_file}: not a tokenizers file: {err}") from err
        config: dict = {}
        cfg_file = folder / CONFIG_FILE
        if cfg_file.is_file():
            try:
                config = json.loads(_utf8_text(cfg_file))
            except json.JSONDecodeError as err:
                raise TokenizerError(f"{cfg_file}: invalid JSON: {err}") from err
            if not isinstance(config, dict):
                raise TokenizerError(f"{cfg_file}: expected a JSON object, got a {type(config).__name__}")
        template, source = None, f"{cfg_file} 'chat_template'"
        if (folder / TEMPLATE_FILE).is_file():
            template, source = _utf8_text(folder / TEMPLATE_FILE), str(folder / TEMPLATE_FILE)
        return cls(tok, config, template, template_source=source)

    def save_pretrained(self, folder: str | os.PathLike) -> list[str]:
        """Write tokenizer.json and tokenizer_config.json (with the chat template), atomically."""
        out = Path(folder)
        out.mkdir(parents=True, exist_ok=True)
        config = dict(self.config)
        if self.chat_template is not None:
            config["chat_template"] = self.chat_template
        written = []
        for name, text in (
            (TOKENIZER_FILE, self.tokenizer.to_str(pretty=True)),
            (CONFIG_FILE, json.dumps(config, indent=2, sort_keys=True, ensure_ascii=False) + "\n"),
        ):
            tmp = out / f".{name}.tmp.{os.getpid()}"
            tmp.write_text(text, encoding="utf-8")
            os.replace(tmp, out / name)
            written.append(str(out / name))
        return written

    # ------------------------------------------------------------------ special tokens
    def _special(self, key: str) -> str | None:
        return _token_text(self.config.get(key))

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self.tokenizer.token_to_id(token)

    @property
    def eos_token(self) -> str | None:
        return self._special("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self._special("pad_token")

    @property
    def eos_token_id(self) -> int | None:
        return self.token_to_id(self.eos_token)

    @property
    def pad_token_id(self) -> int | None:
        return self.token_to_id(self.pad_token)

    @property
    def vocab_size(self) -> int:
        return self.tokenizer.get_vocab_size(with_added_tokens=True)

    # ------------------------------------------------------------------ text
    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=add_special_tokens).ids)

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = False) -> str:
        return self.tokenizer.decode([int(i) for i in ids], skip_special_tokens=skip_special_tokens)

    def __call__(self, text: str) -> list[int]:
        return self.encode(text)

    # ------------------------------------------------------------------ chat
    def _compiled_template(self) -> Any:
        if not self.chat_template:
            raise TokenizerError("this tokenizer has no chat template (tokenizer_config.json 'chat_template')")
        cached = getattr(self, "_template_cache", None)
        if cached is not None and cached[0] == self.chat_template:
            return cached[1]
        from jinja2.exceptions import TemplateError, TemplateSyntaxError
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        def raise_exception(message: str) -> None:
            raise TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, keep_trailing_newline=True)
        env.filters["tojson"] = lambda x, indent=None, ensure_ascii=False: json.dumps(
            x, indent=indent, ensure_ascii=ensure_ascii
        )
        env.globals["raise_exception"] = raise_exception
        try:
            compiled = env.from_string(self.chat_template)
        except TemplateSyntaxError as err:
            raise TokenizerError(
                f"{self.template_source}: chat template syntax error at line {err.lineno}: {err.message}"
            ) from err
        self._template_cache = (self.chat_template, compiled)
        return compiled

    def render_chat(self, messages: Sequence[dict], add_generation_prompt: bool = False, **extra: Any) -> str:
        """The conversation as text, per the chat template."""
        for i, m in enumerate(messages):
            if not isinstance(m, dict) or "role" not in m:
                raise TokenizerError(f"message {i}: expected an object with 'role' and 'content', got {m!r}")
        specials = {k: self._special(k) for k in ("bos_token", "eos_token", "pad_token", "unk_token")}
        return self._compiled_template().render(
            messages=list(messages), add_generation_prompt=add_generation_prompt, **specials, **extra
        )

    def apply_chat_template(
        self, messages: Sequence[dict], tokenize: bool = True, add_generation_prompt: bool = False, **extra: Any
    ) -> list[int] | str:
        """HF's call: the rendered conversation, as token ids (default) or as text."""
        text = self.render_chat(messages, add_generation_prompt=add_generation_prompt, **extra)
        return self.encode(text) if tokenize else text

    def assistant_spans(self, messages: Sequence[dict]) -> tuple[str, list[tuple[int, int]]]:
        """(rendered conversation, character spans written by the assistant): for each assistant
        message, from the end of the generation prompt before it to the end of its turn."""
        full = self.render_chat(messages)
        spans = []
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            before = self.render_chat(messages[:i], add_generation_prompt=True)
            upto = self.render_chat(messages[: i + 1])
            if not upto.startswith(before) or not full.startswith(upto):
                raise TokenizerError(
                    f"message {i}: the chat template does not render this conversation prefix by prefix, "
                    "so the assistant's tokens cannot be located"
                )
            spans.append((len(before), len(upto)))
        return full, spans

    def encode_chat_for_training(self, messages: Sequence[dict]) -> tuple[list[int], list[bool]]:
        """(token ids of the rendered conversation, per token True when the assistant wrote it).

        A token belongs to the assistant when it starts inside an assistant span; the whole
        conversation is tokenized at once, so the ids are exactly those of the rendered text."""
        text, spans = self.assistant_spans(messages)
        enc = self.tokenizer.encode(text, add_special_tokens=False)
        mask = []
        for start, end in enc.offsets:
            mask.append(any(a <= start < b for a, b in spans) and end > start)
        return list(enc.ids), mask
