"""Learning a model's context length from its engines, against real HTTP servers on loopback.

The engine is untrusted: an answer too large, a redirect, a length that is
not a sane whole number, or JSON nested past Python's recursion limit gives
no length, and nothing else happens.
"""
from __future__ import annotations

import asyncio
import json

import aiohttp
import pytest
from aiohttp import web

from llmgwctl.backoff import Backoff
from llmgwctl.contracts import Endpoint
from llmgwctl.router.balancer import Balancer
from llmgwctl.router.modelinfo import MAX_LENGTH, ModelInfo, context_from_card, context_from_props

from ..support import local_server


@pytest.mark.parametrize("doc, want", [
    ({"data": [{"id": "m", "max_model_len": 4096}]}, 4096),
    ({"data": [{"id": "other", "max_model_len": 1}, {"id": "m", "max_model_len": 8192}]}, 8192),
    ({"data": [{"id": "served-as", "max_model_len": 2048}]}, 2048),       # its only card
    ({"data": [{"id": "a", "max_model_len": 1}, {"id": "b", "max_model_len": 2}]}, None),  # neither is m
    ({"data": [{"id": "m", "max_model_len": True}]}, None),
    ({"data": [{"id": "m", "max_model_len": "4096"}]}, None),
    ({"data": [{"id": "m", "max_model_len": 0}]}, None),
    ({"data": [{"id": "m", "max_model_len": MAX_LENGTH + 1}]}, None),
    ({"data": [{"id": "m", "max_model_len": 4096.0}]}, None),
    ({"data": "m"}, None), ([1, 2], None), (None, None),
])
def test_a_card_gives_its_max_model_len_only_when_it_is_a_sane_whole_number(doc, want):
    assert context_from_card(doc, "m") == want


def test_llamacpp_props_give_n_ctx():
    assert context_from_props({"default_generation_settings": {"n_ctx": 8192}, "total_slots": 1}) == 8192
    assert context_from_props({"n_ctx": 2048}) == 2048
    assert context_from_props({"default_generation_settings": {"n_ctx": -1}}) is None
    assert context_from_props({"default_generation_settings": "x"}) is None


def _endpoint(rid: str, url: str, model: str = "m") -> Endpoint:
    return Endpoint(replica_id=rid, model=model, profile="p", engine="fake", url=url)


async def _ask(handlers: dict[str, web.Response | object], **options) -> int | None:
    app = web.Application()
    for path, answer in handlers.items():
        app.router.add_get(path, _handler(answer))
    async with local_server(app) as url, aiohttp.ClientSession() as session:
        return await ModelInfo(**options).ask(_endpoint("r", url), session)


def _handler(answer):
    async def respond(_request):
        return answer() if callable(answer) else answer
    return respond


async def test_vllm_card_then_llamacpp_props():
    card = web.json_response({"object": "list", "data": [{"id": "m", "max_model_len": 32768}]})
    assert await _ask({"/v1/models": card}) == 32768
    # llama.cpp: the card has only the trained length (meta.n_ctx_train), /props the served one.
    llama = {"/v1/models": lambda: web.json_response({"data": [{"id": "m", "meta": {"n_ctx_train": 131072}}]}),
             "/props": lambda: web.json_response({"default_generation_settings": {"n_ctx": 4096}})}
    assert await _ask(llama) == 4096


async def test_a_hostile_answer_gives_no_length():
    big = {"data": [{"id": "m", "max_model_len": 4096, "pad": "x" * 300_000}]}
    assert await _ask({"/v1/models": lambda: web.json_response(big)}) is None
    assert await _ask({"/v1/models": lambda: web.json_response({"data": [{"id": "m", "max_model_len": 9}]})},
                      max_bytes=10) is None
    # A redirect is never followed, even to a page that would give a length.
    redirect = {"/v1/models": lambda: web.Response(status=302, headers={"Location": "/real"}),
                "/real": lambda: web.json_response({"data": [{"id": "m", "max_model_len": 4096}]})}
    assert await _ask(redirect) is None
    deep = ("[" * 100_000) + ("]" * 100_000)
    assert await _ask({"/v1/models": lambda: web.Response(text=deep, content_type="application/json")}) is None
    assert await _ask({"/v1/models": lambda: web.Response(text="not json")}) is None
    assert await _ask({"/v1/models": lambda: web.Response(status=500)}) is None


async def test_each_endpoint_is_asked_once_and_a_model_takes_its_smallest():
    asked: dict[str, int] = {}

    def server(length: int, name: str) -> web.Application:
        async def models(_request):
            asked[name] = asked.get(name, 0) + 1
            return web.json_response({"data": [{"id": "m", "max_model_len": length}]})
        app = web.Application()
        app.router.add_get("/v1/models", models)
        return app

    async with local_server(server(8192, "big")) as big, local_server(server(2048, "small")) as small, \
            aiohttp.ClientSession() as session:
        balancer, info = Balancer(), ModelInfo()
        info.start(session)
        balancer.set_endpoints([_endpoint("big", big)])
        info.sync(balancer.states())
        await _settled(info, 1)
        assert info.context_length("m") == 8192
        balancer.set_endpoints([_endpoint("big", big), _endpoint("small", small)])
        info.sync(balancer.states())
        info.sync(balancer.states())
        await _settled(info, 2)
        assert info.context_length("m") == 2048, "a request may go to either: the smaller is the one to count on"
        assert asked == {"big": 1, "small": 1}
        # Both gone (scaled to zero): the last length said stays, until the model leaves the catalog.
        balancer.set_endpoints([])
        info.sync(balancer.states())
        assert info.lengths() == {} and info.context_length("m") == 2048
        info.retain(["other"])
        assert info.context_length("m") is None
        await info.close()


async def test_an_engine_that_does_not_answer_yet_is_asked_again_then_left():
    calls = []

    async def models(_request):
        calls.append(1)
        return web.Response(status=503)     # an answer, if not a length: not asked again...

    app = web.Application()
    app.router.add_get("/v1/models", models)
    async with local_server(app) as url, aiohttp.ClientSession() as session:
        info = ModelInfo(tries=3, backoff=Backoff(initial=0.01, cap=0.01, jitter=0))
        info.start(session)
        balancer = Balancer()
        balancer.set_endpoints([_endpoint("r", url)])
        info.sync(balancer.states())
        await _settled(info, 0)
        assert info.context_length("m") is None and len(calls) == 1    # then /props, a 404 here
        # ... while one that refuses connections is asked `tries` times, then left.
        dead = Balancer()
        dead.set_endpoints([_endpoint("gone", "http://127.0.0.1:9")])
        info.sync(dead.states())
        await _settled(info, 0)
        assert info.context_length("m") is None
        await info.close()


async def _settled(info: ModelInfo, lengths: int) -> None:
    """Until no ask is running (bounded), then `lengths` lengths are known."""
    await asyncio.wait_for(asyncio.gather(*info._asking.values(), return_exceptions=True), 30)
    assert len(info.lengths()) == lengths, info.lengths()


def test_the_parsers_do_not_need_a_whole_list():
    # What vLLM sends with LoRA adapters loaded: the base card and the adapters', each naming its parent.
    doc = json.loads(json.dumps({"object": "list", "data": [
        {"id": "m", "max_model_len": 4096, "parent": None},
        {"id": "m-lora", "max_model_len": 4096, "parent": "m"}]}))
    assert context_from_card(doc, "m") == 4096
