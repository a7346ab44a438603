"""The API's errors: OpenAI's error object, and an engine request's error as one."""
import re

from services.gateway.client import EngineRequestError

_PARAM_PREFIX = re.compile(r"^([a-z_]+): ")


class APIError(Exception):
    """A request the API refuses; becomes OpenAI's error object with this status."""

    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, headers: dict[str, str] | None = None):
        super().__init__(message)
        self.headers = headers
        self.status = status
        self.message = message
        self.param = param
        self.code = code


def error_type(status: int) -> str:
    if status == 429:
        return "rate_limit_error"
    if status >= 500:
        return "server_error"
    return "invalid_request_error"


def error_body(status: int, message: str, param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": error_type(status), "param": param,
                      "code": code}}


def api_error_from_engine(e: EngineRequestError) -> APIError:
    # The tokenizer's messages start with the field they blame ("prompt: ...").
    match = _PARAM_PREFIX.match(str(e))
    return APIError(e.code, str(e), param=match.group(1) if match else None)
