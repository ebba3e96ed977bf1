"""The `session` policy: one conversation's requests on one replica, weighed against load as prefix's are.

A session is OpenAI's `user` field, else the `x-llmgw-session` header. It
stands for its whole prompt in the prefix cost model (prefix.py): one
"block" worth every token of it, so a session stays on the replica that
served it until that replica is busier than a cold prefill of the prompt is
worth, exactly as a hot prefix does. A request without a session is left to
least-load.
"""
from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..balancer import Balancer, EndpointState
from .plugin import PromptReader, Settings
from .prefix import CHARS_PER_TOKEN, CostPick, Indexes

# The header a client can name its session in when it does not set OpenAI's `user` field.
SESSION_HEADER = "x-llmgw-session"


class Session:
    """The plugin: every model's index of the sessions its endpoints served, and a `CostPick` per request."""

    __slots__ = ("_balancer", "_per_request", "_indexes")

    def __init__(self, settings: Settings) -> None:
        self._balancer: Balancer = settings.balancer
        self._per_request = settings.tokens_per_request
        self._indexes = Indexes(settings.block_chars)

    def chooser(self, model: str, doc: Mapping[str, Any], headers: Mapping[str, str] | None,
                prompt: PromptReader | None) -> CostPick | None:
        session = doc.get("user")
        if type(session) is not str or not session:
            session = headers.get(SESSION_HEADER) if headers is not None else None
        if not session:
            return None
        text = (prompt(doc) if prompt is not None else None) or ""
        tokens = max(1.0, len(text) / CHARS_PER_TOKEN)
        return CostPick(self._balancer, self._indexes.of(model), [hash(("session", session))], tokens,
                        tokens, self._per_request)

    def forget(self, alive: set[EndpointState]) -> None:
        self._indexes.retain(alive)
