"""The fake engine's rerank, score, tokenize and detokenize answers, in vLLM's shapes, without the HTTP.

Scores are the overlap of two texts' words (Jaccard: shared words over all
words, case folded), so a test can tell a relevant document from another
and the order a rerank gives is known in advance. The tokenizer is UTF-8
bytes, one token a byte: `/detokenize` inverts `/tokenize` exactly, which a
word-hashing tokenizer could not. Pure functions of the request; a body
vLLM would refuse raises `BadRequest` naming the field.
"""
from __future__ import annotations

import uuid
from typing import Any

from .fake_replies import BadRequest, count_prompt_tokens

__all__ = ["detokenize", "rerank", "score", "tokenize"]


def _words(text: str) -> set[str]:
    return {w.casefold() for w in text.split()}


def relevance(a: str, b: str) -> float:
    """How alike `a` and `b` are, in [0, 1]: their shared words over all their words."""
    wa, wb = _words(a), _words(b)
    union = wa | wb
    return len(wa & wb) / len(union) if union else 0.0


def _texts(value: Any, field: str) -> list[str]:
    """A string or a non-empty list of strings as a list; BadRequest otherwise."""
    if isinstance(value, str):
        return [value]
    if isinstance(value, list) and value and all(isinstance(x, str) for x in value):
        return value
    raise BadRequest(f"'{field}' must be a string or a non-empty list of strings", field)


def score(body: dict[str, Any], model: str) -> dict[str, Any]:
    """/score and /v1/score: `text_1` against each of `text_2` (one to many), or pairwise (lists of one length)."""
    first, second = _texts(body.get("text_1"), "text_1"), _texts(body.get("text_2"), "text_2")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise BadRequest(f"'text_1' has {len(first)} texts and 'text_2' {len(second)}: give one, or as many",
                         "text_2")
    data = [{"index": i, "object": "score", "score": relevance(a, b)} for i, (a, b) in enumerate(zip(first, second))]
    tokens = sum(count_prompt_tokens(a) + count_prompt_tokens(b) for a, b in zip(first, second))
    return {"id": f"score-{uuid.uuid4().hex}", "object": "list", "model": model, "data": data,
            "usage": {"prompt_tokens": tokens, "total_tokens": tokens, "completion_tokens": 0,
                      "prompt_tokens_details": None}}


def rerank(body: dict[str, Any], model: str) -> dict[str, Any]:
    """/rerank, /v1/rerank, /v2/rerank: `documents` by relevance to `query`, best first; `top_n` of them (0: all)."""
    query = body.get("query")
    if not isinstance(query, str):
        raise BadRequest("'query' must be a string", "query")
    documents = _texts(body.get("documents"), "documents")
    top_n = body.get("top_n", 0)
    if type(top_n) is not int or top_n < 0:
        raise BadRequest("'top_n' must be a whole number, 0 for all", "top_n")
    ranked = sorted(range(len(documents)), key=lambda i: (-relevance(query, documents[i]), i))
    if top_n:
        ranked = ranked[:top_n]
    results = [{"index": i, "document": {"text": documents[i]}, "relevance_score": relevance(query, documents[i])}
               for i in ranked]
    tokens = sum(count_prompt_tokens(query) + count_prompt_tokens(d) for d in documents)
    return {"id": f"rerank-{uuid.uuid4().hex}", "model": model, "usage": {"total_tokens": tokens},
            "results": results}


def _prompt_text(body: dict[str, Any]) -> str:
    """What /tokenize counts: `prompt`, or chat `messages` as role and content lines."""
    if "messages" in body:
        messages = body["messages"]
        if not isinstance(messages, list) or not all(
                isinstance(m, dict) and isinstance(m.get("content", ""), str) for m in messages):
            raise BadRequest("'messages' must be a list of messages with string content", "messages")
        return "".join(f"{m.get('role', '')}\n{m.get('content', '')}\n" for m in messages)
    prompt = body.get("prompt")
    if not isinstance(prompt, str):
        raise BadRequest("'prompt' (or 'messages') must be given, a string", "prompt")
    return prompt


def tokenize(body: dict[str, Any], max_model_len: int) -> dict[str, Any]:
    """/tokenize: the prompt's UTF-8 bytes as token ids, with the model's context length, as vLLM answers."""
    tokens = list(_prompt_text(body).encode())
    strs = [chr(t) if t < 128 else f"<0x{t:02X}>" for t in tokens] if body.get("return_token_strs") else None
    return {"count": len(tokens), "max_model_len": max_model_len, "tokens": tokens, "token_strs": strs}


def detokenize(body: dict[str, Any]) -> dict[str, Any]:
    """/detokenize: the text of `tokens` (ids 0..255, the fake's byte tokens)."""
    tokens = body.get("tokens")
    if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < 256 for t in tokens):
        raise BadRequest("'tokens' must be a list of token ids (0..255 for this engine)", "tokens")
    return {"prompt": bytes(tokens).decode("utf-8", "replace")}
