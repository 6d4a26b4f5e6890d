"""Incremental detokenisation of one request's output, with stop-string detection.

Text is produced with the prefix/read-offset scheme: the ids in [prefix, read) were already turned
into text; after each new token we decode [prefix, end) and emit only what extends the decode of
[prefix, read). Text ending in U+FFFD (an incomplete UTF-8 sequence from byte-level BPE) is held
back until the following tokens complete it, so split multi-byte characters never reach the output.
"""

from __future__ import annotations

from typing import Protocol

from deepinfer.sampling_params import SamplingParams

# Prompt tokens decoded as left context so the first output token gets the right spacing.
_PROMPT_CONTEXT_TOKENS = 5
_INCOMPLETE = "\ufffd"


class _Decoder(Protocol):
    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str: ...


class IncrementalDetokenizer:
    """Owns `output_text` / `output_token_ids` for one request.

    Invariant: text already returned by get_delta() is never removed by a later stop-string
    truncation (it lies before the held-back tail of stop_buffer_length characters).
    """

    def __init__(self, tokenizer: _Decoder, prompt_ids: list[int], params: SamplingParams):
        self.tokenizer = tokenizer
        self.params = params
        self.output_text = ""
        self.output_token_ids: list[int] = []
        self.stop_reason: str | None = None  # the stop string that ended the request, if any
        self._ids = list(prompt_ids[-_PROMPT_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._sent_offset = 0  # chars of output_text already handed out by get_delta()

    @property
    def stopped(self) -> bool:
        return self.stop_reason is not None

    def append(self, token_ids: list[int]) -> str | None:
        """Adds tokens one by one; returns the stop string once one occurs in the text.

        Tokens after the one that completes a stop string are ignored (not added to output_token_ids).
        """
        for token_id in token_ids:
            if self.stopped:
                break
            self.output_token_ids.append(token_id)
            if not self.params.detokenize:
                continue
            new_chars = self._decode_next(token_id)
            if new_chars and len(self.output_token_ids) > self.params.min_tokens:
                self.stop_reason = self._find_stop(new_chars)
        return self.stop_reason

    def get_delta(self, finished: bool = False) -> str:
        """Text not yet returned. Until `finished` (or a stop string matched), the last
        stop_buffer_length characters are held back since they may begin a stop string."""
        end = len(self.output_text)
        if not (finished or self.stopped):
            end -= self.params.stop_buffer_length
        if end <= self._sent_offset:
            return ""
        delta = self.output_text[self._sent_offset:end]
        self._sent_offset = end
        return delta

    def _decode_next(self, token_id: int) -> int:
        """Appends `token_id`; returns how many characters were added to output_text."""
        self._ids.append(token_id)
        skip = self.params.skip_special_tokens
        before = self.tokenizer.decode(self._ids[self._prefix_offset:self._read_offset], skip)
        after = self.tokenizer.decode(self._ids[self._prefix_offset:], skip)
        if len(after) <= len(before) or after.endswith(_INCOMPLETE):
            return 0  # nothing new yet, or a multi-byte character is still incomplete
        new_text = after[len(before):]
        self.output_text += new_text
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        return len(new_text)

    def _find_stop(self, new_chars: int) -> str | None:
        """Earliest stop string that overlaps the `new_chars` just added; truncates the text there."""
        text = self.output_text
        best: tuple[int, str] | None = None
        for stop in self.params.stop:
            start = max(0, len(text) - new_chars - len(stop) + 1)
            index = text.find(stop, start)
            if index >= 0 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        end = index + len(stop) if self.params.include_stop_str_in_output else index
        self.output_text = text[:end]
        return stop
