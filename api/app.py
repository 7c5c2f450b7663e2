"""The REST control plane: FastAPI routers over the Service, under /v1, with bearer-token auth.

Conventions (DESIGN.md §6): lists are {"object": "list", "data", "has_more"} with after/limit
cursors; errors are {"error": {...}} naming the field at fault; every response carries
x-request-id; POST /v1/jobs honours Idempotency-Key. Open without a token: /healthz, /readyz and the
dashboard's static page and assets (they hold no data; the page asks the API with the token).

Each resource is one router module under api/routes/; this module only assembles them with the
app-wide pieces (auth, error shape, request ids and latency, the dashboard).
"""

from __future__ import annotations

import time
import uuid

from fastapi import FastAPI, Request
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import HTMLResponse

from api.auth import Authenticator
from api.dashboard import mount_dashboard
from api.errors import install_error_handlers
from api.prom import make_registry
from api.routes import health, job_outputs, jobs, metrics, rewards
from api.routes.health import VERSION
from controller.service import Service

ROUTERS = (health.router, jobs.router, job_outputs.router, metrics.router, rewards.router)


def create_app(service: Service) -> FastAPI:
    app = FastAPI(
        title="Tandem",
        version=VERSION,
        description="RL post-training jobs: submit, watch, steer.",
        docs_url=None,  # served below from vendored assets: /docs works offline
        redoc_url=None,
    )
    install_error_handlers(app)
    registry, latency = make_registry(service.store)
    app.state.service = service
    app.state.auth = Authenticator(service.store)
    app.state.registry = registry

    @app.middleware("http")
    async def request_id(request: Request, call_next):
        rid = request.headers.get("x-request-id") or "req_" + uuid.uuid4().hex[:16]
        start = time.perf_counter()
        response = await call_next(request)
        response.headers["x-request-id"] = rid
        path = getattr(request.scope.get("route"), "path", "unmatched")
        latency.labels(request.method, path, str(response.status_code)).observe(time.perf_counter() - start)
        return response

    for router in ROUTERS:
        app.include_router(router)
    mount_dashboard(app)
    mount_docs(app)
    return app


def mount_docs(app: FastAPI) -> None:
    """Swagger UI at /docs from the assets vendored in api/static/vendor (no CDN)."""

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return get_swagger_ui_html(
            openapi_url=app.openapi_url or "/openapi.json",
            title="Tandem API",
            swagger_js_url="/static/vendor/swagger-ui-bundle.js",
            swagger_css_url="/static/vendor/swagger-ui.css",
            swagger_favicon_url="/static/vendor/swagger-ui-favicon-32x32.png",
            swagger_ui_parameters={"persistAuthorization": False},
        )
