"""Schemathesis walks the app's own OpenAPI schema: no input gets a 5xx answer.

Each operation gets a few generated cases (kept small: the whole walk runs in
seconds) against the app in process, on real PostgreSQL holding a job with a
failed sample.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest
import schemathesis
from conftest import AUTH
from hypothesis import HealthCheck, Phase, given, settings

pytestmark = pytest.mark.integration

EXAMPLES = 6


def test_no_generated_input_gets_a_5xx(api_env: str, monkeypatch: pytest.MonkeyPatch,
                                       job_factory: Callable[..., Any],
                                       sample_factory: Callable[..., int]) -> None:
    from api.app import create_app

    # Random dataset and tokenizer names must fail fast, not reach for a hub.
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    report = job_factory(["a", "b"])
    sample_factory("failed", job_id=report.job_id, error_class="timeout")
    schema = schemathesis.openapi.from_asgi("/openapi.json", create_app(), headers=AUTH)
    operations = [result.ok() for result in schema.get_all_operations()]
    assert len(operations) >= 15
    answered: dict[str, set[int]] = {}
    for operation in operations:
        _check(operation, answered.setdefault(operation.label, set()))()
    assert all(codes for codes in answered.values())


def _check(operation: Any, codes: set[int]) -> Callable[[], None]:
    """A hypothesis test of ``operation``: generated cases, none answered 5xx."""

    @given(case=operation.as_strategy())
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              phases=[Phase.explicit, Phase.generate], suppress_health_check=list(HealthCheck))
    def check(case: Any) -> None:
        response = case.call(headers=AUTH)
        codes.add(response.status_code)
        assert response.status_code < 500, (case.method, case.formatted_path, case.query,
                                            case.body, response.text[:500])

    return check  # type: ignore[no-any-return]
