"""What placement is handed each pass: a Running per record, a NodeView per node, each rebuilt only where it changed.

Placement reads a Running per record and a NodeView per node every pass;
building them all anew was most of a pass at fleet size. Each is kept with
exactly what it was built from -- a record's state and whether its spec is
current, a node's reported pools, GPUs and engines (new objects with every
report that changed), reachability, cordon and drain and the catalog -- and built again
only when one of those differs, so a kept one is the one a rebuild would
give. The lists stay in record and inventory order. Also what the catalog
says a current replica of each profile hashes to, once per catalog.
"""
from __future__ import annotations

from collections.abc import Iterator, Mapping

from ..catalog import Catalog, Model, Profile
from ..catalog.modelrules import LAUNCH_LORA_ENGINES, LAUNCH_LORA_REASON
from ..catalog.multinode import parallelism
from ..contracts import GroupSlot, ReplicaSpec, ReplicaState
from ..inventory import Inventory, Node
from ..placement import NodeView, Running
from .records import Records

_LEAVING = (ReplicaState.DRAINING, ReplicaState.STOPPING)


def stale_adapters(spec: ReplicaSpec, model: Model | None) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """For a replica of an engine that loads adapters only at launch: (the model's adapters it lacks, those it has
    and the model no longer does, or whose source changed); ((), ()) for any other replica, or a current one."""
    if spec.engine not in LAUNCH_LORA_ENGINES or model is None:
        return (), ()
    wanted = {a.name: a.source for a in model.adapters}
    held = {a.name: a.source for a in spec.adapters}
    return (tuple(n for n, source in wanted.items() if held.get(n) != source),
            tuple(n for n, source in held.items() if wanted.get(n) != source))


def replaced_why(spec: ReplicaSpec, model: Model | None) -> str:
    """Why a replica no longer matches its profile, as `catalog apply` shows it."""
    lacks, extra = stale_adapters(spec, model)
    return LAUNCH_LORA_REASON if lacks or extra else "profile changed"


def profile_of(model: Model | None, name: str) -> Profile | None:
    """`model`'s profile called `name`; None if there is no such model or profile."""
    if model is None:
        return None
    return next((p for p in model.profiles if p.name == name), None)


class SpecHashes:
    """(model, profile) -> the spec hash a current replica of it has; computed once per catalog."""

    def __init__(self) -> None:
        self._of: tuple[str | None, Mapping[tuple[str, str], str]] = (None, {})

    def __call__(self, catalog: Catalog) -> Mapping[tuple[str, str], str]:
        if self._of[0] != catalog.version:
            hashes = {(m.name, p.name): ReplicaSpec.for_profile("", m, p, catalog.engines[p.engine],
                                                                group=_shape(p)).spec_hash
                      for m in catalog.models for p in m.profiles}
            self._of = (catalog.version, hashes)
        return self._of[1]


def _shape(profile: Profile) -> GroupSlot | None:
    """A slot with only what the spec hash reads of one (size, parallel), for a profile spanning nodes."""
    split = parallelism(profile)
    if split is None:
        return None
    return GroupSlot(group="-", rank=0, size=profile.nodes, parallel=split, head_host="-", port=1)


class PlacementInput:
    """Placement's kept input, and the nodes placement may not use (`cordoned`)."""

    def __init__(self, records: Records, inventory: Inventory, forgotten: Mapping[str, str], expected: SpecHashes):
        self.records, self.inventory = records, inventory
        # The replicas given up on (Adoption.forgotten), read to tell placement they still hold GPUs.
        self._forgotten = forgotten
        self.expected_hashes = expected
        self.cordoned: set[str] = set()
        # Cordoned nodes being drained: their replicas are leaving for placement
        # while they still serve, so their models get replacements elsewhere (see maintenance).
        self.draining: set[str] = set()
        # Placement's NodeView per node, with what it was built from.
        self._views: dict[str, tuple[tuple[object, ...], NodeView]] = {}

    def build(self, catalog: Catalog) -> tuple[list[Running], list[NodeView]]:
        """(a Running per record and per replica given up on a lost node, a NodeView per node), kept where unchanged."""
        expected = self.expected_hashes(catalog)
        running: list[Running] = []
        draining = self.draining
        for rec in self.records.values():
            current = rec.spec_hash == expected.get((rec.spec.model, rec.spec.profile))
            moving_off = rec.node in draining
            kept = rec.placed_as
            if kept is None or kept[0] is not rec.state or kept[1] != current or kept[2] != moving_off:
                kept = rec.placed_as = (rec.state, current, moving_off, Running(
                    replica_id=rec.spec.id, model=rec.spec.model, profile=rec.spec.profile,
                    node=rec.node, gpu_indices=rec.spec.gpu_indices, current=current,
                    ready=rec.state == ReplicaState.READY, failed=rec.state == ReplicaState.FAILED,
                    # Draining or stopping: still holding its GPUs (or its share of
                    # their memory) until its engine is gone, but no longer counted
                    # toward what the model wants, and its room counts as coming free.
                    # On a draining node: the same, though it still serves until its replacement does.
                    leaving=rec.state in _LEAVING or moving_off,
                    memory_mib=rec.spec.gpu_memory_mib,
                    group=rec.spec.group.group if rec.spec.group is not None else None,
                    rank=rec.spec.group.rank if rec.spec.group is not None else 0))
            running.append(kept[3])
        views = []
        kept_views = self._views
        for node in self.inventory.nodes():
            if not node.reachable:
                running.extend(self.given_up_on(node, expected))
            cpu = node.last_report.cpu if node.last_report is not None else None
            key = (node.pools, node.gpus, node.engines, node.reachable, node.name in self.cordoned, cpu)
            kept_view = kept_views.get(node.name)
            if kept_view is None or kept_view[0] != key:
                kept_view = kept_views[node.name] = (key, NodeView(
                    name=node.name, pools=node.pools,
                    gpus=tuple(g.index for g in node.gpus),
                    memory={g.index: (g.memory_mib, g.free_mib) for g in node.gpus},
                    # Only what the node's agent says it runs: a catalog-defined engine
                    # runs where a node's operator allowed it (llmgwctl agent
                    # --allow-engine), which the agent reports from its start; a node
                    # that does not name it does not run it (placement's reasons say so).
                    engines=node.available_engines,
                    schedulable=node.reachable and node.name not in self.cordoned,
                    unavailable={name: why for name, (ok, why) in node.engines.items() if not ok},
                    cpu_replicas=cpu.max_replicas if cpu is not None else None,
                ))
            views.append(kept_view[1])
        if len(kept_views) > len(self.inventory):
            # A node the inventory forgot; rare, so swept only when the count says so.
            for name in [n for n in kept_views if self.inventory.get(n) is None]:
                del kept_views[name]
        return running, views

    def given_up_on(self, node: Node, expected: Mapping[tuple[str, str], str]) -> Iterator[Running]:
        """The replicas an unreachable node last reported that were given up (`Adoption.lost_nodes`), as lost.

        Their records are gone, so placement places replacements for them; it
        is told they exist (`Running.lost`) so those replacements go only where
        there is room: a model with replicas on a lost node never preempts
        (the node may come back with them), and they hold the node's GPUs,
        which nobody can free. Replicas of a lost node still waiting out
        REPLACE_AFTER keep their records and count as they are (not lost to
        placement): that wait is what spares a flapping node a reshuffle.
        """
        for rid, rep in node.replicas.items():
            if rid in self._forgotten and rid not in self.records:
                yield Running(replica_id=rid, model=rep.model, profile=rep.profile, node=node.name,
                              gpu_indices=rep.gpu_indices, lost=True,
                              current=rep.spec_hash == expected.get((rep.model, rep.profile)),
                              memory_mib=rep.spec.gpu_memory_mib if rep.spec is not None else 0,
                              group=slot.group if (slot := rep.spec.group if rep.spec else None) else None,
                              rank=slot.rank if slot else 0)
