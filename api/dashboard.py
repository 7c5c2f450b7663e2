"""The web dashboard: one static page and its assets, served by the API itself (no CDN, no build step).
The page carries no data, so it loads without a token; it calls /v1 with the user's token.
"""

from __future__ import annotations

from pathlib import Path

from fastapi import FastAPI
from fastapi.responses import FileResponse
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
    """Serve the page at `/`, its settings at `/dashboard/config` and its assets under `/static/`."""
    index = STATIC_DIR / "index.html"

    @app.api_route("/", methods=["GET", "HEAD"], include_in_schema=False)
    def page() -> FileResponse:
        return FileResponse(index, media_type="text/html", headers=PAGE_HEADERS)

    @app.get("/dashboard/config", include_in_schema=False)
    def config() -> dict[str, object]:
        """What the page needs that is not job data: the hyper-parameters a running job accepts."""
        return {"hyperparameters": {name: ".".join(path) for name, path in HYPERPARAMETERS.items()}}

    app.mount("/static", StaticFiles(directory=STATIC_DIR), name="static")
