"""`RoutableLoads`: the routable workers of each pool in load order, kept current as things change.

A routing decision must not grow with the fleet. Listing the healthy prefill workers and their loads
for every request does (and asking the membership for each of them, a scan of its own, made that
quadratic), so the router keeps them instead, in two `LoadBook`s that change one worker at a time:
- `prefill`: each serving, healthy prefill worker with this router's own counts (`RouteLedger`),
  updated when the ledger books, sees a first token or releases;
- `decode`: each serving, healthy decode instance keyed by the streams this router has on it
  (`WorkerLoad(id, streams, 0)`, so the book's least is the fewest streams, then the smallest id),
  updated when the cluster client starts or ends a request there;
- both follow membership (a worker joins, restarts, drains or leaves: only the members that changed
  are refiled) and the monitor (a worker found dead leaves its book at once).
Routing hands `prefill` to the policy as it is (policies take a LoadBook for a list) and takes the
decode book's least, so neither walks the pool. Owned by the router's event loop, as the books are.

With an in-process index the prefill book shares the index's worker slots (`holder_slots`), so
`cache_aware` meets holders and ties with masks (docs/architecture.md#routing-and-admission). A member
that leaves lets go of its slot here at once and in the index when the feeder drops its entries; the
registry (`CountedSlots`) reuses the slot only after both, so a worker joining later never inherits a
departed one's blocks or load. A Redis index has no slots: the book keeps no masks and the policy walks.
"""

from __future__ import annotations

from cluster.client import ClusterClient
from cluster.cluster_view import ClusterView
from common.membership import SERVING, Member, Membership, membership_delta
from policies.routing import LoadBook, WorkerLoad
from prefix_index.worker_slots import WorkerSlots
from router.ledger import RouteLedger
from router.worker_monitor import WorkerMonitor


class RoutableLoads:
    def __init__(
        self,
        view: ClusterView,
        monitor: WorkerMonitor,
        ledger: RouteLedger,
        client: ClusterClient,
        slots: WorkerSlots | None = None,
    ):
        """`slots`: the routing policy's holder slots (its in-process index's), shared by the prefill book."""
        self.view, self.monitor, self.ledger, self.client = view, monitor, ledger, client
        self.slots = slots
        self.prefill = LoadBook(slots=slots)
        self.decode = LoadBook()
        self._members: dict[str, Member] = {}  # every member of the current membership, by id
        self._file_all(view.membership)
        view.listeners.append(self._on_membership)
        monitor.dead_listeners.append(self._on_dead)
        ledger.listeners.append(self._on_prefill_load)
        client.decode_load_listeners.append(self._on_decode_load)

    def member(self, worker_id: str) -> Member | None:
        return self._members.get(worker_id)

    def least_loaded_decode(self) -> Member:
        """The decode instance with the fewest of this router's streams (ties: the smallest id)."""
        return self._members[self.decode.least().worker_id]

    # ---- listeners --------------------------------------------------------------------------------
    def _on_membership(self, old: Membership, new: Membership) -> None:
        if old.cluster_id != new.cluster_id:
            self._file_all(new)
            return
        delta = membership_delta(old, new)
        for worker_id in delta.removed:
            self._members.pop(worker_id, None)
            self.prefill.remove(worker_id)
            self.decode.remove(worker_id)
        for member in delta.upserts:
            self._members[member.worker_id] = member
            self._file(member)

    def _on_dead(self, worker_id: str, epoch: int) -> None:
        member = self._members.get(worker_id)
        if member is not None and member.epoch == epoch:
            self._file(member)

    def _on_prefill_load(self, worker_id: str) -> None:
        if self.prefill.has(worker_id):
            self.prefill.set(self.ledger.prefill_load(worker_id))

    def _on_decode_load(self, worker_id: str) -> None:
        if self.decode.has(worker_id):
            self.decode.set(self._decode_load(worker_id))

    # ---- filing -----------------------------------------------------------------------------------
    def _file_all(self, membership: Membership) -> None:
        for worker_id in list(self.prefill.ids):  # the old book lets go of its slots
            self.prefill.remove(worker_id)
        self.prefill, self.decode = LoadBook(slots=self.slots), LoadBook()
        self._members = {m.worker_id: m for m in membership.members}
        for member in membership.members:
            self._file(member)

    def _file(self, member: Member) -> None:
        """Puts the member in its pool's book when it is routable (serving and not found dead), else out."""
        book = self.prefill if member.role == "prefill" else self.decode
        if member.state != SERVING or not self._healthy(member):
            book.remove(member.worker_id)
        elif member.role == "prefill":
            book.set(self.ledger.prefill_load(member.worker_id))
        else:
            book.set(self._decode_load(member.worker_id))

    def _healthy(self, member: Member) -> bool:
        # the monitor's verdict for this start of the worker (`is_healthy` looks the id up in the
        # membership, a scan; here the member is at hand)
        return not self.monitor.found_dead(member.worker_id, member.epoch)

    def _decode_load(self, worker_id: str) -> WorkerLoad:
        return WorkerLoad(worker_id, self.client.decode_load(worker_id), 0)

    def check_integrity(self) -> None:
        """The books hold exactly the routable workers with their current loads (tests)."""
        if self.slots is not None:
            self.slots.check_integrity()
        for role, book in (("prefill", self.prefill), ("decode", self.decode)):
            book.check_integrity()
            routable = {m.worker_id for m in self.view.membership.serving(role) if self.monitor.is_healthy(m.worker_id)}
            assert set(book.ids) == routable, f"{role} book {sorted(book.ids)} != routable {sorted(routable)}"
        for load in self.prefill:
            assert load == self.ledger.prefill_load(load.worker_id), f"stale load {load}"
        for load in self.decode:
            assert load == self._decode_load(load.worker_id), f"stale load {load}"
