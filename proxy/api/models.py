"""The served model's card: GET /v1/models and /v1/models/{id} (OpenAI's shape)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from proxima.proxy.api.deps import PrincipalDep, SettingsDep
from proxima.proxy.config import Settings
from proxima.proxy.errors import NotFound

router = APIRouter(prefix="/v1", tags=["openai"])


def _model_card(settings: Settings) -> dict[str, Any]:
    return {"id": settings.model_name, "object": "model", "created": 0, "owned_by": "proxima"}


@router.get("/models")
async def list_models(_: PrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    return {"object": "list", "data": [_model_card(settings)]}


@router.get("/models/{model_id:path}")
async def retrieve_model(model_id: str, _: PrincipalDep, settings: SettingsDep) -> dict[str, Any]:
    """The served model's card (the SDK's ``models.retrieve``); 404 for any other id."""
    if model_id != settings.model_name:
        raise NotFound(
            f"The model '{model_id}' does not exist; this server serves '{settings.model_name}'.",
            param="model",
            code="model_not_found",
        )
    return _model_card(settings)
