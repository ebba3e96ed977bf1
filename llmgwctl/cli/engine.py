"""`llmgwctl engine ...`: the built-in fake engine, and which engines this node can run."""
from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable, Mapping
from typing import Any, TypeVar

import click

from ..engines.fake_config import FakeConfig
from .output import dump, echo, output_option, visible

_F = TypeVar("_F", bound=Callable[..., Any])


@click.group("engine")
def command() -> None:
    """Inference engines: run the built-in fake one, list what this node can run."""


# Each option is named as the FakeConfig field it sets, and a knob shows that
# field's default: one list (the decorators below) and one default per knob,
# not options, parameters and fields that must agree.
_DEFAULTS: Mapping[str, Any] = {f.name: f.default for f in dataclasses.fields(FakeConfig)}
_SECONDS = click.FloatRange(min=0)


def _knob(flag: str, kind: click.ParamType[Any], help_: str) -> Callable[[_F], _F]:
    """`--flag` of type `kind`, defaulting to (and showing) the default of FakeConfig's field of that name."""
    return click.option(flag, type=kind, default=_DEFAULTS[flag[2:].replace("-", "_")], show_default=True,
                        help=help_)


@command.command("fake")
@click.option("--model", required=True, help="The model name to serve (requests naming another get 404).")
@click.option("--port", type=click.IntRange(0, 65535), default=None,
              help="Port to listen on; 0 picks a free one (printed on the first stdout line). "
                   "Required but for a group's worker (--rank 1 or more), which serves nothing.")
@_knob("--host", click.STRING, "Address to bind.")
@click.option("--replica-id", default="", help="Shown in every reply, to tell replicas apart. [default: the port]")
@_knob("--startup-delay", _SECONDS, "Seconds /health answers 503 (as while a real engine loads weights).")
@_knob("--tokens-per-second", _SECONDS, "Stream pacing per request; 0 = as fast as possible.")
@_knob("--ttft", _SECONDS, "Seconds before the first token, once a slot is free.")
@_knob("--max-num-seqs", click.IntRange(min=1), "Requests generated at once; more wait and count as waiting.")
@_knob("--fail-rate", click.FloatRange(0, 1),
       "Share of requests answered 500, spread evenly by a request counter (reproducible).")
@_knob("--default-max-tokens", click.IntRange(min=0),
       "Reply length when a request sets no max_tokens (finish_reason stop).")
@_knob("--embedding-dim", click.IntRange(min=1), "Length of the deterministic embedding vectors.")
@_knob("--max-model-len", click.IntRange(min=1),
       "The context length /v1/models and /tokenize report, as vLLM's max_model_len.")
@click.option("--crash-after", type=_SECONDS, default=None, metavar="SECONDS",
              help="Print a CUDA out-of-memory error and exit this long after starting (as a real engine that "
                   "runs out of GPU memory does).")
@_knob("--crash-code", click.IntRange(1, 255), "The exit code of --crash-after.")
@click.option("--log-requests", is_flag=True,
              help="One line per request on stdout, like vLLM's access log, and one on stderr with its X-Request-Id, "
                   "traceparent and tracestate; echo X-Request-Id.")
# -- behaving like an engine under load: a prefix cache and a cost model (all off by default) --
@_knob("--prefix-cache-tokens", click.IntRange(min=0),
       "Tokens the LRU prefix cache holds (the KV cache's size); 0 = no cache.")
@_knob("--block-size", click.IntRange(min=1),
       "Tokens per cached block, as vLLM's --block-size; only full blocks are cached.")
@_knob("--prefill-time-per-token", _SECONDS, "Seconds per uncached prompt token; prefills run one at a time.")
@_knob("--decode-time-per-token", _SECONDS,
       "Seconds per generated token for a batch of one; replaces --tokens-per-second when set.")
@_knob("--batch-slowdown", _SECONDS,
       "Share of a decode step each further running request adds (0.1: a batch of 11 is half speed).")
# -- end of the cache and cost model options --
@_knob("--max-loras", click.IntRange(min=0), "LoRA adapter slots, as vLLM's --max-loras; 0 = LoRA off.")
@_knob("--max-adapters", click.IntRange(min=0), "Adapters it may hold loaded at once; 0 = no bound.")
@_knob("--lora-swap-time", _SECONDS, "Seconds an adapter not in a slot takes to swap in.")
# -- a member of a replica spanning nodes (see engines/fake_group.py) --
@click.option("--group", default="", help="The group's id (its head's replica id): what a worker's join names.")
@_knob("--group-size", click.IntRange(min=0), "Members in the group, the head included; 0 = not a member.")
@_knob("--rank", click.IntRange(min=0),
       "0: the head, which serves once every worker joined; 1 or more: a worker, which serves nothing.")
@click.option("--rendezvous", default="", metavar="HOST:PORT",
              help="The head's rendezvous: the head listens on PORT at --host, workers connect to it.")
@_knob("--join-timeout", _SECONDS, "Seconds a member waits for its group to form before it exits.")
# -- misbehaving on purpose, for tests and benches of what the router bounds (see engines/fake_faults.py) --
@click.option("--fault", type=click.Choice(("huge-length", "endless-body", "endless-headers", "growing-header",
                                            "no-headers", "redirect", "unavailable", "reset", "cut-headers")),
              default=None,
              help="Answer every POST under /v1/ as a hostile engine would: a 10 GB Content-Length, a body "
                   "without end, headers without end, a header growing without end, no answer, or a 302; or "
                   "as a failing one: 503, a reset connection, half a head then a close.")
@click.option("--metrics-fault", type=click.Choice(("many-series", "huge-page", "redirect")), default=None,
              help="Serve /metrics with 1,000,000 extra series, 100 MB of padding, or a 302.")
@click.option("--redirect-to", default="", metavar="URL", help="Where the redirect faults send.")
def fake(**options: Any) -> None:
    """Serve a fake vLLM: OpenAI routes, /health, /metrics, no GPU."""
    from ..engines.fake_server import run

    member = options["group_size"] > 0
    if member and not (options["group"] and options["rendezvous"] and options["rank"] < options["group_size"]):
        raise click.UsageError("a group's member (--group-size) needs --group, --rendezvous HOST:PORT "
                               "and a --rank below --group-size")
    if member:
        from ..engines.fake_group import parse_address
        try:
            parse_address(options["rendezvous"])
        except ValueError as exc:
            raise click.BadParameter(str(exc), param_hint="--rendezvous") from None
    if options["port"] is None and not (member and options["rank"] > 0):
        raise click.UsageError("--port is required (only a group's worker, --rank 1 or more, serves nothing)")
    if options["port"] is None:
        options["port"] = 0
    config = FakeConfig(**options)
    model, host, port = config.model, config.host, config.port

    def announce(bound: int) -> None:
        # One line a parent process can read to learn the port when it asked for 0.
        print(f"fake engine serving {model} on http://{host}:{bound}", flush=True)

    try:
        run(config, announce)
    except OSError as exc:
        raise click.ClickException(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None


@command.command("list")
@output_option
def list_(fmt: str) -> None:
    """Which built-in engines this node can run, and how to fix the ones it can't."""
    from ..engines import available_engines

    found = available_engines()
    if fmt != "table":
        click.echo(dump({name: {"available": ok, "reason": why} for name, (ok, why) in found.items()}, fmt))
        return
    width = max(len(n) for n in found)
    for name, (ok, why) in found.items():
        echo(f"{name:<{width}}  {'yes' if ok else 'no ':<3}  {visible(why)}")
    sys.stdout.flush()
