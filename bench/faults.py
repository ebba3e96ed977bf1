"""Steady load on 4 fake replicas while, in turn, one is SIGKILLed, one SIGSTOPped, one made to answer 503, a node drained.

    python3 -m bench.faults [--phase-seconds 10] [--stop-seconds 30] [--workers 2] [--keep DIR]

A real fleet on 127.0.0.1 (tests/e2e/fleet.py): `llmgwctl serve` without a
local agent, two agents (nodes n1, n2) and fake engines they launch, every
one a process of its own. Two models of two replicas each, spread one of
each per node: `talk` with stream continuation on (`continuation: true`) and
`plain` with it off, so the same fault meets both. Their fakes stream at 40
tokens/s; each request asks for 16 tokens (0.4 s), streamed or whole.

Three kinds of client run all along, `--workers` threads each, every
outcome kept (a stream counts as good only if it ended with `data: [DONE]`
and no error event):

    whole    non-stream chat completions, to talk and plain in turn
    on       streams to talk (continuation on)
    off      streams to plain (continuation off)

Phases, each `--phase-seconds` unless said:

    quiet    nothing breaks: the baseline for p99
    kill     SIGKILL one replica of each model (its agent restarts it)
    stop     SIGSTOP one replica of talk for --stop-seconds, then SIGCONT
    503      SIGUSR1 one replica of each model (the fake answers 503 until the next SIGUSR1)
    drain    `llmgwctl drain NODE --wait` (the node with most replicas): replacements elsewhere first, then its
             replicas stop

For each it prints the client-visible errors of each kind, how many answers
took more than one attempt (`x-llmgw-attempts`), and p99 latency (whole
answers; streams to their end) against the quiet run's. For `kill`, the off
streams cut must be exactly those that were running on the killed replica
of plain; for `stop`, the seconds until status shows the wedged replica out
of routing and until the last request was sent to it.
"""
from __future__ import annotations

import argparse
import itertools
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import requests

from tests.e2e.fleet import Fleet, wait_until

CATALOG = """\
apiVersion: llmgw/v1
kind: Catalog
models:
  - name: talk
    replicas: 2
    continuation: true
    profiles: [{name: cpu, engine: fake, gpus: 0, args: [--tokens-per-second, '40']}]
  - name: plain
    replicas: 2
    profiles: [{name: cpu, engine: fake, gpus: 0, args: [--tokens-per-second, '40']}]
"""
TOKENS = 16
# Past the longest wedge a phase makes: a request on a stopped engine waits for SIGCONT, it does not fail.
CLIENT_TIMEOUT = 120.0
KINDS = ("whole", "on", "off")


@dataclass(frozen=True, slots=True)
class Outcome:
    kind: str
    model: str
    started: float
    ended: float
    ok: bool
    detail: str
    replica: str
    attempts: int

    @property
    def seconds(self) -> float:
        return self.ended - self.started


def ask(session: requests.Session, url: str, kind: str, model: str) -> Outcome:
    stream = kind != "whole"
    body = {"model": model, "stream": stream, "max_tokens": TOKENS, "ignore_eos": True,
            "messages": [{"role": "user", "content": "steady as she goes"}]}
    started = time.monotonic()
    replica, attempts = "", 0
    try:
        with session.post(url + "/v1/chat/completions", json=body, stream=stream, timeout=CLIENT_TIMEOUT) as resp:
            data = b"".join(resp.iter_content(None))
            replica = resp.headers.get("x-llmgw-replica", "")
            attempts = int(resp.headers.get("x-llmgw-attempts", "0") or 0)
            if resp.status_code != 200:
                return Outcome(kind, model, started, time.monotonic(), False, f"{resp.status_code}: {data[:200]!r}",
                               replica, attempts)
            if stream and (not data.rstrip().endswith(b"data: [DONE]") or b'"error"' in data):
                return Outcome(kind, model, started, time.monotonic(), False, f"cut: {data[-160:]!r}", replica,
                               attempts)
            if not stream and not json.loads(data)["choices"][0]["message"]["content"]:
                return Outcome(kind, model, started, time.monotonic(), False, "empty", replica, attempts)
    except (requests.RequestException, ValueError, KeyError) as exc:
        return Outcome(kind, model, started, time.monotonic(), False, f"{type(exc).__name__}: {exc}", replica,
                       attempts)
    return Outcome(kind, model, started, time.monotonic(), True, "", replica, attempts)


class Load:
    """`workers` threads per kind, each asking in a loop until `stop()`."""

    def __init__(self, url: str, workers: int):
        self.url = url
        self.outcomes: list[Outcome] = []
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._threads = [threading.Thread(target=self._work, args=(kind, i), daemon=True)
                         for kind in KINDS for i in range(workers)]

    def start(self) -> None:
        for t in self._threads:
            t.start()

    def _work(self, kind: str, index: int) -> None:
        models = itertools.cycle(("talk", "plain") if index % 2 == 0 else ("plain", "talk")) if kind == "whole" \
            else itertools.repeat("talk" if kind == "on" else "plain")
        with requests.Session() as session:
            while not self._stop.is_set():
                outcome = ask(session, self.url, kind, next(models))
                with self._lock:
                    self.outcomes.append(outcome)

    def stop(self) -> None:
        self._stop.set()
        for t in self._threads:
            t.join(CLIENT_TIMEOUT + 10)

    def between(self, t0: float, t1: float) -> list[Outcome]:
        """The requests that started in [t0, t1)."""
        with self._lock:
            return [o for o in self.outcomes if t0 <= o.started < t1]

    def ended(self, t0: float, t1: float) -> list[Outcome]:
        """The requests that ended in [t0, t1): how a phase is judged, so a stream cut by a fault counts in the
        fault's phase though it started before it, and one held by a wedged engine counts when it is let go."""
        with self._lock:
            return [o for o in self.outcomes if t0 <= o.ended < t1]


def p99(values: list[float]) -> float:
    if not values:
        return float("nan")
    values = sorted(values)
    return values[min(len(values) - 1, int(0.99 * len(values)))]


@dataclass
class Phase:
    name: str
    t0: float
    t1: float
    note: str = ""


class Bench:
    def __init__(self, root: Path, args: argparse.Namespace):
        self.args = args
        self.fleet = Fleet(root)
        self.load: Load | None = None
        self.phases: list[Phase] = []

    # -- the fleet -------------------------------------------------------------------------------------

    def start(self) -> None:
        fleet = self.fleet
        (fleet.catalogs / "models.yaml").write_text(CATALOG)
        fleet.start_controller()
        fleet.start_agent("n1", "none")
        fleet.start_agent("n2", "none")
        self.settled("the four replicas ready")

    def settled(self, what: str) -> None:
        """Two ready replicas of each model, every one answering, nothing else starting or stopping."""
        def ok() -> bool:
            reps = self.fleet.replicas()
            ready = [r for r in reps if r["state"] == "ready" and not r.get("router")]
            return len(reps) == 4 and len(ready) == 4 and {r["model"] for r in ready} == {"talk", "plain"} \
                and all(sum(r["model"] == m for r in ready) == 2 for m in ("talk", "plain"))
        wait_until(ok, what, timeout=120, every=0.25)

    def replica(self, model: str, node: str | None = None) -> dict[str, Any]:
        reps = [r for r in self.fleet.ready(model) if node is None or r["node"] == node]
        return sorted(reps, key=lambda r: r["node"])[0]

    def llmgwctl(self, *args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "llmgwctl", *args, "--controller", self.fleet.control],
                              capture_output=True, text=True, timeout=180, env=self.fleet.environ)

    # -- phases ----------------------------------------------------------------------------------------

    def phase(self, name: str, seconds: float) -> Phase:
        t0 = time.monotonic()
        time.sleep(seconds)
        phase = Phase(name, t0, time.monotonic())
        self.phases.append(phase)
        return phase

    def run(self) -> None:
        a = self.args
        self.load = Load(self.fleet.router, a.workers)
        self.load.start()
        time.sleep(2)       # connections open, the first requests in
        self.phase("quiet", a.phase_seconds)
        self.kill()
        self.settled("the killed replicas restarted and ready")
        self.stop_one()
        self.settled("the stopped replica back in routing")
        self.unavailable()
        self.settled("the 503 replicas back in routing")
        self.drain()
        time.sleep(1)
        self.load.stop()

    def kill(self) -> None:
        victims = {m: self.replica(m) for m in ("talk", "plain")}
        t0 = time.monotonic()
        for v in victims.values():
            os.kill(v["pid"], signal.SIGKILL)
        killed_at = time.monotonic()
        time.sleep(self.args.phase_seconds)
        phase = Phase("kill", t0, time.monotonic())
        self.phases.append(phase)
        assert self.load is not None
        # The off streams running on plain's victim when it died: those the kill may cut, and no other.
        off = [o for o in self.load.ended(t0, phase.t1) if o.kind == "off"]
        running = {id(o) for o in off if o.replica == victims["plain"]["id"] and o.started <= killed_at}
        cut = {id(o) for o in off if not o.ok}
        on = [o for o in self.load.ended(t0, phase.t1) if o.kind == "on"]
        continued = [o for o in on if o.replica == victims["talk"]["id"] and o.started <= killed_at]
        phase.note = (f"off streams running on the killed {victims['plain']['id']}: {len(running)}, cut: {len(cut)}, "
                      f"cut and running there: {len(cut & running)}; on streams running on the killed "
                      f"{victims['talk']['id']}: {len(continued)}, completed: {sum(o.ok for o in continued)}")

    def stop_one(self) -> None:
        victim = self.replica("talk")
        rid = victim["id"]
        t0 = time.monotonic()
        os.kill(victim["pid"], signal.SIGSTOP)
        out_after = None
        try:
            while time.monotonic() - t0 < self.args.stop_seconds:
                if out_after is None:
                    try:
                        row = next(r for r in self.fleet.replicas("talk") if r["id"] == rid)
                    except (requests.RequestException, StopIteration):
                        row = None
                    if row is not None and ((row.get("router") and "no answer" in row["router"])
                                            or row["state"] != "ready"):
                        out_after = time.monotonic() - t0
                time.sleep(0.1)
        finally:
            os.kill(victim["pid"], signal.SIGCONT)
        phase = Phase("stop", t0, time.monotonic())
        self.phases.append(phase)
        assert self.load is not None
        time.sleep(2)       # the requests held by the wedged engine finish after SIGCONT
        sent_to_it = [o.started - t0 for o in self.load.between(t0, phase.t1) if o.replica == rid]
        last = max(sent_to_it) if sent_to_it else None
        phase.note = (f"{rid} out of routing (status) {out_after:.1f} s after SIGSTOP" if out_after is not None
                      else f"{rid} never shown out of routing") + \
            (f"; last request sent to it {last:.1f} s after SIGSTOP ({len(sent_to_it)} in all)" if last is not None
             else "; no request sent to it after SIGSTOP")

    def unavailable(self) -> None:
        victims = [self.replica(m) for m in ("talk", "plain")]
        t0 = time.monotonic()
        for v in victims:
            os.kill(v["pid"], signal.SIGUSR1)
        try:
            time.sleep(self.args.phase_seconds)
        finally:
            for v in victims:
                os.kill(v["pid"], signal.SIGUSR1)
        phase = Phase("503", t0, time.monotonic())
        self.phases.append(phase)
        phase.note = "answering 503: " + ", ".join(v["id"] for v in victims)

    def drain(self) -> None:
        # The node with the most replicas (the placement spreads, but need not split them evenly).
        nodes = [r["node"] for r in self.fleet.replicas() if r["state"] == "ready"]
        node = max(sorted(set(nodes)), key=nodes.count)
        t0 = time.monotonic()
        out = self.llmgwctl("drain", node, "--wait", "--timeout", "120")
        took = time.monotonic() - t0
        rest = max(0.0, self.args.phase_seconds - took)
        time.sleep(rest)
        phase = Phase("drain", t0, time.monotonic())
        self.phases.append(phase)
        where = sorted(r["node"] for r in self.fleet.replicas() if r["state"] == "ready")
        phase.note = (f"drain {node} ({nodes.count(node)} replicas): exit {out.returncode} in {took:.1f} s ({out.stdout.strip().splitlines()[-1:]}); "
                      f"ready replicas on {where}")

    # -- the report ------------------------------------------------------------------------------------

    def report(self) -> str:
        assert self.load is not None
        # Each phase runs until the next begins (the recovery after a fault is the fault's), the last to the end.
        ends = [p.t0 for p in self.phases[1:]] + [float("inf")]
        base = self.load.ended(self.phases[0].t0, ends[0])
        base_whole = p99([o.seconds for o in base if o.kind == "whole"])
        base_stream = p99([o.seconds for o in base if o.kind != "whole"])
        lines = ["| phase | requests | errors whole | errors on | errors off | retried (attempts > 1) | "
                 "p99 whole | p99 stream | note |",
                 "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        failures: list[str] = []
        for p, end in zip(self.phases, ends):
            got = self.load.ended(p.t0, end)
            errs = {k: [o for o in got if o.kind == k and not o.ok] for k in KINDS}
            for k, bad in errs.items():
                failures += [f"{p.name} {k} {o.model} {o.replica}: {o.detail}" for o in bad[:5]]
            whole = p99([o.seconds for o in got if o.kind == "whole"])
            stream = p99([o.seconds for o in got if o.kind != "whole"])
            retried = sum(1 for o in got if o.attempts > 1)
            lines.append(f"| {p.name} | {len(got)} | {len(errs['whole'])} | {len(errs['on'])} | {len(errs['off'])} | "
                         f"{retried} | {whole * 1e3:.0f} ms ({whole / base_whole:.2f}x) | "
                         f"{stream * 1e3:.0f} ms ({stream / base_stream:.2f}x) | {p.note} |")
        if failures:
            lines += ["", "errors (at most 5 a kind and phase):", *failures]
        return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--phase-seconds", type=float, default=10.0)
    parser.add_argument("--stop-seconds", type=float, default=30.0, help="How long the wedged replica stays stopped.")
    parser.add_argument("--workers", type=int, default=2, help="Client threads per kind (whole, on, off).")
    parser.add_argument("--keep", metavar="DIR", help="Run the fleet under DIR and keep its logs.")
    args = parser.parse_args()
    root = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="llmgw-bench-faults-"))
    bench = Bench(root, args)
    try:
        bench.start()
        bench.run()
        print(bench.report(), flush=True)
    finally:
        if bench.load is not None:
            bench.load.stop()
        bench.fleet.close()
        if not args.keep:
            shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
