import sys
from pathlib import Path

import pytest

# The shared kits are the package `kits` (tests/kits) for every test module, in whatever folder.
sys.path.insert(0, str(Path(__file__).parent))


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test that takes ``rule`` runs once per registered verification rule (``blockspec.verify.RULES``), one that
    takes ``sampled_rule`` once per rule with closed forms, lossless at any temperature (``SAMPLED_RULES``). The
    registry is read at collection, so a rule added to it joins the exact, statistical, property and validation
    tests, their negative controls included, with no test edited. One that takes ``device`` runs on each of
    ``devices()``. A test's own parametrize of the name wins."""
    from blockspec.verify import rules

    own = {
        name.strip()
        for mark in metafunc.definition.iter_markers("parametrize")
        for name in (mark.args[0].split(",") if isinstance(mark.args[0], str) else mark.args[0])
    }
    for name, names in (("rule", rules.RULES), ("sampled_rule", rules.SAMPLED_RULES)):
        if name in metafunc.fixturenames and name not in own:
            metafunc.parametrize(name, list(names))
    if "device" in metafunc.fixturenames and "device" not in own:
        metafunc.parametrize("device", devices(), scope="module")


def devices() -> list[str]:
    """A test (or a module fixture) that takes ``device`` runs on the CPU, and on CUDA too where torch sees a GPU:
    the engine's exact-law, chi-square and greedy tests then check the CUDA path with the same thresholds."""
    import torch

    return ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


@pytest.fixture(autouse=True, scope="module")
def the_users_model_cache_gains_no_test_copies(request):
    """Tests must not fill the user's model cache with copies (float32 ones take GBs). They may reuse (or make) the
    bfloat16 copies the main job makes anyway; anything else, the machine's arithmetic probe, the models' latency
    probes and the tokenizers of GGUF files the tests write included, goes to a temporary cache. Checked after each
    module, which the failure names (a folder a fresh machine lacks is seen there only)."""
    from blockspec.models.cache import cache_root

    root = cache_root()  # the user's: set up before any fixture that points BLOCKSPEC_CACHE elsewhere

    def copies() -> set[Path]:
        return (
            {p for p in root.glob("*/hf-*") if p.name != "hf-bfloat16"}
            | set(root.glob("machine/*"))
            | set(root.glob("sv/*"))
            | set(root.glob("tokenizers*"))  # the folder and its lock too: a failed read leaves them
        )

    before = copies()
    yield
    added = copies() - before
    assert not added, f"{request.module.__name__} wrote into the user's model cache: {sorted(map(str, added))}"


@pytest.fixture(scope="module")
def one_thread():
    """Tiny forwards gain nothing from intra-op threads and lose a lot when the cores are shared (a 6000-row
    generate: 2 s on one thread, 12-16 s on two busy cores). A module opts in with
    ``pytestmark = pytest.mark.usefixtures("one_thread")``."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def probes_in_a_temporary_cache(tmp_path_factory):
    """generate's and bench's defaults measure the machine and the models' step latency once and cache them: for
    the tiny models of the tests, in a cache of their own rather than the user's. A module opts in with
    ``pytestmark = pytest.mark.usefixtures("probes_in_a_temporary_cache")``."""
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("BLOCKSPEC_CACHE", str(tmp_path_factory.mktemp("cache")))
        yield
