"""The package's layers, and a check that every import obeys them (imports inside functions included).

A module may import modules of its own layer and of the layers below it, never above: the verification rules
know nothing of models, models nothing of policies or the engine, and only the command line sees everything.
``verify`` imports torch and the standard library alone. This table is the one place the layers are written.
"""

from __future__ import annotations

import ast
import shutil
import sys
from pathlib import Path

import pytest

import blockspec

LAYERS = (  # lowest first
    ("blockspec.defaults", "blockspec.files", "blockspec.machine", "blockspec.verify"),  # no imports from the package
    ("blockspec.sampling",),  # logits -> probabilities
    ("blockspec.models",),  # adapters, presets, quantization, companions, prompt encoding
    ("blockspec.policy",),  # length policies and what SV runs on
    (  # the loops, ours and vLLM's, and the pieces of ours
        "blockspec.batch",
        "blockspec.checks",
        "blockspec.drafting",
        "blockspec.engine",
        "blockspec.outputs",
        "blockspec.stopping",
        "blockspec.vllm",
    ),
    ("blockspec.auto",),  # machine-aware choices and latency measurement
    ("blockspec.bench",),  # benchmarks, SV calibration and replay
    ("blockspec.cli", "blockspec.__main__"),  # the command line
)
FACADE = "blockspec"  # the package's __init__: lazy re-exports of public names, importable from anywhere
VERIFY_MAY_IMPORT = {"torch", "__future__", "collections", "dataclasses", "functools", "math", "typing", "warnings"}

SOURCE = Path(blockspec.__file__).parent


def layer_of(module: str) -> int | None:
    for level, prefixes in enumerate(LAYERS):
        if any(module == p or module.startswith(p + ".") for p in prefixes):
            return level
    return None


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def imports(path: Path, root: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in ``path``, wherever it is in the file."""
    name = module_name(path, root)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parent = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join(parent + ([node.module] if node.module else []))
            # `from package import name` imports the submodule package.name when there is one
            found += [
                (node.lineno, f"{base}.{alias.name}" if _is_module(f"{base}.{alias.name}", root) else base)
                for alias in node.names
            ]
    return found


def _is_module(name: str, root: Path) -> bool:
    relative = Path(*name.split(".")[1:]) if "." in name else Path()
    return (root / relative).with_suffix(".py").is_file() or (root / relative / "__init__.py").is_file()


def violations(root: Path) -> list[str]:
    """Every import in the package at ``root`` that points to a higher layer, or out of ``verify``'s allowance."""
    found = []
    for path in sorted(root.rglob("*.py")):
        name = module_name(path, root)
        if name == FACADE:  # its lazy re-exports come from every layer
            continue
        own = layer_of(name)
        if own is None:
            found.append(f"{name}: in no layer; add it to LAYERS")
            continue
        for line, target in imports(path, root):
            where = f"{path.relative_to(root.parent)}:{line}"
            if (
                name.startswith("blockspec.verify")
                and not target.startswith("blockspec.verify")
                and target.split(".")[0] not in VERIFY_MAY_IMPORT
            ):
                found.append(f"{where}: verify imports {target}")
            if not target.startswith("blockspec") or target == FACADE:
                continue
            level = layer_of(target)
            if level is None or level > own:
                found.append(f"{where}: {name} (layer {own}) imports {target} (layer {level})")
    return found


def test_every_import_points_down():
    assert violations(SOURCE) == []


@pytest.mark.parametrize(
    "module, planted",
    [
        ("models/base.py", "\n\ndef planted():\n    from ..engine import SpeculativeDecoder\n"),  # deferred, upward
        ("verify/token.py", "\nimport numpy\n"),  # verify beyond torch
        ("policy/fixed.py", "\nfrom blockspec.bench import records\n"),  # absolute, upward
        ("sampling.py", "\nfrom . import auto\n"),  # `from package import module`
    ],
)
def test_a_planted_violation_fails(tmp_path, module, planted):
    root = tmp_path / "blockspec"
    shutil.copytree(SOURCE, root, ignore=shutil.ignore_patterns("__pycache__"))
    assert violations(root) == []
    with open(root / module, "a") as file:
        file.write(planted)
    found = violations(root)
    assert len(found) == 1 and found[0].startswith(str(Path("blockspec", module))), found


def test_a_module_outside_every_layer_is_reported(tmp_path):
    root = tmp_path / "blockspec"
    shutil.copytree(SOURCE, root, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "stray.py").write_text("x = 1\n")
    assert violations(root) == ["blockspec.stray: in no layer; add it to LAYERS"]


def test_the_command_line_imports_no_torch():
    """``blockspec --help`` must not wait for torch: the CLI's modules import it only inside commands."""
    import subprocess

    code = "import sys, blockspec.cli; print('torch' in sys.modules)"
    assert subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout == "False\n"
