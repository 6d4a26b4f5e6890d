"""DeepSeek thinking mode: split generated text into `reasoning_content` and `content`.

With thinking on, the chat template ends the prompt with `<think>`; the model writes its reasoning,
then `</think>`, then the answer. Without thinking the template ends the prompt with `</think>` and
everything generated is content. A model may repeat the opening `<think>`; it is dropped.

Every DeepSeek family uses these markers: V3 / R1 / V3.1 through their Jinja templates, V3.2 / V4 / V4.1
through DeepSeek's encoders (server/tool_formats.py), whose prompts end with `<think>` after
`<｜Assistant｜>` or, in V3.2, after a turn's tool results; V4.1 thinks unless `thinking` is false. Tool calls
are parsed from the content only (after `</think>`). Where a tokenizer marks `<think>` / `</think>` special,
chat outputs keep them in the text this split reads (tool_formats.output_decoder).

Invariant (tested): for every way of cutting a text into deltas, the concatenated reasoning and
content deltas of ReasoningStream equal split_reasoning(text) (None reads as "").
"""

from __future__ import annotations

THINK_START, THINK_END = "<think>", "</think>"


def thinking_enabled(prompt_text: str) -> bool:
    """Whether the rendered prompt leaves the model inside a thinking block."""
    return prompt_text.rstrip().endswith(THINK_START)


def split_reasoning(text: str) -> tuple[str, str | None]:
    """(reasoning, content) of a whole output; content is None while `</think>` has not come."""
    text = text.removeprefix(THINK_START)
    reasoning, found, content = text.partition(THINK_END)
    return (reasoning, content) if found else (text, None)


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper prefix of `marker` (it may still complete)."""
    for size in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-size:]):
            return size
    return 0


class ReasoningStream:
    """Incremental split for streaming. Text that might be the start of a marker is held back
    until the next delta decides it (or until `final`)."""

    def __init__(self) -> None:
        self._pending = ""  # undecided text while still reasoning
        self._at_start = True  # a leading <think> may still be arriving
        self._in_content = False

    @property
    def in_content(self) -> bool:
        """`</think>` has come: everything from now on is content."""
        return self._in_content

    def feed(self, delta: str, final: bool = False) -> tuple[str, str]:
        """(reasoning delta, content delta) for `delta`; `final` flushes everything held back."""
        if self._in_content:
            return "", delta
        self._pending += delta
        if self._at_start and not self._skip_start(final):
            return "", ""
        return self._split_pending(final)

    def _skip_start(self, final: bool) -> bool:
        """Drops a leading <think>; False while the pending text could still become one."""
        if THINK_START.startswith(self._pending) and not final:
            return False
        self._pending = self._pending.removeprefix(THINK_START)
        self._at_start = False
        return True

    def _split_pending(self, final: bool) -> tuple[str, str]:
        before, found, after = self._pending.partition(THINK_END)
        if found:
            self._pending, self._in_content = "", True
            return before, after
        keep = 0 if final else _partial_suffix(self._pending, THINK_END)
        cut = len(self._pending) - keep
        reasoning, self._pending = self._pending[:cut], self._pending[cut:]
        return reasoning, ""
