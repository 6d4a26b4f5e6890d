"""Tokenizer: a `tokenizers.Tokenizer` plus what HF keeps in tokenizer_config.json (BOS/EOS, chat template).

BOS is added by this wrapper (never by the tokenizer.json post-processor), so encode() adds it exactly
once when `add_bos_token` and `add_special_tokens` are both true.
"""

from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

TOKENIZER_FILE = "tokenizer.json"
CONFIG_FILE = "tokenizer_config.json"
TEMPLATE_FILE = "chat_template.jinja"


class Tokenizer:
    def __init__(self, tokenizer: HFTokenizer, config: dict[str, Any] | None = None,
                 chat_template: str | None = None):
        config = config or {}
        self._tok = tokenizer
        self.bos_token = _token_content(config.get("bos_token"))
        self.eos_token = _token_content(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", True))  # DeepSeek's default
        self.chat_template = chat_template if chat_template is not None else _pick_template(config)
        self.bos_token_id = self._id_of(self.bos_token)
        self.eos_token_id = self._id_of(self.eos_token)
        self.special_token_ids = frozenset(
            i for i, t in tokenizer.get_added_tokens_decoder().items() if t.special)
        self._compiled_template: jinja2.Template | None = None

    def __getstate__(self) -> dict[str, Any]:
        """Picklable (the grammar-check workers receive it): the compiled template is rebuilt on use."""
        return {**self.__dict__, "_compiled_template": None}

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        path = Path(path)
        config = _read_json(path / CONFIG_FILE) if (path / CONFIG_FILE).is_file() else {}
        template_file = path / TEMPLATE_FILE
        template = template_file.read_text(encoding="utf-8") if template_file.is_file() else None
        return cls(_load_tokenizer(path / TOKENIZER_FILE), config, template)

    # ------------------------------------------------------------------ encode / decode
    @property
    def inner(self) -> HFTokenizer:
        return self._tok

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        ids = self._tok.encode(text, add_special_tokens=False).ids
        if add_special_tokens and self.add_bos_token and self.bos_token_id is not None:
            return [self.bos_token_id, *ids]
        return ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    def _id_of(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    # ------------------------------------------------------------------ chat template
    def apply_chat_template(self, messages: list[dict[str, Any]], add_generation_prompt: bool = True,
                            tokenize: bool = False, **template_kwargs: Any) -> str | list[int]:
        """Renders `messages`; extra kwargs (e.g. thinking=True, tools=[...]) reach the template.

        With tokenize=True the rendered text is encoded without adding BOS again (the template has it).
        """
        context = {"bos_token": self.bos_token or "", "eos_token": self.eos_token or "", **template_kwargs}
        text = self._template().render(messages=messages, add_generation_prompt=add_generation_prompt,
                                       **context)
        return self.encode(text, add_special_tokens=False) if tokenize else text

    def _template(self) -> jinja2.Template:
        if self._compiled_template is None:
            if not self.chat_template:
                raise ValueError(f"this tokenizer has no chat template (none in {CONFIG_FILE} "
                                 f"'chat_template' or {TEMPLATE_FILE})")
            self._compiled_template = _chat_environment().from_string(self.chat_template)
        return self._compiled_template


def _load_tokenizer(file: Path) -> HFTokenizer:
    if not file.is_file():
        raise ValueError(f"tokenizer file not found: {file}")
    try:
        return HFTokenizer.from_file(str(file))
    except Exception as exc:  # the Rust loader raises a bare Exception on malformed files
        raise ValueError(f"could not load tokenizer from {file}: {exc}") from exc


def _read_json(file: Path) -> dict[str, Any]:
    try:
        return json.loads(file.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise ValueError(f"could not read {file}: {exc}") from exc


def _token_content(token: Any) -> str | None:
    """bos/eos entries are either a plain string or an AddedToken dict {"content": ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _pick_template(config: dict[str, Any]) -> str | None:
    template = config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template}
        return named.get("default")
    return template


# ---------------------------------------------------------------------------------------- jinja


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _tojson(value: Any, ensure_ascii: bool = False, indent: int | None = None,
            separators: tuple[str, str] | None = None, sort_keys: bool = False) -> str:
    # Like HF's filter (and unlike jinja's own): no HTML escaping, non-ASCII kept as-is.
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                      sort_keys=sort_keys)


def _chat_environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
