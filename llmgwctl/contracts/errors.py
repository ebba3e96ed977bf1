"""The contracts' errors, in one place: a payload from another process that breaks its contract.

    ContractError (ValueError)   a document that cannot become the record it claims to be
     ├ ReportError               an agent report; the agent gets a 400 with this text
     ├ UsageError                a standalone router's usage report; the router gets a 400
     ├ EndpointError             an endpoint with an empty id or model, a bad url, weight or metrics path
     └ ModelStateError           a model state (watch stream) with an empty name or an unknown state

They are ValueErrors because that is what they are to a caller that only
checks input. None is retried by waiting: the sender has to change what it sends.
"""
from __future__ import annotations


class ContractError(ValueError):
    """Base of the contracts' errors; the message names the field and what was wrong."""


class ReportError(ContractError):
    """A report that does not follow the agent protocol."""


class UsageError(ContractError):
    """A usage report that does not follow the router's usage protocol."""


class EndpointError(ContractError):
    """An endpoint that could not be routed to as given."""


class ModelStateError(ContractError):
    """A model state that does not follow the watch protocol."""
