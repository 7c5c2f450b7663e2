"""The REST control plane: one router per resource (api/routes/) over the Service, assembled here with
the app-wide pieces: auth, the error shape, request ids and latency, hot reads, the dashboard.
Conventions: docs/ARCHITECTURE.md §5.
"""

from __future__ import annotations

from fastapi import FastAPI

from api.auth import Authenticator
from api.dashboard import mount_dashboard
from api.errors import install_error_handlers
from api.middleware import BodyLimit, RequestLog
from api.read_cache import HotReads, ReadCache
from api.routes import (
    audit,
    files,
    health,
    job_outputs,
    jobs,
    keys,
    metrics,
    openai_endpoint,
    rewards,
    tinker,
    usage,
)
from api.routes.health import VERSION, make_registry
from api.settings import ServeSettings
from api.streams import StreamSlots
from api.validation import Checker
from service.service import Service
from service.tinker_hosts import HostOptions
from service.tinker_service import TinkerService

ROUTERS = (
    health.router,
    jobs.router,
    job_outputs.router,
    metrics.router,
    rewards.router,
    openai_endpoint.router,
    openai_endpoint.trajectories,
    files.router,
    keys.router,
    usage.router,
    audit.router,
    tinker.router,
    tinker.fallback,  # last: any other /api/v1 call is named as unsupported
)


def create_app(service: Service, settings: ServeSettings | None = None) -> FastAPI:
    app = FastAPI(
        title="Tandem",
        version=VERSION,
        description="RL post-training jobs: submit, watch, steer.",
        docs_url=None,  # served by mount_dashboard from vendored assets: /docs works offline
        redoc_url=None,
        # A REST client should get the route or a 404 in the error shape, never a 307 it must follow.
        redirect_slashes=False,
    )
    install_error_handlers(app)
    registry, latency = make_registry(service.store)
    app.state.service = service
    app.state.read_cache = ReadCache(service.store)
    app.state.auth = Authenticator(app.state.read_cache)
    app.state.hot_reads = HotReads(app.state.read_cache, app.state.auth)
    app.state.streams = StreamSlots()
    app.state.registry = registry
    app.state.settings = settings = settings or ServeSettings()
    app.state.checker = Checker(settings, service.home, service.files, service.store)
    service.scheduler.paths = app.state.checker.paths  # a job's paths are checked again when it starts
    app.state.tinker = TinkerService(
        service,
        settings.tinker_models(),
        HostOptions(max_rank=settings.tinker_max_rank, max_pending=settings.tinker_max_pending_requests),
    )

    tinker_data = settings.tinker_max_body_bytes
    limits = {
        "/v1/files": settings.max_upload_bytes,
        "/api/v1/forward_backward": tinker_data,
        "/api/v1/forward": tinker_data,
    }

    def body_limit(scope: dict) -> int:
        path = scope["path"].rstrip("/") if scope["method"] == "POST" else ""
        return limits.get(path, settings.max_body_bytes)

    app.add_middleware(app.state.hot_reads.middleware)  # innermost: inside RequestLog
    app.add_middleware(RequestLog, latency=latency, store=service.store)
    app.add_middleware(BodyLimit, limit_for=body_limit)  # outermost: refuses before anything reads
    for router in ROUTERS:
        app.include_router(router)
    mount_dashboard(app)
    return app
