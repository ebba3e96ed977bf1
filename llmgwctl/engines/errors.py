"""The engines' errors, in one place.

    EngineError            something about an engine llmgw cannot get past
     ├ UnknownEngine       a name no driver or catalog template answers to
     │ └ EngineNotAllowed  (also a NotAllowed) a catalog-defined engine this node's operator
     │                     did not allow (or allowed only as another program)
     ├ NotAllowed          what this node's operator does not let run, whatever the spec says
     │ └ SpecNotAllowed    a replica whose env or args would make its engine run other code
     │                     (env that loads code, an option like --trust-remote-code)
     ├ LaunchError         this replica cannot be launched on this node as specified
     │                     (source not found here, GPU count and indices disagree...)
     └ BadRequest          (fake_replies) a request the fake engine answers with a 400

A LaunchError is permanent for this spec on this node: retrying the same
launch gives the same answer, so the agent reports it and does not loop on it.
It is the only verdict a driver gives on a spec: anything else a driver raises
(a TypeError, a KeyError) is a bug, which the agent logs with its traceback and
retries with backoff, since an upgrade or a passing condition may clear it.
"""
from __future__ import annotations


class EngineError(Exception):
    """Base of the engines' errors."""


class UnknownEngine(EngineError, LookupError):
    """No built-in driver has this name, and no catalog template came with it."""


class NotAllowed(EngineError):
    """This node's operator does not let the spec run here: permanent, whatever the controller asks."""


class EngineNotAllowed(UnknownEngine, NotAllowed):
    """A catalog engine this node does not run: the message says which `--allow-engine` would allow it."""


class SpecNotAllowed(NotAllowed):
    """A spec's env or args would load other code into a built-in engine; the message says why and the fix."""


class LaunchError(EngineError):
    """The spec cannot be turned into a process on this node; the message says what to fix."""
