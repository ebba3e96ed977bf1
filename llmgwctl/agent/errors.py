"""The agent's errors, in one place.

    AgentError                   the root: something went wrong in the agent's own work
     ├ GpuSpecError              --gpus SPEC that is not COUNTxNAME-MEMGB[,...]
     ├ PortRangeError            --ports that is not LOW-HIGH inside 1-65535
     ├ DesiredError              a desired-replicas document that cannot be used (file or controller);
     │                           the agent keeps the last good desired list and says why
     ├ StateLockedError          another live agent holds this --state-dir; the agent does not start
     └ ControllerError           the controller could not be reached or did not answer as the protocol says
        │                        (a 409: another agent process speaks for this node)
        └ RateLimited            a 429: the node sends changed reports faster than the controller takes them;
                                 wait `retry_after` and send the state as it is then

The first four name what to change; waiting does not fix them. A
ControllerError is the one waiting can fix: the loops back off and retry it,
and the engines keep running meanwhile (a refused second agent keeps trying,
and takes the node over once the first one stops reporting). An engine that
cannot be launched is the engines' `LaunchError`, reported as the replica's
failure, not raised here.
"""
from __future__ import annotations


class AgentError(Exception):
    """Base of the agent's errors; the message says what went wrong and, where it can, what to change."""


class GpuSpecError(AgentError, ValueError):
    pass


class PortRangeError(AgentError, ValueError):
    pass


class DesiredError(AgentError, ValueError):
    # The bad document's version when it had one, so the agent skips that version
    # instead of asking for it again (agent/controller.py); None when it had none.
    version: int | None = None


class StateLockedError(AgentError):
    """Another live agent process holds the state directory (its flock); this one must not touch its engines."""


class ControllerError(AgentError):
    """The controller could not be reached or did not answer as the protocol says; retrying may help."""


class RateLimited(ControllerError):
    """The controller takes this node's changed reports no faster than it said (429): try again in `retry_after` s."""

    def __init__(self, message: str, retry_after: float):
        super().__init__(message)
        self.retry_after = retry_after
