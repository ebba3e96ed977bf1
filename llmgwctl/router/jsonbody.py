"""A request's JSON body: what the router reads out of it, parsed where it cannot stall the loop, and the model rewritten in place.

What the router needs from a body is small -- the model, whether it asks for
a stream, the prompt (for prefix routing) and `user` (for session routing) --
and `Facts` holds just that, plus where the model's value sits in the bytes.

Where it is parsed. A body is parsed with the standard library's C parser,
whose cost grows with the number of values in it, not its bytes: a 16 MB
base64 image parses in tens of milliseconds, a 16 MB object of 1,000,000
keys in over a second. A thread does not help: the C parser holds the GIL
from start to end, so the loop waits just as long (measured: four such
bodies in `asyncio.to_thread` left the loop without a turn for 5 s). Bytes
cost too, only less: one 30 MB string takes the parser about 100 ms. So a
body is parsed on the loop only when it is cheap for certain -- at most
`OFF_LOOP_BYTES` long and at most `ON_LOOP_COMMAS` commas, the bound on its
values beyond nesting, which the depth limit bounds -- and otherwise in a
separate process (`OffLoop`, one worker, started on the first such body),
which sends back only the `Facts`. Ordinary requests have few commas outside
their text and are far shorter than that, and never leave the loop; a body
of many values or of megabytes waits for the worker, at most
`OffLoop.max_waiting` of them at once (then 503).

The alias rewrite. A request naming a model by alias reaches the engine
under the canonical name (engines 404 a name they do not serve), written
over the bytes of the `model` member's value and nothing else: the rest of
the body goes on byte for byte as the client sent it, and rewriting costs a
copy, never a second serialisation. The value found is the one the parser
kept -- the top level's *last* `model` member, as every JSON parser keeps
the last of duplicate keys, never one nested deeper or inside a string --
found by walking the top level with the same C scanner `json.loads` uses, so
the two cannot disagree about escapes (`"mod\\u0065l"` is `model`).

It must not know about HTTP, endpoints or the catalog.
"""
from __future__ import annotations

import asyncio
import json
import os
import pickle
import re
import struct
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from json import scanner
from typing import Any

try:
    import fcntl
except ImportError:     # Windows
    fcntl = None  # type: ignore[assignment]

from .. import allocator
from .errors import MAX_NAME_CHARS, RouterError
from .limits import DepthError, check_depth

# Commas a body may hold and still be parsed on the loop: 50,000 values cost
# the C parser a few milliseconds (tens at worst, for object keys, on a
# loaded core), while a chat request holds a few hundred outside its text and
# an embeddings batch of token ids more only past ~50,000 tokens. Counting
# them is one memchr-speed pass, paid only by bodies of more than
# ON_LOOP_BYTES, which cannot hold more commas than that.
ON_LOOP_COMMAS = 50_000
ON_LOOP_BYTES = ON_LOOP_COMMAS
# Bytes past which a body is parsed off the loop whatever it holds: the C
# parser reads a long string at a few milliseconds per MB, so 2 MiB costs the
# loop a few ms at most, while one 30 MB string (a hostile model name, a
# body of padding) cost it 100 ms and every other request waited. Chat
# requests are far smaller; one carrying megabytes of base64 images pays the
# trip to the worker, a copy through a pipe, which costs the loop less than
# parsing it. Such a body is charged to the large-body budget, which bounds
# how many wait for the worker at once.
OFF_LOOP_BYTES = 2 << 20


class BodyRefused(RouterError, ValueError):
    """The body is not one the router forwards: not JSON, not an object, too deep. `code` is the error's code."""

    def __init__(self, message: str, code: str):
        # Both in args: it crosses from the worker process pickled, and is rebuilt from them.
        super().__init__(message, code)
        self.code = code

    def __str__(self) -> str:
        return str(self.args[0])


class WorkerBusy(RouterError):
    """The off-loop parser already has as many bodies as it may hold (503)."""


PromptReader = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True, slots=True)
class Facts:
    """What the router reads out of a body. `doc` is the parsed body, or (parsed off the loop) only `user` and
    `previous_response_id`.

    `model` is the model member's value as parsed (any JSON value; the
    router checks it is a name); `span`, where that value's bytes are in the
    body (None: not found, or a body not in UTF-8: rewrite by re-encoding);
    `prompt`, the prompt as the route reads it (None: none to hash), read
    only off the loop (`off_loop`), where the whole document stays behind;
    on the loop the router reads it from `doc` when a policy wants it.
    """

    doc: Mapping[str, Any]
    model: Any
    stream: bool
    prompt: str | None = None
    span: tuple[int, int] | None = None
    off_loop: bool = False
    # Whether the body spells a lone surrogate (`lone_surrogate`), looked at
    # off the loop too, where a large body's scan costs the loop nothing; None: not yet.
    lone_surrogate: bool | None = None
    # The model name's length when `model` is only its start (a name too long to be any model's).
    model_chars: int | None = None


def heavy(body: bytes) -> bool:
    """Whether `body` may be costly to parse, so it goes to the off-loop parser (see the module docstring)."""
    size = len(body)
    return size > OFF_LOOP_BYTES or (size > ON_LOOP_BYTES and body.count(b",") > ON_LOOP_COMMAS)


def parse(body: bytes, key: str, max_depth: int) -> Facts:
    """`body` parsed: the facts the router needs. BodyRefused when it is not a JSON object within `max_depth` (0: any).

    `key` is the member naming the model (the route's).
    """
    try:
        doc = json.loads(body)
    except (ValueError, RecursionError) as exc:
        raise BodyRefused(f"the request body is not valid JSON: {str(exc) or 'nested too deeply'}",
                          "invalid_json") from None
    if type(doc) is not dict:
        raise BodyRefused("the request body must be a JSON object", "invalid_body")
    if max_depth:
        try:
            check_depth(body, doc, max_depth)
        except DepthError as exc:
            raise BodyRefused(str(exc), "too_deep") from None
    return Facts(doc, doc.get(key), doc.get("stream") is True)


# What of a body parsed off the loop comes back beside the facts: `user` (the
# session policy's) and `previous_response_id` (which replica a Responses
# request must go to, affinity.py); strings only.
_KEPT_OFF_LOOP = ("user", "previous_response_id")


def _parse_off_loop(body: bytes, key: str, prompt: PromptReader | None, max_depth: int) -> Facts | BodyRefused:
    """The worker's side: `parse`, with only what the router needs sent back (not the whole document)."""
    try:
        facts = parse(body, key, max_depth)
    except BodyRefused as exc:
        return exc
    doc, model = facts.doc, facts.model
    if type(model) is str and len(model) > MAX_NAME_CHARS:
        # Refused as too long, quoting only its start: a 30 MB name is not
        # sent back whole for the router to unpickle (tens of ms, holding the GIL).
        return Facts({}, model[:MAX_NAME_CHARS + 1], facts.stream, off_loop=True, model_chars=len(model))
    kept = {k: doc[k] for k in _KEPT_OFF_LOOP if type(doc.get(k)) is str}
    return Facts(kept, model if type(model) is str else None,
                 facts.stream, prompt(doc) if prompt is not None else None,
                 model_span(body, key) if type(model) is str else None, off_loop=True,
                 lone_surrogate=lone_surrogate(body) if type(model) is str else None)


# How much less CPU the worker claims than the router when both want it.
# Each step of `nice` is about 1.25x less weight to Linux's scheduler, so
# at +10 the router's loop gets ~90 % of a contended core: a client's
# million-key body waits for spare CPU instead of taking it from every
# other request (issue 27's bench: two hostile clients kept the worker
# busy a core-second at a time, on a 2-core machine where serve's loop,
# its engines and their clients shared what was left).
WORKER_NICENESS = 10


class OffLoop:
    """A worker process that parses the bodies too costly for the loop (see the module docstring).

    One worker: a body of a million values costs it a second or so, and it
    runs beside the loop, on another core when there is one, instead of in
    it, and at a lower CPU priority (`WORKER_NICENESS`), so where there is
    no spare core the loop still comes first. At most `max_waiting` bodies
    are with it at once (running or queued); past that WorkerBusy, so a
    flood of them costs a bounded queue and the memory of its bodies, not
    the whole router's. The worker starts on the first body it gets (a fresh
    interpreter, never a fork of a process with threads) and is started
    again if it dies.

    The body goes to the worker down a pipe the loop writes, from the bytes
    the router holds: not pickled first (what a process pool does, in one
    of the router's threads, holding the GIL while it copies the whole body:
    15-25 ms of loop stalled for a 30 MB body on a loaded core). Only the
    small request (the key, the prompt reader, the depth) and the facts
    coming back are pickled. One body at a time is on the pipe; a request
    given up while its body is there still lets the exchange finish, so the
    next one finds the pipe in step.
    """

    # Thirty-two bodies: a burst of large batch requests or image-laden
    # chats is served in order rather than refused. A waiting body is held
    # by its request anyway, and one past 1 MiB is charged to the large-body
    # budget (128 MiB in all), which refuses the burst past it first; the
    # bound here is for the smaller bodies of many values.
    def __init__(self, max_waiting: int = 32):
        self.max_waiting = max_waiting
        self._worker: asyncio.subprocess.Process | None = None
        self._pipe = asyncio.Lock()
        self._waiting = 0

    async def parse(self, body: bytes, key: str, prompt: PromptReader | None, max_depth: int) -> Facts:
        if self._waiting >= self.max_waiting:
            raise WorkerBusy(f"{self._waiting} large bodies are being parsed")
        self._waiting += 1
        try:
            got = await asyncio.shield(self._exchange(body, pickle.dumps((key, prompt, max_depth))))
        finally:
            self._waiting -= 1
        if isinstance(got, BaseException):
            raise got
        return got

    async def _exchange(self, body: bytes, request: bytes) -> Facts | BaseException:
        async with self._pipe:
            worker = self._worker
            if worker is None or worker.returncode is not None:
                worker = self._worker = await _start_worker()
            stdin, stdout = worker.stdin, worker.stdout
            assert stdin is not None and stdout is not None
            try:
                stdin.write(_FRAME.pack(len(request), len(body)) + request)
                stdin.write(body)
                await stdin.drain()
                (size,) = _REPLY.unpack(await stdout.readexactly(_REPLY.size))
                got: Facts | BaseException = pickle.loads(await stdout.readexactly(size))
                return got
            except (OSError, asyncio.IncompleteReadError, pickle.UnpicklingError):
                # Killed (the OOM killer, an operator): the next body starts a new one.
                self._worker = None
                await _end(worker)
                return WorkerBusy("the body parser process died")

    async def aclose(self) -> None:
        """End the worker (the app stops)."""
        worker, self._worker = self._worker, None
        if worker is not None:
            await _end(worker)


async def _end(worker: asyncio.subprocess.Process) -> None:
    """Kill `worker` and reap it, so its pipes are closed while the loop runs."""
    if worker.returncode is None:
        try:
            worker.kill()
        except ProcessLookupError:
            pass
    await worker.wait()


# A request to the worker: its pickled part's length and the body's, then
# both; a reply: its length, then the pickled facts (or the refusal).
_FRAME = struct.Struct("!IQ")
_REPLY = struct.Struct("!Q")
_WORKER = "import sys; sys.path[:0] = sys.argv[1:]; from llmgwctl.router import jsonbody; jsonbody.worker_main()"


async def _start_worker() -> asyncio.subprocess.Process:
    # Our own import path handed over, so the worker imports this very copy of
    # llmgwctl however the router was started (installed, -m from a checkout).
    # A session of its own: a Ctrl-C at serve's terminal is serve's to handle;
    # the worker ends when its pipe closes, with serve.
    worker = await asyncio.create_subprocess_exec(
        sys.executable, "-c", _WORKER, *sys.path, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
        start_new_session=True)
    # A pipe of 1 MiB, not 64 KiB: a 30 MB body crosses in 30 of the loop's
    # writes, not 500 (each a wake-up of both sides). Linux only, and only up
    # to what /proc/sys/fs/pipe-max-size allows: else the default stands.
    set_size = getattr(fcntl, "F_SETPIPE_SZ", None) if fcntl is not None else None
    pipe = worker.stdin.transport.get_extra_info("pipe") if worker.stdin is not None else None
    if set_size is not None and pipe is not None:
        try:
            fcntl.fcntl(pipe.fileno(), set_size, 1 << 20)
        except OSError:
            pass
    return worker


def worker_main() -> None:
    """The worker process: parse each body it is sent, until its input ends."""
    try:
        os.nice(WORKER_NICENESS)
    except OSError:     # a platform or sandbox that refuses it: the worker runs at the router's priority
        pass
    # A million-key body's tables are given back when freed.
    allocator.tune()
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    while True:
        head = stdin.read(_FRAME.size)
        if len(head) < _FRAME.size:
            return
        request_size, body_size = _FRAME.unpack(head)
        key, prompt, max_depth = pickle.loads(stdin.read(request_size))
        body = stdin.read(body_size)
        if len(body) < body_size:
            return
        try:
            got: Facts | BaseException = _parse_off_loop(body, key, prompt, max_depth)
        except Exception as exc:     # noqa: BLE001 -- a parse that fails unforeseen is the router's to raise, not the worker's end
            got = exc
        del body
        reply = pickle.dumps(got)
        stdout.write(_REPLY.pack(len(reply)) + reply)
        stdout.flush()


# -- the model's value, in the bytes --------------------------------------------------------

_DECODER = json.JSONDecoder()
_scan_value = scanner.make_scanner(_DECODER)   # type: ignore[arg-type]  # typeshed types it as the class
_scan_string = json.decoder.scanstring      # type: ignore[attr-defined]  # the C one when built
_WS = re.compile(r"[ \t\n\r]*")


def _ws(text: str, i: int) -> int:
    """Past JSON whitespace from `i`."""
    m = _WS.match(text, i)
    return m.end() if m is not None else i


def model_span(body: bytes, key: str = "model") -> tuple[int, int] | None:
    """Byte offsets of the value of `body`'s top-level member `key` (the last, if several); None if none or not UTF-8.

    `body` must be a JSON object (the caller parsed it). Walks the top level
    only, with json's own scanner, so a `"model"` nested deeper, inside a
    string, or spelled with escapes is told apart exactly as `json.loads`
    tells it.
    """
    encoding = json.detect_encoding(body)
    if encoding == "utf-8-sig":
        skip = 3
    elif encoding == "utf-8":
        skip = 0
    else:
        return None     # UTF-16/32: rare, and re-encoded as UTF-8 instead
    text = body[skip:].decode("utf-8", "surrogatepass")
    found = _top_level_span(text, key)
    if found is None:
        return None
    start, end = found
    if len(text) == len(body) - skip:   # ASCII: characters are bytes
        return start + skip, end + skip
    head = len(text[:start].encode("utf-8", "surrogatepass")) + skip
    return head, head + len(text[start:end].encode("utf-8", "surrogatepass"))


def _top_level_span(text: str, key: str) -> tuple[int, int] | None:
    ws = _ws
    i = ws(text, 0)
    if text[i:i + 1] != "{":
        return None
    i = ws(text, i + 1)
    if text[i:i + 1] == "}":
        return None
    span = None
    try:
        while True:
            if text[i:i + 1] != '"':
                return None
            name, i = _scan_string(text, i + 1)
            i = ws(text, i)
            if text[i:i + 1] != ":":
                return None
            i = ws(text, i + 1)
            _, end = _scan_value(text, i)
            if name == key:
                span = (i, end)
            i = ws(text, end)
            sep = text[i:i + 1]
            if sep == "}":
                return span
            if sep != ",":
                return None
            i = ws(text, i + 1)
    except (StopIteration, ValueError, RecursionError):
        return None


def with_model(body: bytes, span: tuple[int, int], name: str) -> bytes:
    """`body` with the bytes at `span` replaced by `name` as a JSON string; nothing else changes."""
    start, end = span
    return b"".join((body[:start], json.dumps(name).encode(), body[end:]))


# A \u escape of a UTF-16 surrogate; which are paired is decided by `lone_surrogate`.
_SURROGATE_ESCAPE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}")
# A surrogate written as UTF-8 bytes, which no valid UTF-8 holds (json.loads
# reads it, with surrogatepass, as a lone surrogate however it is followed).
_SURROGATE_BYTES = re.compile(rb"\xed[\xa0-\xbf]")


def lone_surrogate(body: bytes) -> bool:
    """Whether `body` (valid JSON) spells a lone UTF-16 surrogate (an unpaired \\uD800-\\uDFFF escape), which is not text.

    An escape preceded by an odd run of backslashes is not an escape but a
    literal backslash and text; a surrogate written as raw bytes is never text. Costs one search over a
    body without surrogate escapes, the usual case.
    """
    if _SURROGATE_BYTES.search(body) is not None:
        return True
    if _SURROGATE_ESCAPE.search(body) is None:
        return False
    pending_high = -1      # the end of a high surrogate escape not yet paired
    for m in _SURROGATE_ESCAPE.finditer(body):
        start = m.start()
        run = 0
        while start - run - 1 >= 0 and body[start - run - 1] == 0x5C:
            run += 1
        if run % 2:
            continue        # "\\uD800" is a backslash, then text
        high = body[start + 3] in b"89abAB"
        if pending_high >= 0:
            if not high and start == pending_high:
                pending_high = -1
                continue
            return True     # a high surrogate followed by anything but its low half
        if not high:
            return True     # a low surrogate with no high one before it
        pending_high = m.end()
    return pending_high >= 0
