"""`RouterConfig`: the router's knobs, each default once with its reason.

The CLI's router options (`llmgwctl router`, `llmgwctl serve`) and the
upstream `Pool` take their defaults from here, so a default changes in one
place. It imports nothing but httpserver's constants, so any router module
(upstream included, which server imports) can read it without a cycle.
"""
from __future__ import annotations

from dataclasses import dataclass

from ..httpserver import CLIENT_IDLE_TIMEOUT, MAX_CONNECTIONS_PER_CLIENT, MAX_HEADER_BYTES, MAX_HEADERS

# vLLM's default --max-num-seqs: how many requests one engine generates at
# once. The defaults below that are sized to one engine's batch count in it.
VLLM_MAX_NUM_SEQS = 256


@dataclass(frozen=True, slots=True)
class RouterConfig:
    # Bodies above this get 413 before they are read: a 128k-token prompt is
    # about 0.5 MB of text and requests with a few base64 images reach several
    # MB; 32 MiB leaves room for those while bounding memory per request.
    max_body_bytes: int = 32 * 1024 * 1024
    # Engine gauges change at the pace of requests finishing; 1 s keeps the pick
    # current while costing each engine one small scrape a second.
    poll_interval: float = 1.0
    # A poll of /metrics is also the router's health probe of the engine, and
    # one that takes longer than this is a miss: an engine that is up answers
    # it in milliseconds, even while generating (vLLM's and SGLang's API
    # servers serve it between scheduler steps), so 1 s of silence is a
    # stopped process, a hung GPU or a partition, not load. Not capped at a
    # shorter poll interval: a pass then waits out a wedged engine's timeout
    # (the others' readings come a little late), where a timeout as short as
    # a 0.1 s interval would eject engines that are merely busy.
    probe_timeout: float = 1.0
    # Missed polls in a row that take an endpoint out of routing until it
    # answers (router/outlier.py): with the 1 s poll, a wedged engine is out
    # within about 4 s, one lost scrape ejects nothing. 0: never (the agents'
    # probes alone withdraw a wedged replica; the misses are still counted, so
    # requests waiting on one withdrawn while silent still move: inflight.py).
    eject_after: int = 3
    # Long enough for a 7B-70B model cached on local disk to load (30-90 s with
    # vLLM); past it, a 503 with Retry-After lets the client decide.
    cold_timeout: float = 120.0
    # Waiting requests per cold model: a burst costs memory in proportion but not
    # without limit; one vLLM engine's batch.
    cold_queue: int = VLLM_MAX_NUM_SEQS
    # Endpoints tried per request when one fails before any byte of its answer
    # (refused, reset, headers cut short or late, 502/503; see retry.py): the
    # first failure is usually one replica going away, a third in a row means
    # the model is in trouble and the client should hear about it.
    max_attempts: int = 3
    # Engines are on the same LAN; a connect taking longer than this means the
    # host is gone, and the request is better moved to another endpoint.
    connect_timeout: float = 3.0
    # One client connection pool for every engine. Per host: twice vLLM's default
    # max_num_seqs, so every slot plus a visible queue is reachable and requests
    # past that wait in the router, where they count as in-flight load. Total:
    # bounded well under the file-descriptor limit the CLI raises to.
    connections_per_endpoint: int = 2 * VLLM_MAX_NUM_SEQS
    connections_total: int = 8192
    # Below uvicorn's default 5 s keep-alive (vLLM, SGLang), so the router closes
    # an idle connection before the engine does and never sends a request down
    # a socket the engine is closing (which would look like a reset and eject a
    # healthy endpoint).
    keepalive_timeout: float = 4.0
    # -- limits on what clients can make the router hold (see limits.py) --
    # OpenAI request bodies nest about 6 deep (messages, content parts, image
    # urls) and a tool's JSON schema rarely past 20; 64 leaves room for any real
    # schema while refusing the deeply nested bodies that make parsers recurse.
    max_json_depth: int = 64
    # Large bodies held at once (limits.BodyBudget): a body of 1 MiB or more
    # is a long prompt or images. While parsed and sent one costs the process
    # about three times its size (the bytes, their decoded text, the parsed
    # strings), so 32 MiB per client address (one body at the size limit, or
    # six 5 MB images) and 128 MiB in all keep a burst of the largest bodies
    # to a few hundred MB; a client past it hears 429 (503 when the router's
    # whole budget is in use) before its body is read.
    large_body_bytes: int = 1024 * 1024
    large_bodies_per_client: int = 32 * 1024 * 1024
    large_bodies_total: int = 128 * 1024 * 1024
    # Once the headers are in, the whole body must arrive within this: 32 MiB
    # at 1 MB/s (a slow link) takes 32 s; a client slower than that is holding
    # a connection, not sending a request.
    body_timeout: float = 120.0
    # Slow headers, idle keep-alive, header sizes and connections per address:
    # the limits every llmgw server shares, each with its reason in httpserver.
    client_idle_timeout: float = CLIENT_IDLE_TIMEOUT
    max_header_bytes: int = MAX_HEADER_BYTES
    max_headers: int = MAX_HEADERS
    max_connections_per_client: int = MAX_CONNECTIONS_PER_CLIENT
    # A stream whose engine sends no byte for this long ends (504 before its
    # first byte, an error event after): a long prefill sends nothing until the
    # first token, and 10 minutes is past any real one. A whole (non-stream)
    # reply sends nothing until it is done: it is bounded by the next one.
    upstream_idle_timeout: float = 600.0
    # The wait for an engine's headers, for every request, from the moment it
    # is sent. vLLM, SGLang and llama.cpp send a whole (non-stream) answer's
    # headers with its body, when the generation ends, so this bounds a whole
    # generation: 30 minutes is 32k tokens at under 20 tokens/s, past what
    # any client waits for without streaming (OpenAI's SDKs give up at 10
    # minutes and disconnect, which frees the slot at once). It is what ends a
    # request to an engine that never answers, or trickles header bytes
    # forever, for a client that never gives up. 0: no bound.
    upstream_headers_timeout: float = 1800.0
    # A whole (non-stream) answer is held to be counted and passed on; past
    # this it is refused (502) and its engine ejected for a while. The largest
    # real answers are embeddings of a big batch: 2,048 inputs (OpenAI's cap
    # per request) of 1,024 floats as JSON text (~20 bytes each) are ~40 MiB,
    # and a long completion with top logprobs is a few MiB. 64 MiB holds both,
    # and bounds what one engine can make the router hold per request. A
    # stream is passed through as it arrives and is not capped.
    max_answer_bytes: int = 64 * 1024 * 1024
    # An engine's /metrics page at most, read per poll: real pages are 10-80 KB
    # (a vLLM V1 page with every histogram ~75 KB); 4 MiB is fifty times
    # that, and reading and scanning it each second costs a few ms of a
    # worker thread. A larger page is not read: no reading, counted, shown.
    max_metrics_bytes: int = 4 * 1024 * 1024
    # A streaming client that reads nothing for this long is cut off and the
    # engine's slot freed: a stranger must not hold a GPU slot by not reading.
    # 60 s is far past any pause a live reader makes (a mobile client changing
    # networks), and the check costs nothing while the client keeps up.
    client_write_timeout: float = 60.0
    # One line per request on the `llmgw.access` logger (at INFO).
    access_log: bool = True
    # Responses the router remembers the replica of (router/responses.py), so
    # a request naming one (previous_response_id, GET /v1/responses/ID)
    # reaches the replica that stored it. An entry is about 300 bytes, so
    # 100,000 are ~30 MB at most; that is every response of a busy day on a
    # small fleet, and the least recently used goes first past it.
    responses_kept: int = 100_000
    # How long one is remembered after it was made: a day covers a
    # conversation left overnight; the engine's store (vLLM's is in memory)
    # seldom holds it longer, since it is lost at any restart or redeploy.
    responses_ttl: float = 24 * 3600.0
    # A stream held for a cold start gets an SSE comment (": waiting for model X
    # to start") this often, so clients, proxies and load balancers see bytes
    # and keep the connection: 5 s is under every idle timeout in common use
    # (nginx's 60 s, AWS ALB's 60 s, Cloudflare's 100 s) by a wide margin, and
    # a wait shorter than it sends none, so a warm model's errors keep their
    # status codes. 0: no comments (the stream's headers wait for the model).
    cold_keepalive: float = 5.0
    # Browser origins allowed to call the API (CORS); empty: no CORS headers and
    # no preflight answers, and a request from any other page's origin is 403
    # (llmgwctl.httporigin), as a gateway is called by servers unless the
    # operator says otherwise. "*" allows any origin.
    cors_origins: tuple[str, ...] = ()
    # Host names the router answers to beyond IP addresses, dotless names and
    # localhost (`*.example.com` for a domain, `*` for any): a name a page
    # could point at this address is refused (DNS rebinding, see
    # llmgwctl.httporigin). Bound beyond loopback, Host is checked only once
    # this names something, as llmgw cannot know the names it is reached by there.
    allowed_hosts: tuple[str, ...] = ()


# One knob's default, for a piece that takes a single setting (Pool,
# ColdStart, LoadPoller, the CLI's options): a slotted dataclass keeps its
# defaults on an instance, not on the class.
DEFAULTS = RouterConfig()
