"""The explorer's API against its own published OpenAPI schema, by schemathesis.

Every operation, with requests generated from the schema (valid and invalid):
no 5xx, every status code documented, every body and header as documented,
invalid data refused, undeclared methods answered 405 with ``Allow``. The
check "schema-valid data is accepted" is left out on purpose: some rules
cannot be written in JSON Schema (rows of equal length, Q and K sharing d,
tiles no larger than the sequence, the per-request work limit); breaking them
gets the documented 422 with a message naming the field.

The default run is short (a few examples per operation); ``-m slow`` runs more.
"""

from __future__ import annotations

import pytest

pytest.importorskip("schemathesis", reason="schemathesis is not installed")
pytest.importorskip("fastapi", reason="the web extra is not installed")

import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.specs.openapi.checks import positive_data_acceptance

from flashledger.web.app import create_app

# schemathesis's ASGI client calls the server "testserver": let the Host check allow it
APP = create_app(allow_hosts=["testserver"])
schema = schemathesis.openapi.from_asgi("/openapi.json", APP)
OPERATIONS = 7
"""GET /api/examples and six POST endpoints."""


def test_every_operation_is_in_the_schema() -> None:
    assert len(list(schema.get_all_operations())) == OPERATIONS


@schema.parametrize()
@settings(max_examples=4, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_follows_its_schema(case: schemathesis.Case) -> None:
    case.call_and_validate(excluded_checks=[positive_data_acceptance])


@pytest.mark.slow
@schema.parametrize()
@settings(max_examples=60, deadline=None, suppress_health_check=list(HealthCheck))
def test_api_follows_its_schema_long(case: schemathesis.Case) -> None:
    case.call_and_validate(excluded_checks=[positive_data_acceptance])
