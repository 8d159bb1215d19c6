"""lm1b, pydoc-qa and pydoc-summary: prose and sections of the standard library's pydoc_data.topics.

pydoc_data.topics changes with every Python release, so its sets are keyed by topic names (mostly stable), not
positions; it is imported only when one of these sets is loaded (about 0.8 MB of text).
"""

from __future__ import annotations

import re

from .packages import Prompt

# lm1b-style continuation: paragraphs of at least LM1B_MIN_WORDS words, cut to their first
# LM1B_PREFIX_WORDS words, so the prompt stops mid-paragraph and the model continues the prose.
LM1B_MIN_WORDS = 48
LM1B_PREFIX_WORDS = 32
# pydoc-qa / pydoc-summary: sections of the pydoc topics (a heading and its text up to the next heading) of
# PYDOC_MIN_CHARS to PYDOC_MAX_CHARS characters: enough text to answer from and to summarise, and a prompt that
# stays short (150 to 600 tokens). Blank-line paragraphs that long are rare (36 of prose on Python 3.11.7), hence
# sections.
PYDOC_MIN_CHARS = 600
PYDOC_MAX_CHARS = 2500
# A heading: a line underlined with "*" (a topic's title), "=" or "-" (its sections), as pydoc renders them.
PYDOC_HEADING_RE = re.compile(r"^\S[^\n]*\n([*=-])\1+$", re.MULTILINE)
PYDOC_QA_TEMPLATE = (
    "Here is a section of the Python documentation.\n\n{section}\n\nQuestion: what does this section say about "
    "'{title}'? Quote the sentences of the section that answer it, word for word, then explain them in your own words."
)
PYDOC_SUMMARY_TEMPLATE = "Summarise this section of the Python documentation in three to five sentences.\n\n{section}"


def lm1b() -> list[Prompt]:
    from pydoc_data.topics import topics  # standard library; ~0.8 MB of text, so only when asked for

    prompts, seen = [], set()
    for topic in sorted(topics):
        for index, paragraph in enumerate(re.split(r"\n[ \t]*\n", topics[topic])):
            lines = paragraph.strip("\n").split("\n")
            # Prose only: indented lines are code, grammar or tables; ">>>" is a session; a paragraph that
            # does not start with a capital letter or a quote is a list item or a fragment.
            if any(line.startswith((" ", "\t")) for line in lines) or ">>>" in paragraph:
                continue
            words = paragraph.split()
            if len(words) < LM1B_MIN_WORDS or not (words[0][0].isupper() or words[0][0] in "\"'“"):
                continue
            text = " ".join(words[:LM1B_PREFIX_WORDS])  # re-flowed: pydoc wraps lines at ~70 columns
            if text not in seen:  # some topics repeat paragraphs of others
                seen.add(text)
                prompts.append(Prompt(f"lm1b/{topic}/{index}", text, "lm1b"))
    return prompts


def _pydoc_sections() -> list[tuple[str, str, str]]:
    """("<topic>/<section>", title, text) of the pydoc topics' sections of PYDOC_MIN_CHARS to PYDOC_MAX_CHARS
    characters, by topic name then position. Topics share sections ("for" is a section of "compound" too), often
    at another heading level: a section whose title and body appeared before, whatever its underline, is left out.
    """
    from pydoc_data.topics import topics

    sections, seen = [], set()
    for topic in sorted(topics):
        text = topics[topic]
        starts = [match.start() for match in PYDOC_HEADING_RE.finditer(text)]  # a topic starts with its title
        for index, (start, end) in enumerate(zip(starts, starts[1:] + [len(text)])):
            section = text[start:end].strip()
            if not PYDOC_MIN_CHARS <= len(section) <= PYDOC_MAX_CHARS:
                continue
            title, _, body = section.split("\n", 2)  # the underline between them
            if (title, body) not in seen:
                seen.add((title, body))
                sections.append((f"{topic}/{index}", title, section))
    return sections


def pydoc_qa() -> list[Prompt]:
    return [
        Prompt(f"pydoc-qa/{key}", PYDOC_QA_TEMPLATE.format(section=section, title=title), "pydoc-qa")
        for key, title, section in _pydoc_sections()
    ]


def pydoc_summary() -> list[Prompt]:
    return [
        Prompt(f"pydoc-summary/{key}", PYDOC_SUMMARY_TEMPLATE.format(section=section), "pydoc-summary")
        for key, _, section in _pydoc_sections()
    ]
