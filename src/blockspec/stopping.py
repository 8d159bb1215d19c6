"""Where a row ends: at its first EOS (kept), at the end of a stop string, or at its token limit."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


class Stopper:
    """Cuts each step's new tokens where the row ends.

    Stop strings are matched on the text the user gets (``GenerationResult.texts``: special tokens skipped), less
    a last character still cut (its U+FFFD stands for bytes a later token may complete; a stop string waits for
    the token that settles it, so a stop string ending in a real U+FFFD ends its row one token late). They are
    looked for first in the text of a window: the new tokens and, before them, as many generated tokens other
    than special ones as the longest stop string has UTF-8 bytes, plus 3 (such a token carries at least one byte
    of the text, and the window's first character may be cut: a UTF-8 character spans at most 4 bytes). A stop
    string that ends in the new tokens lies inside that window, so a step decodes a bounded number of tokens
    however long the row (special tokens aside); only a match there (which a cut first character could fake)
    is checked on the row's whole text.
    """

    def __init__(self, eos_ids: Iterable[int], tokenizer, stop_strings: Sequence[str], limit: int):
        self.eos, self.tokenizer = set(eos_ids), tokenizer
        self.stop_strings, self.limit = tuple(stop_strings), limit
        self.window = max((len(s.encode("utf-8")) for s in stop_strings), default=0) + 3
        self.special = set(getattr(tokenizer, "all_special_ids", ()))  # tokens the text skips: no bytes in it

    def cut(self, generated: list[int], new: list[int]) -> tuple[list[int], str | None]:
        """The part of ``new`` that is kept, and why the row finished (None if it goes on)."""
        reason = None
        for n, token in enumerate(new):
            if token in self.eos:
                new, reason = new[: n + 1], "eos"
                break
        if self.stop_strings:
            before = self._tail(generated)
            for n in range(1, len(new) + 1):  # the shortest prefix whose text completes a stop string
                if self._stops(before + new[:n]) and self._stops(generated + new[:n]):
                    new, reason = new[:n], "stop"
                    break
        if len(generated) + len(new) >= self.limit:
            new, reason = new[: self.limit - len(generated)], reason or "length"
        return new, reason

    def _tail(self, generated: list[int]) -> list[int]:
        """The last ``window`` tokens of ``generated`` that are not special (those are skipped in the text)."""
        tail = []
        for token in reversed(generated):
            if len(tail) == self.window:
                break
            if token not in self.special:
                tail.append(token)
        return tail[::-1]

    def _stops(self, tokens: list[int]) -> bool:
        text = self.tokenizer.decode(tokens, skip_special_tokens=True)
        settled = text.rstrip("\ufffd")  # a cut last character decodes as U+FFFD until its bytes are complete
        return any(s in settled for s in self.stop_strings)
