"""The rendered overlays the manifest policy tests read."""

from __future__ import annotations

from typing import Any

import pytest

from tests.deploy.schemas import DEPLOY, render

OVERLAYS = ("base", "overlays/dev", "overlays/prod")


@pytest.fixture(scope="module")
def overlays() -> dict[str, list[dict[str, Any]]]:
    return {name: render(DEPLOY / name) for name in OVERLAYS}
