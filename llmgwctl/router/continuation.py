"""Stream continuation: a chat stream whose engine dies mid-way, resumed on another replica and spliced on.

Opt-in per model (the catalog's `continuation`). When a streamed chat
completion's engine dies after its stream began, the answer path asks
`Continuation.resume` for another stream instead of ending the client's
with an error event. The request goes again to another ready replica of the
model with the text the client got so far as a last assistant message and
`continue_final_message: true, add_generation_prompt: false` (vLLM's way to
continue a message); `max_tokens` / `max_completion_tokens` shrink by the
tokens already sent. The new stream's events are rewritten onto the
first's (`Splice`): its `id`, `created` and `model`, no second role delta,
usage counting the original prompt and the completion tokens of every part.

What a stream of such a model costs: its body parsed once more when the
stream opens (`Continuation.watch`, to know whether it may be continued at
all; ineligible streams pass as bytes as every other), and for an eligible
one each event read as it passes (`Splice.feed`) to keep the text and the
token count; a partial event is held back until its end arrives, so a cut
never leaves the client half an event. Bounded: `attempts` tries per stream
(the catalog's), and an event longer than `MAX_EVENT` ends the watch.

Never for a request whose meaning a resumed generation could change
(`refusal`): tools, response_format or guided decoding, n > 1, logprobs,
echo, an assistant prefill -- nor once the engine sent a finish_reason,
reasoning or tool-call deltas, or an error. Those end as before.

It must not know about the request path's attempts before the first byte:
those are the request path's.
"""
from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from typing import Any

from ..observability.metrics import RouterMetrics
from . import jsonbody, loraselect
from .balancer import Balancer, EndpointState
from .call import Call
from .config import RouterConfig
from .inflight import Abandoned, InFlight
from .upstream import ConnectFailed, Pool, Response, UpstreamError

__all__ = ["CHAT", "MAX_EVENT", "Continuation", "Splice", "continuation_body", "refusal"]

log = logging.getLogger("llmgw.router")

CHAT = "/v1/chat/completions"
# An SSE event held back whole before it is passed on: vLLM's chunks are a
# few hundred bytes (a few KB with usage and long tokens); one of 1 MiB is no
# chunk an engine sends, and holding more would let an engine make the
# router buffer without bound. Past it the stream passes as bytes, uncontinued.
MAX_EVENT = 1 << 20
# What of a refusing engine's answer is read for its message: an OpenAI error body is far shorter.
_ERROR_BYTES = 4096
_COMPACT = (",", ":")

# Body members whose value, when set, make a resumed generation mean something
# else than the one cut: the reason is what the log says.
_CHANGES_MEANING = {
    "tools": "tools", "tool_choice": "tool_choice", "functions": "functions", "function_call": "function_call",
    "structured_outputs": "guided decoding", "regex": "guided decoding", "ebnf": "guided decoding",
    "json_schema": "guided decoding", "logprobs": "logprobs", "top_logprobs": "logprobs",
    "prompt_logprobs": "logprobs", "return_tokens_as_token_ids": "logprobs", "echo": "echo",
    "use_beam_search": "beam search", "continue_final_message": "an assistant prefill",
}


def refusal(doc: Mapping[str, Any]) -> str | None:
    """Why a chat body's stream may not be continued elsewhere, or None when it may.

    A continuation is a new generation from the text so far: it is the same
    answer only when nothing but that text steers it. Tools and guided
    decoding carry state the text does not (a half-written call, a grammar's
    position); logprobs and echo would come again or differ; n > 1 is several
    streams in one; an assistant prefill is already a continuation.
    """
    messages = doc.get("messages")
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return "no messages"
    if messages[-1].get("role") == "assistant":
        return "an assistant prefill"
    for key, why in _CHANGES_MEANING.items():
        value = doc.get(key)
        if value is not None and value is not False and value != [] and value != 0:
            if key == "tool_choice" and value == "none":
                continue
            return why
    fmt = doc.get("response_format")
    if fmt is not None and fmt != {"type": "text"}:
        return "response_format"
    if any(k.startswith("guided_") and v is not None for k, v in doc.items()):
        return "guided decoding"
    n = doc.get("n")
    if n is not None and n != 1:
        return "n > 1"
    return None


def continuation_body(doc: Mapping[str, Any], model: str, text: str, sent: int) -> bytes | str:
    """The request that continues `doc`'s answer from `text` (`sent` tokens of it), or (a str) why there is none.

    With no text yet it is the request itself (the client got only the
    stream's headers): nothing to continue, everything to answer.
    """
    body = dict(doc)
    body["model"] = model
    for key in ("max_tokens", "max_completion_tokens", "min_tokens"):
        limit = body.get(key)
        if isinstance(limit, int) and not isinstance(limit, bool):
            if key != "min_tokens" and limit - sent < 1:
                return f"{key} {limit} reached at the cut"
            body[key] = max(0, limit - sent)
    if text:
        body["messages"] = [*doc["messages"], {"role": "assistant", "content": text}]
        body["continue_final_message"] = True
        body["add_generation_prompt"] = False
    return json.dumps(body, ensure_ascii=False, separators=_COMPACT).encode()


class Splice:
    """One eligible stream, part by part: what the client was sent, and the next part rewritten onto the first.

    `feed` takes the engine's bytes and returns those to pass on, whole
    events only: part 0 as they came (read to keep the text), later parts
    rewritten. `cut` starts the next part and says where the stream stands.
    `ended` says why the stream can no longer be continued (None: it can).
    """

    __slots__ = ("doc", "attempts", "tries", "tried", "ended", "part", "text", "counted", "base", "part_usage",
                 "prompt", "head", "role_sent", "_tail", "open")

    def __init__(self, doc: Mapping[str, Any], attempts: int):
        self.doc = doc
        self.attempts = attempts            # replicas this stream may be sent to after its first
        self.tries = 0
        self.tried: tuple[EndpointState, ...] = ()
        self.ended: str | None = None
        self.part = 0
        self.text: list[str] = []           # the content passed on, delta by delta
        self.counted = 0                    # content deltas passed on in this part
        self.base = 0                       # tokens passed on before this part
        self.part_usage: int | None = None  # this part's completion tokens, when its engine says per chunk
        self.prompt: int | None = None      # the original prompt's tokens, once known
        self.head: tuple[Any, Any, Any] | None = None     # the first stream's id, created, model
        self.role_sent = False
        self._tail = b""
        # The continuations' answers and endpoints, released when the stream ends (Continuation.close).
        self.open: list[tuple[Response, EndpointState]] = []

    @property
    def sent(self) -> int:
        """Tokens passed on so far: the engine's running usage where it sends one, else content deltas counted."""
        return self.base + (self.part_usage if self.part_usage is not None else self.counted)

    def feed(self, chunk: bytes) -> bytes:
        """The whole events in what arrived so far (a partial one is held back); b"" when none is whole yet."""
        data = self._tail + chunk if self._tail else chunk
        if self.ended is not None and not self.part:
            # The first stream can no longer be continued: the rest passes as it comes.
            self._tail = b""
            return data
        lf, crlf = data.rfind(b"\n\n"), data.rfind(b"\n\r\n")
        end = max(lf + 2 if lf >= 0 else 0, crlf + 3 if crlf >= 0 else 0)
        if not end:
            if len(data) > MAX_EVENT:
                self.ended = f"an event longer than {MAX_EVENT} bytes"
                self._tail = b""
                return data
            self._tail = data
            return b""
        events, self._tail = data[:end], data[end:]
        return self._read(events)

    def rest(self) -> bytes:
        """What is held back when the stream ends: passed on as it is."""
        tail, self._tail = self._tail, b""
        return tail

    def cut(self) -> None:
        """The part being read was cut: what it sent stays, what it held back is dropped, the next part begins."""
        self.base = self.sent
        self.counted = 0
        self.part_usage = None
        self.part += 1
        self._tail = b""

    def _read(self, events: bytes) -> bytes:
        out: list[bytes] | None = [] if self.part else None
        for line in events.splitlines():
            if not line.startswith(b"data:"):
                if out is not None and line:
                    out.append(line + b"\n\n")
                continue
            payload = line[5:].strip()
            if payload == b"[DONE]":
                self.ended = "the stream was done"
            obj = _json(payload) if payload.startswith(b"{") else None
            if obj is None:
                if out is not None:
                    out.append(line + b"\n\n")
                continue
            keep = self._record(obj)
            if out is not None and keep:
                out.append(b"data: " + json.dumps(obj, ensure_ascii=False, separators=_COMPACT).encode() + b"\n\n")
        return events if out is None else b"".join(out)

    def _record(self, obj: dict[str, Any]) -> bool:
        """Keep what `obj` (one event's JSON) adds to the stream; in a later part, rewrite it onto the first.

        False: a later part's event the client must not see (its role delta, sent already).
        """
        if "error" in obj:
            self.ended = "the engine sent an error"
            return True
        if self.head is None:
            self.head = (obj.get("id"), obj.get("created"), obj.get("model"))
        elif self.part:
            obj["id"], obj["created"], obj["model"] = self.head
        usage = obj.get("usage")
        if isinstance(usage, dict):
            self._count_usage(usage)
        choices = obj.get("choices")
        if not isinstance(choices, list):
            return True
        for choice in choices:
            if not isinstance(choice, dict):
                continue
            delta = choice.get("delta")
            if isinstance(delta, dict):
                if "role" in delta:
                    if self.part and self.role_sent:
                        del delta["role"]
                        if not delta.get("content") and choice.get("finish_reason") is None \
                                and len(choices) == 1 and set(delta) <= {"content"}:
                            return False
                    self.role_sent = True
                content = delta.get("content")
                if isinstance(content, str) and content:
                    self.text.append(content)
                    self.counted += 1
                if delta.get("reasoning_content") or delta.get("reasoning"):
                    self.ended = "reasoning deltas"
                if delta.get("tool_calls"):
                    self.ended = "tool-call deltas"
            if choice.get("index", 0) != 0:
                self.ended = "more than one choice"
            if choice.get("logprobs") is not None:
                self.ended = "logprobs"
            if choice.get("finish_reason") is not None:
                self.ended = "the generation finished"
        return True

    def _count_usage(self, usage: dict[str, Any]) -> None:
        prompt, completion = usage.get("prompt_tokens"), usage.get("completion_tokens")
        if not isinstance(completion, int):
            return
        if not self.part:
            self.part_usage = completion
            if isinstance(prompt, int):
                self.prompt = prompt
            return
        # A later part's prompt is the original plus the text so far, which
        # counted `base` tokens as it passed: the original is what is left.
        if self.prompt is None and isinstance(prompt, int):
            self.prompt = max(0, prompt - self.base)
        self.part_usage = completion
        total = self.base + completion
        usage["completion_tokens"] = total
        if self.prompt is not None:
            usage["prompt_tokens"] = self.prompt
            usage["total_tokens"] = self.prompt + total


def _json(payload: bytes) -> dict[str, Any] | None:
    try:
        obj = json.loads(payload)
    except ValueError:
        return None
    return obj if isinstance(obj, dict) else None


class Continuation:
    """Which streams may be continued (`watch`), and the next part of one whose engine died (`resume`)."""

    def __init__(self, config: RouterConfig, *, balancer: Balancer, metrics: RouterMetrics,
                 inflight: InFlight | None = None):
        self._config = config
        self._balancer = balancer
        self._metrics = metrics
        # A continuation waiting for its headers on a replica that stops answering moves on, as a
        # first attempt does (inflight.py); None: it waits there.
        self._inflight = inflight
        # Requests' connections to engines: the request path's pool, handed over as the app starts.
        self.pool: Pool | None = None

    def watch(self, call: Call) -> Splice | str | None:
        """A stream about to pass: a Splice to read it through when it may be continued; (a str) why it may not,
        for a model that has continuation on; None for every other."""
        attempts = call.view.continuation.get(call.model)
        if not attempts or call.route.path != CHAT or not call.stream:
            return None
        body = call.body
        if jsonbody.heavy(body):
            # Parsed off the loop on arrival; parsing it again here would stall it.
            return "a body the router parses off its loop"
        doc = _json(body)
        if doc is None:
            return "a body that is not a JSON object"
        why = refusal(doc)
        return why if why is not None else Splice(doc, attempts)

    async def resume(self, call: Call, splice: Splice | str, state: EndpointState,
                     failure: str) -> tuple[Response, EndpointState] | None:
        """The next part of a stream cut at `state` (already ejected), its headers in; None: end it as before."""
        model = state.endpoint.model
        counted = self._metrics.continuations
        if isinstance(splice, str):
            counted.labels(model, "ineligible").inc()
            log.warning("endpoint %s died mid-stream (%s); not continued: %s", state.replica_id, failure, splice)
            return None
        if splice.ended is not None:
            counted.labels(model, "ineligible").inc()
            log.warning("endpoint %s died mid-stream (%s); not continued: %s", state.replica_id, failure,
                        splice.ended)
            return None
        splice.cut()
        splice.tried += (state,)
        sent = splice.sent
        body = continuation_body(splice.doc, model, "".join(splice.text), sent)
        if isinstance(body, str):
            counted.labels(model, "ineligible").inc()
            log.warning("endpoint %s died mid-stream (%s); not continued: %s", state.replica_id, failure, body)
            return None
        why = f"{splice.attempts} hand-overs already"
        while splice.tries < splice.attempts:
            splice.tries += 1
            answer = await self._send(call, splice, model, body)
            if isinstance(answer, str):
                why = answer
                continue
            upstream, to = answer
            call.continued += ((state.replica_id, to.replica_id, sent),)
            counted.labels(model, "resumed").inc()
            log.warning("endpoint %s died mid-stream after %d tokens (%s); continuing on %s", state.replica_id,
                        sent, failure, to.replica_id,
                        extra={"event": "stream-continued", "endpoint": state.replica_id, "to": to.replica_id,
                               "tokens": sent, "request_id": call.rid})
            return answer
        counted.labels(model, "failed").inc()
        log.warning("endpoint %s died mid-stream after %d tokens (%s); not continued: %s", state.replica_id, sent,
                    failure, why)
        return None

    async def _send(self, call: Call, splice: Splice, model: str,
                    body: bytes) -> tuple[Response, EndpointState] | str:
        """The continuation sent to a replica not tried yet, once its stream's headers are in; or (a str) why not."""
        balancer, pool = self._balancer, self.pool
        assert pool is not None     # handed over as the app starts, before any request
        chooser = call.chooser if model == call.model else None
        to = balancer.pick(model, splice.tried, chooser)
        if to is None:
            splice.tries = splice.attempts      # nothing left to try
            return f"no other replica of {model!r} is ready"
        splice.tried += (to,)
        # Its adapters off on llama.cpp, as the request's own attempts had them (a base's stream: an adapter's is
        # not continued, its name having no continuation of its own).
        body = loraselect.for_endpoint(call, to, body)
        balancer.started(to)
        sent = pool.post(to.endpoint.url, call.request.raw_path, body, headers=call.fwd,
                         idle_timeout=self._config.upstream_idle_timeout or None)
        inflight = self._inflight if splice.tries < splice.attempts else None    # with a try left, it may move
        try:
            upstream = await (sent if inflight is None else inflight.headers(to, model, splice.tried, sent))
        except Abandoned as exc:
            balancer.finished(to)       # already out of routing: no ejection of ours
            return f"{to.replica_id} stopped answering while the continuation waited on it ({exc})"
        except UpstreamError as exc:
            balancer.finished(to)
            balancer.eject(to)
            kind = "could not be reached" if isinstance(exc, ConnectFailed) else "failed"
            return f"{to.replica_id} {kind}: {exc or type(exc).__name__}"
        except BaseException:
            balancer.finished(to)       # the client left while it was sent
            raise
        # From here on released by close(), however the stream ends.
        opened = (upstream, to)
        splice.open.append(opened)
        if upstream.status != 200 or not upstream.headers.get("content-type", "").startswith("text/event-stream"):
            try:
                said = (await upstream.read(_ERROR_BYTES))[:300].decode(errors="replace")
            except UpstreamError:
                said = ""
            splice.open.remove(opened)
            upstream.release()
            balancer.finished(to)
            return f"{to.replica_id} answered {upstream.status}: {said}"
        balancer.succeeded(to)
        return opened

    def close(self, splice: Splice) -> None:
        """The stream ended, however: the continuations' connections released, their endpoints' requests over."""
        for upstream, state in splice.open:
            upstream.release()
            self._balancer.finished(state)
        splice.open.clear()
