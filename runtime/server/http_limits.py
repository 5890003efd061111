"""The limits of one HTTP connection, below the app: how large a request's headers may be, how long a client may
take to send them, and how long a connection may stay idle. They keep a hostile or broken client from holding a
socket open for free (slowloris) or making the event loop, which relays every live stream, parse megabytes.

    headers over max_header_bytes        431, JSON error body, connection closed (after a short linger)
    headers not complete in header_timeout_s (counted from the connection, or from the request's first byte)
                                         408 if the request had begun, then closed; a silent socket just closed
    idle between requests                uvicorn's own timeout_keep_alive (keep_alive_timeout_s) closes it

uvicorn's httptools protocol has neither a header limit nor a header timeout (its h11 protocol has the size limit,
h11_max_incomplete_event_size, which uvicorn_config passes when it must fall back to h11); limited_protocol adds
both to it. It counts the header bytes the parser hands over and the socket reads that leave a request's headers
incomplete, so a 128 MB header costs the server max_header_bytes plus one read, never a parse of all of it. It also answers HTTP/1.0 clients
without chunked encoding, which they cannot read: a response without Content-Length is sent as it comes and
ended by closing the connection. It knows nothing of routes or of the engine.

    config = uvicorn.Config(app, http=limited_protocol(HTTPLimits()), timeout_keep_alive=5)
"""
from __future__ import annotations

import http
import json
import logging
from dataclasses import dataclass

from engine.core.errors import EngineError

from .protocol import APIError

log = logging.getLogger("engine.server")
LINGER_S = 1.0          # after a 431, read and drop the rest for this long, so the client can read the answer


@dataclass(frozen=True)
class HTTPLimits:
    max_header_bytes: int = 64 * 1024       # request line + headers (nginx allows 4 x 8 KiB, Node 16 KiB)
    header_timeout_s: float = 10.0          # to send a request's headers (Node's headersTimeout is 60 s)
    keep_alive_timeout_s: float = 5.0       # idle between two requests of a connection (uvicorn's default)

    def __post_init__(self):
        if self.max_header_bytes < 1024:
            raise EngineError(f"--max-header-bytes {self.max_header_bytes} must be at least 1024", usage=True)
        for flag, value in (("--header-timeout", self.header_timeout_s),
                            ("--keep-alive-timeout", self.keep_alive_timeout_s)):
            if not value > 0:
                raise EngineError(f"{flag} {value} must be > 0 seconds", usage=True)


def error_response(status: int, message: str, code: str) -> bytes:
    """A whole HTTP/1.1 response in OpenAI's error shape that closes the connection."""
    body = json.dumps(APIError(message, status=status, code=code).body()).encode()
    return (f"HTTP/1.1 {status} {http.HTTPStatus(status).phrase}\r\ncontent-type: application/json\r\n"
            f"content-length: {len(body)}\r\nconnection: close\r\n\r\n").encode() + body


class _HeadersTooLarge(Exception):
    """Raised from the parser's callbacks to stop it at the header limit."""


def limited_protocol(limits: HTTPLimits) -> type:
    """uvicorn's httptools protocol with `limits`' header size and header timeout, and HTTP/1.0 streams."""
    # imported here: HTTPLimits (ServerConfig's) must not need httptools, which only the serve extra installs
    from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

    class _Http10Cycle(RequestResponseCycle):
        """A request-response cycle of an HTTP/1.0 client: a body without Content-Length (a stream) is written as it
        comes, not chunked (HTTP/1.1 only), and the connection's close ends it."""

        _close_delimited = False

        async def send(self, message) -> None:
            if message["type"] == "http.response.start" and not self.response_started:
                if not any(name.lower() == b"content-length" for name, _ in message.get("headers", [])):
                    self._close_delimited, self.chunked_encoding, self.keep_alive = True, False, False
                return await super().send(message)
            if not self._close_delimited or message["type"] != "http.response.body" or self.response_complete:
                return await super().send(message)
            if self.flow.write_paused and not self.disconnected:
                await self.flow.drain()
            if self.disconnected:
                return
            if self.scope["method"] != "HEAD":
                self.transport.write(message.get("body", b""))
            if not message.get("more_body", False):
                self.response_complete = True
                self.message_event.set()
                self.transport.close()
                self.on_response()

    class LimitedHttpToolsProtocol(HttpToolsProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._header_bytes, self._parsed_bytes, self._header_timer = 0, 0, None
            self._refused = self._too_large = False
            self._awaiting_headers, self._began = True, False
            self._arm()                     # a socket that never sends a byte is closed too

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def data_received(self, data: bytes) -> None:
            if self._refused:               # lingering after a 431: drop what the client is still sending
                return
            super().data_received(data)
            # Headers spread over many reads: httptools buffers an unfinished header, so count the reads.
            if self._awaiting_headers and not self.transport.is_closing():
                self._header_bytes += len(data)
                if self._header_bytes > limits.max_header_bytes:
                    self._refuse()

        def on_message_begin(self) -> None:
            super().on_message_begin()
            self._header_bytes, self._parsed_bytes, self._awaiting_headers, self._began = 0, 0, True, True
            if self._header_timer is None:  # the first request's deadline still counts from the connection
                self._arm()

        # Headers within one read: count what the parser hands over; raising stops it before the app sees them.
        def on_url(self, url: bytes) -> None:
            self._count(len(url))
            super().on_url(url)

        def on_header(self, name: bytes, value: bytes) -> None:
            self._count(len(name) + len(value) + 4)
            super().on_header(name, value)

        def _count(self, n: int) -> None:
            self._parsed_bytes += n
            if self._parsed_bytes > limits.max_header_bytes:
                self._too_large = True
                raise _HeadersTooLarge

        def send_400_response(self, msg: str) -> None:
            # uvicorn answers any parser error 400; the error raised by _count is a 431
            if self._too_large:
                self._refuse()
            else:
                super().send_400_response(msg)

        def on_headers_complete(self) -> None:
            self._awaiting_headers = False
            self._disarm()
            super().on_headers_complete()
            if self.scope["http_version"] == "1.0" and self.cycle is not None:
                self.cycle.__class__ = _Http10Cycle

        def _arm(self) -> None:
            self._header_timer = self.loop.call_later(limits.header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if getattr(self, "_header_timer", None) is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.transport.is_closing() or not self._awaiting_headers:
                return
            if self._began:
                self.transport.write(error_response(
                    408, f"the request's headers did not arrive within {limits.header_timeout_s:g} s; send them "
                    "at once", "request_timeout"))
            self.transport.close()

        def _refuse(self) -> None:
            log.warning("refused request headers over %d bytes from %s", limits.max_header_bytes, self.client)
            self._refused = True
            self._disarm()
            self.transport.write(error_response(
                431, f"the request's headers are larger than this server accepts ({limits.max_header_bytes} bytes, "
                "--max-header-bytes); send fewer or shorter headers", "request_header_fields_too_large"))
            if self.transport.can_write_eof():
                self.transport.write_eof()
            self.loop.call_later(LINGER_S, self.transport.close)

    return LimitedHttpToolsProtocol
