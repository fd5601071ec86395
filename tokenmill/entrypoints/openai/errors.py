"""OpenAI-style error bodies: {"error": {"message", "type", "param", "code"}}."""

from __future__ import annotations

import re

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from tokenmill.engine.async_llm import RequestTimeoutError
from tokenmill.engine.core_client import EngineDeadError
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


def add_exception_handlers(app: FastAPI) -> None:
    """Every failure a handler raises becomes an OpenAI-style body: our APIErrors as they are, a ValueError (bad
    input found past validation) and request validation as 400s naming the field, a timed-out request as 408, a
    dead engine as 503."""

    @app.exception_handler(APIError)
    async def api_error(_: Request, e: APIError):
        return error_response(e.status, e.message, e.param, e.headers)

    @app.exception_handler(RequestTimeoutError)
    async def timed_out(_: Request, e: RequestTimeoutError):
        return error_response(408, str(e))

    @app.exception_handler(RequestValidationError)
    async def invalid(_: Request, e: RequestValidationError):
        return error_response(400, *_validation_message(e.errors()))

    @app.exception_handler(StarletteHTTPException)
    async def http_error(_: Request, e: StarletteHTTPException):
        return error_response(e.status_code, str(e.detail))

    @app.exception_handler(ValueError)
    async def bad_value(_: Request, e: ValueError):
        return error_response(400, str(e), param_of(str(e)))

    @app.exception_handler(EngineDeadError)
    async def engine_dead(_: Request, e: EngineDeadError):
        return error_response(503, str(e))


def _validation_message(errs: list[dict]) -> tuple[str, str | None]:
    """pydantic's errors as one message, and the first one's field as the param."""
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    message = "; ".join(f"{'.'.join(str(x) for x in er.get('loc', ()) if x != 'body') or 'body'}: "
                        f"{er.get('msg')}" for er in errs) or "invalid request"
    return message, loc[0] if loc else None
