"""Context parallelism: ring attention over torch.distributed, every hop booked.

The sequence is sharded across ``W`` ranks (``shard_sequence``: contiguous
pieces, or the causally balanced zigzag). Each rank keeps its queries; the K/V
shards travel around the ring, and each arriving shard is attended with the
blocked loop at its global positions, the partial results merged with the one
merge (``online.merge_partials``). The backward sends the shards round again,
rebuilds every probability block from the rank's saved LSE, keeps dQ local and
returns each shard's dK/dV to its owner after a full circle.

- ``ring_attention(q, k, v, *, group=None, layout=...)``: the differentiable op,
  on a torch.distributed group (gloo on CPU, nccl on GPU).
- ``simulate_ring(q, k, v, *, world_size, layout=...)``: the in-process twin on
  full tensors: the same per-rank code with in-memory wires, one thread per
  rank; returns outputs, LSE, gradients and the ``RingLedger``.
- ``RingLedger``: every hop (step, sender, receiver, shard, bytes) and every
  (query chunk, key chunk) pair each rank ran or skipped, with the blocked
  loop's counters; ``ring_comm_totals`` is the closed form it is checked
  against.
- ``add_cli_arguments`` / ``run_cli``: the ``flashledger ring`` command.

Run ``python -m flashledger.ring`` for a small demo of the twin.
"""

from ._ring_cli import _main, add_cli_arguments, run_cli
from ._ring_core import RingResult, ring_attention, simulate_ring
from ._ring_layout import LAYOUTS, Chunk, Layout, chunk_bounds, shard_sequence, unshard_sequence
from ._ring_ledger import (
    CommTotals,
    Hop,
    PairStep,
    RankState,
    RankWork,
    RingLedger,
    RingSetup,
    ring_comm_totals,
)
from ._ring_transport import DistTransport, LocalTransport, Transport

__all__ = [
    "LAYOUTS",
    "Chunk",
    "CommTotals",
    "DistTransport",
    "Hop",
    "Layout",
    "LocalTransport",
    "PairStep",
    "RankState",
    "RankWork",
    "RingLedger",
    "RingResult",
    "RingSetup",
    "Transport",
    "add_cli_arguments",
    "chunk_bounds",
    "ring_attention",
    "ring_comm_totals",
    "run_cli",
    "shard_sequence",
    "simulate_ring",
    "unshard_sequence",
]

if __name__ == "__main__":
    raise SystemExit(_main())
