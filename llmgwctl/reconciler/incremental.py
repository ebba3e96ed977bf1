"""The tripwire for what a pass keeps: the test suite's check that each kept thing is what a full walk gives.

A pass looks only at what changed (`Records` notes it) and keeps the rest:
the merges it may skip, the endpoint list, each node's desired list. With
CHECK_INCREMENTAL set (reconciler.core; the suite sets it, and through
LLMGW_CHECK_INCREMENTAL=1 in every serve it starts), `checked` wraps each
pass: before it, the merges the pass would skip must find the records they
kept; after each completed publish, the kept lists must equal a walk of every
record. A difference raises IncrementalMismatch. It wraps the pass and reads
the parts' state; none of the parts knows it is there.
"""
from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator

from ..contracts import ReplicaSpec, ReplicaState
from .adoption import Adoption
from .publishing import Publisher, replica_id
from .records import Records


class IncrementalMismatch(AssertionError):
    """What a pass kept differs from what a walk of every record gives (CHECK_INCREMENTAL): a bug."""


@contextlib.contextmanager
def checked(records: Records, adoption: Adoption, publisher: Publisher) -> Iterator[None]:
    """Around a pass (or anything that publishes): the skipped merges before, the published lists after."""
    check_skipped_merges(records, adoption)
    published = publisher.published
    try:
        yield
    finally:
        # Only a publish that ran to its end left lists to compare (a sink that raised stops it midway).
        if publisher.published != published:
            check_published(records, publisher)


def check_skipped_merges(records: Records, adoption: Adoption) -> None:
    """A node whose merge the next pass skips must still have the records, in the states, it merged."""
    for node, kept in adoption.skippable():
        if kept != [(rec, rec.state) for _, rec in records.of(node)]:
            raise IncrementalMismatch(f"{node}'s records changed unseen; its merge was skipped")


def check_published(records: Records, publisher: Publisher) -> None:
    """The kept desired lists and endpoint list must be the ones a walk of every record gives."""
    walked: dict[str, list[ReplicaSpec]] = collections.defaultdict(list)
    for rec in records.values():
        if rec.state != ReplicaState.STOPPING:
            walked[rec.node].append(rec.spec)
    if {n: tuple(v) for n, v in walked.items()} != publisher.node_specs:
        raise IncrementalMismatch("the kept desired lists differ from the records'")
    assert publisher.basis is not None      # set by every publish
    ranks, reachable = publisher.basis
    whole = sorted((ep for rec in records.values() if (ep := publisher.endpoint_of(rec, ranks, reachable))),
                   key=replica_id)
    if whole != publisher.ordered:
        kept = {e.replica_id for e in publisher.ordered}
        walked_ids = {e.replica_id for e in whole}
        raise IncrementalMismatch(f"kept endpoints differ from every record's: only kept {sorted(kept - walked_ids)[:5]}, "
                                  f"only walked {sorted(walked_ids - kept)[:5]}")
