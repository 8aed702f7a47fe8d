"""Shared fixtures: one SparkSession (local[2]) for the whole test session."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def spark():
    from ackflow.spark.session import session

    s = session("local[2]")
    yield s
    s.stop()

