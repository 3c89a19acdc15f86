"""Generated tokens -> the text a client sees: incremental detokenization, then stop strings."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from services.proxy.detokenizer import IncrementalDetokenizer, Tokenizer
from services.proxy.request import Output
from services.proxy.stop_strings import StopMatcher


class OutputText:
    def __init__(self, tokenizer: Tokenizer, stops: Sequence[str], prompt_tokens: int) -> None:
        self.detokenizer = IncrementalDetokenizer(tokenizer)
        self.matcher = StopMatcher(stops)
        self.prompt_tokens = prompt_tokens
        self.completion_tokens = 0

    @property
    def stopped(self) -> bool:
        """A stop string matched: the request is over, whatever the engine does next."""
        return self.matcher.stopped

    def add(self, token_ids: Iterable[int]) -> Output:
        """Tokens after a stop string match are dropped and not counted."""
        out = self._output()
        for token in token_ids:
            self.completion_tokens += 1
            out.token_ids.append(token)
            out.text += self.matcher.feed(self.detokenizer.add(token))
            if self.stopped:
                return self._finish_stopped(out)
        out.completion_tokens = self.completion_tokens
        return out

    def finish(self, reason: str) -> Output:
        out = self._output()
        out.text = self.matcher.feed(self.detokenizer.flush())
        if self.stopped:
            return self._finish_stopped(out)
        out.text += self.matcher.flush()
        out.finish_reason = reason
        return out

    def _finish_stopped(self, out: Output) -> Output:
        out.finish_reason = "stop"
        out.completion_tokens = self.completion_tokens
        return out

    def _output(self) -> Output:
        return Output(prompt_tokens=self.prompt_tokens, completion_tokens=self.completion_tokens)
