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
can say it in its own language. Every other error answer has the same body:
400 (a ``Host`` that is not the explorer's: DNS rebinding), 404 (no such path:
the message lists the endpoints), 405 (a method the path does not answer: the
message and ``Allow`` name the one it does), 408 (a body not sent within
``BODY_TIMEOUT_S``), 413 (a body over 192 KiB), 415 (a body labelled as
anything but JSON), 431 (a request line and headers over 16 KiB), 503 with
``Retry-After`` (the queue is full). The OpenAPI schema documents them.

Requests that compute go through bounded queues (``_queue.Lanes``): as many
run at once as there are cores (at most ``MAX_WORKERS``), ``WAITING_PER_WORKER``
per worker wait, more are refused with 503; each request's work is estimated
before it runs and refused over ``compute.MAX_WORK`` (about a second); work
whose client went away stops. The page, static files and ``/api/examples``
never wait behind them. ``serve`` adds a header timeout and a cap on
connections at the protocol level (``_guard``).
"""

from __future__ import annotations

import hashlib
import mimetypes
import re
import sys
import threading
import webbrowser
from collections.abc import AsyncIterator, Callable, Iterable, Mapping
from contextlib import asynccontextmanager
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any, TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import HTMLResponse, JSONResponse, Response
from pydantic import BaseModel
from starlette.exceptions import HTTPException as StarletteHTTPException

from flashledger import __version__

from . import _guard, _queue, compute
from . import schemas as sc
from .formulas import render_formula

__all__ = ["create_app", "serve"]

T = TypeVar("T", bound=BaseModel)

CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; "
    "img-src 'self' data:; connect-src 'self'; font-src 'self'; object-src 'none'; "
    "base-uri 'none'; frame-ancestors 'none'"
)
SECURITY_HEADERS = {"Content-Security-Policy": CSP, "X-Content-Type-Options": "nosniff"}
"""On every answer (the protocol level's refusals too: ``serve``)."""
_FORMULA = re.compile(r"<!--formula:(\w+)-->")

MAX_WORKERS = 4
"""Most computing requests run at once (one per core up to this). They are threads of one
process: the traced loops hold Python's interpreter lock, so more would add contention,
not throughput."""
WAITING_PER_WORKER = 4
"""Requests that may wait in line per worker; beyond that, 503."""
BODY_TIMEOUT_S = 5.0
"""A request body must arrive within this many seconds of its headers."""
HEADER_TIMEOUT_S = 5.0
"""A request's headers must arrive within this many seconds (``serve`` only)."""
KEEP_ALIVE_S = 5.0
"""An idle connection is closed after this many seconds (``serve`` only)."""
MAX_CONNECTIONS = 128
"""Most connections open at once (``serve`` only); more are answered 503 and closed."""
MAX_HEADER_BYTES = 16 * 1024
"""Largest request line and headers: 431 beyond it (h11 answers 400 to more arriving in
pieces)."""
SWITCH_INTERVAL_S = 0.0005
"""Python's thread switch interval in the server process (``serve`` only; default 5 ms):
how soon the event loop gets the interpreter back from threads running traced loops.
Measured with 50 parallel worst-case requests on a loaded 2-core machine: the slowest
trivial request 0.67-0.71 s with it, 2.5-2.6 s without."""

_ERRORS = {
    400: "the Host header is not a name of this explorer (DNS rebinding guard)",
    408: f"the request body did not arrive within {BODY_TIMEOUT_S:g} s",
    413: f"the request body is over {sc.MAX_BODY_BYTES} bytes",
    415: "the request body is labelled as something other than JSON "
    "(send Content-Type: application/json)",
    422: "invalid input: each error names the field, what was wrong and what is allowed "
    "(shapes that must agree, tiles no larger than the sequence and the work limit are "
    "checked beyond what this schema can say)",
    431: "the request line and headers are over 16 KiB",
    503: "the explorer is busy (its queue is full) or going away: try again after Retry-After",
}
_RETRY_AFTER = {
    "Retry-After": {
        "description": "seconds to wait before trying again",
        "schema": {"type": "integer", "minimum": 1},
    }
}


def _responses(*codes: int) -> dict[int | str, dict[str, Any]]:
    """OpenAPI ``responses`` for the error answers ``codes``, all with the error body."""
    out: dict[int | str, dict[str, Any]] = {}
    for code in codes:
        out[code] = {"model": sc.ErrorResponse, "description": _ERRORS[code]}
        if code == 503:
            out[code]["headers"] = _RETRY_AFTER
    return out


_GET_ERRORS = _responses(400, 431, 503)
_POST_ERRORS = _responses(400, 408, 413, 415, 422, 431, 503)


def _json(model: BaseModel) -> Response:
    """A response model as JSON, with ±inf as ``"Infinity"``/``"-Infinity"``."""
    return Response(model.model_dump_json(), media_type="application/json")


def _error(
    status: int, errors: list[dict[str, Any]], headers: Mapping[str, str] | None = None
) -> JSONResponse:
    detail = "; ".join(e["message"] for e in errors) or "invalid request"
    items = [{"kind": "invalid", "limits": {}} | e for e in errors]
    content = {"detail": detail, "errors": items}
    return JSONResponse(status_code=status, content=content, headers=dict(headers or {}))


def _path(loc: tuple[Any, ...]) -> str:
    """``("body", "scores", 3)`` -> ``"scores[3]"`` (a name over 40 characters cut short)."""
    out = ""
    for part in loc:
        if part == "body" and not out:
            continue
        if isinstance(part, str):
            part = sc.cut(part)
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _fields_at(model: type[BaseModel] | None, loc: tuple[Any, ...]) -> list[str]:
    """The field names of the request object at ``loc`` (the body's, or a nested one's:
    ``("body", "mask", "x")`` -> the mask's), or [] where that is not a known model."""
    parts = [p for p in loc[:-1] if p != "body"]
    for part in parts:
        if model is None or not isinstance(part, str) or part not in model.model_fields:
            return []
        model = _model_in(model.model_fields[part].annotation)
    return list(model.model_fields) if model is not None else []


def _model_in(annotation: Any) -> type[BaseModel] | None:
    """The request model an annotation holds (``MaskSpec``, ``MaskSpec | None``), if any."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return next(filter(None, (_model_in(a) for a in getattr(annotation, "__args__", ()))), None)


_WANTED = {
    "float_type": "a finite number (a JSON number, not a string or a boolean)",
    "finite_number": "a finite number",
    "int_type": "an integer (a JSON number without a fraction, not a string or a boolean)",
    "bool_type": "true or false",
    "string_type": "a string",
}
"""What a strictly typed field wants, by pydantic's error type."""


MAX_ERRORS = 20
"""Most errors one 422 lists; one more item counts the rest (kind ``more_errors``)."""


def _validation_errors(
    exc: RequestValidationError, model: type[BaseModel] | None = None
) -> list[dict[str, Any]]:
    """The error items of a request's validation errors (at most ``MAX_ERRORS``, then one
    that counts the rest); ``model`` (the endpoint's request) names the fields allowed
    where one is unknown."""
    errors: list[dict[str, Any]] = []
    found = exc.errors()
    for err in found[:MAX_ERRORS]:
        cause = (err.get("ctx") or {}).get("error")
        loc = tuple(err.get("loc", ()))
        path = _path(loc)
        if isinstance(cause, sc.InputError):
            errors.append(cause.as_error())
            continue
        kind = err.get("type", "")
        if kind == "json_invalid":  # loc: ("body", character offset)
            why = (err.get("ctx") or {}).get("error") or err.get("msg", "")
            at = loc[-1] if loc and isinstance(loc[-1], int) else None
            where = f" at character {at}" if at is not None else ""
            message = f"the request body is not valid JSON: {why}{where}"
            path = ""
        elif kind == "missing" and not path:
            message = "a JSON object is required as the request body"
        elif kind in ("model_type", "model_attributes_type", "dict_type"):
            got = sc.shown(err.get("input"))
            where = f"{path}: must be" if path else "the request body must be"
            message = f"{where} a JSON object {{...}}, not {got}"
        elif kind == "extra_forbidden":
            names = _fields_at(model, loc)
            allowed = (
                f"allowed: {', '.join(names)}" if names else "see /docs for the fields allowed"
            )
            message = f"{path}: unknown field; {allowed}"
        elif kind == "float_type" and type(err.get("input")) is int:  # past float64's range
            digits = len(str(abs(err["input"])))
            message = (
                f"{path}: must be a finite number within ±1.8e308, not a {digits}-digit integer"
            )
        elif kind in _WANTED:
            message = f"{path}: must be {_WANTED[kind]}, not {sc.shown(err.get('input'))}"
        else:
            message = f"{path}: {err.get('msg', 'invalid value')}" if path else err.get("msg", "")
        field = next((p for p in loc if isinstance(p, str) and p != "body"), "")
        field = sc.cut(field)
        errors.append({"field": field, "path": path, "message": message} | sc.error_details(err))
    if len(found) > MAX_ERRORS:
        more = len(found) - MAX_ERRORS
        message = f"{more} more errors in this request, not listed (the first {MAX_ERRORS} are)"
        limits = {"count": more, "listed": MAX_ERRORS}
        errors.append(
            {"field": "", "path": "", "message": message, "kind": "more_errors", "limits": limits}
        )
    return errors


def _static_files(directory: Traversable) -> dict[str, tuple[bytes, str, str]]:
    """``name -> (bytes, media type, ETag)`` of every file in ``directory``."""
    files = {}
    for entry in directory.iterdir():
        if entry.is_file():
            data = entry.read_bytes()
            media_type = mimetypes.guess_type(entry.name)[0] or "application/octet-stream"
            files[entry.name] = (data, media_type, f'"{hashlib.sha256(data).hexdigest()[:20]}"')
    return files


def _index_html() -> str:
    text = resources.files("flashledger.web").joinpath("static/index.html").read_text("utf-8")
    return _FORMULA.sub(lambda m: render_formula(m.group(1)), text)


def create_app(
    *,
    host: str = "127.0.0.1",
    allow_hosts: Iterable[str] = (),
    workers: int | None = None,
    waiting: int | None = None,
    max_work: float = compute.MAX_WORK,
    body_timeout_s: float = BODY_TIMEOUT_S,
    idle_release_s: float = 1.0,
) -> FastAPI:
    """The explorer app: page, static files, JSON API, error handlers and guards.

    ``host`` is the address the server listens on and ``allow_hosts`` more names
    it answers to (the ``Host`` check). ``workers`` computing requests run at once
    (default: one per core, at most ``MAX_WORKERS``) and ``waiting`` more wait
    (default ``WAITING_PER_WORKER`` per worker); ``max_work`` is the per-request
    work limit; memory is given back after ``idle_release_s`` seconds idle.
    The lanes are ``app.state.lanes``.
    """
    n_workers = workers if workers is not None else min(_queue.cores(), MAX_WORKERS)
    n_waiting = waiting if waiting is not None else WAITING_PER_WORKER * n_workers
    lanes = _queue.Lanes(workers=n_workers, waiting=n_waiting, idle_s=idle_release_s)

    @asynccontextmanager
    async def lifespan(_app: FastAPI) -> AsyncIterator[None]:
        yield
        lanes.stop_all()

    app = FastAPI(
        title="flashledger explorer",
        version=__version__,
        description="Exact blocked attention, observed: the JSON API behind the explorer.",
        docs_url=None,
        redoc_url=None,
        openapi_url="/openapi.json",
        lifespan=lifespan,
    )
    app.state.lanes = lanes
    routes = {
        f"/api/{name}": lanes.heavy for name in ("backward", "conventions", "measure", "ring")
    }
    routes |= {f"/api/{name}": lanes.light for name in ("ledger", "storage")}
    index = _index_html()
    static_dir = resources.files("flashledger.web").joinpath("static")
    docs_html = static_dir.joinpath("apidocs.html").read_text("utf-8")
    examples_json = compute.examples_payload().model_dump_json()

    async def run(
        lane: _queue.Lane, request: Request, work: Callable[[compute.Check], T]
    ) -> Response:
        """``work`` on ``lane``, serialised there too; 503 when the lane is full."""
        try:
            body = await lane.run(lambda check: work(check).model_dump_json(), request.receive)
        except _queue.Busy as exc:
            headers = {"Retry-After": str(exc.retry_after)}
            busy = {"kind": "busy", "limits": {"retry_after": exc.retry_after}}
            return _error(503, [{"field": "", "path": "", "message": str(exc)} | busy], headers)
        if body is None:  # the client went away; nobody reads this
            return _error(503, [{"field": "", "path": "", "message": "the client went away"}])
        return Response(body, media_type="application/json")

    models: dict[str, type[BaseModel]] = {
        "/api/ledger": sc.LedgerRequest,
        "/api/backward": sc.BackwardRequest,
        "/api/storage": sc.StorageRequest,
        "/api/conventions": sc.ConventionsRequest,
        "/api/measure": sc.MeasureRequest,
        "/api/ring": sc.RingRequest,
    }
    endpoints = ", ".join(["GET /api/examples", *(f"POST {path}" for path in models)])

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return _error(422, _validation_errors(exc, models.get(request.url.path)))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        if exc.status_code == 400:  # FastAPI could not parse the body as JSON
            message = (
                "the request body could not be read as JSON (not UTF-8 text, nested "
                "too deeply, or a number with too many digits)"
            )
            error = {"field": "", "path": "", "message": message, "kind": "invalid_json"}
            return _error(422, [error])
        message = str(exc.detail)
        headers = dict(exc.headers or {})
        if "GET" in headers.get("Allow", "").split(", ") and "HEAD" not in headers["Allow"]:
            headers["Allow"] += ", HEAD"  # answered by HeadAsGet
        where = request.url.path[:80]
        if exc.status_code == 404:
            message = f"no such path {where!r}; the page is GET /, the API: {endpoints}"
        elif exc.status_code == 405:
            allowed = headers.get("Allow", "")
            message = f"{request.method} is not answered on {where}; allowed: {allowed}"
        return _error(exc.status_code, [{"field": "", "path": "", "message": message}], headers)

    @app.exception_handler(ValueError)
    async def _value_error(_request: Request, exc: ValueError) -> JSONResponse:
        if isinstance(exc, sc.InputError):
            return _error(422, [exc.as_error()])
        return _error(422, [{"field": "", "path": "", "message": str(exc)}])

    @app.exception_handler(_queue.Cancelled)
    async def _stopped(_request: Request, _exc: _queue.Cancelled) -> JSONResponse:
        message = "the explorer is stopping; the request was not finished"
        error = {"field": "", "path": "", "message": message, "kind": "busy"}
        return _error(503, [error | {"limits": {"retry_after": 1}}], {"Retry-After": "1"})

    @app.exception_handler(Exception)
    async def _unexpected(_request: Request, exc: Exception) -> JSONResponse:
        message = f"internal error ({type(exc).__name__}): {exc}"
        return _error(500, [{"field": "", "path": "", "message": message}])

    @app.get("/", response_class=HTMLResponse, include_in_schema=False)
    async def page() -> HTMLResponse:
        return HTMLResponse(index)

    @app.get("/docs", response_class=HTMLResponse, include_in_schema=False)
    async def docs() -> HTMLResponse:
        return HTMLResponse(docs_html)

    @app.get(
        "/api/examples",
        response_model=sc.ExamplesResponse,
        responses=_GET_ERRORS,
        summary="The seed's data",
    )
    async def examples() -> Response:
        """The six-score row, the five-position Q/K/V/G, the presets and the input limits."""
        return Response(examples_json, media_type="application/json")

    @app.post(
        "/api/ledger",
        response_model=sc.LedgerResponse,
        responses=_POST_ERRORS,
        summary="One row, block by block",
    )
    async def ledger(req: sc.LedgerRequest, request: Request) -> Response:
        """Section 02: ``OnlineSoftmax`` over one row; every block's m, α, ℓ, acc, output."""
        return await run(lanes.light, request, lambda _check: compute.ledger_steps(req))

    @app.post(
        "/api/backward",
        response_model=sc.BackwardResponse,
        responses=_POST_ERRORS,
        summary="Traced backward",
    )
    async def backward(req: sc.BackwardRequest, request: Request) -> Response:
        """Section 04: blocked forward, traced blocked backward, reference and autograd check."""

        def work(check: compute.Check) -> sc.BackwardResponse:
            compute.check_work(req, limit=max_work)  # on the worker: it may build the native step
            return compute.backward_steps(req, check=check)

        return await run(lanes.heavy, request, work)

    @app.post(
        "/api/storage",
        response_model=sc.StorageResponse,
        responses=_POST_ERRORS,
        summary="Storage and work",
    )
    async def storage(req: sc.StorageRequest, request: Request) -> Response:
        """Section 05: full P vs one LSE per row, dot products, tiles, memory traffic."""
        return await run(lanes.light, request, lambda _check: compute.storage(req))

    @app.post(
        "/api/conventions",
        response_model=sc.ConventionsResponse,
        responses=_POST_ERRORS,
        summary="Every preset",
    )
    async def conventions(req: sc.ConventionsRequest, request: Request) -> Response:
        """Section 06: O and LSE of every row under each conventions preset."""

        def work(check: compute.Check) -> sc.ConventionsResponse:
            compute.check_work(req, limit=max_work)
            return compute.conventions_table(req, check=check)

        return await run(lanes.heavy, request, work)

    @app.post(
        "/api/measure",
        response_model=sc.MeasureResponse,
        responses=_POST_ERRORS,
        summary="Run times here",
    )
    async def measure(req: sc.MeasureRequest, request: Request) -> Response:
        """Section 03: medians of the untraced blocked loop and the dense reference on this CPU."""
        return await run(lanes.heavy, request, lambda check: compute.measure(req, check=check))

    @app.post(
        "/api/ring",
        response_model=sc.RingResponse,
        responses=_POST_ERRORS,
        summary="Ring attention, every hop",
    )
    async def ring(req: sc.RingRequest, request: Request) -> Response:
        """Section 07: ``simulate_ring`` forward and backward; hops, per-rank states, oracle."""
        return await run(lanes.heavy, request, lambda check: compute.ring(req, check=check))

    static = _static_files(static_dir)
    # the page as / serves it (its formulas rendered), not the template
    page_file = static["index.html"]
    rendered = index.encode()
    static["index.html"] = (
        rendered,
        page_file[1],
        f'"{hashlib.sha256(rendered).hexdigest()[:20]}"',
    )

    @app.get("/static/{name}", include_in_schema=False)
    async def static_file(name: str, request: Request) -> Response:
        """The page's files, held in memory (no file system access while serving)."""
        found = static.get(name)
        if found is None:
            message = f"no static file {name[:80]!r}"
            return _error(404, [{"field": "", "path": "", "message": message}])
        data, media_type, etag = found
        headers = {"ETag": etag, "Cache-Control": "no-cache"}
        if request.headers.get("if-none-match") == etag:
            return Response(status_code=304, headers=headers)
        return Response(data, media_type=media_type, headers=headers)

    # outermost first: the security headers (on every answer, the guards' refusals too),
    # the Host check, early refusal when full, the body
    app.add_middleware(
        _guard.BodyGuard,
        limit=sc.MAX_BODY_BYTES,
        timeout_s=body_timeout_s,
        header_limit=MAX_HEADER_BYTES,
    )
    app.add_middleware(_queue.Admission, routes=routes)
    app.add_middleware(_guard.HeadAsGet)
    app.add_middleware(_guard.HostCheck, rule=_guard.HostRule(host, allow_hosts))
    app.add_middleware(_guard.SecurityHeaders, headers=SECURITY_HEADERS)
    return app


def _url(host: str, port: int) -> str:
    name = "127.0.0.1" if host in _guard.WILDCARDS else host
    return f"http://[{name}]:{port}/" if ":" in name else f"http://{name}:{port}/"


def check_hosts(host: str, allow_hosts: Iterable[str]) -> None:
    """Raise ``ValueError`` (one line naming the option) for an empty ``host`` (which
    would listen on every interface) or an ``allow_hosts`` name that cannot be a host
    name (empty, or with spaces)."""
    if not isinstance(host, str) or not host.strip():
        raise ValueError(
            "--host is empty; give an address, e.g. 127.0.0.1, or 0.0.0.0 for all interfaces"
        )
    for name in allow_hosts:
        if not isinstance(name, str) or not name.strip() or any(c.isspace() for c in name):
            raise ValueError(f"--allow-host {name!r} is not a host name (empty, or has spaces)")


def serve(
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    open_browser: bool = False,
    allow_hosts: Iterable[str] = (),
) -> None:
    """Run the explorer with uvicorn until interrupted; optionally open it in a browser.

    The port is bound first: a busy port, a missing permission or an unknown host
    raises ``OSError`` with a one-line reason before the server starts. Listening
    beyond loopback prints a warning on standard error.
    """
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"port must be an integer in 0..65535, got {port!r}")
    check_hosts(host, allow_hosts)
    sock = _guard.listen(host, port)
    port = sock.getsockname()[1]
    url = _url(host, port)
    if not _guard.is_loopback(host):
        where = "every network interface" if host in _guard.WILDCARDS else host
        print(
            f"flashledger explore: warning: listening on {where} ({host or '0.0.0.0'}), not "
            "only on this machine: anyone who can reach it can use the explorer and its CPU "
            "(there is no login); --host 127.0.0.1 keeps it local",
            file=sys.stderr,
        )
    print(f"flashledger explorer on {url} (Ctrl+C stops it)", file=sys.stderr, flush=True)
    # the event loop takes the GIL back from computing threads within this, not 5 ms
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    app = create_app(host=host, allow_hosts=allow_hosts)
    config = uvicorn.Config(
        app,
        http=_guard.protocol_class(
            header_timeout_s=HEADER_TIMEOUT_S, max_connections=MAX_CONNECTIONS
        ),
        log_level="info",
        timeout_keep_alive=int(KEEP_ALIVE_S),
        h11_max_incomplete_event_size=MAX_HEADER_BYTES,
    )
    if open_browser:
        threading.Timer(1.0, webbrowser.open, args=(url,)).start()
    uvicorn.Server(config).run(sockets=[sock])
