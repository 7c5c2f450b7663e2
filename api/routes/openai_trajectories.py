"""External trajectories of a job fed by agents: the reward an agent reports (a step trains once
rewarded trajectories form whole groups), and the token-level record itself."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Path
from pydantic import BaseModel, ConfigDict, Field

from api.body_checks import CheckedRoute
from api.deps import AUTH_ERRORS, BODY_ERRORS, READ, WRITE, CallerDep, ServiceDep
from api.errors import documented
from api.routes.openai_bridge import call, external_job

router = APIRouter(
    prefix="/v1/jobs/{job_id}/trajectories",
    tags=["openai-compatible endpoint"],
    route_class=CheckedRoute,
    responses={**AUTH_ERRORS, **BODY_ERRORS, **documented(404, 409, 503)},
)

TrajectoryId = Path(..., min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.:-]+$")


class RewardRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    reward: float = Field(..., ge=-1e6, le=1e6, description="the trajectory's reward (its GRPO score)")
    task_id: str | None = Field(
        None, min_length=1, max_length=256,
        description="trajectories with the same task id form a GRPO group; default: the trajectory's id",
    )  # fmt: skip
    turn_rewards: list[float] | None = Field(None, max_length=100_000, description="optional, per call")
    metadata: dict[str, Any] | None = Field(None, description="kept with the trajectory")


@router.post("/{trajectory_id}/reward", dependencies=WRITE)
async def reward(
    job_id: str,
    body: RewardRequest,
    service: ServiceDep,
    caller: CallerDep,
    trajectory_id: str = TrajectoryId,
) -> dict[str, Any]:
    """Close the trajectory with its reward: 404 unknown, 409 already rewarded, dropped or trained on."""
    external_job(service, job_id, caller.sees)
    return await call(job_id, "reward", trajectory_id, body.model_dump(exclude_none=True))


@router.get("/{trajectory_id}", dependencies=READ)
async def trajectory(
    job_id: str, service: ServiceDep, caller: CallerDep, trajectory_id: str = TrajectoryId
) -> dict[str, Any]:
    """The trajectory's record, token by token, while the job runs (a step's samples keep it after)."""
    external_job(service, job_id, caller.sees)
    return await call(job_id, "trajectory", trajectory_id)
