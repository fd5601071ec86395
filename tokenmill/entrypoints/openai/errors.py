"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

from tokenmill.entrypoints.openai.protocol import ErrorInfo, ErrorResponse

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error", 408: "timeout_error",
          413: "invalid_request_error",
          429: "rate_limit_error", 503: "service_unavailable_error", 500: "internal_server_error"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.status, self.message, self.param, self.headers = status, message, param, headers


def error_response(status: int, message: str, param: str | None = None,
                   headers: dict[str, str] | None = None) -> JSONResponse:
    body = ErrorResponse(error=ErrorInfo(message=message, type=_TYPES.get(status, "error"), param=param, code=status))
    return JSONResponse(body.model_dump(), status_code=status, headers=headers)


def param_of(message: str) -> str | None:
    """Our ValueErrors start with the field they are about (`top_p must be ...`)."""
    m = re.match(r"([a-z_][a-z_0-9.\[\]]*) (must|has|is|names|cannot|does)\b", message)
    return m.group(1) if m else None
