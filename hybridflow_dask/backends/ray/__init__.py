"""``RayBackend``: the same WorkerGroups on a Ray cluster (``pip install 'hybridflow-dask[ray]'``).

The only part of the package that imports ``ray``. How the contract in ``backends/base.py``
maps onto Ray:

- **Slots are placement-group bundles.** A pool is one ``STRICT_PACK`` placement group
  per entry of ``process_on_nodes`` (that entry's ranks share a Ray node), one bundle per
  rank. A cluster the backend starts has ``max_slots`` logical ``hf_slot`` resources and
  a bundle asks for one, so a pool's size never depends on the core count (a 2-core
  machine holds 6 slots); on another cluster a bundle asks for one CPU, plus a GPU for
  GPU pools.
- **One slot actor per bundle hosts every instance on the slot.** Groups on one
  pool (the ranks of colocated roles) are instances in the same actor process, as on a
  Dask worker, rather than one actor each in a shared bundle. That is what colocation
  means in this package (rank ``i`` of every group on a pool shares a process, one CUDA
  context and the instance's objects, as verl gets by fusing the classes into one
  actor), and one process per slot keeps memory and start-up to one Python with torch
  per rank. Each instance still has its own thread, event loop and environment inside
  the slot actor (``worker.slot_actor.SlotActor``).
- **Calls are actor method calls, results are ObjectRefs.** A call is
  ``host.call.remote(...)``; its result stays in the Ray object store and a
  ``RayFuture`` (the ``ObjectRef`` and who made it) is what the driver holds. A future
  passed to another group rides inside the call and is awaited by the consuming host,
  so Ray moves the data node to node, never through the driver. Ray captures arguments
  when the call is made (it serializes them in ``.remote()``); results are copied in the
  instance's thread as the method returns, because Ray serializes a return value after
  the instance's thread has handed it over, when the next call may already run.
- **Order is the driver's.** Each instance's calls carry a sequence number per driver
  and run one at a time in that order (Ray keeps submission order only for
  single-threaded actors, which would serialize colocated instances too).
- **Death comes from Ray.** Each host runs a ``watch`` call that never returns; Ray fails
  it, and every call in flight there, with ``ActorDiedError`` when the process dies. A
  failed ``watch`` turns ``alive`` false; a call's ``ActorDiedError`` (or a lost object)
  becomes ``WorkerLostError`` naming the group and rank. ``replace`` starts a new host in
  the same bundle, which ``WorkerGroup.recover()`` rebuilds the rank on.
- **Names outlive nothing.** Hosts are named actors in the ``hybridflow`` namespace and
  a small detached registry actor keeps each group's ``InstanceRef``s, so a second driver
  attached to the cluster finds groups with ``WorkerGroup.from_detached``; hosts belong
  to the driver that placed them and end with it.

What differs from ``DaskBackend``: no dashboard page (Ray's own dashboard is off in a
cluster the backend starts; attach to a cluster that runs one to see the actors); a
result already computed stays gettable after its host dies (it lives in the node's
object store, not in the host); numpy arrays arrive writable as on Dask (Ray hands
them out read-only; the host copies those).
"""

from __future__ import annotations

from .driver.backend import NAMESPACE, SLOT_RESOURCE, RayBackend
from .futures import RayFuture

__all__ = ["NAMESPACE", "SLOT_RESOURCE", "RayBackend", "RayFuture"]
