"""Fixtures of the benchmark tests."""

import importlib.util
from pathlib import Path
from types import ModuleType

import pytest

from blockspec import machine

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture(scope="module")
def benchmark_script():
    """A loader of ``benchmarks/<name>.py`` by name (scripts, not a package: loaded from their path)."""

    def load(name: str) -> ModuleType:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        assert spec is not None and spec.loader is not None
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        return module

    return load


@pytest.fixture(scope="module")
def quiet_machine():
    """No CPU time of other processes is seen; a module opts in with ``pytest.mark.usefixtures("quiet_machine")``.
    A run on tiny models lasts milliseconds, and /proc counts CPU time
    in 10 ms ticks: one tick of any other process on the shared cores would mark it contended, and the report
    would drop it from the speeds the tests check. The machine's busy time is held still (others = busy - own,
    clamped at 0): reading it as this process's own time was not enough, since a tick falling between the two
    reads of one clock reading made 10 ms of "others" now and then."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(machine, "busy_seconds", lambda: 0.0)
        yield
