"""The adapter a request applies on an engine that takes it in the body by number: llama.cpp's `lora` member.

llama-server loads its model's adapters at launch, at scale 0
(engines/llamacpp.py), serves them all under the base's name, and applies to
a request what its body's `lora` member names -- `[{"id": N, "scale": S}]`,
every adapter not listed at 0. So a request bound for such an endpoint
(`SELECTS_BY_BODY`) is rewritten for it, at each attempt (another replica
may number its adapters otherwise: a replacement launched with one more):

- for an adapter: the model names the base (what the engine serves), and
  `"lora":[{"id":N,"scale":1}]` names the adapter by the endpoint's number
  for it (`Endpoint.adapter_ids`, which its agent read from the engine);
- for a base model that has adapters: `"lora":[{"id":0,"scale":0}]`, every
  adapter off. Neither `[]` nor no member: llama-server takes both as "no
  choice" and applies its global scales, which are not 0 -- its listing
  says 1.0 for each adapter even under --lora-init-without-apply, and
  applies it (measured on the bundled build: a base request without the
  member answered as the adapter).

Either way the member is written last in the top-level object, after
whatever the client sent: llama-server's JSON parser (nlohmann) keeps the
last of duplicate keys, so a client's own `lora` -- under any spelling
JSON's escapes allow -- cannot reach an adapter its key and model do not
name. The body is spliced, never serialised again (see jsonbody); the
answer names the base, so it is echoed back as the name asked for (echo.py).

It must not know how endpoints are picked, nor the catalog beyond the
request's model.
"""
from __future__ import annotations

import json

from . import errors, jsonbody
from .balancer import EndpointState
from .call import Call, Refused
from .echo import Echo

__all__ = ["SELECTS_BY_BODY", "echo_for", "for_endpoint", "with_member"]

# Engines whose endpoints take the adapter in each request's body, by number.
SELECTS_BY_BODY = frozenset({"llamacpp"})
# Every adapter off: a list that names one (id 0) at scale 0, the rest unnamed and so 0 as well.
_NONE = b'[{"id":0,"scale":0}]'


def for_endpoint(call: Call, state: EndpointState, body: bytes) -> bytes:
    """`body` as `state`'s engine must get it: unchanged unless it selects adapters in the body (see the module docstring)."""
    ep = state.endpoint
    if ep.engine not in SELECTS_BY_BODY:
        return body
    if call.base:
        number = ep.adapter_ids.get(call.model)
        if number is None:
            # Picked under the adapter's name, so listed by the endpoint; a
            # static file's llama.cpp endpoint may list one without its number.
            raise Refused(errors.response(
                503, f"replica {ep.replica_id} serves adapter {call.model!r} without saying the engine's number "
                "for it", "service_unavailable", "adapter_number_unknown"))
        span = jsonbody.model_span(body, call.route.model_key)
        if span is not None:
            body = jsonbody.with_model(body, span, call.base)
        return with_member(body, "lora", b'[{"id":%d,"scale":1}]' % number)
    if not ep.adapter_ids:
        model = call.view.catalog.resolve(call.model)
        if model is None or not model.adapters:
            return body     # an engine with no adapters of ours: the client's `lora` reaches nothing
    # The model's adapters, or the engine's: one launched with an adapter the
    # catalog has dropped since serves on until its replacement is ready.
    return with_member(body, "lora", _NONE)


def with_member(body: bytes, key: str, value: bytes) -> bytes:
    """`body` (a JSON object) with `"key":value` added as its last top-level member; nothing before it changes.

    A body not in UTF-8 (JSON may be UTF-16 or 32) is re-encoded whole as
    UTF-8, the member set in the document, as the alias rewrite does.
    """
    encoding = json.detect_encoding(body)
    if encoding not in ("utf-8", "utf-8-sig"):
        doc = json.loads(body)
        doc[key] = json.loads(value)
        return json.dumps(doc, ensure_ascii=False, separators=(",", ":")).encode()
    end = len(body.rstrip(b" \t\r\n"))
    close = end - 1         # the top-level object's `}`: the body parsed as an object
    head = body[:close].rstrip(b" \t\r\n")
    comma = b"" if head.endswith(b"{") else b","
    return b"".join((head, comma, json.dumps(key).encode(), b":", value, body[close:]))


def echo_for(call: Call, state: EndpointState) -> Echo | None:
    """What rewrites the engine's answer to name the model asked for; None when it names it already."""
    served = call.base if call.base and state.endpoint.engine in SELECTS_BY_BODY else call.model
    asked = call.echo_as or call.model
    return Echo(served, asked) if served != asked else None
