"""Observability: Prometheus metrics and log setup, shared by the router and the control plane.

    metrics   the router's metrics (pre-bound children for the hot path, gauges
              read at scrape time) and the control plane's (read from the
              controller's own state at scrape time)
    logs      `setup_logging(verbose, fmt)`: human lines by default, one JSON
              object per line with `--log-format json`

It must not change what it observes: every gauge here is read from state the
router, reconciler or inventory already keep, at scrape time, so a scrape
costs the scraper and a request pays only for its own counters. The router and
the controller import this package, never the other way round.
"""
from .logs import JsonFormatter, setup_logging

__all__ = ["JsonFormatter", "setup_logging"]
