"""The DynamoGraphDeployment conversion webhook: the apiserver POSTs a ConversionReview whenever a DGD is
written or read at a version other than the one it is stored at (v1beta1 <-> v1alpha1).

``dgd_conversion.convert_review`` decides. Every request gets a ConversionReview back, a malformed one
a Failure whose message the apiserver hands to the client, never an HTTP error: the apiserver reports
a non-200 answer only as "conversion webhook failed", without what was wrong.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Final

from aiohttp import web
from prometheus_client import Counter

from dynamo_snapshot.api.crdgen import CONVERSION_PATH
from dynamo_snapshot.api.dgd_conversion import convert_review

__all__ = ["CONVERSIONS", "CONVERSION_PATH", "answer", "handle_convert"]

log = logging.getLogger(__name__)

CONVERSIONS: Final = Counter(
    "dynsnap_dgd_conversions_total",
    "ConversionReviews of DynamoGraphDeployments answered, by outcome (Success or Failure)",
    ["outcome"],
)


def answer(body: bytes) -> dict[str, Any]:
    """The ConversionReview answering the request ``body`` (JSON), whatever the body holds."""
    try:
        review: Any = json.loads(body)
    except ValueError as e:
        answered = convert_review(None)
        answered["response"]["result"]["message"] = f"the request body is not JSON: {e}"
        return answered
    return convert_review(review)


async def handle_convert(request: web.Request) -> web.Response:
    body = await request.read()
    # Validation and conversion are CPU work on every object of a list; off the event loop.
    review = await asyncio.to_thread(answer, body)
    response = review["response"]
    outcome = response["result"]["status"]
    CONVERSIONS.labels(outcome=outcome).inc()
    where = {"uid": response["uid"], "objects": len(response.get("convertedObjects") or [])}
    if outcome == "Success":
        log.debug("dgd conversion answered", extra=where)
    else:
        log.warning("dgd conversion refused", extra={**where, "reason": response["result"].get("message")})
    return web.json_response(review)
