"""PrometheusSource and TickCache against a real Prometheus (scraping fake vLLM exporters every second)."""

from __future__ import annotations

import asyncio
import json
import math
import socket
import time
import urllib.request
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import TypeVar

import pytest
import requests
import urllib3
from prometheus_client.parser import text_string_to_metric_families

from dynamo_snapshot.autoscale import prometheus
from dynamo_snapshot.autoscale.prometheus import (
    InvalidQuery,
    MetricsUnavailable,
    NoData,
    NotOneSeries,
    PrometheusError,
    PrometheusSource,
    TickCache,
)
from dynamo_snapshot_dev.localcluster import LocalPrometheus
from dynamo_snapshot_dev.localcluster.components import ComponentsMissingError
from tests.autoscale.exporter import KV_CACHE, RUNNING, WAITING, FakeVllmExporter
from tests.helpers.stub_server import Response, StubServer

T = TypeVar("T")

SUM_WAITING = f"sum({WAITING})"


async def eventually(
    probe: Callable[[], Awaitable[T]], accept: Callable[[T], bool], within: float = 6.0
) -> T:
    """Poll ``probe`` until ``accept`` holds; Prometheus sees a new value at its next scrape (1 s)."""
    deadline = time.monotonic() + within
    last: object = None
    while time.monotonic() < deadline:
        try:
            value = await probe()
        except PrometheusError as e:
            last = e
        else:
            if accept(value):
                return value
            last = value
        await asyncio.sleep(0.1)
    raise AssertionError(f"not seen within {within}s; last: {last!r}")


def _query_requests(prometheus: LocalPrometheus) -> float:
    """Instant queries Prometheus has answered, by its own request counter."""
    with urllib.request.urlopen(prometheus.url + "/metrics", timeout=5) as response:
        text = response.read().decode()
    return sum(
        sample.value
        for family in text_string_to_metric_families(text)
        if family.name == "prometheus_http_requests"
        for sample in family.samples
        if sample.name.endswith("_total") and sample.labels.get("handler") == "/api/v1/query"
    )


@pytest.fixture
def source(prometheus: LocalPrometheus) -> Iterator[PrometheusSource]:
    src = PrometheusSource(prometheus.url, timeout_s=2.0)
    yield src
    src.close()


# --- values ---------------------------------------------------------------------------------------


async def test_total_follows_the_gauges(
    fresh_exporters: list[FakeVllmExporter], source: PrometheusSource
) -> None:
    first, second = fresh_exporters
    first.set(WAITING, 3)
    second.set(WAITING, 4)
    assert await eventually(lambda: source.query_total(SUM_WAITING), lambda v: v == 7.0) == 7.0

    second.set(WAITING, 10.5)
    assert await eventually(lambda: source.query_total(SUM_WAITING), lambda v: v == 13.5) == 13.5

    # Zero is a value, not "no data".
    first.set(WAITING, 0)
    second.set(WAITING, 0)
    assert await eventually(lambda: source.query_total(SUM_WAITING), lambda v: v == 0.0) == 0.0


async def test_label_selected_single_series_and_scalars(
    fresh_exporters: list[FakeVllmExporter], source: PrometheusSource
) -> None:
    first, second = fresh_exporters
    first.set(KV_CACHE, 0.25)
    second.set(KV_CACHE, 0.75)
    # One series picked by label: no sum needed.
    query = f'{KV_CACHE}{{pod="worker-1"}}'
    assert await eventually(lambda: source.query_total(query), lambda v: v == 0.75) == 0.75
    # A scalar result.
    assert await eventually(lambda: source.query_total(f"scalar(avg({KV_CACHE}))"), lambda v: v == 0.5) == 0.5
    assert await source.query_total("1 + 2") == 3.0


# --- errors ---------------------------------------------------------------------------------------


async def test_invalid_promql_is_reported_with_prometheus_message(source: PrometheusSource) -> None:
    with pytest.raises(InvalidQuery) as caught:
        await source.query_total(f"sum({WAITING}")
    message = str(caught.value)
    assert "bad_data" in message
    assert "parse error" in message
    assert "\n" not in message


async def test_several_series_are_refused(
    fresh_exporters: list[FakeVllmExporter], source: PrometheusSource
) -> None:
    first, second = fresh_exporters
    first.set(RUNNING, 1)
    second.set(RUNNING, 2)

    async def count() -> int:
        try:
            await source.query_total(RUNNING)
        except NotOneSeries as e:
            return e.count
        return 1

    await eventually(count, lambda n: n == 2)
    with pytest.raises(
        NotOneSeries, match=r"^query returned 2 series; it must return one \(wrap it in sum\(\.\.\.\)\)$"
    ):
        await source.query_total(RUNNING)
    assert await source.query_total(f"sum({RUNNING})") == 3.0


async def test_absent_metric_is_no_data_not_zero(source: PrometheusSource) -> None:
    with pytest.raises(NoData, match="no data"):
        await source.query_total("sum(vllm:no_such_metric)")
    with pytest.raises(NoData, match="no data"):
        await source.query_total('vllm:num_requests_waiting{pod="no-such-pod"}')


async def test_any_number_is_returned_as_it_is(source: PrometheusSource) -> None:
    # Whether a total is usable is the autoscaler's call (UnusableValue), not a missing metric.
    assert math.isnan(await source.query_total("0 / 0"))
    assert await source.query_total("vector(1e300)") == 1e300
    assert await source.query_total("-1 / 0") == -math.inf
    assert await source.query_total("vector(-5)") == -5.0


async def test_metric_gone_from_the_exporter_is_no_data(
    fresh_exporters: list[FakeVllmExporter], source: PrometheusSource
) -> None:
    first, _ = fresh_exporters
    first.set(WAITING, 5)
    await eventually(lambda: source.query_total(SUM_WAITING), lambda v: v == 5.0)
    first.remove(WAITING)

    async def gone() -> bool:
        try:
            await source.query_total(SUM_WAITING)
        except NoData:
            return True
        return False

    await eventually(gone, bool)


async def test_range_vector_is_an_invalid_query(
    prometheus: LocalPrometheus, source: PrometheusSource
) -> None:
    # Two series of `up` (one per exporter), but the shape is the problem to report.
    with pytest.raises(InvalidQuery, match="range vector"):
        await source.query_total("up[1m]")


async def test_stopped_prometheus_is_unavailable_within_the_timeout(
    exporters: list[FakeVllmExporter],
) -> None:
    server = LocalPrometheus([exporters[0].address])
    server.start()
    src = PrometheusSource(server.url, timeout_s=1.0)
    try:
        assert await src.query_total("1") == 1.0
        server_url = server.url
        server.stop()
        started = time.monotonic()
        with pytest.raises(MetricsUnavailable) as caught:
            await src.query_total(SUM_WAITING)
        assert time.monotonic() - started < 1.5
    finally:
        server.stop()
        src.close()
    assert str(caught.value) == f"prometheus at {server_url} unreachable: connection refused"


@pytest.fixture
def silent_server() -> Iterator[str]:
    """A port that accepts connections and never answers, like a hung Prometheus."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        yield f"http://127.0.0.1:{listener.getsockname()[1]}"


async def test_hung_prometheus_times_out_without_blocking_the_loop(silent_server: str) -> None:
    src = PrometheusSource(silent_server, timeout_s=0.5)
    gaps: list[float] = []
    done = asyncio.Event()

    async def heartbeat() -> None:
        last = time.monotonic()
        while not done.is_set():
            await asyncio.sleep(0.01)
            now = time.monotonic()
            gaps.append(now - last)
            last = now

    beat = asyncio.create_task(heartbeat())
    started = time.monotonic()
    try:
        with pytest.raises(MetricsUnavailable, match=r"unreachable: (no answer within 0\.5s|timed out)$"):
            await src.query_total(SUM_WAITING)
    finally:
        done.set()
        await beat
        src.close()
    assert time.monotonic() - started < 1.0
    assert len(gaps) > 10
    assert max(gaps) < 0.2, "the event loop was blocked"


def _tsdb_not_ready() -> Response:
    return 503, "application/json", b'{"status":"error","errorType":"unavailable","error":"TSDB not ready"}'


async def test_server_error_is_unavailable() -> None:
    with StubServer(_tsdb_not_ready) as server:
        url = server.url
        src = PrometheusSource(url, timeout_s=2.0)
        try:
            with pytest.raises(MetricsUnavailable) as caught:
                await src.query_total("1")
        finally:
            src.close()
    assert str(caught.value) == f"prometheus at {url} unreachable: HTTP 503: unavailable: TSDB not ready"


def _prometheus_error(status: int, kind: str, error: str) -> Response:
    body = json.dumps({"status": "error", "errorType": kind, "error": error}).encode()
    return status, "application/json", body


@pytest.mark.parametrize(
    ("answer", "error", "message"),
    [
        (
            _prometheus_error(400, "bad_data", 'invalid parameter "query": 1:5: parse error'),
            InvalidQuery,
            'prometheus refused the query: bad_data: invalid parameter "query": 1:5: parse error',
        ),
        (
            _prometheus_error(422, "execution", "query processing would load too many samples"),
            InvalidQuery,
            "prometheus refused the query: execution: query processing would load too many samples",
        ),
        (
            _prometheus_error(503, "unavailable", "TSDB not ready"),
            MetricsUnavailable,
            "prometheus at {url} unreachable: HTTP 503: unavailable: TSDB not ready",
        ),
        (
            (404, "text/plain", b"404 page not found\n"),
            MetricsUnavailable,
            "prometheus at {url} unreachable: HTTP 404: 404 page not found",
        ),
        (
            (502, "text/html", b"<html>\n<body>Bad Gateway</body>\n</html>"),
            MetricsUnavailable,
            "prometheus at {url} unreachable: HTTP 502: <html> <body>Bad Gateway</body> </html>",
        ),
        (
            (204, "text/plain", b""),
            MetricsUnavailable,
            "prometheus at {url} unreachable: not a Prometheus API answer",
        ),
        (
            (200, "text/html", b"<html>a login page</html>"),
            MetricsUnavailable,
            "prometheus at {url} unreachable: not a Prometheus API answer (JSONDecodeError: ",
        ),
    ],
    ids=["400", "422", "503", "404-text", "502-html", "204", "200-not-json"],
)
async def test_each_status_code_says_what_went_wrong(
    answer: Response, error: type[PrometheusError], message: str
) -> None:
    with StubServer(lambda: answer) as server:
        url = server.url
        src = PrometheusSource(url, timeout_s=2.0)
        try:
            with pytest.raises(error) as caught:
                await src.query_total("sum(x)")
        finally:
            src.close()
    assert type(caught.value) is error
    assert str(caught.value).startswith(message.format(url=url)), str(caught.value)
    assert "\n" not in str(caught.value)


# --- TickCache ------------------------------------------------------------------------------------


async def test_tick_cache_sends_each_query_once_per_tick(
    fresh_exporters: list[FakeVllmExporter], prometheus: LocalPrometheus, source: PrometheusSource
) -> None:
    fresh_exporters[0].set(WAITING, 6)
    await eventually(lambda: source.query_total(SUM_WAITING), lambda v: v == 6.0)
    cache = TickCache()
    # Another source for the same Prometheus shares the entries: the cache keys on the URL.
    twin = PrometheusSource(prometheus.url + "/", timeout_s=2.0)
    before = _query_requests(prometheus)

    # Five policies asking at once, then two more later in the same tick.
    values = await asyncio.gather(*(cache.query(source, SUM_WAITING) for _ in range(5)))
    values += [await cache.query(source, SUM_WAITING), await cache.query(twin, SUM_WAITING)]
    assert values == [6.0] * 7
    assert (cache.requests, cache.hits) == (1, 6)

    # A different query is a different request; so is the same query in the next tick.
    assert await cache.query(source, f"sum({RUNNING}) or vector(0)") == 0.0
    cache.new_tick()
    assert await cache.query(source, SUM_WAITING) == 6.0
    assert cache.requests == 3

    await asyncio.sleep(0.3)  # Prometheus counts a request just after answering it
    assert _query_requests(prometheus) - before == 3
    twin.close()


async def test_tick_cache_shares_failures(source: PrometheusSource) -> None:
    cache = TickCache()
    results = await asyncio.gather(*(cache.query(source, "sum(") for _ in range(3)), return_exceptions=True)
    assert all(isinstance(result, InvalidQuery) for result in results)
    assert (cache.requests, cache.hits) == (1, 2)
    with pytest.raises(NoData):
        await cache.query(source, "sum(vllm:no_such_metric)")
    with pytest.raises(NoData):
        await cache.query(source, "sum(vllm:no_such_metric)")
    assert cache.requests == 2


async def test_a_cancelled_caller_does_not_cancel_the_shared_query(silent_server: str) -> None:
    src = PrometheusSource(silent_server, timeout_s=0.5)
    cache = TickCache()
    impatient = asyncio.create_task(cache.query(src, "1"))
    patient = asyncio.create_task(cache.query(src, "1"))
    await asyncio.sleep(0.05)
    impatient.cancel()
    with pytest.raises(MetricsUnavailable, match=r"no answer within 0\.5s|timed out"):
        await patient
    assert impatient.cancelled()
    src.close()


def test_missing_prometheus_binary_is_one_clear_line(tmp_path: Path) -> None:
    with pytest.raises(ComponentsMissingError) as caught:
        LocalPrometheus(binary=tmp_path / "prometheus").start()
    assert str(caught.value).startswith("prometheus is missing: run scripts/test-env.sh")
    assert "\n" not in str(caught.value)


def test_a_read_that_timed_out_behind_the_retry_is_said_to_have_timed_out() -> None:
    """With retries off, requests raises a ConnectionError around urllib3's MaxRetryError around the read
    timeout: it is a timeout all the same, not an unreachable server."""
    url = "/api/v1/query?query=1"
    timed_out = urllib3.exceptions.ReadTimeoutError(None, url, "Read timed out. (read timeout=0.5)")  # type: ignore[arg-type]
    error = requests.ConnectionError(urllib3.exceptions.MaxRetryError(None, url, reason=timed_out))  # type: ignore[arg-type]
    assert prometheus._connection_reason(error) == "timed out"
    refused = ConnectionRefusedError(111, "Connection refused")
    error = requests.ConnectionError(urllib3.exceptions.MaxRetryError(None, url, reason=refused))  # type: ignore[arg-type]
    assert prometheus._connection_reason(error) == "connection refused"
