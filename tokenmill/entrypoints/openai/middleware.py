"""The server's checks in front of every route, as plain ASGI middleware: the API key and the body-size limit."""

from __future__ import annotations

import hmac

from tokenmill.entrypoints.openai.errors import error_response

_OPEN_PATHS = ("/health", "/live", "/ready", "/metrics", "/version", "/load")


class APIKeyMiddleware:
    """Bearer-key check as plain ASGI. (FastAPI's @app.middleware("http") wraps `receive`, and a handler behind it
    never saw its client disconnect: a non-streamed request kept running after the client had gone.)"""

    def __init__(self, app, api_key: str):
        self.app, self.expected = app, f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send):
        # the page itself is open (it holds no data); every API call it makes needs the key
        if scope["type"] == "http" and scope["path"] != "/" and not scope["path"].startswith(_OPEN_PATHS):
            given = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(given, self.expected):
                await error_response(401, "Unauthorized: a valid API key is required")(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Reads a request body up to --max-request-bytes (413 past it) before the app sees it, then hands the app
    the same body; later receives pass through, so handlers still see their client disconnect."""

    def __init__(self, app, limit: int):
        self.app, self.limit = app, limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)
                return
            size += len(message.get("body", b""))
            if size > self.limit:
                await error_response(413, f"the request body is larger than {self.limit} bytes "
                                          "(--max-request-bytes)")(scope, receive, send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        await self.app(scope, replay, send)
