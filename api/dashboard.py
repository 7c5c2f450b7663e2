"""The web pages: the dashboard (one static page and its assets) and the API docs, served by the API
itself from api/static (no CDN, no build step). The pages carry no data, so they load without a token;
the dashboard calls /v1 with the user's token.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.openapi.docs import get_swagger_ui_html
from fastapi.responses import FileResponse, HTMLResponse
from fastapi.staticfiles import StaticFiles

from controller.hyperparameters import HYPERPARAMETERS

STATIC_DIR = Path(__file__).resolve().parent / "static"

# Scripts and styles only from this origin and no inline script: a page that holds a token should
# not run anything it did not ship. Chart.js styles its canvases through the CSSOM, which this allows.
PAGE_HEADERS = {
    "Content-Security-Policy": (
        "default-src 'self'; script-src 'self'; style-src 'self'; img-src 'self' data:; "
        "connect-src 'self'; frame-ancestors 'none'; base-uri 'none'; form-action 'self'"
    ),
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "Cache-Control": "no-cache",
}


def mount_dashboard(app: FastAPI) -> None:
    """Serve the page at `/`, its settings at `/dashboard/config`, Swagger UI at `/docs` and the assets
    under `/static/`."""
    index = STATIC_DIR / "index.html"

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/dashboard/config", include_in_schema=False)
    def config() -> dict[str, object]:
        """What the page needs that is not job data: the hyper-parameters a running job accepts."""
        return {"hyperparameters": {name: ".".join(path) for name, path in HYPERPARAMETERS.items()}}

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

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
