"""Rewards: try a reward function on a few rows before a job uses it."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter
from pydantic import BaseModel, ConfigDict, Field

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, BODY_ERRORS, WRITE, CallerDep, CheckerDep
from api.errors import APIError
from controller.user_code import UserCodeError, UserCodeRefused, run_sandboxed

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
def validate_reward(body: RewardValidateRequest, checker: CheckerDep, caller: CallerDep) -> dict[str, Any]:
    """Score the rows with the function, in a sandbox: user code never runs in the API. An uploaded
    module must be the caller's."""
    ref = checker.reward_source(body.function, "function", caller.sees)
    rows = [row.model_dump() for row in body.rows]
    s = checker.settings
    try:
        result = run_sandboxed("controller.rewards:score_rows", ref, [rows], s.user_code_timeout_s,
                               f"reward function '{body.function}'", s.user_code_limits(), s.unsandboxed_user_code)  # fmt: skip
    except UserCodeRefused as err:
        raise APIError(422, f"function: {err}", "function", "user_code_refused") from None
    except UserCodeError as err:
        raise APIError(422, f"function: {err}", "function", "invalid_reward_function") from None
    return {"function": body.function, **result}
