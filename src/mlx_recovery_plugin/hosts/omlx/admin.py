"""Recovery status and the in-place budget change on oMLX's own admin API.

``GET /admin/api/recovery/status`` returns the recovery plugin's status snapshot and
``POST /admin/api/recovery/budget`` (``{"pct": 12.5}``) changes the process budget in
place. Both sit behind oMLX's admin authentication dependency
(``omlx.admin.auth.require_admin``: a signed admin session cookie), so a call without a
session is refused with 401 exactly like oMLX's other admin routes.

The routes are added to oMLX's FastAPI app after it is built (``app.include_router``),
which needs no change to oMLX: the start-up hook does it when ``omlx.server`` is
imported, or call :func:`attach_admin_routes` yourself.

Threads: FastAPI runs these sync handlers on its thread pool; ``status`` and
``set_budget`` of the recovery plugin are thread-safe by contract.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import pluggy
from pydantic import BaseModel, Field, field_validator

from ...recovery.control import SetBudgetFn, StatusFn
from ...settings import validate_budget_pct

log = logging.getLogger(__name__)

ROUTE_PREFIX = "/admin/api/recovery"

# Apps that already have the routes (FastAPI may keep an included router as one entry).
_attached: weakref.WeakSet[Any] = weakref.WeakSet()



class BudgetChange(BaseModel):
    """Body of ``POST .../budget``."""

    pct: float = Field(..., ge=0.0, le=100.0, description="share of wall time; 0 = off")

    @field_validator("pct")
    @classmethod
    def _check_pct(cls, value: float) -> float:
        return validate_budget_pct(value)  # the settings' and the CLI's own check


def recovery_controls(pm: pluggy.PluginManager) -> tuple[StatusFn, SetBudgetFn] | None:
    """``status`` and ``set_budget`` of the first registered plugin that has both."""
    for plugin in pm.get_plugins():
        status = getattr(plugin, "status", None)
        set_budget = getattr(plugin, "set_budget", None)
        if callable(status) and callable(set_budget):
            return status, set_budget
    return None


def build_router(
    status: StatusFn,
    set_budget: SetBudgetFn,
    *,
    auth: Callable[..., Any] | None = None,
    on_budget_change: Callable[[float], None] | None = None,
) -> Any:
    """An ``APIRouter`` with the two routes; ``auth`` defaults to oMLX's ``require_admin``."""
    from fastapi import APIRouter, Depends, HTTPException

    if auth is None:
        from omlx.admin.auth import require_admin

        auth = require_admin

    router = APIRouter(prefix=ROUTE_PREFIX, tags=["mlx-recovery"], dependencies=[Depends(auth)])

    @router.get("/status")
    def recovery_status() -> dict[str, Any]:
        return status()

    @router.post("/budget")
    def recovery_budget(change: BudgetChange) -> dict[str, Any]:
        try:
            budget = set_budget(change.pct)
        except ValueError as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from None
        if on_budget_change is not None:
            try:
                on_budget_change(change.pct)
            except Exception as exc:  # noqa: BLE001 - the change itself went through
                log.warning("mlx-recovery: after budget change: %r", exc)
        return {"budget": budget}

    return router


def attach_admin_routes(
    app: Any,
    pm: pluggy.PluginManager,
    *,
    auth: Callable[..., Any] | None = None,
    on_budget_change: Callable[[float], None] | None = None,
) -> bool:
    """Add the routes to ``app`` (oMLX's ``omlx.server.app``); False when no plugin offers
    a status and a budget, or the routes are there already."""
    if app in _attached:
        return False
    controls = recovery_controls(pm)
    if controls is None:
        return False
    app.include_router(build_router(*controls, auth=auth, on_budget_change=on_budget_change))
    _attached.add(app)
    log.info("mlx-recovery: admin routes at %s/status and %s/budget", ROUTE_PREFIX, ROUTE_PREFIX)
    return True
