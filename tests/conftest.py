"""Every test starts from the same random state and leaves none behind.

torch seeds its default generator randomly at start-up, and a test that seeds it (``torch.manual_seed(0)``,
``seed_everything``) used to leave that state to the tests after it: a model built without a seed then drew
weights that depended on which tests ran before (a planted saturation seen at step 2 instead of 0 after
``tests/unit`` and the doctests). Each test now runs from seed 0 of torch, ``random`` and NumPy, and the states
before it are put back after it.

Under pytest-xdist (``scripts/test.sh`` runs one worker per core) each worker keeps torch to one intra-op
thread: the tests' models are tiny, and two workers each running two threads on two cores made single fits
up to 5x slower than one thread each.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator

import numpy as np
import pytest
import torch

SEED = 0


def pytest_configure(config: pytest.Config) -> None:
    if os.environ.get("PYTEST_XDIST_WORKER"):
        torch.set_num_threads(1)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    python_state, numpy_state = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(SEED)
        random.seed(SEED)
        np.random.seed(SEED)
        try:
            yield
        finally:
            random.setstate(python_state)
            np.random.set_state(numpy_state)
