"""Errors a user can act on: configuration problems (at start-up), bad requests (per request), and responses
that break the wire contract (in clients)."""
from .contract import INVALID_INPUT
from .refusal import Refusal


class ConfigError(ValueError):
    """The model configuration or checkpoint cannot be served as configured."""


class InputError(ValueError):
    """A request's inputs are invalid; the message names the input and the expected value. `code`: the client's
    refusal code (contract.ERROR_CODES), INVALID_INPUT unless the cause has one of its own."""

    def __init__(self, message: str, code: str = INVALID_INPUT) -> None:
        super().__init__(message)
        self.code = code

    @property
    def refusal(self) -> Refusal:
        return Refusal(self.code, str(self))


class ResponseError(ValueError):
    """A server response breaks the wire contract (read by clients)."""
