"""`specctl generate --local`: the in-process engine (`specd.Engine`), streamed and
detokenized exactly as the daemon does it (same detokenizer, same stop-string rule), so the
two paths can be compared token for token and character for character."""

from __future__ import annotations

from collections.abc import Iterator

from specd.daemon.detokenizer import IncrementalDetokenizer
from specd.ipc.generation import GenerateResult, StreamDelta
from specd.ipc.sampling import SamplingParams

REQUEST_ID = "local-0"


class LocalGeneration:
    """One request on a private `specd.Engine`; iterate `deltas()`, then read `result`."""

    def __init__(self, model: str | None, text: str, messages: list[dict[str, str]] | None,
                 sampling: SamplingParams) -> None:
        from specd.workers.engine.api import Engine  # torch: only on the --local path

        self.engine = Engine(model=model)
        tokenizer = self.engine.tokenizer
        prompt = tokenizer.apply_chat_template(messages) if messages else text
        # A rendered chat holds its own special tokens (the daemon encodes it the same way).
        self.prompt_token_ids = tokenizer.encode(prompt, add_special_tokens=not messages)
        self.sampling = sampling
        self.detokenizer = IncrementalDetokenizer(tokenizer, sampling.stop)
        self.result: GenerateResult | None = None

    def deltas(self) -> Iterator[StreamDelta]:
        core = self.engine.core
        core.add_request(REQUEST_ID, self.prompt_token_ids, self.sampling)
        token_ids: list[int] = []
        while self.result is None:
            for delta in core.step():
                if delta.request_id != REQUEST_ID:
                    continue
                token_ids.extend(delta.new_token_ids)
                text = self.detokenizer.add(delta.new_token_ids)
                reason = delta.finish_reason
                if reason is None and self.detokenizer.is_stopped:
                    core.abort_request(REQUEST_ID)
                    reason = "stop"
                if reason is not None:
                    text += self.detokenizer.finish()
                    self.result = GenerateResult(
                        text=self.detokenizer.text, token_ids=token_ids, finish_reason=reason,
                        num_prompt_tokens=delta.num_prompt_tokens,
                        num_output_tokens=delta.num_output_tokens,
                        num_cached_tokens=delta.num_cached_tokens,
                        num_drafted=delta.num_drafted, num_accepted=delta.num_accepted,
                        acceptance_length=0.0, stop_string=self.detokenizer.stop_string,
                        logprobs=[])
                if text or delta.new_token_ids:
                    yield StreamDelta(text, delta.new_token_ids)
