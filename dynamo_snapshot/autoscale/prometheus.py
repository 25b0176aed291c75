"""Reading service-wide metric totals from Prometheus without blocking the event loop.

``PrometheusSource.query_total`` runs one instant query through prometheus-api-client (synchronous,
so in a worker thread, bounded by a timeout) and returns its single value, whatever number it is (NaN,
infinite and negative values included: whether a total can size a service is the autoscaler's call,
which it reports by name).  Every way that can fail is an exception with a one-line message, so a
policy's status can say exactly what is wrong:

* ``MetricsUnavailable``: Prometheus cannot be reached, does not answer in time, or fails (5xx, or
  any answer but an error about the query or a Prometheus API result);
* ``InvalidQuery``: Prometheus refused the query (its own error text is in the message);
* ``NotOneSeries``: the query returned several series instead of one total;
* ``NoData``: the query returned nothing: a missing metric, never to be read as zero.

``TickCache`` shares queries within one evaluation tick: policies that ask the same Prometheus the
same query cost one request, even when they ask concurrently.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import requests
import urllib3
from prometheus_api_client.exceptions import PrometheusApiClientException
from prometheus_api_client.prometheus_connect import PrometheusConnect
from urllib3.util.retry import Retry

__all__ = [
    "InvalidQuery",
    "MetricsUnavailable",
    "NoData",
    "NotOneSeries",
    "PrometheusError",
    "PrometheusSource",
    "TickCache",
]


class PrometheusError(RuntimeError):
    """A query did not produce a usable value; the message is one line."""


class MetricsUnavailable(PrometheusError):
    """Prometheus could not be reached, did not answer within the timeout, or failed (5xx)."""


class InvalidQuery(PrometheusError):
    """Prometheus refused the query (400 bad_data, 422 execution error) or its result has a wrong type."""


class NotOneSeries(PrometheusError):
    """The query returned several series; a policy needs one total."""

    def __init__(self, count: int) -> None:
        super().__init__(f"query returned {count} series; it must return one (wrap it in sum(...))")
        self.count = count


class NoData(PrometheusError):
    """The query returned no series: the metric is missing, which is not zero."""


def _one_line(text: str, limit: int = 300) -> str:
    line = " ".join(text.split())
    return line if len(line) <= limit else line[: limit - 3] + "..."


class _ErrorAnswer(Exception):
    """Prometheus answered with a 4xx or 5xx status: the answer itself, status code and body."""

    def __init__(self, response: requests.Response) -> None:
        super().__init__(response.status_code)
        self.response = response


def _raise_on_error_status(response: requests.Response, *args: Any, **kwargs: Any) -> None:
    """A session response hook: an error answer raises _ErrorAnswer, with the response, before the client
    turns it into an exception that carries only text."""
    if response.status_code >= 400:
        raise _ErrorAnswer(response)


def _error_text(response: requests.Response) -> str:
    """Prometheus' own error (``errorType: error``) from an error answer, else its body, in one line."""
    try:
        document = response.json()
    except ValueError:
        return _one_line(response.text)
    if isinstance(document, dict) and document.get("error"):
        kind = document.get("errorType")
        message = str(document["error"])
        return _one_line(f"{kind}: {message}" if kind else message)
    return _one_line(response.text)


def _causes(error: BaseException) -> Iterator[BaseException]:
    """`error` and what it wraps: its cause and context, and urllib3's `reason` for giving up."""
    seen: set[int] = set()
    todo: list[BaseException] = [error]
    while todo:
        current = todo.pop(0)
        if id(current) in seen:
            continue
        seen.add(id(current))
        yield current
        reason = getattr(current, "reason", None)
        wrapped = [a for a in current.args if isinstance(a, BaseException)]
        todo += [e for e in (reason, current.__cause__, current.__context__) if isinstance(e, BaseException)]
        todo += wrapped


def _connection_reason(error: requests.RequestException) -> str:
    """Why a request got no answer, as the operating system said it (``connection refused``)."""
    if isinstance(error, requests.Timeout):
        return "timed out"
    causes = list(_causes(error))
    for cause in causes:
        if isinstance(cause, OSError) and cause.strerror:
            return cause.strerror.strip().lower()
    # With retries off, requests reports a read that timed out as a ConnectionError around it. (urllib3's
    # failed connections are timeouts by class too: the operating system's word comes first, above.)
    if any(isinstance(cause, urllib3.exceptions.TimeoutError | TimeoutError) for cause in causes):
        return "timed out"
    return _one_line(f"{type(error).__name__}: {error}", 200)


def _single_value(result: Any) -> float:
    """The value of an instant query's result: a scalar ``[t, "v"]`` or a vector of one sample."""
    if isinstance(result, list) and len(result) == 2 and isinstance(result[0], int | float):
        # A scalar (or string) result: [timestamp, "value"].
        raw = result[1]
    elif isinstance(result, list):
        if not result:
            raise NoData("query returned no data")
        if not all(isinstance(sample, dict) and "value" in sample for sample in result):
            # A range vector ("values"), e.g. rate's argument queried on its own.
            raise InvalidQuery("query returned a range vector; it must return an instant vector or scalar")
        if len(result) > 1:
            raise NotOneSeries(len(result))
        raw = result[0]["value"][1]
    else:
        raise InvalidQuery(f"unexpected query result {_one_line(repr(result), 120)}")
    try:
        value = float(raw)
    except (TypeError, ValueError):
        raise InvalidQuery(f"query returned {raw!r}, not a number") from None
    return value


class PrometheusSource:
    """One Prometheus server, queried from worker threads so the event loop never blocks."""

    def __init__(self, url: str, *, timeout_s: float = 2.0) -> None:
        self.url = url.rstrip("/")
        self.timeout_s = timeout_s
        # The client reports an error answer only as text; this session's hook raises it with its response.
        session = requests.Session()
        session.hooks["response"].append(_raise_on_error_status)
        # No retries: a tick is seconds long; an unreachable Prometheus must be reported, not waited on.
        # The client annotates timeout as int; it hands it to requests, which takes seconds as a float.
        self._client = PrometheusConnect(
            url=self.url,
            retry=Retry(total=0, status_forcelist=(), raise_on_status=False),
            timeout=timeout_s,  # type: ignore[arg-type]
            session=session,
        )

    def __repr__(self) -> str:
        return f"PrometheusSource({self.url!r}, timeout_s={self.timeout_s})"

    def _query(self, promql: str) -> Any:
        try:
            return self._client.custom_query(promql)
        except _ErrorAnswer as e:
            status, text = e.response.status_code, _error_text(e.response)
            if status in (400, 422):
                raise InvalidQuery(f"prometheus refused the query: {text}") from None
            raise MetricsUnavailable(f"prometheus at {self.url} unreachable: HTTP {status}: {text}") from None
        except PrometheusApiClientException:
            # Any other answer than 200 that is no error (a 204, a redirect not followed).
            raise MetricsUnavailable(
                f"prometheus at {self.url} unreachable: not a Prometheus API answer"
            ) from None
        except (requests.JSONDecodeError, KeyError, TypeError) as e:  # a 200 that is not Prometheus' JSON
            detail = _one_line(f"{type(e).__name__}: {e}", 120)
            raise MetricsUnavailable(
                f"prometheus at {self.url} unreachable: not a Prometheus API answer ({detail})"
            ) from None
        except requests.RequestException as e:
            reason = _connection_reason(e)
            raise MetricsUnavailable(f"prometheus at {self.url} unreachable: {reason}") from None

    async def query_total(self, promql: str) -> float:
        """The single value of the instant query ``promql``; raises a ``PrometheusError`` otherwise."""
        try:
            result = await asyncio.wait_for(asyncio.to_thread(self._query, promql), self.timeout_s)
        except TimeoutError:
            raise MetricsUnavailable(
                f"prometheus at {self.url} unreachable: no answer within {self.timeout_s:g}s"
            ) from None
        return _single_value(result)

    def close(self) -> None:
        self._client.close()


def _mark_retrieved(task: asyncio.Task[float]) -> None:
    # A shared query's failure is reported to whoever awaits it; this only silences asyncio's
    # "exception was never retrieved" when every waiter was cancelled first.
    if not task.cancelled():
        task.exception()


class TickCache:
    """Memoizes queries for one evaluation tick: each (Prometheus, query) pair is sent once per tick.

    Concurrent callers of the same query share the one request in flight, and its failure too.
    Call ``new_tick()`` (or use a new cache) when the next tick starts.
    """

    def __init__(self) -> None:
        self._entries: dict[tuple[str, str], asyncio.Task[float]] = {}
        self.requests = 0
        self.hits = 0

    def new_tick(self) -> None:
        self._entries.clear()

    async def query(self, source: PrometheusSource, promql: str) -> float:
        key = (source.url, promql)
        task = self._entries.get(key)
        if task is None:
            task = asyncio.ensure_future(source.query_total(promql))
            task.add_done_callback(_mark_retrieved)
            self._entries[key] = task
            self.requests += 1
        else:
            self.hits += 1
        # Shielded: one caller giving up must not cancel the request the others are waiting on.
        return await asyncio.shield(task)
