"""The playground: a page at `GET /` that drives the HTTP API from a browser (generate with live
progress, the mesh's stages, sleep and wake). Static files shipped with the package, read once;
the page calls the same public routes as any client, and holds the API key and control token the
person types only in the tab's memory: nothing secret is ever written into what is served here."""

from __future__ import annotations

from importlib import resources

from fastapi import FastAPI
from fastapi.responses import Response

from stagemesh.gateway.http import errors as http_errors

ASSET_PREFIX = "/playground/"
_PAGE = "index.html"
_TYPES = {
    ".html": "text/html; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".svg": "image/svg+xml",
}
# Everything from the gateway's own origin, no inline script or style, no frames, no plugins:
# images are shown from blob: URLs the script makes out of the answers' base64.
CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        "script-src 'self'",
        "style-src 'self'",
        "img-src 'self' blob:",
        "connect-src 'self'",
        "form-action 'none'",
        "base-uri 'none'",
        "frame-ancestors 'none'",
    )
)
_HEADERS = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    "referrer-policy": "no-referrer",
    # Small files that change with the installed version: revalidate rather than go stale.
    "cache-control": "no-cache",
}


def _load() -> dict[str, tuple[bytes, str]]:
    """name -> (bytes, content type) of every file in static/."""
    folder = resources.files(__package__) / "static"
    files = {}
    for entry in folder.iterdir():
        suffix = "." + entry.name.rsplit(".", 1)[-1]
        if entry.is_file() and suffix in _TYPES:
            files[entry.name] = (entry.read_bytes(), _TYPES[suffix])
    return files


def add_routes(app: FastAPI) -> None:
    files = _load()

    def serve(name: str) -> Response:
        if name not in files:
            status, body = 404, http_errors.error_body(404, f"no file {name!r} in the playground", None, "not_found")
            return http_errors.error_response(status, body)
        content, media_type = files[name]
        return Response(content, media_type=media_type, headers=_HEADERS)

    @app.get("/", include_in_schema=False)
    async def page() -> Response:
        return serve(_PAGE)

    @app.get(ASSET_PREFIX + "{name}", include_in_schema=False)
    async def asset(name: str) -> Response:
        return serve(name)
