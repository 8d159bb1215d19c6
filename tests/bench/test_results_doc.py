"""docs/results.md: every table there is the benchmark report's own output on the records kept in the repository.

Each table of the page follows a line that names the command which regenerates it and the report section it is
taken from (<records> is benchmarks/results/<run>/records.jsonl.gz):

    Reproduce: `python -m blockspec.bench.report --records <records>`, section "<title>".
    Reproduce: `python benchmarks/vllm_serve.py report --out benchmarks/results/<run>`, section "<title>".
    Reproduce: `python benchmarks/llamacpp_compare.py report --out benchmarks/results/<run>`, section "<title>".
    Reproduce: `python benchmarks/draft_layers.py report --out benchmarks/results/<run>`, section "<title>".
    Reproduce: `python benchmarks/argmax_rule.py report --out benchmarks/results/<run>`, section "<title>".
    Reproduce: `python benchmarks/length_replay.py report --out benchmarks/results/<run>`, section "<title>".

The tests run that command's code path (``blockspec.bench.report.main``, or the benchmark script's ``main``, which
reads <run>/records.jsonl.gz) on the kept records and require the page's table to equal the section's table line
for line, so an edited figure, or records that no longer give the published figure, fail here. They also require
the machine the records name (CPU flags, threads) to be stated with the table, a README.md in every directory
under benchmarks/results/ (how its records were made), and every file kept there to be cited by the page or by its
directory's README, which the page cites. No model is loaded.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import io
import re
import shlex
from pathlib import Path

import pytest

from blockspec.bench import report

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "results.md"
KEPT = ROOT / "benchmarks" / "results"
COMMAND = re.compile(
    r"^Reproduce: `(?P<command>python -m blockspec\.bench\.report"
    r"|python benchmarks/(?:vllm_serve|llamacpp_compare|draft_layers|argmax_rule|length_replay)\.py report)"
    r' (?P<args>[^`]+)`, section "(?P<section>[^"]+)"\.$'
)
SCRIPTS = {  # the benchmark scripts whose `report --out <run>` prints tables of <run>/records.jsonl.gz
    f"python benchmarks/{name}.py report": name
    for name in ("vllm_serve", "llamacpp_compare", "draft_layers", "argmax_rule", "length_replay")
}
MACHINE = re.compile(r"^Machine: CPU flags (?P<flags>.+); (?P<threads>\d+) threads\.$", re.M)


def markdown_tables(lines: list[str]) -> list[tuple[int, list[str]]]:
    """(index of the first line, the lines) of every run of consecutive lines starting with "|"."""
    found, start = [], None
    for n, line in enumerate([*lines, ""]):
        if line.startswith("|") and start is None:
            start = n
        elif not line.startswith("|") and start is not None:
            found.append((start, lines[start:n]))
            start = None
    return found


def documented_tables(text: str) -> list[dict]:
    """Every table of the page with the command and section named above it (and the text since the previous
    heading, where the machine is stated)."""
    lines = text.splitlines()
    tables = []
    for start, table in markdown_tables(lines):
        for back in range(start - 1, -1, -1):
            match = COMMAND.match(lines[back])
            if match or lines[back].startswith("|"):
                break
        assert match, f"docs/results.md:{start + 1}: a table without a 'Reproduce:' line above it"
        heading = max((n for n in range(start) if lines[n].startswith("#")), default=0)
        tables.append(
            dict(
                line=start + 1,
                command=match["command"],
                args=match["args"],
                section=match["section"],
                table=table,
                context=" ".join(" ".join(lines[heading:start]).split()),
            )
        )  # lines rewrapped
    return tables


@functools.cache
def report_output(args: str, command: str = "python -m blockspec.bench.report") -> str:
    """What ``<command> <args>`` prints, run from the repository's root."""
    main, argv = report.main, shlex.split(args)
    if command in SCRIPTS:
        name = SCRIPTS[command]
        spec = importlib.util.spec_from_file_location(name, ROOT / "benchmarks" / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        main, argv = module.main, ["report", *argv]
    out = io.StringIO()
    with contextlib.chdir(ROOT), contextlib.redirect_stdout(out):
        status = main(argv)
    assert status == 0, f"the report exited {status} on {args}"
    return out.getvalue()


def section_table(output: str, title: str) -> list[str]:
    """The first table under the report's heading "## <title>"."""
    lines = output.splitlines()
    assert f"## {title}" in lines, f"the report has no section {title!r}"
    start = lines.index(f"## {title}")
    end = next((n for n in range(start + 1, len(lines)) if lines[n].startswith("## ")), len(lines))
    tables = markdown_tables(lines[start:end])
    assert tables, f"section {title!r} has no table"
    return tables[0][1]


def differences(published: list[str], regenerated: list[str]) -> list[str]:
    """The lines that differ, as "published != regenerated" pairs ([] when the tables are equal)."""
    pairs = [f"{a!r} != {b!r}" for a, b in zip(published, regenerated) if a != b]
    if len(published) != len(regenerated):
        pairs.append(f"{len(published)} lines published, {len(regenerated)} regenerated")
    return pairs


TABLES = documented_tables(PAGE.read_text())


def test_the_page_has_its_tables_each_with_a_command_over_kept_records():
    assert len(TABLES) >= 6
    for table in TABLES:
        args = shlex.split(table["args"])
        if table["command"] in SCRIPTS:
            paths = [Path(args[args.index("--out") + 1]) / "records.jsonl.gz"]
        else:
            paths = [Path(p) for p in args[args.index("--records") + 1 :] if not p.startswith("-")]
        assert paths and all(p.name == "records.jsonl.gz" and (ROOT / p).is_file() for p in paths), table["args"]


@pytest.mark.parametrize("table", TABLES, ids=lambda t: f"line{t['line']}")
def test_the_table_equals_the_report_regenerated_from_the_records(table):
    regenerated = section_table(report_output(table["args"], table["command"]), table["section"])
    wrong = differences(table["table"], regenerated)
    assert not wrong, f"docs/results.md:{table['line']} differs from the regenerated report:\n" + "\n".join(wrong)


@pytest.mark.parametrize("table", TABLES, ids=lambda t: f"line{t['line']}")
def test_the_machine_the_records_name_is_stated_with_the_table(table):
    """Records of schema 3 name their machine kind; the page must say it above the table (records without it
    have their machine described in words, which this cannot check)."""
    machine = MACHINE.search(report_output(table["args"], table["command"]))
    if machine:
        assert f"CPU flags {machine['flags']}" in table["context"], table["line"]
        assert f"{machine['threads']} threads" in table["context"], table["line"]


def test_an_edited_figure_is_caught():
    """The comparison is strict: one digit changed in a cell is a difference (and so a failure above)."""
    table = TABLES[0]["table"]
    row = next(n for n, line in enumerate(table) if n >= 2 and re.search(r"\d\.\d", line))
    edited = list(table)
    edited[row] = re.sub(r"(\d)\.(\d)", lambda m: f"{m[1]}.{(int(m[2]) + 1) % 10}", edited[row], count=1)
    assert edited != table
    assert differences(edited, table)
    assert not differences(table, table)


def unended_tables(lines: list[str]) -> list[int]:
    """Line numbers (from 1) of text that directly follows a table: Markdown renders it as one more row."""
    return [
        n + 2
        for n in range(len(lines) - 1)
        if lines[n].startswith("|") and lines[n + 1].strip() and not lines[n + 1].startswith("|")
    ]


def test_every_table_ends_at_a_blank_line():
    assert not unended_tables(PAGE.read_text().splitlines()), "docs/results.md: text right below a table"
    assert unended_tables(["| a |", "|---|", "| 1 |", "Sat Nov 28 11:55:21 UTC 2026", ""]) == [4]
    assert not unended_tables(["| a |", "|---|", "| 1 |", "", "text"])


def test_every_run_directory_says_how_its_records_were_made():
    """Provenance (commands, times, code, machine) lives beside the records, in a README.md per directory."""
    directories = sorted({p.parent for p in KEPT.rglob("*") if p.is_file()})
    assert directories
    for directory in directories:
        assert (directory / "README.md").is_file(), f"{directory.relative_to(ROOT)} has no README.md"


def test_every_file_kept_under_benchmarks_results_is_cited():
    """By the page, or by the README.md of its directory, which the page cites (config.json: its directory)."""
    text = PAGE.read_text()
    kept = sorted(p.relative_to(ROOT) for p in KEPT.rglob("*") if p.is_file())
    assert kept
    for path in kept:
        readme = path.parent / "README.md"
        cited = path.as_posix() in text or (
            readme.as_posix() in text
            and (path.name in ("README.md", "config.json") or path.name in (ROOT / readme).read_text())
        )
        assert cited, f"{path} is kept but neither docs/results.md nor {readme} cites it: cite it or remove it"


def test_every_plot_the_page_shows_exists():
    for image in re.findall(r"!\[[^\]]*\]\(([^)]+)\)", PAGE.read_text()):
        assert (PAGE.parent / image).is_file(), image
