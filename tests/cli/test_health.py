"""The /healthz and /readyz endpoints over real sockets, and the readiness rules of the controller and agent
commands."""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import AsyncIterator
from pathlib import Path
from unittest.mock import AsyncMock

import pytest
import yaml
from kubernetes_asyncio import client
from pydantic import ValidationError

from dynamo_snapshot.cli import agent_cmd, controller_cmd
from dynamo_snapshot.cli.agent_cmd import AgentConfig
from dynamo_snapshot.cli.controller_cmd import ControllerCommandConfig, build_controller
from dynamo_snapshot.cli.health import HealthServer, health_endpoints, start_health_server
from dynamo_snapshot.cli.main import build_parser
from dynamo_snapshot.cli.service import load_settings
from dynamo_snapshot.kube import Kube

REPO = Path(__file__).resolve().parents[2]


def _request(port: int, raw: bytes, timeout: float = 5.0) -> bytes:
    """Send `raw`, return everything the server answers until it closes (blocking; run off the loop)."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
        s.sendall(raw)
        chunks = []
        while chunk := s.recv(4096):
            chunks.append(chunk)
    return b"".join(chunks)


async def get(port: int, path: str, method: str = "GET") -> tuple[int, str, bytes]:
    raw = f"{method} {path} HTTP/1.1\r\nHost: x\r\nUser-Agent: kube-probe/1.37\r\n\r\n".encode()
    answer = await asyncio.to_thread(_request, port, raw)
    head, _, body = answer.partition(b"\r\n\r\n")
    status_line = head.split(b"\r\n", 1)[0].decode()
    return int(status_line.split(" ")[1]), body.decode(), head


@pytest.fixture
async def server() -> AsyncIterator[tuple[HealthServer, dict[str, str | None]]]:
    state: dict[str, str | None] = {"ready": "caches not synced", "live": None}
    srv = HealthServer(0, host="127.0.0.1", live=lambda: state["live"], ready=lambda: state["ready"])
    async with srv:
        yield srv, state


async def test_endpoints(server: tuple[HealthServer, dict[str, str | None]]) -> None:
    srv, state = server
    status, body, head = await get(srv.port, "/healthz")
    assert (status, body) == (200, "ok\n")
    assert b"Content-Length: 3" in head
    assert b"Connection: close" in head

    assert (await get(srv.port, "/readyz"))[:2] == (503, "caches not synced\n")
    state["ready"] = None
    assert (await get(srv.port, "/readyz"))[:2] == (200, "ok\n")
    assert (await get(srv.port, "/readyz?verbose=1"))[:2] == (200, "ok\n"), "the query string is ignored"

    state["live"] = "wedged"
    assert (await get(srv.port, "/healthz"))[:2] == (503, "wedged\n")


async def test_head_unknown_paths_methods_and_garbage(
    server: tuple[HealthServer, dict[str, str | None]],
) -> None:
    srv, _ = server
    status, body, head = await get(srv.port, "/healthz", method="HEAD")
    assert (status, body) == (200, "")
    assert b"Content-Length: 3" in head
    assert (await get(srv.port, "/metrics"))[:2] == (404, "not found\n")
    assert (await get(srv.port, "/healthz", method="POST"))[0] == 405
    answer = await asyncio.to_thread(_request, srv.port, b"nonsense\r\n\r\n")
    assert answer.split(b" ", 2)[1] == b"400", answer
    # A request line past the parser's limit is refused before any check runs.
    answer = await asyncio.to_thread(_request, srv.port, b"GET /" + b"a" * 20000 + b" HTTP/1.1\r\n\r\n")
    assert answer.split(b" ", 2)[1] == b"400", answer[:200]


async def test_a_failing_check_is_a_503_not_a_crash() -> None:
    def broken() -> str | None:
        raise KeyError("lease")

    async with HealthServer(0, host="127.0.0.1", ready=broken) as srv:
        status, body, _ = await get(srv.port, "/readyz")
        assert (status, body) == (503, "check failed: KeyError: 'lease'\n")
        assert (await get(srv.port, "/healthz"))[:2] == (200, "ok\n")


async def test_a_blocked_event_loop_fails_the_probe_and_recovers() -> None:
    """The answer is made on the service's own loop: while that loop is blocked, a probe with a timeout
    gets nothing (kubelet counts a failure), and once it runs again, probes pass."""
    async with HealthServer(0, host="127.0.0.1") as srv:
        outcome: dict[str, object] = {}

        def probe() -> None:
            try:
                outcome["answer"] = _request(srv.port, b"GET /healthz HTTP/1.1\r\n\r\n", timeout=0.5)
            except TimeoutError as e:
                outcome["error"] = e

        t = threading.Thread(target=probe)
        t.start()
        time.sleep(1.5)  # noqa: ASYNC251 -- blocks the loop on purpose, as a synchronous call would
        await asyncio.to_thread(t.join)
        assert isinstance(outcome.get("error"), TimeoutError), outcome
        assert (await get(srv.port, "/healthz"))[:2] == (200, "ok\n")


async def test_a_silent_client_does_not_hold_up_probes() -> None:
    async with HealthServer(0, host="127.0.0.1") as srv:
        _, writer = await asyncio.open_connection("127.0.0.1", srv.port)
        writer.write(b"GET /hea")  # and nothing more
        await writer.drain()
        assert (await get(srv.port, "/healthz"))[:2] == (200, "ok\n")
        writer.close()


async def test_start_health_server_disabled_or_port_taken() -> None:
    assert await start_health_server(0) is None
    with socket.socket() as taken:
        taken.bind(("0.0.0.0", 0))
        taken.listen()
        port = taken.getsockname()[1]
        # Two replicas on one host (tests, dev machines) must not kill the second one.
        assert await start_health_server(port) is None
    srv = await start_health_server(port)
    assert srv is not None
    try:
        assert (await get(srv.port, "/healthz"))[:2] == (200, "ok\n")
    finally:
        await srv.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("0.0.0.0", 0))
        return int(s.getsockname()[1])


def _listening(port: int) -> bool:
    with socket.socket() as s:
        return s.connect_ex(("127.0.0.1", port)) == 0


async def test_health_endpoints_serve_the_block_and_take_the_check_once_built() -> None:
    port = _free_port()
    async with health_endpoints(port, starting="connecting") as health:
        assert (await get(port, "/healthz"))[:2] == (200, "ok\n")
        assert (await get(port, "/readyz"))[:2] == (503, "connecting\n")
        problem: list[str | None] = ["caches not synced"]
        health.use(lambda: problem[0])
        assert (await get(port, "/readyz"))[:2] == (503, "caches not synced\n")
        problem[0] = None
        assert (await get(port, "/readyz"))[:2] == (200, "ok\n")
    assert not _listening(port), "the endpoints close with the block"

    async def failing_service() -> None:
        async with health_endpoints(port, starting="starting"):
            assert _listening(port)
            raise RuntimeError("boom")

    with pytest.raises(RuntimeError, match="boom"):
        await failing_service()
    assert not _listening(port), "closed on the way out of a failing block too"


async def test_health_endpoints_disabled_by_port_0() -> None:
    async with health_endpoints(0, starting="starting") as health:
        health.use(lambda: None)
        assert health() is None


# --------------------------------------------------------------------------- readiness of the commands


@pytest.fixture
async def kube() -> AsyncIterator[Kube]:
    # Nothing is sent: the objects under test only need a client to exist.
    async with client.ApiClient(client.Configuration()) as api:
        yield Kube(api)


async def test_controller_is_ready_as_standby_and_as_leader_once_synced(
    kube: Kube, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = controller_cmd.ControllerCommandConfig(lease_name="ready-test", lease_namespace="ns")
    controller = build_controller(kube, config)
    # A second replica of the same lease in this process: its readiness is its own elector's, not a
    # process-wide view of the lease.
    standby = build_controller(kube, config)
    assert controller.elector is not None
    assert controller.readiness() is None, "a standby is ready: it can take over"

    # The elector wins the Lease (the API server's answer stubbed) and says so through is_leader.
    monkeypatch.setattr(controller.elector, "try_acquire_or_renew", AsyncMock(return_value=True))
    await controller.elector.acquire()
    reason = controller.readiness()
    assert reason is not None
    assert "not synced" in reason
    assert "DynamoGraphDeployment" in reason
    assert standby.readiness() is None, "the other replica is still a standby"
    for inf in controller.informers:
        inf.has_synced.set()
    assert controller.readiness() is None

    solo = controller_cmd.ControllerCommandConfig(leader_elect=False)
    alone = build_controller(kube, solo)
    assert alone.elector is None
    assert alone.readiness() is not None, "without election it leads from the start"
    for inf in alone.informers:
        inf.has_synced.set()
    assert alone.readiness() is None


async def test_agent_is_ready_once_its_pods_are_listed(kube: Kube, tmp_path: Path) -> None:
    config = agent_cmd.AgentConfig(
        node_name="gpu-7",
        runtime="local",
        artifact_root=tmp_path / "a",
        control_root=tmp_path / "c",
        state_root=tmp_path / "s",
    )
    agent = agent_cmd.build(config, kube)
    assert agent_cmd.readiness(agent) == "pods of node gpu-7 not listed yet"
    agent.pods.has_synced.set()
    assert agent_cmd.readiness(agent) is None


def test_health_port_is_a_setting_and_a_flag(tmp_path: Path) -> None:
    parser = build_parser()
    cfg = tmp_path / "c.yaml"
    cfg.write_text("healthPort: 9999\n")

    def controller_settings(*argv: str) -> controller_cmd.ControllerCommandConfig:
        args = parser.parse_args(["controller", *argv])
        return load_settings(
            controller_cmd.ControllerCommandConfig, args.config, args, controller_cmd._OVERRIDES
        )

    assert controller_settings().health_port == 8081
    assert controller_settings("--config", str(cfg)).health_port == 9999
    assert controller_settings("--config", str(cfg), "--health-port", "0").health_port == 0

    args = parser.parse_args(["agent", "--node-name", "n", "--health-port", "1234"])
    assert (
        load_settings(agent_cmd.AgentConfig, None, args, agent_cmd._FLAGS).observability.health_port == 1234
    )
    assert agent_cmd.AgentConfig(node_name="n").observability.health_port == 8082


def test_shipped_config_files_carry_the_health_ports() -> None:
    """controller/config.yaml and agent/config.yaml are what the images run with: the keys themselves, as
    the models' defaults would hide a missing line."""
    ctrl = yaml.safe_load((REPO / "controller" / "config.yaml").read_text())
    assert ctrl["healthPort"] == 8081
    assert controller_cmd.ControllerCommandConfig.model_validate(ctrl).health_port == 8081
    agent = yaml.safe_load((REPO / "agent" / "config.yaml").read_text())
    assert agent["observability"]["healthPort"] == 8082
    assert agent_cmd.AgentConfig.model_validate({**agent, "nodeName": "n"}).observability.health_port == 8082


def test_one_port_for_metrics_and_health_is_refused() -> None:
    for make in (
        lambda: AgentConfig(node_name="n", metrics_port=9100, health_port=9100),
        lambda: ControllerCommandConfig(metrics_port=9100, health_port=9100),
    ):
        with pytest.raises(ValidationError, match="give them different ports"):
            make()
    AgentConfig(node_name="n", metrics_port=0, health_port=0)  # both off is fine
