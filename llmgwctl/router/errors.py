"""The router's errors: its exception root, and error responses in the OpenAI shape.

Exceptions, each defined beside the code that raises it:

    RouterError                  the root: the router cannot do what was asked as asked
     ├ KeyFileError (auth)       the API key file cannot be used; the last good keys stay
     ├ EndpointFileError (static)  the static endpoint file cannot be used
     ├ WatchError (watch)        one round of the controller's watch failed; the loop backs off
     ├ DepthError (limits)       a request body nested deeper than the router parses (a 400)
     ├ PathError (limits)        a request target that is not a normalised path under /v1/ (a 400)
     ├ BudgetFull (limits)       a large body past its client's or the router's budget (a 429 / 503)
     ├ BodyRefused (jsonbody)    a body that is not a JSON object within the depth limit (a 400)
     ├ WorkerBusy (jsonbody)     the off-loop parser holds as many bodies as it may (a 503)
     ├ QueueFull (coldstart)     a cold model's wait queue is full (a 429)
     ├ ColdTimeout (coldstart)   no replica of a cold model came up in time (a 503)
     └ UpstreamError (upstream)  talking to an engine failed; its own tree says when a retry is safe

Responses: `{"error": {"message", "type", "code"}}`. Clients are OpenAI SDKs;
they read `error.message` and raise by status, so every error the router
itself produces goes through here; a route whose clients parse another
shape (Anthropic's, on /v1/messages) passes it through its `shapes.Shape`
on the way out. Errors an engine returns are passed
through untouched: the router is transparent.
"""
from __future__ import annotations

import difflib
from collections.abc import Iterable

from aiohttp import web

from ..httpserver import error_response
from .shapes import OPENAI, Shape


class RouterError(Exception):
    """Base of the router's exceptions."""


# Seconds a client should wait before retrying, per situation:
# no replica and nobody to wake one: the controller may be placing one; 5 s is
# a few of its reconcile passes.
RETRY_NO_REPLICA = 5
# the cold-start queue is full: waiters ahead are being served as replicas come
# up; retrying in 2 s spreads the burst without giving up on the model.
RETRY_QUEUE_FULL = 2
# a cold start ran past the timeout: loading a large model takes minutes, so
# ask for a longer pause than for a plain "no replica".
RETRY_COLD_TIMEOUT = 10
# a model that cannot be placed for want of room now: room comes back when a
# replica ends or a lost node returns, which is tens of seconds, not one; 10 s
# keeps an SDK's retries (it honours Retry-After up to 60 s) from hammering.
RETRY_UNPLACEABLE = 10
# the large request bodies in flight fill their budget: each is answered in
# about one generation, so a second is a fair wait for room.
RETRY_LARGE_BODIES = 1


# The most of a client's own text an error quotes back: enough to recognise a
# typo, never the 30 MB a client sent as a model name (nor a page of it).
QUOTE_CHARS = 100


def quote(text: str, limit: int = QUOTE_CHARS, length: int | None = None) -> str:
    """`text`, as a client sent it, for an error message: repr'd, at most `limit` characters of it, and its length when cut.

    `length`: the length of what the client sent, when `text` is already only its start.
    """
    length = len(text) if length is None else length
    if length <= limit:
        return repr(text)
    return f"{text[:limit]!r}... ({length} characters)"


# The one builder of the OpenAI error shape, shared with the control API.
response = error_response


def invalid_json(detail: str) -> web.Response:
    return response(400, f"the request body is not valid JSON: {detail}", "invalid_request_error", "invalid_json")


def not_an_object() -> web.Response:
    return response(400, "the request body must be a JSON object", "invalid_request_error", "invalid_body")


def missing_model() -> web.Response:
    return response(400, "the request body must name a model: {\"model\": \"<name>\", ...}; "
                    "GET /v1/models lists them", "invalid_request_error", "missing_model")


def unknown_model(name: str, known: Iterable[str], *, or_not_permitted: bool = False) -> web.Response:
    """404 for `name`, suggesting close names among `known` -- only names the caller may use (see server).

    `or_not_permitted`: the same words for a model the caller's key may not
    use as for one that does not exist (OpenAI's retrieve answers so), so
    the answer does not tell the two apart.

    A name longer than any model name can be (`MAX_NAME_CHARS`) gets no
    suggestion: difflib's cost grows with the name's length times each
    candidate's, and no name that long is a typo of one in the catalog.
    """
    close = difflib.get_close_matches(name, list(known), n=3, cutoff=0.5) if len(name) <= MAX_NAME_CHARS else []
    hint = f"; did you mean {', '.join(repr(c) for c in close)}?" if close else "; GET /v1/models lists them"
    what = "does not exist or this API key may not use it" if or_not_permitted else "does not exist"
    return response(404, f"the model {quote(name)} {what}{hint}", "invalid_request_error", "model_not_found")


# The longest name or alias a catalog allows (its schema's `name` pattern):
# a longer `model` cannot name anything, so it is refused before it is
# looked up, matched against a key's patterns or compared for suggestions.
MAX_NAME_CHARS = 128


def name_too_long(name: str, length: int | None = None) -> web.Response:
    return response(400, f"the model name {quote(name, 40, length)} is longer than any model's: names and aliases have "
                    f"at most {MAX_NAME_CHARS} characters; GET /v1/models lists them",
                    "invalid_request_error", "invalid_model")


def no_such_route(method: str, path: str, model: str) -> web.Response:
    """404 for a catalog-added route that `model`'s engines do not all serve."""
    return response(404, f"model {model!r} is not served on {method} {quote(path)}: not every one of its "
                    "engines lists that route (the catalog's engines.NAME.routes)", "invalid_request_error",
                    "not_found")


def large_bodies_busy(per_client: bool, limit: int) -> web.Response:
    """The large bodies in flight already hold the router's budget for them (limits.BodyBudget)."""
    if per_client:
        return response(429, f"this client already has {limit} bytes of large request bodies in flight; "
                        "retry when one is answered", "rate_limit_error", "too_many_large_bodies",
                        headers={"Retry-After": str(RETRY_LARGE_BODIES)})
    return response(503, f"the router holds its limit of {limit} bytes of large request bodies now; retry shortly",
                    "service_unavailable", "too_many_large_bodies", headers={"Retry-After": str(RETRY_LARGE_BODIES)})


def too_large(limit: int) -> web.Response:
    return response(413, f"the request body is larger than the router's limit of {limit} bytes",
                    "invalid_request_error", "request_too_large")


def no_replica(model: str) -> web.Response:
    return response(503, f"no replica of model {model!r} is ready; retry shortly", "service_unavailable",
                    "no_ready_replica", headers={"Retry-After": str(RETRY_NO_REPLICA)})


def adapter_not_loaded(adapter: str, base: str, ready: int) -> web.Response:
    """A LoRA adapter none of its base's ready replicas holds yet: at once, rather than a wait on a load that may fail."""
    where = f"none of the {ready} ready replica(s) of {base!r}" if ready else f"no ready replica of {base!r}"
    return response(503, f"adapter {adapter!r} is loaded on {where} yet; retry shortly "
                         "(`llmgwctl status` shows its load and any failure)", "service_unavailable",
                    "adapter_not_loaded", headers={"Retry-After": str(RETRY_NO_REPLICA)})


def cold_timeout(model: str, waited: float) -> web.Response:
    return response(503, f"model {model!r} is starting but no replica was ready within {waited:g} s; "
                    "retry shortly", "service_unavailable", "cold_start_timeout",
                    headers={"Retry-After": str(RETRY_COLD_TIMEOUT)})


def unplaceable(model: str, reason: str, retry: bool) -> web.Response:
    """A model the controller cannot place now: at once, with its reason, instead of a cold wait that cannot end well.

    Only when the situation can change by itself is there a Retry-After; when
    it cannot (the fleet can never hold the model), `x-should-retry: false`
    tells OpenAI SDKs not to retry it, where they would retry any 503 twice.
    """
    if retry:
        hint, headers = "; retry later", {"Retry-After": str(RETRY_UNPLACEABLE)}
    else:
        hint, headers = ("; this will not change until the fleet or the catalog does",
                         {"x-should-retry": "false"})
    return response(503, f"model {model!r} cannot be placed now: {reason or 'no node can run it'}{hint}",
                    "service_unavailable", "model_unplaceable", headers=headers)


def queue_full(model: str, size: int) -> web.Response:
    return response(429, f"model {model!r} is starting and {size} requests are already waiting for it; "
                    "retry shortly", "rate_limit_error", "cold_start_queue_full",
                    headers={"Retry-After": str(RETRY_QUEUE_FULL)})


def upstream_failed(model: str, detail: str) -> web.Response:
    return response(502, f"every replica tried for model {model!r} failed: {detail}", "upstream_error",
                    "upstream_unavailable")


def engine_out_of_bounds(model: str, replica: str, detail: str) -> web.Response:
    """502 for an answer the router refused to pass on (too large, a redirect, headers without end): the replica named."""
    return response(502, f"replica {replica} of model {model!r} {detail}; the router refused its answer and "
                    "sends it no requests for a while", "upstream_error", "upstream_out_of_bounds")


def not_found(path: str) -> web.Response:
    """404 for a route the router does not serve; `path` is the client's ("METHOD /path"), quoted shortened."""
    return response(404, f"no route for {path[:QUOTE_CHARS]}{'...' if len(path) > QUOTE_CHARS else ''}; "
                    "the router serves /v1/chat/completions, /v1/completions, /v1/embeddings, /v1/responses, "
                    "/v1/messages, /v1/messages/count_tokens and /v1/models",
                    "invalid_request_error", "not_found")


def stream_error_event(detail: str, shape: Shape = OPENAI) -> bytes:
    """The last SSE event of a stream whose engine died, in the route's `shape`: SDKs raise on it instead of hanging."""
    return shape.stream_error(f"the engine stopped mid-stream: {detail}", "upstream_error", "upstream_disconnected")
