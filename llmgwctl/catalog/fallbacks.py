"""Fallback models: the rules a model's `fallbacks` list must keep, and the chain it makes.

A model may name other models of the catalog, by name or alias, that answer
its requests when it has no replica that can (the router decides when, see
llmgwctl.router.fallback). A fallback's own fallbacks follow it, so the lists
make a graph, and the rules are about that graph, which no JSON Schema can
state:

- every name resolves to a model of the catalog (an unknown name is a typo
  that would only show the day the model fails);
- a model does not name itself, under its name or an alias;
- no model is listed twice in one list (under two of its names, say);
- no cycle (a -> b -> a): a chain must end, or the router would hand a request
  round in circles; and an operator who wrote one meant something else.

`check_fallbacks` runs inside `Catalog`'s constructor, so an invalid list
cannot be in force: `catalog validate` and a live reload both refuse it, with
the file and line of the entry at fault. `chains` turns a valid catalog's
lists into each model's whole chain, as the router tries it.

It imports nothing of ours at run time but the error type: `model` imports it.
"""
from __future__ import annotations

import functools
from collections.abc import Iterable, Iterator, Mapping
from types import MappingProxyType
from typing import TYPE_CHECKING

from .errors import Problem

if TYPE_CHECKING:
    from .model import Catalog, Model

__all__ = ["MAX_CHAIN", "chains", "check_fallbacks"]

# The most models one request may be offered to, its own fallbacks' fallbacks
# included. Each costs the router one look at the balancer per request that
# falls back; 16 is twice the longest list one model may write (the schema's
# 8), far past any chain an operator means ("the 70B, else the 8B, else the
# small one on CPU").
MAX_CHAIN = 16


def check_fallbacks(models: Iterable[Model], index: Mapping[str, Model]) -> Iterator[Problem]:
    """What is wrong with the models' fallbacks, each at the entry at fault; `index` resolves names and aliases.

    A name `index` does not hold is unknown (a broken model's stand-in
    names never match one written in a file).
    """
    models = tuple(models)
    edges: dict[str, list[tuple[int, Model]]] = {}
    for model in models:
        file, base = model.origin.file, model.origin.path
        seen: dict[str, int] = {}
        out: list[tuple[int, Model]] = []
        for i, name in enumerate(model.fallbacks):
            target = index.get(name)
            if target is None:
                yield Problem(file, base + ("fallbacks", i),
                              f"{name!r} is not a model or alias of the catalog; a fallback names another model")
                continue
            if target is model:
                how = "" if name == model.name else f" (an alias of {model.name!r})"
                yield Problem(file, base + ("fallbacks", i),
                              f"{name!r}{how} is this model itself; a model cannot fall back to itself")
                continue
            if target.name in seen:
                yield Problem(file, base + ("fallbacks", i),
                              f"{name!r} is model {target.name!r}, already listed at fallbacks[{seen[target.name]}]")
                continue
            seen[target.name] = i
            out.append((i, target))
        edges[model.name] = out
    yield from _cycles(models, edges)


def _cycles(models: tuple[Model, ...], edges: Mapping[str, list[tuple[int, Model]]]) -> Iterator[Problem]:
    """Each cycle once, at the entry that closes it, naming the whole loop.

    Depth-first and iterative (a catalog of thousands of models chained one
    to the next must not hit the interpreter's recursion limit): an edge to a
    model still on the path closes a cycle.
    """
    done: set[str] = set()
    for root in models:
        if root.name in done:
            continue
        path: list[Model] = [root]
        on_path: dict[str, int] = {root.name: 0}
        stack: list[Iterator[tuple[int, Model]]] = [iter(edges.get(root.name, ()))]
        while stack:
            step = next(stack[-1], None)
            if step is None:
                stack.pop()
                left = path.pop()
                del on_path[left.name]
                done.add(left.name)
                continue
            i, target = step
            here = path[-1]
            if target.name in on_path:
                loop = [m.name for m in path[on_path[target.name]:]] + [target.name]
                yield Problem(here.origin.file, here.origin.path + ("fallbacks", i),
                              f"{here.fallbacks[i]!r} makes a cycle of fallbacks: {_spelled(loop)}; "
                              "a chain of fallbacks must end")
                continue
            if target.name in done:
                continue
            on_path[target.name] = len(path)
            path.append(target)
            stack.append(iter(edges.get(target.name, ())))


def _spelled(loop: list[str]) -> str:
    """A cycle as `a -> b -> a`; a long one by its ends, so the reason fits a problem's one line."""
    if len(loop) <= 8:
        return " -> ".join(loop)
    return " -> ".join(loop[:3] + [f"... ({len(loop) - 6} more)"] + loop[-3:])


# A few catalogs: the one in force and the one replacing it. The router's view
# and every status read ask for the same catalog's chains; a Catalog hashes by
# its version, and the one in force is found by identity before any compare.
@functools.lru_cache(maxsize=4)
def chains(catalog: Catalog) -> Mapping[str, tuple[str, ...]]:
    """{model name: the canonical names its requests may fall back to, in the order tried} for models with fallbacks.

    A fallback's own fallbacks come right after it (depth first), each model
    once, the model itself never, at most MAX_CHAIN. The catalog is valid,
    so every name resolves and nothing loops.
    """
    out: dict[str, tuple[str, ...]] = {}
    for model in catalog.models:
        if not model.fallbacks:
            continue
        chain: list[str] = []
        seen = {model.name}
        # An explicit stack of the lists still to walk, the first fallback first.
        stack: list[Iterator[str]] = [iter(model.fallbacks)]
        while stack and len(chain) < MAX_CHAIN:
            name = next(stack[-1], None)
            if name is None:
                stack.pop()
                continue
            target = catalog.resolve(name)
            if target is None or target.name in seen:
                continue
            seen.add(target.name)
            chain.append(target.name)
            stack.append(iter(target.fallbacks))
        out[model.name] = tuple(chain)
    return MappingProxyType(out)
