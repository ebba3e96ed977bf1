"""Control: wires the pieces into a control plane, and serves its API.

Owns no decision of its own. `controller.Controller` connects the catalog and
its watcher, the inventory, the reconciler and (in `serve`) the in-process
router, and spells out the order where it crosses pieces (a new catalog
reaches the router before replicas move). Around it: the control API
(`api`: status, catalog apply, the agent service, watch streams for
standalone routers, metrics), its bearer-token checks (`auth`), the usage
board merging every router's usage (`usage`), `catalog apply`'s validate and
write (`apply`), and `serve` (controller + router + API + local agent in one
process). Each decision lives in the piece that owns it; nothing below
control imports it.

Deliberately imports nothing here: `llmgwctl.control.auth` is read by the CLI
without loading aiohttp, the reconciler or the router.
"""
