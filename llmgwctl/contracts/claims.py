"""`NodeClaims`: what a node token lets its node claim -- pools, GPUs, an advertised host -- and its serial.

Minted by the operator into the token (`llmgwctl token node NAME --pools
h100 --max-gpus 8`, see control.auth), read back by the control API when a
report arrives, and applied to the report (`bound`) before the inventory
keeps it: a node is then, for placement and adoption, only what its operator
said it may be. A report asking for more keeps what is allowed; what was
dropped is said in the node's status row and in an event, not answered with
an error: a node whose agent carries one label too many keeps serving with
the labels it may hold, instead of going silent and losing its replicas.

`UNBOUNDED` is what the admin token, a control API without tokens (loopback
only: every caller is the operator) and `serve --legacy-node-tokens` give:
the report is taken as it says.
"""
from __future__ import annotations

from dataclasses import dataclass, replace

from .report import AgentReport

# A token minted without --max-gpus: the GPUs of one HGX/DGX board, the most a
# common GPU server carries. A larger machine is minted with its count; a CPU
# node with 0, so its token cannot claim any GPU.
DEFAULT_MAX_GPUS = 8


@dataclass(frozen=True, slots=True)
class NodeClaims:
    """What one node token allows. `pools=None` / `max_gpus=None`: no bound (the operator's own credentials)."""

    pools: frozenset[str] | None = frozenset()
    max_gpus: int | None = DEFAULT_MAX_GPUS
    # The host the node may advertise its engines on instead of the address its
    # reports come from (a node behind NAT, a separate data network); "" when
    # it may not, and its replica URLs must be on the report's source address;
    # None: whatever the report says (the operator's own credentials).
    advertise_host: str | None = ""
    # Which token of the node this is: the revocation list refuses serials
    # below a node's minimum there (control.auth), so a new token replaces a
    # stolen one without rotating the agent secret of the whole fleet.
    serial: int = 0
    # The token is from before claims (`llmgwn.<node>.<mac>`): said in status,
    # so an operator sees which nodes still need a new token.
    legacy: bool = False

    @property
    def unbounded(self) -> bool:
        return self.pools is None and self.max_gpus is None

    def bound(self, report: AgentReport) -> tuple[AgentReport, tuple[str, ...]]:
        """The report with only what may be claimed, and what was dropped (one line each, naming the claim)."""
        refused: list[str] = []
        pools = report.pools
        if self.pools is not None:
            extra = [p for p in pools if p not in self.pools]
            if extra:
                allowed = ", ".join(sorted(self.pools)) or "none"
                refused.extend(f"pool {p!r}: the node's token allows pools {allowed} "
                               f"(llmgwctl token node {report.node} --pools ...)" for p in extra)
                pools = tuple(p for p in pools if p in self.pools)
        gpus = report.gpus
        if self.max_gpus is not None and len(gpus) > self.max_gpus:
            # The lowest indices are kept: GPU 0..N-1 are the ones a node with fewer GPUs has too.
            refused.append(f"{len(gpus) - self.max_gpus} of {len(gpus)} GPUs: the node's token allows "
                           f"{self.max_gpus} (llmgwctl token node {report.node} --max-gpus N)")
            gpus = tuple(sorted(gpus, key=lambda g: g.index)[:self.max_gpus])
        if pools is report.pools and gpus is report.gpus:
            return report, ()
        return replace(report, pools=pools, gpus=gpus), tuple(refused)


UNBOUNDED = NodeClaims(pools=None, max_gpus=None, advertise_host=None)
