"""The gateway's request error (400), shared by the parsing modules."""


class RequestError(ValueError):
    """A malformed request (400); the message says what to fix."""
