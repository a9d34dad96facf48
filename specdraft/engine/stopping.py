"""Stop conditions applied token by token, so nothing past EOS, a stop string or max_tokens is ever emitted,
even when it sits inside an accepted block of draft tokens."""

from __future__ import annotations

from dataclasses import dataclass, field

from specdraft.runtime.tokenizer import StreamDecoder, Tokenizer
from specdraft.verify.sampling import SamplingParams


@dataclass
class OutputAssembler:
    tokenizer: Tokenizer
    params: SamplingParams
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted_chars: int = 0  # how much of `text` was already streamed
    finish_reason: str | None = None
    _decoder: StreamDecoder | None = None

    def __post_init__(self) -> None:
        self._decoder = StreamDecoder(self.tokenizer)
        # Stream text lags this many chars behind, since they could still turn out to start a stop string.
        self._holdback = max((len(s) for s in self.params.stop), default=1) - 1

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def add(self, token: int) -> None:
        """Append one generated token and decide whether generation ends with it."""
        if self.finished:
            raise RuntimeError("add() after the request finished")
        self.token_ids.append(token)
        if token in self.tokenizer.eos_token_ids and not self.params.ignore_eos:
            self.finish_reason = "stop"
            self.text += self._decoder.flush()
            return
        previous_len = len(self.text)
        self.text += self._decoder.push([token])
        if self.params.stop:
            # A new match must end in the new text: search only from where such a match could start.
            window_start = max(0, previous_len - self._holdback)
            hits = [i for s in self.params.stop if (i := self.text.find(s, window_start)) >= 0]
            if hits:
                self.text = self.text[:min(hits)]
                self.finish_reason = "stop"
                return
        if len(self.token_ids) >= self.params.max_tokens:
            self.text += self._decoder.flush()
            self.finish_reason = "length"

    def take_delta(self) -> str:
        """Text that is final and not streamed yet."""
        end = len(self.text) if self.finished else max(self.emitted_chars, len(self.text) - self._holdback)
        delta = self.text[self.emitted_chars:end]
        self.emitted_chars = end
        return delta
