"""Every test starts with no first-use verdict on the Triton kernels (``selfcheck.trusted``): a test
that breaks a kernel on purpose must not leave the torch fallback to the tests after it."""

from __future__ import annotations

import pytest

from attnlab.attention.common.triton import selfcheck


@pytest.fixture(autouse=True)
def _fresh_first_use_checks():
    selfcheck.forget()
    yield
    selfcheck.forget()
