"""Exceptions the engine raises for bad input, each naming what is wrong.

Callers at the edge (the router, the CLI) turn `InvalidRequestError` into a client-facing error that
names `field`; nothing else needs to parse messages.
"""


class InvalidRequestError(ValueError):
    """A request (prompt or sampling parameter) is invalid; `field` names the offending input."""

    def __init__(self, field: str, message: str):
        super().__init__(f"{field}: {message}")
        self.field = field
        self.reason = message

    def __reduce__(self):  # crosses process boundaries (Ray) with its fields intact
        return (type(self), (self.field, self.reason))


class UnsupportedModelError(ValueError):
    """The checkpoint cannot be served: unknown architecture, missing file, unsupported option."""
