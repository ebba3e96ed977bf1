"""The control plane's exception root; each error is defined beside the code that raises it.

    ControlError                 the root: the control plane cannot do what was asked as asked
     ├ TokenError (auth)         a token file that cannot be used, or a bind beyond loopback without a token
     ├ ServeError (serve)        `serve` cannot start as configured (an address it cannot listen on)
     └ ApplyError (apply)        a catalog apply request that is wrong in itself (file name, empty body);
                                 an invalid catalog is the catalog's own CatalogError

A malformed agent report or usage report is a contract's error
(`llmgwctl.contracts.ReportError`, `UsageError`), answered with a 400.
"""
from __future__ import annotations


class ControlError(Exception):
    """Base of the control plane's exceptions; the message says what to change."""
