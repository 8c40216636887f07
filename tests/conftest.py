"""Fixtures more than one test package uses (helpers/ holds the plain functions)."""

from __future__ import annotations

import pytest
import trustme


@pytest.fixture
def ca() -> trustme.CA:
    """A fresh certificate authority (trustme): backends' or clients' certificates."""
    return trustme.CA()
