"""Errors a user can act on: configuration problems (at start-up), bad requests (per request), and responses
that break the wire contract (in clients)."""


class ConfigError(ValueError):
    """The model configuration or checkpoint cannot be served as configured."""


class InputError(ValueError):
    """A request's inputs are invalid; the message names the input and the expected value."""


class ResponseError(ValueError):
    """A server response breaks the wire contract (read by clients)."""
