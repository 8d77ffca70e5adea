"""The model's tokenizer: `tokenizer.json` (through `tokenizers`) or `tiktoken.model` (through
`tiktoken`, `tiktoken_tokenizer.py`), and its chat templates (`chat_template.py`).

No torch here: the front process tokenizes and detokenizes. The two file formats are two
`TokenizerBackend`s behind one `Tokenizer`; `tokenizer.json` wins when a model has both,
and a model with neither fails to load (ValueError naming both files).

Special tokens around a prompt follow the tokenizer's own rule, as transformers'
AutoTokenizer does: for `tokenizer.json`, its post-processor (Llama-3's adds
`<|begin_of_text|>`); for a `tokenizer.json` without one, and for `tiktoken.model`,
`tokenizer_config.json`'s `add_bos_token` / `add_eos_token` (both false when absent; Kimi
sets neither). The rule is read once at load as the ids it puts before and after a prompt
(`prefix_ids`, `suffix_ids`). `encode(text)` adds them, except a prefix the text's own
tokens already start with: a prompt that begins with its BOS never gets a second one.
`encode(text, add_special_tokens=False)` adds none; a rendered chat template is encoded so,
since the template writes its own special tokens (transformers' `apply_chat_template` does
the same).

Chat requests reach the template as the model's tokenizer class would hand them on: for a
`tiktoken.model` model, its class is read from its file as data (`tokenizer_code.py`) and
what its `apply_chat_template` does first (Kimi's: tool keys sorted; K2.5's: tools declared
in TypeScript as `tools_ts_str`, `thinking` true unless the request says otherwise) is done by
`chat_preparation.py`. A `tokenizer.json` model's tools and kwargs reach the template as given.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol

from tokenizers import Tokenizer as HFTokenizer

from specd.chat_preparation import ChatPreparation
from specd.chat_template import SPECIAL_TOKEN_NAMES, ChatTemplates, Message, TemplateError
from specd.tiktoken_tokenizer import TIKTOKEN_FILE, TiktokenBackend, class_code
from specd.token_bound import bytes_per_token_bound

__all__ = ["TOKENIZER_FILES", "Message", "TemplateError", "Tokenizer", "TokenizerBackend"]

HF_TOKENIZER_FILE = "tokenizer.json"
TOKENIZER_FILES = (HF_TOKENIZER_FILE, TIKTOKEN_FILE)  # in the order they are looked for


class TokenizerBackend(Protocol):
    """Text <-> ids for one file format. `encode` adds no special tokens of its own (special
    tokens written in the text are encoded as such); `decode` of ids with no token gives
    nothing for them. `max_bytes_per_token`: the most UTF-8 bytes of prompt text one token
    can stand for (`token_bound.py`), or None, `bound_reason` saying why. `num_named_ids`:
    the embedding rows the tokenizer needs (`vocab_size` less unnamed reserved ids at the
    top, which only their own text in a prompt gives)."""

    vocab_size: int
    num_named_ids: int
    max_bytes_per_token: int | None
    bound_reason: str

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str: ...

    def token_to_id(self, token: str) -> int | None: ...


class HFBackend:
    """A `tokenizer.json` through the `tokenizers` library."""

    def __init__(self, tokenizer: HFTokenizer, max_bytes_per_token: int | None,
                 bound_reason: str) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = tokenizer.get_vocab_size(with_added_tokens=True)
        self.num_named_ids = self.vocab_size
        self.max_bytes_per_token = max_bytes_per_token
        self.bound_reason = bound_reason

    @classmethod
    def from_file(cls, path: Path) -> HFBackend:
        """Raises ValueError naming the file when it does not parse or load."""
        text = _read_text(path)
        spec = _parse_json(text, path)
        try:
            tokenizer = HFTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ValueError(f"{path}: not a tokenizer the `tokenizers` library can "
                             f"load: {exc}") from exc
        # The front counts a prompt's real tokens: a tokenizer.json that truncates or pads
        # would hide a prompt that is too long, or add tokens nobody sent.
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return cls(tokenizer, *bytes_per_token_bound(spec))

    def encode(self, text: str) -> list[int]:
        """Releases the GIL while it tokenizes (the batch entry point of `tokenizers` does;
        the single-text `encode` does not), so a large prompt can be tokenized on a worker
        thread while the front's event loop runs on."""
        ids: list[int] = self._tokenizer.encode_batch_fast([text], add_special_tokens=False)[0].ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def token_to_id(self, token: str) -> int | None:
        return self._tokenizer.token_to_id(token)

    def post_processor_affixes(self) -> tuple[list[int], list[int]] | None:
        """(ids before, ids after) a text that the post-processor adds; None without one.
        Found by encoding a probe with and without it (post-processors only add tokens)."""
        if self._tokenizer.post_processor is None:
            return None
        probe = next((p for p in ("a", "0", ".", " ") if self._tokenizer.encode(
            p, add_special_tokens=False).ids), "")
        plain = self._tokenizer.encode(probe, add_special_tokens=False).ids
        full = self._tokenizer.encode(probe, add_special_tokens=True).ids
        if not plain:
            return full, []
        for i in range(len(full) - len(plain) + 1):
            if full[i:i + len(plain)] == plain:
                return full[:i], full[i + len(plain):]
        raise ValueError("tokenizer.json: its post-processor changes a text's own tokens")


class Tokenizer:
    """Encode text, decode ids, render chat messages. Immutable after construction.

    `prefix_ids` / `suffix_ids`: the special tokens `encode` puts around a prompt (module
    docstring). `max_bytes_per_token` / `bound_reason`: the backend's byte bound per token.
    `vocab_size` / `num_named_ids`: the backend's. `chat_preparation`: what the model's
    tokenizer class does to a chat request before its template renders (module docstring).
    """

    def __init__(self, backend: TokenizerBackend, config: Mapping[str, Any],
                 prefix_ids: Sequence[int], suffix_ids: Sequence[int],
                 eos_token_ids: tuple[int, ...], chat_templates: ChatTemplates,
                 chat_preparation: ChatPreparation) -> None:
        self._backend = backend
        self.special_tokens = {name: text for name in SPECIAL_TOKEN_NAMES
                               if (text := _token_text(config.get(name))) is not None}
        self.bos_token = self.special_tokens.get("bos_token")
        self.eos_token = self.special_tokens.get("eos_token")
        self.prefix_ids = tuple(prefix_ids)
        self.suffix_ids = tuple(suffix_ids)
        self.eos_token_ids = eos_token_ids
        self.chat_templates = chat_templates
        self.chat_preparation = chat_preparation
        self.vocab_size = backend.vocab_size
        self.num_named_ids = backend.num_named_ids
        self.max_bytes_per_token = backend.max_bytes_per_token
        self.bound_reason = backend.bound_reason

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load the tokenizer of the model in `path` (+ `tokenizer_config.json`, the chat
        templates, `generation_config.json` for EOS ids).

        Raises ValueError naming what is missing when there is neither tokenizer file, and
        naming the file for one that does not parse; OSError for one that cannot be read.
        """
        root = Path(path)
        config = _read_json(root / "tokenizer_config.json")
        backend: TokenizerBackend
        affixes = None
        preparation = ChatPreparation()
        if (root / HF_TOKENIZER_FILE).is_file():
            hf_backend = HFBackend.from_file(root / HF_TOKENIZER_FILE)
            backend, affixes = hf_backend, hf_backend.post_processor_affixes()
        elif (root / TIKTOKEN_FILE).is_file():
            code = class_code(root, config)
            backend = TiktokenBackend.from_dir(root, config, code)
            if code is not None:
                preparation = code.chat
        else:
            raise ValueError(f"{root}: no tokenizer: neither {HF_TOKENIZER_FILE} nor "
                             f"{TIKTOKEN_FILE} in the model directory")
        prefix, suffix = affixes if affixes is not None else _flag_affixes(backend, config)
        eos_ids = _eos_ids(root, backend, _token_text(config.get("eos_token")))
        return cls(backend, config, prefix, suffix, eos_ids, ChatTemplates.from_dir(root, config),
                   preparation)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of `text`; with `add_special_tokens`, the tokenizer's prompt rule
        (`prefix_ids`, unless the text's tokens already start with them; `suffix_ids`).
        Releases the GIL while tokenizing (both backends do)."""
        ids = self._backend.encode(text)
        if not add_special_tokens or not (self.prefix_ids or self.suffix_ids):
            return ids
        prefix = self.prefix_ids if tuple(ids[:len(self.prefix_ids)]) != self.prefix_ids else ()
        return [*prefix, *ids, *self.suffix_ids]

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._backend.decode(ids, skip_special_tokens=skip_special_tokens)

    def token_to_id(self, token: str) -> int | None:
        """The id of the token spelled `token` (a special token's text), None if none."""
        return self._backend.token_to_id(token)

    def apply_chat_template(self, messages: Sequence[Message],
                            tools: Sequence[Mapping[str, Any]] | None = None,
                            add_generation_prompt: bool = True, **template_kwargs: Any) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...]), as
        transformers' `apply_chat_template(..., tokenize=False)` renders it, after the
        model's tokenizer class prepared the request (`chat_preparation`): `tools` (JSON
        schemas) pick the "tool_use" template when the model names one; `template_kwargs`
        (e.g. `enable_thinking`, `thinking`) are template variables and override the
        special tokens. Encode the result with `add_special_tokens=False`. Raises
        TemplateError."""
        template = self.chat_templates.select(has_tools=tools is not None)
        prepared, kwargs = self.chat_preparation.prepare(tools, template_kwargs)
        variables = {**self.special_tokens, **kwargs, "documents": None, "tools": prepared,
                     "add_generation_prompt": add_generation_prompt}
        return template.render(messages, variables)


def _flag_affixes(backend: TokenizerBackend, config: Mapping[str, Any]
                  ) -> tuple[list[int], list[int]]:
    """BOS / EOS around a prompt from tokenizer_config.json's add_bos_token / add_eos_token."""
    def flagged(flag: str, name: str) -> list[int]:
        token = _token_text(config.get(name))
        token_id = backend.token_to_id(token) if token is not None else None
        return [token_id] if config.get(flag) is True and token_id is not None else []
    return flagged("add_bos_token", "bos_token"), flagged("add_eos_token", "eos_token")


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return value if isinstance(value, str) else None


def _read_json(path: Path) -> dict[str, Any]:
    """The JSON object in `path` ({} when there is no such file); ValueError naming the
    file when it is not a JSON object."""
    if not path.is_file():
        return {}
    return _parse_json(_read_text(path), path)


def _read_text(path: Path) -> str:
    try:
        return path.read_bytes().decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{path}: not UTF-8: {exc}") from exc


def _parse_json(text: str, path: Path) -> dict[str, Any]:
    try:
        data = json.loads(text)
    except ValueError as exc:
        raise ValueError(f"{path}: not valid JSON: {exc}") from exc
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


def _eos_ids(root: Path, backend: TokenizerBackend, eos_token: str | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer's eos_token."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(root / name).get("eos_token_id")
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value:
            return tuple(int(v) for v in value)
    eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
    return (eos_id,) if eos_id is not None else ()
