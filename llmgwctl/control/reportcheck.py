"""An agent's report checked before it is taken: JSON with finite numbers, the schema, its replica URLs, the contract.

`checked_report` is the whole check, run by the agent service (`agentapi`)
for a report that is not a heartbeat; `replica_url_problem` is the rule that
keeps a node's replicas on the node (see its docstring) and `forbidden_host`
the addresses no replica may be served from whoever asks.
"""
from __future__ import annotations

import functools
import ipaddress
import json
import math
from collections.abc import Mapping
from typing import Any
from urllib.parse import urlsplit

from ..contracts import UNBOUNDED, AgentReport, NodeClaims, ReportError
from . import schemas

# Replica URLs checked once each, not in every report: a changed report
# carries every replica of its node again, and a rollout at 5,000 nodes is
# thousands of changed reports on the loop. Only ready replicas
# have a URL: 20,000 at that size, and a rollout's new ones beside them.
URL_CHECKS = 65536


@functools.lru_cache(maxsize=URL_CHECKS)
def _host(value: str) -> str:
    host = value.strip().strip("[]").lower()
    try:
        return ipaddress.ip_address(host).compressed
    except ValueError:
        return host.rstrip(".")


# Where a cloud machine's instance metadata (and its credentials) is served:
# no replica URL may point there, whoever advertises it -- the router would
# send clients' requests, and return the answers, to it. Link-local addresses
# (169.254.0.0/16, fe80::/10) hold every provider's metadata service; these
# are the names some of them also answer to.
METADATA_HOSTS = frozenset({"metadata.google.internal", "metadata.goog", "metadata", "instance-data",
                            "instance-data.ec2.internal", "metadata.azure.internal"})


def forbidden_host(host: str) -> str | None:
    """Why no replica may be served from `host` (already `_host`-normalized), or None."""
    if host in METADATA_HOSTS:
        return "a cloud metadata service's name"
    try:
        ip = ipaddress.ip_address(host)
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_link_local:
        return "link-local, where cloud metadata services answer"
    if ip.is_unspecified or ip.is_multicast:
        return "not a host's address"
    return None


def replica_url_problem(body: Any, remote: str | None, claims: NodeClaims = UNBOUNDED) -> str | None:
    """Why a report's replica URLs cannot be trusted, naming the field; None when every one is fine.

    Each must be http(s) on the address the report came from, and on the
    port it reports: a node may offer traffic to its own engines only, never
    point the router at another machine (a cloud's metadata service least of
    all: `forbidden_host`, refused whoever asks). The node's `advertise_host`
    is used instead only when its token allows exactly that host
    (`claims.advertise_host`; the operator's own credentials allow any):
    a node cannot vouch for an address by naming it in the same report.
    (Run after the schema check.)
    """
    if not isinstance(body, Mapping) or not isinstance(body.get("replicas"), list):
        return None
    advertised = body.get("advertise_host") or ""
    allowed = claims.advertise_host
    honoured = bool(advertised) and isinstance(advertised, str) and (
        allowed is None or (bool(allowed) and _host(advertised) == _host(allowed)))
    if honoured:
        expected = _host(advertised)
        where = f"the node's advertise_host {advertised!r}"
    else:
        expected = _host(remote or "")
        where = f"the address the report came from ({remote})"
        if advertised:
            where += (f"; its advertise_host {str(advertised)[:100]!r} is not honoured, since its token does not allow "
                      "that host (llmgwctl token node NAME --advertise-host HOST)")
    bad_host = forbidden_host(expected)
    if bad_host and any(isinstance(rep, Mapping) and rep.get("url") is not None for rep in body["replicas"]):
        return f"replicas: {where} is {bad_host}; no replica may be served from there"
    for i, rep in enumerate(body["replicas"]):
        if not isinstance(rep, Mapping) or rep.get("url") is None:
            continue
        field = f"replicas[{i}].url"
        url, reported = rep["url"], rep.get("port")
        hashable = isinstance(url, str) and (reported is None or type(reported) is int)
        wrong = _url_wrong(url, reported, expected) if hashable else _url_wrong.__wrapped__(url, reported, expected)
        if wrong == "shape":
            return f"{field}: {str(url)[:100]!r} is not an http://host:port URL"
        if wrong == "host":
            return f"{field}: {url[:100]!r} is not on {where}; a node's replicas must be served from the node"
        if wrong == "port":
            return f"{field}: {url[:100]!r} is not on the replica's reported port {reported}"
    return None


@functools.lru_cache(maxsize=URL_CHECKS)
def _url_wrong(url: Any, reported: Any, expected: str) -> str | None:
    """What is wrong with one replica URL: "shape", "host" (not `expected`), "port" (not `reported`); None: fine."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except (ValueError, TypeError):
        return "shape"
    # Nothing but scheme, host and port: user info, a path or a query could
    # be read differently by the router's own URL handling than here.
    if (parts.scheme not in ("http", "https") or not parts.hostname or "@" in parts.netloc
            or parts.path not in ("", "/") or parts.query or parts.fragment):
        return "shape"
    if _host(parts.hostname) != expected:
        return "host"
    if reported is not None and port != reported:
        return "port"
    return None


# Reports larger than this are parsed and checked in a worker thread: a node's
# usual report (8 GPUs, a few replicas) is a few KB and parsed faster than the
# thread hop; one of hundreds of replicas takes milliseconds of the loop.
OFF_LOOP_BYTES = 64 * 1024
# The most of one schema problem a 400 says: the path and the bound, and a
# glimpse of the value.
MAX_PROBLEM = 300


def checked_report(raw: bytes, node: str, remote: str | None, claims: NodeClaims) -> AgentReport | str:
    """A report's bytes parsed and checked (JSON, finite numbers, schema, URLs, contract); else why not (the 400)."""
    odd: list[str] = []

    def number(text: str) -> float:
        value = float(text)
        if not math.isfinite(value):
            odd.append(text)
        return value

    def constant(name: str) -> float:
        odd.append(name)
        return float("nan")

    try:
        body = json.loads(raw, parse_float=number, parse_constant=constant)
    except (ValueError, UnicodeDecodeError):
        return "report must be a JSON object"
    if odd:
        return (f"{_non_finite_path(body)}: {odd[0][:40]} is not a finite number (a JSON number past a float's range "
                "reads as infinity, and NaN and Infinity are not JSON)")
    wrong = schemas.problems("agent-report", body)
    if wrong:
        # Each cut: a bound's message quotes the value, and a list 10,000 long is megabytes of it.
        return "report does not follow schemas/api/agent-report.schema.json: " + "; ".join(
            p if len(p) <= MAX_PROBLEM else p[:MAX_PROBLEM] + "..." for p in wrong)
    wrong_url = replica_url_problem(body, remote, claims)
    if wrong_url:
        return wrong_url
    try:
        return AgentReport.from_dict(body, node=node)
    except ReportError as exc:
        return str(exc)


def _non_finite_path(doc: Any) -> str:
    """Where in `doc` the first non-finite number is, as `a.b[2].c` (the report's field for the 400)."""
    stack: list[tuple[str, Any]] = [("", doc)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, float) and not math.isfinite(value):
            return path or "report"
        if isinstance(value, dict):
            stack.extend((f"{path}.{k}" if path else str(k), v) for k, v in reversed(list(value.items())))
        elif isinstance(value, list):
            stack.extend((f"{path}[{i}]", v) for i, v in reversed(list(enumerate(value))))
    return "report"
