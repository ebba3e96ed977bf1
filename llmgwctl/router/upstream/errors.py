"""What can go wrong between the router and an engine, and whether sending the request elsewhere is safe.

    UpstreamError         (a RouterError, see router/errors.py)
     ├── ConnectFailed    refused, reset or closed before any byte of the answer:
     │                    the engine did not answer, another endpoint may
     ├── UpstreamTimeout  no byte for `idle_timeout` (only when one is given), or
     │                    no complete headers within `headers_timeout`: the engine
     │                    took the request and may be running it, no retry
     └── UpstreamBroken   the answer started, then the connection failed or the
          │               engine sent something that is not HTTP: no retry
          └── OutOfBounds the engine broke a bound the router holds every peer to
                          (its headers too long or too many, a whole answer past
                          the cap): not a blip but a broken or hostile engine,
                          which the router keeps out for a while (ejection.py)

    BadEndpointURL        (a ValueError, not an UpstreamError) the URL cannot be
                          an engine's: a configuration error, found by
                          `parse_target` when the endpoint is set, never sent
"""
from __future__ import annotations

from ..errors import RouterError


class UpstreamError(RouterError):
    pass


class ConnectFailed(UpstreamError):
    """No byte of the answer arrived: safe to try another endpoint."""


class UpstreamTimeout(UpstreamError):
    """The engine sent nothing for the idle timeout, or no complete headers in time."""


class UpstreamBroken(UpstreamError):
    """The answer started and did not finish."""


class OutOfBounds(UpstreamBroken):
    """The engine's answer broke one of the bounds on what a peer may send; `code` names which (a metric label)."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code


class BadEndpointURL(ValueError):
    """An endpoint URL no request could be sent to: the configuration is wrong, the engine is not down."""
