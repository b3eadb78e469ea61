"""Errors a user can act on: configuration problems (at start-up) and bad requests (per request)."""


class ConfigError(ValueError):
    """The model configuration or checkpoint cannot be served as configured."""


class InputError(ValueError):
    """A request's inputs are invalid; the message names the input and the expected value."""
