"""Prompt sets for `blockspec bench`: deterministic, seeded samples of prompts with stable ids.

Every set is read from data shipped inside a pinned PyPI package (or the standard library), never from a model
or data hub, and no data package is ever imported. The sets, their sources and their ids: docs/guide/bench.md.

    load("gsm8k")                 # all 100 prompts, in source order
    load("gsm8k", n=10, seed=0)   # a seeded sample without replacement
    available("sharegpt")         # is its data package installed?
    DATASETS                      # name -> one-line description
"""

from .jsonarray import iter_json_array
from .packages import DataPackage, MissingDataPackage, Prompt
from .registry import DATASETS, available, load, package_for

__all__ = [
    "DATASETS",
    "DataPackage",
    "MissingDataPackage",
    "Prompt",
    "available",
    "iter_json_array",
    "load",
    "package_for",
]
