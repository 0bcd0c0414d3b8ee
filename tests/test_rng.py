from __future__ import annotations

import io
import random

import numpy as np
import pytest
import torch

from ckptools import rng

pytestmark = pytest.mark.versions  # torch's RNG states


def _draw():
    return random.random(), float(np.random.rand()), torch.rand(3).tolist(), random.gauss(0, 1)


def test_roundtrip_through_weights_only_file():
    random.gauss(0, 1)  # leaves a cached gaussian in python's state
    np.random.standard_normal()
    state = rng.get_rng_state()
    expected = _draw()
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    restored = torch.load(buf, weights_only=True)  # no ndarray, no custom classes
    rng.set_rng_state(restored)
    assert _draw() == expected


def test_capture_does_not_advance():
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    rng.get_rng_state()
    a = _draw()
    random.seed(3), np.random.seed(3), torch.manual_seed(3)
    assert _draw() == a


def test_partial_state_leaves_the_rest_alone():
    torch.manual_seed(1)
    state = {"torch": torch.get_rng_state()}
    random.seed(9)
    expected_py = random.random()
    random.seed(9)
    rng.set_rng_state(state)
    assert random.random() == expected_py
