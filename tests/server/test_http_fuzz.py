"""A bounded HTTP fuzz: schemathesis over every operation of our OpenAPI document, valid and
invalid bodies, integers unbounded (the document sets no int32 bounds, so values past 2**31
and 2**63 are generated). No response is a 5xx and every response matches the document.

CI runs JAXSERVE_HTTP_FUZZ_EXAMPLES (default 10) examples per operation and mode; the full
check of issue 21 is `JAXSERVE_HTTP_FUZZ_EXAMPLES=200 python -m pytest tests/server/
test_http_fuzz.py` (200 valid and 200 invalid examples per operation), and
scripts/http_fuzz_health.py runs it while probing /health.
"""

from __future__ import annotations

import os

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis import GenerationMode
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               response_headers_conformance,
                                               response_schema_conformance,
                                               status_code_conformance)

from engine_helpers import assert_no_leaks
from server_helpers import wait_engine_idle

EXAMPLES = int(os.environ.get("JAXSERVE_HTTP_FUZZ_EXAMPLES", "10"))
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_headers_conformance, response_schema_conformance]


def fuzz_operations(url: str, headers: dict[str, str], examples: int) -> dict[str, int]:
    """Run schemathesis over every operation at `url`; returns the examples run per
    operation and mode. A failing check raises."""
    doc = httpx.get(f"{url}/openapi.json", headers=headers).json()
    schema = schemathesis.openapi.from_dict(doc)
    counts: dict[str, int] = {}
    for result in schema.get_all_operations():
        operation = result.ok()
        modes = [GenerationMode.POSITIVE] + ([GenerationMode.NEGATIVE] if operation.method
                                             == "post" else [])  # a GET has nothing to break
        for mode in modes:
            label = f"{operation.label} {mode.value}"
            counts[label] = 0

            @settings(max_examples=examples, deadline=None, database=None,
                      suppress_health_check=list(HealthCheck))
            @given(case=operation.as_strategy(mode))
            def run(case: schemathesis.Case) -> None:
                counts[label] += 1
                case.call_and_validate(base_url=url, headers=headers, checks=CHECKS,
                                       timeout=120)

            run()
    return counts


def test_schemathesis_finds_no_server_error_or_schema_mismatch(served):
    counts = fuzz_operations(served.url, served.headers, EXAMPLES)
    assert len(counts) == 5 + 6 * 2 and min(counts.values()) >= 1  # GETs; POSTs both modes
    wait_engine_idle(served.llm)
    served.llm.call_in_engine(assert_no_leaks).result()
    assert httpx.get(f"{served.url}/health").status_code == 200
