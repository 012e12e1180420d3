"""Recovery status and budget on oMLX's admin API, behind oMLX's own admin authentication."""

from __future__ import annotations

from collections.abc import Iterator
from types import SimpleNamespace

import pytest

omlx = pytest.importorskip(
    "omlx.scheduler", reason="oMLX (flyto-mlx) is not installed; CI installs it for these tests"
)
pytest.importorskip("fastapi", reason="oMLX's admin API needs FastAPI")

from fastapi import FastAPI
from fastapi.testclient import TestClient
from omlx.admin.auth import SESSION_COOKIE_NAME, create_session_token

from mlx_recovery_plugin.hosts.omlx import OmlxInstrumentor
from mlx_recovery_plugin.hosts.omlx.admin import ROUTE_PREFIX, attach_admin_routes
from mlx_recovery_plugin.plugins import make_plugin_manager
from mlx_recovery_plugin.recovery.plugin import RecoveryPlugin
from mlx_recovery_plugin.settings import RecoverySettings


@pytest.fixture
def plugin() -> Iterator[RecoveryPlugin]:
    p = RecoveryPlugin(settings=RecoverySettings(budget_pct=5.0), control_socket=False)
    yield p
    p.close()


@pytest.fixture
def client(plugin: RecoveryPlugin) -> TestClient:
    app = FastAPI()
    pm = make_plugin_manager([plugin], settings=RecoverySettings(), entry_points_too=False)
    assert attach_admin_routes(app, pm)
    assert not attach_admin_routes(app, pm)  # once per app
    return TestClient(app)


def signed_in(client: TestClient) -> TestClient:
    client.cookies.set(SESSION_COOKIE_NAME, create_session_token())
    return client


def test_calls_without_an_admin_session_are_refused(client: TestClient, plugin: RecoveryPlugin) -> None:
    assert client.get(f"{ROUTE_PREFIX}/status").status_code == 401
    assert client.post(f"{ROUTE_PREFIX}/budget", json={"pct": 50}).status_code == 401
    client.cookies.set(SESSION_COOKIE_NAME, "forged-token")
    assert client.post(f"{ROUTE_PREFIX}/budget", json={"pct": 50}).status_code == 401
    assert plugin.budget.pct == 5.0


def test_an_admin_reads_the_status_and_changes_the_budget_in_place(
    client: TestClient, plugin: RecoveryPlugin
) -> None:
    admin = signed_in(client)
    status = admin.get(f"{ROUTE_PREFIX}/status")
    assert status.status_code == 200
    assert status.json()["budget"]["pct"] == 5.0

    changed = admin.post(f"{ROUTE_PREFIX}/budget", json={"pct": 12.5})
    assert changed.status_code == 200 and changed.json()["budget"]["pct"] == 12.5
    assert plugin.budget.pct == 12.5
    assert admin.get(f"{ROUTE_PREFIX}/status").json()["budget"]["pct"] == 12.5


@pytest.mark.parametrize("body", [{"pct": 101}, {"pct": -1}, {"pct": "lots"}, {}, {"pct": 1e-320}, {"pct": 0.001}])
def test_an_invalid_budget_is_rejected_and_nothing_changes(
    client: TestClient, plugin: RecoveryPlugin, body: dict
) -> None:
    assert signed_in(client).post(f"{ROUTE_PREFIX}/budget", json=body).status_code == 422
    assert plugin.budget.pct == 5.0


def test_the_adapter_adds_the_routes_to_the_server_app_and_wakes_idle_engines(
    plugin: RecoveryPlugin,
) -> None:
    inst = OmlxInstrumentor()
    server = SimpleNamespace(app=FastAPI())
    assert not inst.attach_admin(server)  # not attached to oMLX yet: nothing to expose
    inst.instrument(pm=make_plugin_manager([plugin], settings=RecoverySettings(), entry_points_too=False))
    woken: list[object] = []
    inst.wake = lambda scheduler=None: woken.append(scheduler)  # type: ignore[method-assign]
    try:
        assert inst.attach_admin(server)
        admin = signed_in(TestClient(server.app))
        assert admin.post(f"{ROUTE_PREFIX}/budget", json={"pct": 30}).status_code == 200
    finally:
        inst.uninstrument()
    assert woken == [None]
    assert plugin.budget.pct == 30.0


def test_without_a_recovery_plugin_no_routes_are_added() -> None:
    app = FastAPI()
    assert not attach_admin_routes(app, make_plugin_manager([], settings=RecoverySettings(), entry_points_too=False))
    assert TestClient(app).get(f"{ROUTE_PREFIX}/status").status_code == 404
