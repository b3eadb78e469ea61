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


class Refused(Exception):
    """A request refused with a refusal of its own (its code, sentence and any retry time): `refusal`."""

    def __init__(self, refusal: Refusal) -> None:
        super().__init__(refusal.message)
        self.refusal = refusal


class ResponseError(ValueError):
    """A server response breaks the wire contract (read by clients)."""
