"""The engine directory's tokenizer: encode/decode with `tokenizers`, chat templates with jinja2.

Reads tokenizer.json, tokenizer_config.json (bos/eos/pad/unk tokens, add_bos_token, chat_template) and
chat_template.jinja / chat_template.json, which take precedence over tokenizer_config's template as in
transformers. Templates render in the environment transformers gives them (sandboxed, trim_blocks, lstrip_blocks,
loop controls, `raise_exception`, `strftime_now`, a `tojson` that keeps non-ASCII), so checkpoint templates
behave the same here without transformers.
"""
from __future__ import annotations

import json
from datetime import datetime
from pathlib import Path
from typing import Any, Sequence

from engine.core.errors import EngineError
from engine.core.serde import read_json

SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "pad_token", "unk_token")


class Tokenizer:
    def __init__(self, model_dir: Path):
        from tokenizers import Tokenizer as HFTokenizer
        model_dir = Path(model_dir)
        path = model_dir / "tokenizer.json"
        if not path.is_file():
            raise EngineError(f"{path} does not exist; the engine directory has no tokenizer — rebuild it from a "
                              "checkpoint converted from a model directory that has tokenizer.json")
        try:
            self._tok = HFTokenizer.from_file(str(path))
        except Exception as e:  # the Rust side raises a bare Exception
            raise EngineError(f"cannot load {path}: {e}; the file is truncated or corrupt — rebuild the "
                              "engine") from None
        cfg = _read_optional_json(model_dir / "tokenizer_config.json")
        self.special_tokens = {k: _token_text(cfg.get(k)) for k in SPECIAL_TOKEN_KEYS}
        self.add_bos_token = bool(cfg.get("add_bos_token", False))
        self.bos_token_id = self.token_to_id(self.special_tokens["bos_token"])
        self.eos_token_id = self.token_to_id(self.special_tokens["eos_token"])
        self.chat_template = _find_chat_template(model_dir, cfg)
        self._template = None

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    def vocabulary(self) -> dict[str, int]:
        """Every token (added ones included) and its id."""
        return self._tok.get_vocab(with_added_tokens=True)

    def to_json(self) -> str:
        """tokenizer.json's content as `tokenizers` holds it (for llguidance, runtime/structured/)."""
        return self._tok.to_str()

    def is_added_token(self, text: str) -> bool:
        """Whether `text` is one of tokenizer.json's added tokens (a token of its own, such as <tool_call>)."""
        return any(t.content == text for t in self._tok.get_added_tokens_decoder().values())

    def token_to_id(self, token: str | None) -> int | None:
        return None if token is None else self._tok.token_to_id(token)

    def encode(self, text: str, *, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`. With add_special_tokens, tokenizer.json's post-processor runs, and a bos token is
        prepended when tokenizer_config says add_bos_token and the post-processor did not add one."""
        ids = self._tok.encode(text, add_special_tokens=add_special_tokens).ids
        if (add_special_tokens and self.add_bos_token and self.bos_token_id is not None
                and (not ids or ids[0] != self.bos_token_id)):
            ids = [self.bos_token_id] + ids
        return ids

    def decode(self, ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def apply_chat_template(self, messages: list[dict], *, add_generation_prompt: bool = True,
                            **kwargs: Any) -> str:
        """The prompt text of a conversation (encode it with add_special_tokens=False: templates add bos)."""
        if self.chat_template is None:
            raise EngineError("this engine's tokenizer has no chat template (none in tokenizer_config.json or "
                              "chat_template.jinja); send plain prompts instead of chat messages")
        if not isinstance(messages, list) or not all(isinstance(m, dict) for m in messages):
            raise EngineError(f"chat messages must be a list of {{'role', 'content'}} objects, got {messages!r:.80}")
        import jinja2
        try:
            if self._template is None:
                self._template = _jinja_env().from_string(self.chat_template)
            return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt,
                                         **{k: v for k, v in self.special_tokens.items() if v is not None},
                                         **kwargs)
        except jinja2.TemplateError as e:
            raise EngineError(f"the chat template failed on these messages: {e}") from None

    def encode_chat(self, messages: list[dict], **kwargs: Any) -> list[int]:
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)


def _read_optional_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return read_json(path)   # a JSON object, or an EngineError naming the file
    except EngineError as e:
        raise EngineError(f"{e} — rebuild the engine") from None


def _token_text(value) -> str | None:
    # tokenizer_config holds special tokens as strings or as AddedToken dicts {"content": ...}.
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


def _find_chat_template(model_dir: Path, cfg: dict) -> str | None:
    jinja_file = model_dir / "chat_template.jinja"
    if jinja_file.is_file():
        return jinja_file.read_text()
    json_file = _read_optional_json(model_dir / "chat_template.json")
    template = json_file.get("chat_template", cfg.get("chat_template"))
    if isinstance(template, list):  # named templates: [{"name": "default", "template": ...}, ...]
        named = {t.get("name"): t.get("template") for t in template if isinstance(t, dict)}
        template = named.get("default", next(iter(named.values()), None))
    return template if isinstance(template, str) else None


def _raise_exception(message: str):
    from jinja2.exceptions import TemplateError
    raise TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _jinja_env():
    from jinja2.ext import loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env
