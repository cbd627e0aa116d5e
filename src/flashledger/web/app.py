"""The explorer: a FastAPI app serving the page, its static files and a JSON API.

``create_app()`` builds the app; ``serve()`` runs it with uvicorn (this is what
``flashledger explore`` and ``python -m flashledger.web`` call). The page is
plain HTML, CSS and ES modules from ``static/``; formulas are MathML rendered
on the server; nothing is loaded from outside the server (a
Content-Security-Policy header enforces it).

Endpoints (all JSON; ±inf travel as ``"Infinity"``/``"-Infinity"``):

==========  =====================  ==================================================
method      path                   purpose
==========  =====================  ==================================================
GET         ``/``                  the explorer page
GET         ``/docs``              this API, rendered from ``/openapi.json``
GET         ``/openapi.json``      OpenAPI schema
GET         ``/api/examples``      the seed's data, conventions presets, input limits
POST        ``/api/ledger``        section 02: one row through ``OnlineSoftmax``
POST        ``/api/backward``      section 04: traced blocked backward + checks
POST        ``/api/storage``       section 05: storage/work ledger, memory traffic
POST        ``/api/conventions``   section 06: one problem under every preset
POST        ``/api/measure``       section 03: run times of the blocked loop here
POST        ``/api/ring``          section 07: ring attention, every rank and hop
==========  =====================  ==================================================

Invalid input gets status 422 and ``{"detail": "<one line>", "errors":
[{"field", "path", "message", "kind", "limits"}]}``: ``kind`` names the rule
broken and ``limits`` its numbers (``schemas.ERROR_KINDS``), so that a page
can say it in its own language; a body over 192 KiB gets 413.
"""

from __future__ import annotations

import re
import threading
import webbrowser
from collections.abc import Awaitable, Callable, MutableMapping
from importlib import resources
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from fastapi.staticfiles import StaticFiles
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashledger import __version__

from . import compute
from . import schemas as sc
from .formulas import render_formula

__all__ = ["create_app", "serve"]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
_FORMULA = re.compile(r"<!--formula:(\w+)-->")


class BodyLimit:
    """ASGI middleware: refuse a request body over ``limit`` bytes with 413.

    A declared ``Content-Length`` over the limit is refused at once; otherwise
    the body is read (never more than ``limit + 1`` bytes are kept) and handed
    on in one piece, so a streamed body is held to the same limit.
    """

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._refuse(scope, receive, send, int(declared))
            return
        body = bytearray()
        more = True
        while more:
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) > self.limit:
                await self._refuse(scope, receive, send, len(body))
                return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, size: int) -> None:
        message = f"the request body is {size} bytes or more; the limit is {self.limit} bytes"
        await _error(413, [{"field": "", "path": "", "message": message}])(scope, receive, send)


def _json(model: BaseModel) -> Response:
    """A response model as JSON, with ±inf as ``"Infinity"``/``"-Infinity"``."""
    return Response(model.model_dump_json(), media_type="application/json")


def _error(status: int, errors: list[dict[str, Any]]) -> JSONResponse:
    detail = "; ".join(e["message"] for e in errors) or "invalid request"
    items = [{"kind": "invalid", "limits": {}} | e for e in errors]
    return JSONResponse(status_code=status, content={"detail": detail, "errors": items})


def _path(loc: tuple[Any, ...]) -> str:
    """``("body", "scores", 3)`` -> ``"scores[3]"``."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _validation_errors(exc: RequestValidationError) -> list[dict[str, Any]]:
    errors = []
    for err in exc.errors():
        cause = (err.get("ctx") or {}).get("error")
        loc = tuple(err.get("loc", ()))
        path = _path(loc)
        if isinstance(cause, sc.InputError):
            errors.append(cause.as_error())
            continue
        kind = err.get("type", "")
        if kind == "json_invalid":
            message = f"the request body is not valid JSON ({err.get('msg', '')})"
        elif kind == "missing" and not path:
            message = "a JSON object is required as the request body"
        elif kind == "extra_forbidden":
            message = f"{path}: unknown field; see /docs for the fields allowed"
        else:
            message = f"{path}: {err.get('msg', 'invalid value')}" if path else err.get("msg", "")
        field = next((p for p in loc if isinstance(p, str) and p != "body"), "")
        errors.append({"field": field, "path": path, "message": message} | sc.error_details(err))
    return errors


def _index_html() -> str:
    text = resources.files("flashledger.web").joinpath("static/index.html").read_text("utf-8")
    return _FORMULA.sub(lambda m: render_formula(m.group(1)), text)


def create_app() -> FastAPI:
    """The explorer app: page, static files, JSON API, error handlers, body limit."""
    app = FastAPI(
        title="flashledger explorer",
        version=__version__,
        description="Exact blocked attention, observed: the JSON API behind the explorer.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
    )
    index = _index_html()
    static_dir = resources.files("flashledger.web").joinpath("static")
    docs_html = static_dir.joinpath("apidocs.html").read_text("utf-8")

    @app.middleware("http")
    async def _headers(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        response = await call_next(request)
        response.headers["Content-Security-Policy"] = CSP
        response.headers["X-Content-Type-Options"] = "nosniff"
        return response

    @app.exception_handler(RequestValidationError)
    async def _invalid(_request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, _validation_errors(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _error(exc.status_code, [{"field": "", "path": "", "message": str(exc.detail)}])

    @app.exception_handler(ValueError)
    async def _value_error(_request: Request, exc: ValueError) -> JSONResponse:
        if isinstance(exc, sc.InputError):
            return _error(422, [exc.as_error()])
        return _error(422, [{"field": "", "path": "", "message": str(exc)}])

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error ({type(exc).__name__}): {exc}"
        return _error(500, [{"field": "", "path": "", "message": message}])

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    def page() -> HTMLResponse:
        return HTMLResponse(index)

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    def docs() -> HTMLResponse:
        return HTMLResponse(docs_html)

    @app.get("/api/examples", response_model=sc.ExamplesResponse, summary="The seed's data")
    def examples() -> Response:
        """The six-score row, the five-position Q/K/V/G, the presets and the input limits."""
        return _json(compute.examples_payload())

    @app.post("/api/ledger", response_model=sc.LedgerResponse, summary="One row, block by block")
    def ledger(req: sc.LedgerRequest) -> Response:
        """Section 02: ``OnlineSoftmax`` over one row; every block's m, α, ℓ, acc, output."""
        return _json(compute.ledger_steps(req))

    @app.post("/api/backward", response_model=sc.BackwardResponse, summary="Traced backward")
    def backward(req: sc.BackwardRequest) -> Response:
        """Section 04: blocked forward, traced blocked backward, reference and autograd check."""
        return _json(compute.backward_steps(req))

    @app.post("/api/storage", response_model=sc.StorageResponse, summary="Storage and work")
    def storage(req: sc.StorageRequest) -> Response:
        """Section 05: full P vs one LSE per row, dot products, tiles, memory traffic."""
        return _json(compute.storage(req))

    @app.post("/api/conventions", response_model=sc.ConventionsResponse, summary="Every preset")
    def conventions(req: sc.ConventionsRequest) -> Response:
        """Section 06: O and LSE of every row under each conventions preset."""
        return _json(compute.conventions_table(req))

    @app.post("/api/measure", response_model=sc.MeasureResponse, summary="Run times here")
    def measure(req: sc.MeasureRequest) -> Response:
        """Section 03: medians of the untraced blocked loop and the dense reference on this CPU."""
        return _json(compute.measure(req))

    @app.post("/api/ring", response_model=sc.RingResponse, summary="Ring attention, every hop")
    def ring(req: sc.RingRequest) -> Response:
        """Section 07: ``simulate_ring`` forward and backward; hops, per-rank states, oracle."""
        return _json(compute.ring(req))

    app.mount("/static", StaticFiles(directory=str(static_dir)), name="static")
    app.add_middleware(BodyLimit, limit=sc.MAX_BODY_BYTES)
    return app


def serve(*, host: str = "127.0.0.1", port: int = 8000, open_browser: bool = False) -> None:
    """Run the explorer with uvicorn until interrupted; optionally open it in a browser."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in 0..65535, got {port!r}")
    url = f"http://{'127.0.0.1' if host in ('0.0.0.0', '') else host}:{port}/"
    if open_browser:
        threading.Timer(1.0, webbrowser.open, args=(url,)).start()
    uvicorn.run(create_app(), host=host, port=port, log_level="info")
