"""The fake engine's rerank, score and tokenizer answers: vLLM's shapes, deterministic, refusing what vLLM refuses."""
from __future__ import annotations

import pytest

from llmgwctl.engines.fake_replies import BadRequest
from llmgwctl.engines.fake_scoring import detokenize, relevance, rerank, score, tokenize


def test_relevance_is_the_share_of_words_two_texts_share():
    assert relevance("A cat", "a CAT") == 1.0
    assert relevance("a cat", "a dog") == pytest.approx(1 / 3)
    assert relevance("", "") == 0.0 and relevance("x", "y") == 0.0


def test_rerank_orders_documents_best_first_in_vllms_shape():
    out = rerank({"query": "cat", "documents": ["dog", "cat", "a cat"], "top_n": 2}, "m")
    assert set(out) == {"id", "model", "usage", "results"} and out["model"] == "m"
    assert [r["index"] for r in out["results"]] == [1, 2]
    assert out["results"][0] == {"index": 1, "document": {"text": "cat"}, "relevance_score": 1.0}
    assert out["usage"]["total_tokens"] == 3 + 1 + 1 + 2
    assert len(rerank({"query": "cat", "documents": ["a", "b", "c"]}, "m")["results"]) == 3    # top_n 0: all


def test_score_one_to_many_and_pairwise():
    data = score({"text_1": "a cat", "text_2": ["a cat", "a dog"]}, "m")["data"]
    assert [d["index"] for d in data] == [0, 1] and data[0] == {"index": 0, "object": "score", "score": 1.0}
    pairs = score({"text_1": ["x", "y"], "text_2": ["x", "z"]}, "m")["data"]
    assert [d["score"] for d in pairs] == [1.0, 0.0]


def test_tokenize_is_utf8_bytes_and_detokenize_inverts_it():
    out = tokenize({"prompt": "héllo"}, 4096)
    assert out == {"count": 6, "max_model_len": 4096, "tokens": list("héllo".encode()), "token_strs": None}
    assert detokenize({"tokens": out["tokens"]}) == {"prompt": "héllo"}
    chat = tokenize({"messages": [{"role": "user", "content": "hi"}], "return_token_strs": True}, 8)
    assert chat["tokens"] == list(b"user\nhi\n") and chat["token_strs"][:4] == ["u", "s", "e", "r"]


@pytest.mark.parametrize("call, param", [
    (lambda: rerank({"documents": ["a"]}, "m"), "query"),
    (lambda: rerank({"query": "a", "documents": "a b"}, "m") and rerank({"query": "a", "documents": []}, "m"),
     "documents"),
    (lambda: rerank({"query": "a", "documents": ["a"], "top_n": -1}, "m"), "top_n"),
    (lambda: score({"text_1": ["a", "b"], "text_2": ["a", "b", "c"]}, "m"), "text_2"),
    (lambda: score({"text_1": 3, "text_2": "a"}, "m"), "text_1"),
    (lambda: tokenize({}, 1), "prompt"),
    (lambda: tokenize({"messages": "hi"}, 1), "messages"),
    (lambda: detokenize({"tokens": [256]}), "tokens"),
    (lambda: detokenize({"tokens": "ab"}), "tokens"),
])
def test_a_body_vllm_would_refuse_names_its_field(call, param):
    with pytest.raises(BadRequest) as err:
        call()
    assert err.value.param == param
