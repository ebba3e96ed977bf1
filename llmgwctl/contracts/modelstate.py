"""`ModelState`: what the router is told about a model that has no ready replica (controller -> router).

The third thing the router is told, beside the endpoint list and the catalog
(DESIGN.md, "What the router is told"): a model that is *starting* is worth
waiting for; a model that *cannot be placed* now is answered at once, with the
placement's reason. A model the controller says nothing about is treated as
before: a request with no ready endpoint waits for one (the cold start).

`retry` says whether the situation can change by itself -- no room now, but a
replica may finish or a lost node come back: a client may retry, and gets a
Retry-After -- or only by someone changing the fleet or the catalog (a
profile needing 8 GPUs where the largest node has 4, a pool no node has):
retrying is pointless, and the client is told not to.

Wire form (inside the watch answer, `"models": [...]`)::

    {"name": "big-model", "state": "unplaceable", "reason": "...", "retry": false}
"""
from __future__ import annotations

import enum
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from .errors import ModelStateError


class ModelCondition(str, enum.Enum):
    STARTING = "starting"          # a replica is placed or starting: requests wait for it
    UNPLACEABLE = "unplaceable"    # nothing is starting and no replica fits: requests are answered at once

    def __str__(self) -> str:
        return self.value


@dataclass(frozen=True, slots=True)
class ModelState:
    name: str                       # the model's canonical name
    state: ModelCondition
    reason: str = ""                # for unplaceable: the placement's reason, in words an operator acts on
    retry: bool = True              # can it change by itself? (see the module docstring)

    def __post_init__(self) -> None:
        if not self.name:
            raise ModelStateError("model state: name must not be empty")
        if not isinstance(self.state, ModelCondition):
            raise ModelStateError(f"model state {self.name}: state must be a ModelCondition, got {self.state!r}")

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "state": self.state.value, "reason": self.reason, "retry": self.retry}

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ModelState:
        """The inverse of `to_dict`; ModelStateError naming the field when one is missing or wrong."""
        try:
            name, raw = data["name"], data["state"]
            reason, retry = data.get("reason", ""), data.get("retry", True)
        except (KeyError, TypeError) as exc:
            raise ModelStateError(f"model state {data!r}: missing field {exc}") from None
        if not isinstance(name, str) or not isinstance(reason, str) or not isinstance(retry, bool):
            raise ModelStateError(f"model state {data!r}: name and reason must be strings, retry a boolean")
        try:
            state = ModelCondition(raw)
        except ValueError:
            # A newer controller may know states this router does not: the
            # caller skips such an entry (the model is then treated as before).
            raise ModelStateError(f"model state {name}: unknown state {raw!r}") from None
        return cls(name=name, state=state, reason=reason, retry=retry)
