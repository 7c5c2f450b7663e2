"""The web pages: the dashboard (one static page and its assets) and the API docs, served by the API
itself from api/static (no CDN, no build step). The pages carry no data, so they load without a token;
the dashboard calls /v1 with the user's token.
"""

from __future__ import annotations

import base64
import hashlib
import re
from pathlib import Path
from typing import Any

from fastapi import FastAPI, Response
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


class PageFiles(StaticFiles):
    """The assets, each sent with the page's headers: /static/index.html is the page too, and must not
    be framed or run inline script where `/` may not."""

    def file_response(self, *args: Any, **kwargs: Any) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers.update(PAGE_HEADERS)
        return response


def docs_headers(page: bytes) -> dict[str, str]:
    """The page's headers for Swagger UI's page, whose one inline script (its settings) is allowed by
    its hash: any other inline script, and any framing, is refused as on the dashboard."""
    script = re.search(rb"<script>(.*?)</script>", page, re.S)
    if script is None:
        raise RuntimeError("FastAPI's Swagger UI page has no inline script to allow")
    digest = base64.b64encode(hashlib.sha256(script.group(1)).digest()).decode()
    policy = PAGE_HEADERS["Content-Security-Policy"].replace(
        "script-src 'self'", f"script-src 'self' 'sha256-{digest}'"
    )
    return {**PAGE_HEADERS, "Content-Security-Policy": policy}


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

    docs_page = get_swagger_ui_html(
        openapi_url=app.openapi_url or "/openapi.json",
        title="Tandem API",
        swagger_js_url="/static/vendor/swagger-ui-bundle.js",
        swagger_css_url="/static/vendor/swagger-ui.css",
        swagger_favicon_url="/static/vendor/swagger-ui-favicon-32x32.png",
        swagger_ui_parameters={"persistAuthorization": False},
    ).body
    headers = docs_headers(docs_page)

    @app.get("/docs", include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(docs_page, headers=headers)

    app.mount("/static", PageFiles(directory=STATIC_DIR), name="static")
