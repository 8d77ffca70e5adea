"""The model's tokenizer: `tokenizer.json` through `tokenizers`, chat templates through jinja2.

No torch here: the front process tokenizes and detokenizes. Chat templates are rendered the
way transformers renders them (a sandboxed jinja2 environment with `trim_blocks`,
`lstrip_blocks`, the `loopcontrols` extension, a `tojson` filter and `raise_exception`),
so a model's own template gives the same text under specd as under transformers.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from datetime import datetime
from functools import cached_property
from pathlib import Path
from typing import Any

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as HFTokenizer

from specd.token_bound import bytes_per_token_bound

Message = Mapping[str, Any]


class TemplateError(ValueError):
    """The chat template raised, or the model has none."""


def _raise_exception(message: str) -> None:
    raise TemplateError(message)


def _tojson(value: Any, indent: int | None = None) -> str:
    return json.dumps(value, indent=indent, ensure_ascii=False)


def _token_text(value: Any) -> str | None:
    """tokenizer_config.json spells special tokens as strings or as AddedToken dicts."""
    if isinstance(value, dict):
        return str(value.get("content")) if value.get("content") is not None else None
    return value if isinstance(value, str) else None


def compile_chat_template(source: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(source)


class Tokenizer:
    """Encode text, decode ids, render chat messages. Immutable after construction.

    `max_bytes_per_token`: the most UTF-8 bytes of prompt text one token can stand for
    (`token_bound`), or None when this tokenizer has no such bound; `bound_reason` says how
    it was found or why there is none.
    """

    def __init__(
        self, backend: HFTokenizer, config: Mapping[str, Any], eos_token_ids: tuple[int, ...],
        max_bytes_per_token: int | None = None, bound_reason: str = "not analysed",
    ) -> None:
        self._backend = backend
        self._config = dict(config)
        self.bos_token = _token_text(config.get("bos_token"))
        self.eos_token = _token_text(config.get("eos_token"))
        self.add_bos_token = bool(config.get("add_bos_token", False))
        self.eos_token_ids = eos_token_ids
        self.vocab_size = backend.get_vocab_size(with_added_tokens=True)
        template = config.get("chat_template")
        if isinstance(template, list):  # named templates: take "default"
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        self.chat_template_source: str | None = template if isinstance(template, str) else None
        self.max_bytes_per_token = max_bytes_per_token
        self.bound_reason = bound_reason

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        """Load `tokenizer.json` (+ `tokenizer_config.json`, `generation_config.json`).

        Raises OSError for a missing or unreadable file and ValueError for one that does
        not parse, naming the file.
        """
        root = Path(path)
        tok_file = root / "tokenizer.json"
        if not tok_file.is_file():
            raise FileNotFoundError(f"{tok_file}: no tokenizer.json in the model directory")
        text = _read_text(tok_file)
        spec = _parse_json(text, tok_file)
        try:
            backend = HFTokenizer.from_str(text)
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ValueError(f"{tok_file}: not a tokenizer the `tokenizers` library can "
                             f"load: {exc}") from exc
        # The front counts a prompt's real tokens: a tokenizer.json that truncates or pads
        # would hide a prompt that is too long, or add tokens nobody sent.
        backend.no_truncation()
        backend.no_padding()
        config = _read_json(root / "tokenizer_config.json")
        eos_ids = _eos_ids(root, backend, _token_text(config.get("eos_token")))
        bound, reason = bytes_per_token_bound(spec)
        return cls(backend, config, eos_ids, bound, reason)

    def encode(self, text: str) -> list[int]:
        """Token ids of `text` (with the BOS token first when the model asks for it).

        Releases the GIL while it tokenizes (the batch entry point of `tokenizers` does;
        the single-text `encode` does not), so a large prompt can be tokenized on a worker
        thread while the front's event loop runs on.
        """
        encoding = self._backend.encode_batch_fast([text], add_special_tokens=False)[0]
        ids: list[int] = encoding.ids
        if self.add_bos_token and self.bos_token is not None:
            bos = self._backend.token_to_id(self.bos_token)
            if bos is not None and (not ids or ids[0] != bos):
                ids = [bos, *ids]
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return str(self._backend.decode(list(ids), skip_special_tokens=skip_special_tokens))

    def id_to_token(self, token_id: int) -> str | None:
        return self._backend.id_to_token(token_id)

    @cached_property
    def _chat_template(self) -> jinja2.Template:
        if self.chat_template_source is None:
            raise TemplateError("this model's tokenizer_config.json has no chat_template")
        return compile_chat_template(self.chat_template_source)

    def apply_chat_template(
        self, messages: Sequence[Message], add_generation_prompt: bool = True
    ) -> str:
        """The prompt text for `messages` ([{"role": ..., "content": ...}, ...])."""
        for i, message in enumerate(messages):
            if not isinstance(message, Mapping) or "role" not in message:
                raise TemplateError(f"messages[{i}] must be a mapping with a 'role'")
        return str(self._chat_template.render(
            messages=list(messages),
            add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "",
            eos_token=self.eos_token or "",
        ))


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


def _eos_ids(root: Path, backend: HFTokenizer, eos_token: str | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, else config.json, else the tokenizer's eos_token."""
    for name in ("generation_config.json", "config.json"):
        value = _read_json(root / name).get("eos_token_id")
        if isinstance(value, int):
            return (value,)
        if isinstance(value, list) and value:
            return tuple(int(v) for v in value)
    eos_id = backend.token_to_id(eos_token) if eos_token is not None else None
    return (eos_id,) if eos_id is not None else ()
