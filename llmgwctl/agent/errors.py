"""The agent's errors, in one place.

    AgentError                   something the operator must fix before or while the agent runs
     ├ GpuSpecError              --gpus SPEC that is not COUNTxNAME-MEMGB[,...]
     ├ PortRangeError            --ports that is not LOW-HIGH inside 1-65535
     ├ DesiredError              a desired-replicas document that cannot be used (file or controller);
     │                           the agent keeps the last good desired list and says why
     └ StateLockedError          another live agent holds this --state-dir; the agent does not start

None of these is retried by waiting: each names what to change. Failures that
waiting can fix (an unreachable controller, an engine still loading) are not
exceptions here; the loops back off and retry them.
"""
from __future__ import annotations


class AgentError(Exception):
    """Base of the agent's errors; the message says what to change."""


class GpuSpecError(AgentError, ValueError):
    pass


class PortRangeError(AgentError, ValueError):
    pass


class DesiredError(AgentError, ValueError):
    pass


class StateLockedError(AgentError):
    pass
