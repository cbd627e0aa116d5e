"""The explorer's HTTP guards (private): what a hostile or broken client cannot do.

- :class:`HostCheck` answers 400 to a ``Host`` header that is not one of the
  explorer's names (loopback names, the address it listens on, names allowed
  with ``--allow-host``), so a page on another site cannot reach the API
  through DNS rebinding.
- :class:`BodyGuard` reads each request body before the app sees it: over the
  size limit, 413; not complete within ``timeout_s`` seconds (a slow or
  half-sent body), 408 and the connection is closed; labelled as anything but
  JSON, 415.
- :class:`SecurityHeaders` adds the Content-Security-Policy and ``nosniff``;
  :class:`HeadAsGet` answers ``HEAD`` wherever ``GET`` is answered.
- :func:`protocol_class` is uvicorn's h11 protocol plus a header timeout (a
  request whose headers are not complete within ``header_timeout_s`` is
  answered 408 and closed; a silent connection is closed) and a cap on open
  connections (beyond it a connection is answered 503 at once and closed).
- :func:`listen` binds the listening socket up front, so a busy port is one
  clear error before the server starts.

Every error body has the API's shape, ``{"detail": "...", "errors": [...]}``.
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import socket
from collections.abc import Awaitable, Callable, Iterable, Mapping, MutableMapping
from typing import Any

from .._text import RepeatedKey, cut, unique_keys

__all__ = [
    "BodyGuard",
    "HeadAsGet",
    "HostCheck",
    "HostRule",
    "SecurityHeaders",
    "error_body",
    "is_loopback",
    "listen",
    "protocol_class",
]

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
ASGIApp = Callable[[Scope, Receive, Send], Awaitable[None]]

WILDCARDS = ("", "0.0.0.0", "::")
"""Addresses that mean "every interface"."""
BACKLOG = 2048
"""Connections the kernel queues before the server accepts them (uvicorn's default)."""


def error_body(message: str, kind: str, limits: Mapping[str, int | float | str]) -> bytes:
    """The JSON error body: ``{"detail": message, "errors": [{field, path, message, kind,
    limits}]}`` (``kind`` one of ``schemas.ERROR_KINDS``)."""
    error = {"field": "", "path": "", "message": message, "kind": kind, "limits": dict(limits)}
    return json.dumps({"detail": message, "errors": [error]}).encode()


async def send_error(
    send: Send,
    status: int,
    message: str,
    kind: str,
    limits: Mapping[str, int | float | str],
    headers: Iterable[tuple[str, str]] = (),
) -> None:
    """Answer with ``status`` and the JSON error body."""
    body = error_body(message, kind, limits)
    raw = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    raw += [(k.lower().encode(), v.encode()) for k, v in headers]
    await send({"type": "http.response.start", "status": status, "headers": raw})
    await send({"type": "http.response.body", "body": body, "more_body": False})


def _raw_response(
    status: int, reason: str, message: str, kind: str, limits: Mapping[str, int | float | str]
) -> bytes:
    """A whole HTTP/1.1 response that closes the connection, for the protocol level."""
    body = error_body(message, kind, limits)
    extra = "retry-after: 1\r\n" if status == 503 else ""
    head = (
        f"HTTP/1.1 {status} {reason}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nx-content-type-options: nosniff\r\n"
        f"connection: close\r\n{extra}\r\n"
    )
    return head.encode() + body


def _plain_number(x: float) -> int | float:
    """``5.0`` as ``5``: a limit as people write it."""
    return int(x) if float(x).is_integer() else x


# ----------------------------------------------------------------------------- Host


def _ip(host: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address | None:
    try:
        return ipaddress.ip_address(host)
    except ValueError:
        return None


def is_loopback(host: str) -> bool:
    """True for ``localhost`` and loopback addresses (127.0.0.0/8, ::1)."""
    if host.lower().rstrip(".") == "localhost":
        return True
    ip = _ip(host)
    return ip is not None and ip.is_loopback


def _host_name(value: str) -> str:
    """The name in a ``Host`` header, without the port: ``[::1]:8000`` -> ``::1``; ""
    (no name allowed) where a port is there but not a number of 0..65535."""
    value = value.strip().lower()
    if value.startswith("["):
        name, _, rest = value[1:].partition("]")
        return name if rest == "" or _port_part(rest) else ""
    if value.count(":") == 1:
        value, _, port = value.partition(":")
        if not _port_part(":" + port):
            return ""
    return value.rstrip(".")


def _port_part(text: str) -> bool:
    """``text`` is ``:PORT`` with PORT a number of 0..65535."""
    port = text[1:]
    return text.startswith(":") and port.isascii() and port.isdigit() and int(port) <= 65535


class HostRule:
    """Which ``Host`` names the explorer answers to.

    Always ``localhost`` and the loopback addresses; the address it listens on
    (``bound``); the names in ``extra``. Listening on every interface
    (``0.0.0.0``), also any IP address and this machine's own names: a DNS
    rebinding attack needs a name the attacker controls, never an address.
    """

    def __init__(self, bound: str = "127.0.0.1", extra: Iterable[str] = ()) -> None:
        self.bound = bound
        self.any_address = bound in WILDCARDS
        self.names = {"localhost", _host_name(bound)} | {_host_name(x) for x in extra}
        self.names.discard("")
        if self.any_address:
            self.names |= {socket.gethostname().lower(), socket.getfqdn().lower()}

    def allows(self, host: str) -> bool:
        name = _host_name(host)
        if name in self.names:
            return True
        ip = _ip(name)
        return ip is not None and (ip.is_loopback or self.any_address)

    def describe(self) -> str:
        names = sorted(self.names | {"127.0.0.1", "::1"})
        if self.any_address:
            names.append("any IP address")
        return ", ".join(names)


class HostCheck:
    """ASGI middleware: 400 unless the ``Host`` header is allowed by ``rule``.

    A request without a ``Host`` header (HTTP/1.0) passes: browsers always send one.
    """

    def __init__(self, app: ASGIApp, rule: HostRule) -> None:
        self.app = app
        self.rule = rule

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] in ("http", "websocket"):
            host = dict(scope.get("headers") or []).get(b"host")
            if host is not None:
                text = host.decode("latin-1")
                if not self.rule.allows(text):
                    if scope["type"] == "websocket":
                        await send({"type": "websocket.close", "code": 1008})
                        return
                    message = (
                        f"Host {text[:80]!r} is not a name this explorer answers to "
                        f"({self.rule.describe()}); start it with --allow-host NAME to add one"
                    )
                    await send_error(send, 400, message, "host", {"allowed": self.rule.describe()})
                    return
        await self.app(scope, receive, send)


# ----------------------------------------------------------------------------- bodies


class BodyGuard:
    """ASGI middleware: read the whole request body first, within a size and a time limit.

    Request line and headers over ``header_limit`` bytes are refused (431; h11 itself
    only bounds headers that arrive in pieces). A declared ``Content-Length`` over
    ``limit`` is refused at once (413); a streamed
    body is held to the same limit. A body not complete ``timeout_s`` seconds after
    its headers gets 408 and the connection is closed. A body labelled as anything
    but JSON (curl's ``-d`` labels it a form) gets 415 with the header to send; an
    unlabelled one is read as JSON. The app then receives the body in one piece.
    """

    def __init__(
        self, app: ASGIApp, *, limit: int, timeout_s: float, header_limit: int | None = None
    ) -> None:
        self.app = app
        self.limit = limit
        self.timeout_s = timeout_s
        self.header_limit = header_limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        head = len(scope.get("raw_path") or b"") + len(scope.get("query_string") or b"")
        head += sum(len(k) + len(v) + 4 for k, v in scope.get("headers") or [])
        if self.header_limit is not None and head > self.header_limit:
            why = (
                f"the request line and headers are about {head} bytes; the limit is "
                f"{self.header_limit} bytes"
            )
            sizes = {"max": self.header_limit, "got": head}
            await send_error(send, 431, why, "too_large", sizes, [("connection", "close")])
            return
        declared = dict(scope.get("headers") or []).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > self.limit:
            await self._too_large(send, int(declared))
            return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.timeout_s
        body = bytearray()
        more = True
        while more:
            try:
                message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0.0))
            except TimeoutError:
                reason = (
                    f"the request body was not complete within {self.timeout_s:g} s "
                    f"({len(body)} bytes received); send it at once"
                )
                limits = {"seconds": _plain_number(self.timeout_s)}
                await send_error(send, 408, reason, "timeout", limits, [("connection", "close")])
                return
            if message["type"] != "http.request":  # the client went away
                return
            body += message.get("body", b"")
            more = bool(message.get("more_body", False))
            if len(body) > self.limit:
                await self._too_large(send, len(body))
                return
        media = _media_type(scope)
        json_ok = media == "application/json" or media.endswith("+json")
        if body and media and not json_ok and scope.get("method") not in ("GET", "HEAD"):
            reason = (
                f"the request body was sent as {media}; the API reads JSON: send it with "
                "the header Content-Type: application/json"
            )
            await send_error(send, 415, reason, "media_type", {"got": media[:60]})
            return
        coding = dict(scope.get("headers") or []).get(b"content-encoding", b"")
        coding_name = coding.decode("latin-1").strip().lower()
        if body and coding_name not in ("", "identity"):
            reason = (
                f"the request body was sent with Content-Encoding {coding_name[:40]!r}; the "
                "API reads plain JSON: send it without a Content-Encoding header"
            )
            await send_error(send, 415, reason, "media_type", {"got": coding_name[:60]})
            return
        twice = _repeated_key(bytes(body)) if body and (json_ok or not media) else None
        if twice is not None:
            reason = (
                f"the request body names the key {cut(twice)!r} more than once in one "
                "object (only the last would count); give each key once"
            )
            await send_error(send, 422, reason, "invalid_json", {})
            return
        if body and not media:  # unlabelled: read as JSON, as it is labelled for the app
            scope = dict(scope)
            scope["headers"] = [
                *(scope.get("headers") or []),
                (b"content-type", b"application/json"),
            ]
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": bytes(body), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _too_large(self, send: Send, size: int) -> None:
        message = f"the request body is {size} bytes or more; the limit is {self.limit} bytes"
        limits = {"max": self.limit, "got": size}
        await send_error(send, 413, message, "too_large", limits, [("connection", "close")])


def _repeated_key(body: bytes) -> str | None:
    """The first key a JSON object of ``body`` names twice, or None (also where ``body``
    is not JSON at all: the app says what is wrong with it)."""
    try:
        json.loads(body, object_pairs_hook=unique_keys)
    except RepeatedKey as exc:
        return exc.key
    except (ValueError, RecursionError):
        return None
    return None


def _media_type(scope: Scope) -> str:
    """The request's ``Content-Type`` without its parameters, lower case ("" when absent)."""
    raw = dict(scope.get("headers") or []).get(b"content-type", b"")
    return raw.decode("latin-1").split(";", 1)[0].strip().lower()


class SecurityHeaders:
    """ASGI middleware: every response gets ``headers`` (unless it already has them)."""

    def __init__(self, app: ASGIApp, headers: dict[str, str]) -> None:
        self.app = app
        self.headers = [(k.lower().encode(), v.encode()) for k, v in headers.items()]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                have = {k.lower() for k, _ in message.get("headers", [])}
                extra = [(k, v) for k, v in self.headers if k not in have]
                message["headers"] = [*message.get("headers", []), *extra]
            await send(message)

        await self.app(scope, receive, send_with_headers)


class HeadAsGet:
    """ASGI middleware: ``HEAD`` is answered as ``GET`` without the body (RFC 9110), so
    every page, file and GET endpoint answers it."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] != "HEAD":
            await self.app(scope, receive, send)
            return

        async def without_body(message: Message) -> None:
            if message["type"] == "http.response.body":
                message = {**message, "body": b""}
            await send(message)

        await self.app({**scope, "method": "GET"}, receive, without_body)


# ----------------------------------------------------------------------------- connections


def protocol_class(*, header_timeout_s: float, max_connections: int) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol with a header timeout and a cap on open connections."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class GuardedH11Protocol(H11Protocol):
        """One connection: headers within ``header_timeout_s``, at most ``max_connections``."""

        _timer: asyncio.TimerHandle | None = None
        _partial = False

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                message = (
                    f"the explorer has {max_connections} connections open, its most; "
                    "try again in a moment"
                )
                limits = {"retry_after": 1}
                transport.write(_raw_response(503, "Service Unavailable", message, "busy", limits))
                transport.close()
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            if self.transport.is_closing():
                self._disarm()
            elif self.conn.their_state is h11.IDLE:  # a request's headers are still coming
                self._partial = self._partial or bool(data)
                if self._timer is None:
                    self._arm()
            else:  # the headers are in: the body's time is BodyGuard's
                self._partial = False
                self._disarm()

        def send_400_response(self, msg: str) -> None:
            """h11 could not parse the request: the API's JSON error, then close."""
            message = (
                "the request could not be read as HTTP/1.1 (malformed, a negative or "
                "invalid Content-Length, or headers over the size limit)"
            )
            self.transport.write(_raw_response(400, "Bad Request", message, "invalid", {}))
            self.transport.close()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

        def _arm(self) -> None:
            self._timer = self.loop.call_later(header_timeout_s, self._expired)

        def _disarm(self) -> None:
            if self._timer is not None:
                self._timer.cancel()
                self._timer = None

        def _expired(self) -> None:
            self._timer = None
            if self.transport.is_closing() or self.conn.their_state is not h11.IDLE:
                return
            if self._partial:
                message = (
                    f"the request headers were not complete within {header_timeout_s:g} s; "
                    "send them at once"
                )
                limits = {"seconds": _plain_number(header_timeout_s)}
                self.transport.write(
                    _raw_response(408, "Request Timeout", message, "timeout", limits)
                )
            self.transport.close()

    return GuardedH11Protocol


def listen(host: str, port: int) -> socket.socket:
    """A socket listening on ``(host, port)``, for the server to accept on.

    Raises ``OSError`` with a one-line reason (port in use, no permission, not an
    address of this machine) before any server starts.
    """
    where = f"{host or '0.0.0.0'} port {port}"
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror as exc:
        raise OSError(
            f"cannot listen on {host!r}: not a known host name ({exc.strerror})"
        ) from None
    except UnicodeError:  # a label empty or over 63 characters ("a..b")
        raise OSError(
            f"cannot listen on {host[:80]!r}: not a valid host name (dot-separated labels of "
            "1 to 63 characters, or an IP address)"
        ) from None
    family, kind, proto, _, address = infos[0]
    sock = socket.socket(family, kind, proto)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind(address)
    except OSError as exc:
        sock.close()
        if exc.errno == errno.EADDRINUSE:
            reason = (
                f"{where} is already in use (another explorer or program listens there); "
                "choose another with --port, or --port 0 for any free port"
            )
        elif exc.errno == errno.EACCES:
            reason = (
                f"no permission to listen on {where} (ports below 1024 need privileges); "
                "choose another with --port"
            )
        elif exc.errno == errno.EADDRNOTAVAIL:
            reason = f"cannot listen on {host}: it is not an address of this machine"
        else:
            reason = f"cannot listen on {where}: {exc.strerror or exc}"
        raise OSError(reason) from None
    sock.listen(BACKLOG)  # connections wait in the backlog until the server accepts them
    return sock
