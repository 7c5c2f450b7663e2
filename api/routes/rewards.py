"""Rewards: try a reward function on a few rows before a job uses it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, BODY_ERRORS, WRITE
from api.errors import APIError
from controller.rewards import RewardFunctionError, RewardScorer

router = APIRouter(
    prefix="/v1/rewards", tags=["rewards"], route_class=CheckedRoute, responses={**AUTH_ERRORS, **BODY_ERRORS}
)


class RewardRow(BaseModel):
    model_config = ConfigDict(extra="forbid")
    prompt: str = ""
    response: str
    ground_truth: Any = None
    extra: dict[str, Any] | None = None


class RewardValidateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    function: str = Field(..., description="'builtin:NAME', 'module:function' or 'path/file.py:function'")
    rows: list[RewardRow] = Field(..., min_length=1, max_length=1000)


@router.post("/validate", dependencies=WRITE)
def validate_reward(body: RewardValidateRequest) -> dict[str, Any]:
    try:
        scorer = RewardScorer(body.function)
    except RewardFunctionError as err:
        raise APIError(422, f"function: {err}", "function", "invalid_reward_function") from None
    rows = body.rows
    result = scorer.score([r.prompt for r in rows], [r.response for r in rows],
                          [r.ground_truth for r in rows], [r.extra for r in rows])  # fmt: skip
    return {
        "function": body.function,
        "scores": result.scores.tolist(),
        "metrics": result.metrics,
        "errors": result.errors,
        "error_messages": result.error_messages,
    }
