"""OpenAI's Responses API through the router: conversations stay on the replica that stored them, per key.

Two fake-engine processes serve one model; each stores the responses it
makes in its own memory and answers 404 for an id it does not hold, as
vLLM does. The official `openai` SDK drives the router: a conversation
chained by `previous_response_id` (plain and streamed turns) must have
every turn answered by the replica that stored the one before, or half of
them would be 404s. Retrieval, input items, cancel and delete reach that
replica too; another API key is told no such response exists; a replica
that left routing is named as the reason.
"""
from __future__ import annotations

import openai
import pytest
import requests

from llmgwctl.router import auth

from .harness import RouterThread, catalog, make_router, spawn_engine

MODEL = "resp-model"
ALIAS = "resp-alias"
OTHER = "resp-other"
LONE = "resp-lone"          # a model whose one engine a test kills
KEYS = {"alice": "sk-alice-0123456789", "bob": "sk-bob-0123456789", "narrow": "sk-narrow-0123456789"}
TURNS = 9


def key_file(narrow: str = OTHER) -> auth.ApiKeys:
    """alice and bob may use every model, `narrow` only the one named."""
    return auth.parse_keys({"keys": [
        {"name": name, "sha256": auth.hash_key(secret), "models": ["*"] if name != "narrow" else [narrow],
         "rpm": 100_000} for name, secret in KEYS.items()]})


@pytest.fixture(scope="module")
def served():
    engines = [spawn_engine(MODEL, f"resp-{i}") for i in range(2)]
    other = spawn_engine(OTHER, "resp-o")
    rt = RouterThread(make_router(catalog((MODEL, (ALIAS,)), (OTHER, ()), (LONE, ()))))
    rt.all_endpoints = [e.endpoint() for e in engines] + [other.endpoint()]
    try:
        rt.set_endpoints(rt.all_endpoints)
        rt.call(rt.router.set_api_keys, key_file())
        yield rt, engines
    finally:
        rt.close()
        for e in engines + [other]:
            e.kill()


def client(rt: RouterThread, who: str = "alice") -> openai.OpenAI:
    return openai.OpenAI(base_url=rt.url + "/v1", api_key=KEYS[who], max_retries=0, timeout=30)


def replica_of(text: str) -> str:
    """The fake's reply opens with `replica=ID`."""
    first = text.split()[0]
    assert first.startswith("replica="), text
    return first.removeprefix("replica=")


def test_a_conversation_chained_by_previous_response_id_stays_on_the_replica_that_stored_it(served):
    rt, engines = served
    c = client(rt)
    previous = None
    seen, prompts = [], set()
    for turn in range(TURNS):
        if turn % 3 == 2:
            # The SDK's stream helper, which rebuilds the response from the events as they come.
            with c.responses.stream(model=MODEL, input=f"turn {turn}", previous_response_id=previous) as stream:
                deltas = [e.delta for e in stream if e.type == "response.output_text.delta"]
                response = stream.get_final_response()
            assert "".join(deltas) == response.output_text
        elif turn % 3 == 1:
            # A streamed turn: the SDK's events, the id read off response.created by the router.
            events = list(c.responses.create(model=ALIAS if turn == 1 else MODEL, input=f"turn {turn}",
                                             previous_response_id=previous, stream=True))
            kinds = [e.type for e in events]
            assert kinds[0] == "response.created" and kinds[-1] == "response.completed", kinds
            assert "response.output_text.delta" in kinds
            response = events[-1].response
            assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == \
                response.output_text
        else:
            response = c.responses.create(model=MODEL, input=f"turn {turn}", instructions="be brief",
                                          previous_response_id=previous, max_output_tokens=8)
        assert response.id.startswith("resp_") and response.previous_response_id == previous
        seen.append(replica_of(response.output_text))
        prompts.add(response.output_text.split()[2])      # prompt=DIGEST: the whole conversation so far
        previous = response.id
    assert len(set(seen)) == 1, seen
    assert len(prompts) == TURNS
    # What the router saves the client from: the other replica does not hold the response.
    (elsewhere,) = [e for e in engines if e.replica_id != seen[0]]
    r = requests.post(elsewhere.url + "/v1/responses", timeout=10,
                      json={"model": MODEL, "input": "x", "previous_response_id": previous})
    assert r.status_code == 404, r.text


def test_a_stored_response_is_retrieved_listed_cancelled_and_deleted_on_its_replica(served):
    rt, _ = served
    c = client(rt)
    made = c.responses.with_raw_response.create(model=MODEL, input="keep this", max_output_tokens=6)
    replica, response = made.headers["x-llmgw-replica"], made.parse()
    for _ in range(4):      # each would hit the wrong replica half the time without affinity
        got = c.responses.with_raw_response.retrieve(response.id)
        assert got.headers["x-llmgw-replica"] == replica
        assert got.parse().output_text == response.output_text
    items = c.responses.input_items.list(response.id)
    assert [item.content[0].text for item in items.data] == ["keep this"]
    # The fake, as vLLM, cancels only background responses: its own 400, from the replica that holds it.
    with pytest.raises(openai.BadRequestError) as cancelled:
        c.responses.cancel(response.id)
    assert cancelled.value.response.headers["x-llmgw-replica"] == replica
    assert "synchronous" in cancelled.value.message
    c.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError) as gone:
        c.responses.retrieve(response.id)
    # Forgotten by the router with the delete: its 404, not the engine's.
    assert gone.value.body["code"] == "response_not_found" and "x-llmgw-replica" not in gone.value.response.headers


def test_another_key_is_told_no_such_response_exists(served):
    rt, _ = served
    response = client(rt).responses.create(model=MODEL, input="mine", max_output_tokens=4)
    bob = client(rt, "bob")
    unknown = client(rt, "bob")
    with pytest.raises(openai.NotFoundError) as never:
        unknown.responses.retrieve("resp_" + "0" * 32)
    attempts = [
        lambda: bob.responses.retrieve(response.id),
        lambda: bob.responses.create(model=MODEL, input="and now?", previous_response_id=response.id),
        lambda: bob.responses.input_items.list(response.id),
        lambda: bob.responses.cancel(response.id),
        lambda: bob.responses.delete(response.id),
    ]
    for attempt in attempts:
        with pytest.raises(openai.NotFoundError) as refused:
            attempt()
        # Word for word the answer for an id never made, but the id: nothing tells them apart.
        assert refused.value.body == {**never.value.body, "message": never.value.body["message"].replace(
            "resp_" + "0" * 32, response.id)}
    # Still there for its owner.
    assert client(rt).responses.retrieve(response.id).id == response.id


def test_a_key_no_longer_allowed_the_model_is_refused_its_responses(served):
    rt, _ = served
    narrow = client(rt, "narrow")
    made = narrow.responses.create(model=OTHER, input="hello", max_output_tokens=4)
    assert narrow.responses.retrieve(made.id).id == made.id
    rt.call(rt.router.set_api_keys, key_file(narrow=MODEL))
    try:
        with pytest.raises(openai.PermissionDeniedError):
            narrow.responses.retrieve(made.id)
        with pytest.raises(openai.PermissionDeniedError):
            narrow.responses.create(model=OTHER, input="x", previous_response_id=made.id)
    finally:
        rt.call(rt.router.set_api_keys, key_file())


def test_a_response_is_continued_only_by_its_own_model(served):
    rt, _ = served
    c = client(rt)
    made = c.responses.create(model=MODEL, input="hello", max_output_tokens=4)
    with pytest.raises(openai.BadRequestError) as refused:
        c.responses.create(model=OTHER, input="x", previous_response_id=made.id)
    assert refused.value.body["code"] == "response_model_mismatch"
    # By alias: the same model.
    assert c.responses.create(model=ALIAS, input="x", previous_response_id=made.id, max_output_tokens=4).id


def test_when_the_replica_that_stored_it_is_gone_the_404_says_so(served):
    rt, engines = served
    c = client(rt)
    made = c.responses.with_raw_response.create(model=MODEL, input="hello", max_output_tokens=4)
    replica, response = made.headers["x-llmgw-replica"], made.parse()
    rt.set_endpoints([ep for ep in rt.all_endpoints if ep.replica_id != replica])
    try:
        for attempt in (lambda: c.responses.create(model=MODEL, input="on", previous_response_id=response.id),
                        lambda: c.responses.retrieve(response.id)):
            with pytest.raises(openai.NotFoundError) as gone:
                attempt()
            assert gone.value.body["code"] == "response_replica_gone"
            assert replica in gone.value.message and "no longer serving" in gone.value.message
        # A new conversation still goes to the replica left.
        assert c.responses.create(model=MODEL, input="anew", max_output_tokens=4).id
    finally:
        rt.set_endpoints(rt.all_endpoints)


def test_when_that_replica_refuses_the_connection_no_other_is_tried(served, engines):
    rt, _ = served
    lone = engines(LONE, "resp-lone")
    rt.set_endpoints(rt.all_endpoints + [lone.endpoint()])
    try:
        c = client(rt)
        made = c.responses.create(model=LONE, input="hello", max_output_tokens=4)
        lone.kill()
        with pytest.raises(openai.InternalServerError) as refused:
            c.responses.create(model=LONE, input="on", previous_response_id=made.id)
        assert refused.value.status_code == 502 and refused.value.body["code"] == "response_replica_unreachable"
        assert "resp-lone" in refused.value.message
    finally:
        rt.set_endpoints(rt.all_endpoints)


def test_a_body_parsed_off_the_loop_still_reaches_the_replica_that_stored_its_previous_response(served):
    rt, _ = served
    c = client(rt)
    made = c.responses.with_raw_response.create(model=MODEL, input="short", max_output_tokens=4)
    replica, previous = made.headers["x-llmgw-replica"], made.parse().id
    # Past 50,000 commas: parsed in the router's worker process, which hands back previous_response_id.
    # Each turn's text its own from the first character, so no prefix match steers it.
    for turn in range(5):
        big = c.responses.with_raw_response.create(model=MODEL, input=f"{turn} " + "a, " * 60_000,
                                                   max_output_tokens=4, previous_response_id=previous)
        assert big.headers["x-llmgw-replica"] == replica
        previous = big.parse().id


@pytest.mark.parametrize("path", ["/v1/responses/resp_nope", "/v1/responses/" + "a" * 200,
                                  "/v1/responses/r%C3%A9sp", "/v1/responses/resp_nope/input_items"])
def test_an_unknown_id_is_an_openai_shaped_404(served, path):
    rt, _ = served
    r = requests.get(rt.url + path, headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=10)
    assert r.status_code == 404, r.text
    assert r.json()["error"]["code"] == "response_not_found" and r.headers.get("X-Request-Id")
    assert len(r.json()["error"]["message"]) < 400


def test_without_a_key_the_responses_routes_are_401(served):
    rt, _ = served
    for method, path in (("POST", "/v1/responses"), ("GET", "/v1/responses/resp_x"),
                         ("DELETE", "/v1/responses/resp_x"), ("POST", "/v1/responses/resp_x/cancel")):
        r = requests.request(method, rt.url + path, json={"model": MODEL, "input": "x"}, timeout=10)
        assert r.status_code == 401, (method, path, r.text)


def test_affinity_and_the_responses_usage_show_in_the_routers_metrics(served):
    rt, _ = served
    c = client(rt)
    made = c.responses.create(model=MODEL, input="count me", max_output_tokens=5)
    c.responses.create(model=MODEL, input="and me", max_output_tokens=5, previous_response_id=made.id)
    with pytest.raises(openai.NotFoundError):
        c.responses.retrieve("resp_never")
    from prometheus_client.parser import text_string_to_metric_families
    text = requests.get(rt.url + "/metrics", headers={"Authorization": f"Bearer {KEYS['alice']}"}, timeout=10).text
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert samples[("llmgw_router_response_affinity_total", (("outcome", "routed"),))] >= 1
    assert samples[("llmgw_router_response_affinity_total", (("outcome", "not_found"),))] >= 1
    assert samples[("llmgw_router_responses_kept", ())] >= 2
    # A Responses answer's usage (input_tokens, output_tokens) is metered as a chat's.
    assert samples[("llmgw_router_key_tokens_total", (("direction", "out"), ("key", "alice")))] >= 10
