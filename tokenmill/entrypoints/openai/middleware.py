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

    UPLOAD_PATHS = ("/v1/audio/",)   # multipart uploads: their own, larger limit

    def __init__(self, app, limit: int, upload_limit: int | None = None):
        self.app, self.limit, self.upload_limit = app, limit, upload_limit or limit

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit = self.upload_limit if scope.get("path", "").startswith(self.UPLOAD_PATHS) else self.limit
        chunks, size, more = [], 0, True
        while more:
            message = await receive()
            if message["type"] != "http.request":
                await self.app(scope, receive, send)
                return
            size += len(message.get("body", b""))
            if size > limit:
                await error_response(413, f"the request body is larger than {limit} bytes "
                                          f"({'--max-media-bytes' if limit != self.limit else '--max-request-bytes'})"
                                     )(scope, receive, send)
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
