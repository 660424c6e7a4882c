"""Shared by the router tests that run a real router in front of fake workers (tests/helpers/router_fakes.py): one
pair of fake workers and one default router per test module. A module that needs other fakes or another router
defines its own fixture of the same name."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.helpers.router_fakes import FakeWorkers, RouterHarness


@pytest.fixture(scope="module")
def workers() -> Iterator[FakeWorkers]:
    fake = FakeWorkers()
    yield fake
    fake.close()


@pytest.fixture(scope="module")
def router(workers: FakeWorkers) -> Iterator[RouterHarness]:
    harness = RouterHarness(workers)
    yield harness
    harness.close()
