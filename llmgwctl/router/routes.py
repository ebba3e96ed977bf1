"""The routes the router proxies: one entry per API, and nothing else reaches an engine.

A client reaches only what is in `TABLE` -- the APIs llmgw documents -- and
the routes a catalog adds for the engines that serve them (`engines.NAME.routes`,
validated by the catalog: under /v1/, never an engine-admin route). Every
other path is an OpenAI-shaped 404 from the router, whatever an engine
behind it exposes: vLLM's `/v1/load_lora_adapter` or `/sleep`, SGLang's
`/flush_cache`, llama.cpp's `/slots` change the engine for every client, so
a client must never reach them (adapters are desired state, loaded by
agents, see DESIGN.md).

Each entry says, for its API:

- `path` and `methods`: what the router registers (in `Router.app`);
- `model_key`: the body's top-level member that names the model (the router
  resolves it and rewrites an alias there, see `jsonbody`);
- `streams`: whether `"stream": true` asks for an event stream (the
  upstream's idle timer then runs);
- `prompt`: how the prompt is read for prefix routing (`policies/prefix.py`); None:
  the pick is by load alone;
- `usage`: how its answers' token counts are read for metering (`usage.py`);
- `error_shape`: the shape the router's own errors take on this route
  (`shapes.py`: OpenAI's unless the route's SDK parses another, as the
  `anthropic` SDK does on the Messages routes);
- `binds`: whether the answer names a response the engine stored (its id),
  which later requests name (`previous_response_id` in the body): the
  router remembers the replica and sends those there (affinity.py);
- `by_response`: the path names a stored response (`{id}`) instead of the
  body a model: routed to the replica that stored it, for the key that made it.

The model's name goes both ways on every route: a request by alias reaches
the engine under the canonical name (`model_key` rewritten), and the answer's
`model` names the alias again (`echo.py`).

Adding an API is adding an entry. A catalog-added route is an entry like
embeddings' -- the model in the body, no stream timer, no prompt -- served
for a model only when every one of its profiles' engines lists it, so
whichever replica is picked can answer it.

It must not know about endpoints or the balancer.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ..catalog import Catalog
from . import usage as metering
from .policies.prefix import chat_prompt, completion_prompt, messages_prompt, responses_prompt
from .shapes import ANTHROPIC, OPENAI, Shape

PromptReader = Callable[[Mapping[str, Any]], "str | None"]


@dataclass(frozen=True, slots=True)
class Route:
    """One API the router proxies; see the module docstring for each field."""

    path: str
    methods: tuple[str, ...] = ("POST",)
    model_key: str = "model"
    streams: bool = False
    prompt: PromptReader | None = None
    usage: metering.Reading = metering.OPENAI
    error_shape: Shape = OPENAI
    binds: bool = False
    by_response: bool = False
    # Added by the catalog for some engines, not documented by llmgw: served
    # only for the models whose engines all list it (`View.allows`).
    from_catalog: bool = False

    @property
    def prefix(self) -> str:
        """What its request target must start with (`limits.check_target`): /v1/ for the OpenAI
        routes, / for those vLLM serves at the root (/rerank, /score, /tokenize...)."""
        return "/v1/" if self.path.startswith("/v1/") else "/"


TABLE: tuple[Route, ...] = (
    Route("/v1/chat/completions", streams=True, prompt=chat_prompt),
    Route("/v1/completions", streams=True, prompt=completion_prompt),
    Route("/v1/embeddings"),
    # Reranking and scoring, under every path vLLM serves them at: /rerank
    # (Jina's API), /v1/rerank, /v2/rerank (Cohere's clients), /score and
    # /v1/score. Each names its model in the body like embeddings and takes
    # the pick by load: a query and its documents have no prefix worth
    # following.
    Route("/v1/rerank"),
    Route("/rerank"),
    Route("/v2/rerank"),
    Route("/v1/score"),
    Route("/score"),
    # A model's tokenizer: vLLM and SGLang serve these two at the root only
    # (no /v1/ form), and answer with the model's max_model_len beside the
    # tokens, which is why a client wants the model's own replica.
    Route("/tokenize"),
    Route("/detokenize"),
    # OpenAI's Responses API: made by model, then named by id (responses.py).
    Route("/v1/responses", streams=True, prompt=responses_prompt, binds=True),
    Route("/v1/responses/{id}", methods=("GET", "DELETE"), streams=True, by_response=True),
    Route("/v1/responses/{id}/cancel", by_response=True),
    Route("/v1/responses/{id}/input_items", methods=("GET",), by_response=True),
    # Anthropic Messages (vLLM, llama.cpp's server): the anthropic SDK and Claude Code.
    Route("/v1/messages", streams=True, prompt=messages_prompt, usage=metering.MESSAGES, error_shape=ANTHROPIC),
    # A count costs no generation: not metered.
    Route("/v1/messages/count_tokens", usage=metering.NONE, error_shape=ANTHROPIC),
)
BY_PATH: Mapping[str, Route] = {r.path: r for r in TABLE}
# The prefix every by-response route's path starts with; `{id}` is the segment after it.
RESPONSES = "/v1/responses/"


def template_of(path: str) -> str:
    """`path` as the table spells it: a stored response's id as `{id}` (the rest as it is)."""
    if path.startswith(RESPONSES):
        head, sep, tail = path[len(RESPONSES):].partition("/")
        if head:
            return RESPONSES + "{id}" + sep + tail
    return path


class View:
    """The routes one catalog adds, built once per catalog: path -> route, and which models may use it."""

    __slots__ = ("routes", "_models")

    def __init__(self, catalog: Catalog):
        served: dict[str, set[str]] = {}
        for model in catalog.models:
            if not model.profiles:
                continue
            engines = catalog.engines
            # The routes every profile's engine lists: a replica of any profile may be picked.
            common: set[str] | None = None
            for profile in model.profiles:
                spec = engines.get(profile.engine)
                paths = set(spec.routes) if spec is not None else set()
                common = paths if common is None else common & paths
            for path in common or ():
                if path not in BY_PATH:
                    served.setdefault(path, set()).add(model.name)
        self.routes: Mapping[str, Route] = {p: Route(p, from_catalog=True) for p in served}
        self._models: Mapping[str, frozenset[str]] = {p: frozenset(m) for p, m in served.items()}

    def allows(self, route: Route, model: str) -> bool:
        """Whether `model` (canonical) is served on `route`: always for the table's, by its engines for the catalog's."""
        return not route.from_catalog or model in self._models.get(route.path, ())

    def paths(self) -> Iterable[str]:
        return self.routes.keys()
