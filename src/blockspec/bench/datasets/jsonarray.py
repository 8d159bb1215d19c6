"""A streaming reader of a top-level JSON array that stops cleanly at a truncated tail (the ShareGPT file is cut)."""

from __future__ import annotations

import json
import logging
import re
from collections.abc import Iterator
from typing import Any, TextIO

log = logging.getLogger(__name__)

_WHITESPACE = re.compile(r"[ \t\n\r]*")


def iter_json_array(stream: TextIO, chunk_size: int = 1 << 20) -> Iterator[Any]:
    """Yield the elements of a top-level JSON array one at a time, stopping cleanly at a truncated tail.

    Reads `stream` in chunks and decodes one element at a time with `json.JSONDecoder.raw_decode`, so memory
    holds one chunk plus the element being decoded, not the whole array. Every element yielded is complete;
    when the input ends inside an element (or inside the array after a complete one), what was complete is
    kept and the broken tail is dropped with an INFO log line saying how many characters were lost. A
    corrupt element before the end stops the reader the same way (it cannot tell a corrupt element from a
    cut one); the log line gives the character offset where it stopped.

    Raises ValueError if the input does not start with "[" or has something other than "," or "]" after an
    element.
    """
    decoder = json.JSONDecoder()
    buf = ""
    pos = 0  # next unread character of buf
    dropped = 0  # characters discarded from the front of buf (to report absolute offsets)
    eof = False

    def read_more() -> bool:
        nonlocal buf, pos, dropped, eof
        if eof:
            return False
        # Read at least as much as is buffered: an element larger than a chunk is re-decoded from its start
        # after each read, and doubling keeps that linear rather than quadratic in the element's size.
        chunk = stream.read(max(chunk_size, len(buf) - pos))
        if not chunk:
            eof = True
            return False
        buf, dropped, pos = buf[pos:] + chunk, dropped + pos, 0
        return True

    def truncated(what: str) -> None:
        log.info(
            "JSON array truncated at character %d (%s): kept %d complete elements, dropped %d characters",
            dropped + pos,
            what,
            count,
            len(buf) - pos,
        )

    count = 0
    state = "open"  # open: expect "["; first: a value or "]"; value: a value; separator: "," or "]"
    while True:
        pos = _WHITESPACE.match(buf, pos).end()  # pyright: ignore[reportOptionalMemberAccess]  (matches "" at worst)
        if pos == len(buf):
            if read_more():
                continue
            if state == "open":
                raise ValueError("empty input: expected a JSON array")
            return truncated("end of input before the closing bracket")
        char = buf[pos]
        if state == "open":
            if char != "[":
                raise ValueError(f"expected a JSON array, found {char!r} at character {dropped + pos}")
            pos, state = pos + 1, "first"
            continue
        if state == "separator":
            if char == "]":
                return
            if char != ",":
                raise ValueError(
                    f"expected ',' or ']' after element {count}, found {char!r} at character {dropped + pos}"
                )
            pos, state = pos + 1, "value"
            continue
        if char == "]" and state == "first":
            return
        try:
            value, end = decoder.raw_decode(buf, pos)
        except json.JSONDecodeError:
            if read_more():
                continue
            return truncated("inside an element")
        # A number that ends exactly at the end of the buffer may go on in the next chunk ("12" of "123");
        # objects, arrays, strings and true/false/null end with their own closing character.
        if end == len(buf) and char not in '{["tfn':
            if read_more():
                continue
            return truncated("a number at the end of input")
        yield value
        count += 1
        pos, state = end, "separator"
