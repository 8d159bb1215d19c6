"""The engine tests' tiny pair: a target and a draft close to it, on each device the tests run on."""

from __future__ import annotations

import pytest
from kits.tiny import perturbed, tiny_model


@pytest.fixture(scope="module")
def pair(device):
    target = tiny_model(sharpness=5.0)
    draft = perturbed(target, scale=0.3, seed=1)
    return target.to(device), draft.to(device)
