"""Time GETs from a process of their own: `python3 -m bench.get_times URL [N]`.

N calls (default 50) one after another, each a new connection with a plain
`requests.get`, as `llmgwctl status` asks. One line per call: seconds, HTTP
status, body bytes. `bench/fleet.py` runs it so that what it measures is the
controller's answer, not a wait on the bench's own loop (5,000 simulated
agents' worth).
"""
from __future__ import annotations

import sys
import time

import requests


def main() -> None:
    url = sys.argv[1]
    calls = int(sys.argv[2]) if len(sys.argv) > 2 else 50   # enough for a p90 and a p99 that is not the max alone
    for _ in range(calls):
        t = time.monotonic()
        # 60 s: at 5,000 nodes an answer behind a slow pass is seconds, never this.
        resp = requests.get(url, timeout=60)
        size = len(resp.content)
        print(f"{time.monotonic() - t:.6f} {resp.status_code} {size}", flush=True)


if __name__ == "__main__":
    main()
