"""What ``blockspec generate`` shows while it runs: prefill progress and the streamed text of a single prompt."""

from __future__ import annotations

import sys

LONG_PROMPT = 512  # tokens: prefill progress is shown for prompts this long even when stderr is not a terminal


class PrefillProgress:
    """Prefill progress of one model, on stderr: rewritten in place on a terminal; elsewhere (a pipe, a log file)
    one line per tenth of the prompt, and only for prompts of at least LONG_PROMPT tokens, so that short runs,
    pipes and tests stay clean."""

    def __init__(self, label: str, stream=None):
        self.label, self.stream = label, stream
        self.shown = -1  # the last tenth printed (not on a terminal)

    def __call__(self, done_tokens: int, total_tokens: int) -> None:
        stream = self.stream or sys.stderr
        terminal = stream.isatty()
        if not terminal and total_tokens < LONG_PROMPT:
            return
        line = f"prefilling {self.label}: {done_tokens}/{total_tokens} tokens ({100 * done_tokens // total_tokens}%)"
        if terminal:
            stream.write("\r" + line + ("\n" if done_tokens >= total_tokens else ""))
        else:
            tenth = 10 * done_tokens // max(total_tokens, 1)
            if tenth == self.shown:
                return
            self.shown = tenth
            stream.write(line + "\n")
        stream.flush()


def watch_prefill(model, progress: PrefillProgress) -> None:
    """Route ``model``'s prefill progress to ``progress``, for models that report it (HFModel's ``on_prefill``,
    called after each prefill forward as on_prefill(done_tokens, total_tokens)); other models prefill silently."""
    if hasattr(model, "on_prefill"):
        model.on_prefill = progress


class Streamer:
    """Prints a single row's text as its tokens are accepted. It decodes a window of the row's latest tokens, not
    the whole row (which would cost O(n^2) over a long answer): the window starts WINDOW tokens back, at a point
    already printed, so a multi-byte character split across tokens comes out whole. A character still incomplete
    when the row ends is printed as the decoded text has it (U+FFFD), so the printed text is ``result.texts``."""

    WINDOW = 64  # tokens kept as the decoding window's context once printed

    def __init__(self, tokenizer):
        self.tokenizer, self.tokens, self.shown = tokenizer, [], ""

    def __call__(self, row: int, tokens: list[int]) -> None:
        self.tokens += tokens
        text = self._decode()
        if text.endswith("\ufffd"):  # an incomplete character: wait for the next tokens
            return
        self._write(text)
        if len(self.tokens) > 2 * self.WINDOW:  # everything is printed: keep only the window's context
            self.tokens = self.tokens[-self.WINDOW :]
            self.shown = self._decode()

    def close(self) -> None:
        self._write(self._decode())
        sys.stdout.write("\n")
        sys.stdout.flush()

    def _decode(self) -> str:
        return self.tokenizer.decode(self.tokens, skip_special_tokens=True)

    def _write(self, text: str) -> None:
        sys.stdout.write(text[len(self.shown) :])
        sys.stdout.flush()
        self.shown = text
