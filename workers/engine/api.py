"""The in-process API: `specd.Engine(model=None, **options).generate(prompts, sampling)`."""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, fields
from types import TracebackType
from typing import Any

from specd.ipc.sampling import SamplingParams
from specd.model_fit import check_vocabulary, declared_special_ids, tokenizer_misfits
from specd.tokenizer import TOKENIZER_FILES, Tokenizer
from specd.workers.config import EngineConfig
from specd.workers.engine.core import EngineCore
from specd.workers.models.config import ModelConfig
from specd.workers.named_models import ensure_imported, named_model

log = logging.getLogger("specd.engine")


@dataclass(frozen=True)
class GenerateOutput:
    """One prompt's result from `Engine.generate`."""

    prompt_token_ids: list[int]
    token_ids: list[int]
    text: str
    finish_reason: str


class Engine:
    """In-process API: `Engine(model=None, **options).generate(prompts, sampling)`.

    `model=None` serves the embedded fixture model; option names are EngineConfig fields,
    which match the daemon's CLI flags.

    With `tensor_parallel_size` > 1 the engine starts a worker process per extra rank,
    which lives until `close()` (or the end of a `with Engine(...) as engine:` block) stops
    it, or until this process exits. `close()` may be called more than once; after it,
    `generate` and `stream` raise RuntimeError.
    """

    def __init__(self, model: str | None = None, **options: Any) -> None:
        known = {f.name for f in fields(EngineConfig)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise TypeError(f"unknown engine option(s) {unknown}; known: {sorted(known)}")
        self.config = EngineConfig(model=model, **options)
        named = named_model(self.config.model or "fixture")
        if named is not None:
            ensure_imported(named)  # a named model imported from a GGUF file, once
        # Token-id prompts work without a tokenizer (tiny test models have none).
        has_tokenizer = any((self.config.model_path / name).is_file()
                            for name in TOKENIZER_FILES)
        self.tokenizer = Tokenizer.from_dir(self.config.model_path) if has_tokenizer else None
        if self.tokenizer is not None:  # before the weights load, as the daemon does
            vocab_size = ModelConfig.from_dir(self.config.model_path).vocab_size
            check_vocabulary(self.tokenizer.num_named_ids, vocab_size, self.config.model_path)
            misfits = tokenizer_misfits(self.tokenizer, vocab_size,
                                        declared_special_ids(self.config.model_path))
            if misfits:
                log.warning("the tokenizer of %s looks like another model's: %s",
                            self.config.model_path, "; ".join(misfits),
                            extra={"event": "tokenizer_misfit", "evidence": misfits})
        self.core = EngineCore(self.config)
        self._next_id = 0
        self.is_closed = False

    def close(self) -> None:
        """Stop the worker ranks (tensor parallelism; nothing to stop in one process) and
        wait for them to exit. Idempotent."""
        if not self.is_closed:
            self.is_closed = True
            self.core.close()

    def __enter__(self) -> Engine:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def _prompt_ids(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError(f"{self.config.model_path} has no tokenizer "
                                 f"({' or '.join(TOKENIZER_FILES)}): pass prompts as "
                                 "token-id lists")
            return self.tokenizer.encode(prompt)
        if not all(isinstance(t, int) for t in prompt):
            raise TypeError("a prompt is a string or a list of token ids")
        return list(prompt)

    def _add(self, prompt: str | list[int], sampling: SamplingParams) -> tuple[str, list[int]]:
        if self.is_closed:
            raise RuntimeError("the engine is closed")
        request_id = f"req-{self._next_id}"
        self._next_id += 1
        ids = self._prompt_ids(prompt)
        self.core.add_request(request_id, ids, sampling)
        return request_id, ids

    def generate(
        self,
        prompts: Sequence[str | list[int]],
        sampling: SamplingParams | Sequence[SamplingParams] | None = None,
    ) -> list[GenerateOutput]:
        """Generate for every prompt (strings or token-id lists), all batched together.
        `sampling` is one SamplingParams for all prompts or one per prompt."""
        if isinstance(prompts, str):
            raise TypeError("prompts must be a list of strings or of token-id lists")
        params = _per_prompt(sampling, len(prompts))
        order: list[str] = []
        prompt_ids: dict[str, list[int]] = {}
        tokens: dict[str, list[int]] = {}
        reasons: dict[str, str] = {}
        try:
            for prompt, p in zip(prompts, params, strict=True):
                request_id, ids = self._add(prompt, p)
                order.append(request_id)
                prompt_ids[request_id] = ids
                tokens[request_id] = []
        except (ValueError, TypeError):
            # All or nothing: a bad prompt must not leave the good ones queued.
            for request_id in order:
                self.core.abort_request(request_id)
            raise
        while self.core.has_unfinished():
            for delta in self.core.step():
                tokens[delta.request_id].extend(delta.new_token_ids)
                if delta.finish_reason is not None:
                    reasons[delta.request_id] = delta.finish_reason
        return [GenerateOutput(prompt_ids[r], tokens[r], self.decode(tokens[r]), reasons[r])
                for r in order]

    def decode(self, token_ids: list[int]) -> str:
        """Text of `token_ids`; empty when the model directory has no tokenizer."""
        return self.tokenizer.decode(token_ids) if self.tokenizer is not None else ""

    def stream(self, prompt: str | list[int], sampling: SamplingParams | None = None
               ) -> Iterator[list[int]]:
        """Yield each step's new token ids for one prompt (for `specctl generate --local`)."""
        request_id, _ = self._add(prompt, sampling or SamplingParams())
        done = False
        try:
            while not done and self.core.has_unfinished():
                for delta in self.core.step():
                    if delta.request_id != request_id:
                        continue
                    done = delta.finish_reason is not None
                    if delta.new_token_ids:
                        yield delta.new_token_ids
        finally:
            if not done:
                self.core.abort_request(request_id)


def _per_prompt(
    sampling: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if sampling is None:
        return [SamplingParams()] * n
    if isinstance(sampling, SamplingParams):
        return [sampling] * n
    params = list(sampling)
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts")
    return params
