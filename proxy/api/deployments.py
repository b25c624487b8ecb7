"""Admin routes of the deployments: the version registry, promotion, canary, rollback.

Every route needs the admin token. Each validates its body and calls one
method of ``ProductionController`` (``proxima.proxy.policies.production``). Each
takes the policy it acts on: ``adapter`` in the body or the query (absent: the
base model); one policy's production never moves another's.
"""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import APIRouter, Depends, Path, Query, Request
from proxima.proxy.api.deps import AdminDep
from proxima.proxy.api.schemas import check_identifier
from proxima.proxy.policies.adapters import check_adapter
from proxima.proxy.policies.deployments import CanarySplit
from proxima.proxy.policies.production import ProductionController
from proxima.proxy.state import state_of
from proxima.proxy.store.values import INT32_MAX
from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

router = APIRouter(tags=["deployments"])

_VERSION = Field(ge=0, le=2**31 - 1, description="A registered policy version (0: the base).")
# A LoRA adapter's name (absent: the base model).
Adapter = Annotated[str | None, AfterValidator(check_adapter)]
_ADAPTER = Field(None, description="The adapter whose production this is (absent: the base).")
AdapterQuery = Annotated[
    str | None,
    Query(description="An adapter's name (absent: the base model)."),
    AfterValidator(check_adapter),
]


class CanaryRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = _VERSION
    fraction: float = Field(
        ge=0.0, le=1.0, description="Share of production sessions the canary serves."
    )


class PromoteRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    version: int = _VERSION
    canary: CanaryRequest | None = None
    require_eval: bool = Field(
        False, description="Refuse a version whose eval score is below production's."
    )
    adapter: Adapter = _ADAPTER


class EvalScoreRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    score: float = Field(allow_inf_nan=False, description="Higher is better (e.g. accuracy).")
    items: int | None = Field(
        None, ge=0, le=INT32_MAX, description="How many held-out items were scored."
    )
    name: str = Field("eval", min_length=1, max_length=200, description="Which evaluation.")
    adapter: Adapter = _ADAPTER

    @field_validator("name")
    @classmethod
    def _name(cls, v: str) -> str:
        check_identifier(v, "name")
        return v


async def get_production(request: Request) -> ProductionController:
    return state_of(request).production


ProductionDep = Annotated[ProductionController, Depends(get_production)]
VersionPath = Annotated[int, Path(ge=0, le=2**31 - 1)]


@router.get("/admin/versions")
async def list_versions(
    _: AdminDep, production: ProductionDep, adapter: AdapterQuery = None
) -> dict[str, Any]:
    """Every registered version of the policy (0: the starting model), its eval score,
    who serves it."""
    return await production.versions(adapter)


@router.post("/admin/versions/{version}/evals")
async def record_eval(
    version: VersionPath, body: EvalScoreRequest, _: AdminDep, production: ProductionDep
) -> dict[str, Any]:
    """Remember an eval score of a registered version (``proxima eval --version``)."""
    await production.path_of(version, body.adapter)  # 404 for a version never pushed
    rec = await production.store.record_version_eval(
        version=version, score=body.score, items=body.items, name=body.name, adapter=body.adapter
    )
    return {
        "adapter": rec.adapter,
        "version": rec.version,
        "score": rec.score,
        "items": rec.items,
        "name": rec.name,
        "at": rec.created_at.isoformat(),
    }


@router.get("/admin/production")
async def production_status(
    _: AdminDep, production: ProductionDep, adapter: AdapterQuery = None
) -> dict[str, Any]:
    """The policy's current version, canary, history of promotions."""
    return await production.status(adapter)


@router.post("/admin/production")
async def promote(body: PromoteRequest, _: AdminDep, production: ProductionDep) -> dict[str, Any]:
    """Serve ``version`` in production (and ``canary.version`` to a share of sessions)."""
    canary = CanarySplit(body.canary.version, body.canary.fraction) if body.canary else None
    return await production.promote(
        body.version, canary, require_eval=body.require_eval, adapter=body.adapter
    )


@router.post("/admin/production/rollback")
async def rollback(
    _: AdminDep, production: ProductionDep, adapter: AdapterQuery = None
) -> dict[str, Any]:
    """The policy back to the version promoted before its current one (its canary is
    dropped)."""
    return await production.rollback(adapter)
