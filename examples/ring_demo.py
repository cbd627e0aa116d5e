"""Ring attention on real processes, checked against the dense oracle.

Run with torchrun (gloo on CPU; nccl when every rank has a GPU)::

    torchrun --nproc-per-node 4 examples/ring_demo.py --layout zigzag --causal

Every rank builds the same random Q, K, V and upstream gradient from
``--seed``, keeps its shard (``shard_sequence``), runs ``ring_attention``
forward and backward, and sends its results to rank 0, which prints the
gathered ring ledger and the largest differences from the float64 dense
reference. Every rank exits with status 1 if any check fails, 0 otherwise.
"""

from __future__ import annotations

import argparse
import datetime
import os
import sys

import torch
import torch.distributed as dist

import flashledger as fl
from flashledger.ring import RingLedger, ring_attention, shard_sequence, unshard_sequence

TOLERANCE = {"float64": 1e-10, "float32": 1e-4}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layout", choices=("contiguous", "zigzag"), default="zigzag")
    p.add_argument("--seq", type=int, default=64, help="sequence length L (default 64)")
    p.add_argument("--d", type=int, default=16, help="head dim (default 16)")
    p.add_argument("--heads", type=int, default=2, help="query heads (default 2)")
    p.add_argument("--kv-heads", type=int, default=1, help="key/value heads (default 1: MQA)")
    p.add_argument("--causal", action="store_true", help="causal mask")
    p.add_argument("--block", type=int, default=16, help="tile size (default 16)")
    p.add_argument("--dtype", choices=sorted(TOLERANCE), default="float64")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--timeout", type=float, default=120.0, help="seconds before giving up")
    return p.parse_args(argv)


def _host(t: torch.Tensor | None) -> torch.Tensor:
    """A result as a float64 CPU tensor, ready to send to rank 0."""
    if t is None:
        raise RuntimeError("no gradient reached an input shard")
    return t.detach().cpu().double()


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    use_cuda = torch.cuda.is_available() and torch.cuda.device_count() > 0
    backend = "nccl" if use_cuda else "gloo"
    if use_cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    dist.init_process_group(backend, timeout=datetime.timedelta(seconds=args.timeout))
    try:
        return run(args, torch.device("cuda") if use_cuda else torch.device("cpu"))
    finally:
        dist.destroy_process_group()


def run(args: argparse.Namespace, device: torch.device) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    b, hq, hkv, n, d = 1, args.heads, args.kv_heads, args.seq, args.d
    q = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)  # (B, Hq, L, d)
    k = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)  # (B, Hkv, L, d)
    v = torch.randn(b, hkv, n, d, generator=gen, dtype=torch.float64)  # (B, Hkv, L, d)
    do = torch.randn(b, hq, n, d, generator=gen, dtype=torch.float64)  # (B, Hq, L, d)
    mask = fl.Causal() if args.causal else None

    def mine(x: torch.Tensor) -> torch.Tensor:
        return shard_sequence(x, rank, world, args.layout).to(device=device, dtype=dtype)

    qs, ks, vs = (mine(x).requires_grad_() for x in (q, k, v))
    ledger = RingLedger()
    o, lse = ring_attention(
        qs,
        ks,
        vs,
        layout=args.layout,
        mask=mask,
        block_q=args.block,
        block_k=args.block,
        return_lse=True,
        ledger=ledger,
        timeout=args.timeout,
    )
    o.backward(mine(do))
    full_ledger = ledger.gather()
    mine_out = [_host(t) for t in (o, lse, qs.grad, ks.grad, vs.grad)]
    every: list[list[torch.Tensor] | None] = [None] * world
    dist.all_gather_object(every, mine_out)
    failed = torch.zeros((), dtype=torch.int64, device=device)
    if rank == 0:
        ref = fl.reference_forward(q, k, v, mask=mask)
        refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, mask=mask)
        tol = TOLERANCE[args.dtype]
        print(full_ledger)
        print(f"\ncheck against the float64 dense oracle ({world} processes, {dist.get_backend()})")
        names = ("o", "lse", "dq", "dk", "dv")
        wants = (ref.o, ref.lse, refb.dq, refb.dk, refb.dv)
        for i, (name, want) in enumerate(zip(names, wants)):
            got = unshard_sequence(
                [parts[i] for parts in every if parts is not None],
                args.layout,
                dim=-1 if name == "lse" else -2,
            )
            err = float((got - want).abs().max())
            verdict = "ok" if err <= tol else "FAIL"
            failed += int(err > tol)
            print(f"  max |{name} - reference| = {err:.3g}  {verdict}")
        comm_ok = full_ledger.comm_matches()
        failed += int(not comm_ok)
        print(f"communication equals the closed form: {'yes' if comm_ok else 'NO'}")
        print(f"result: {'ok' if int(failed) == 0 else 'FAILED'}")
    dist.broadcast(failed, src=0)
    return 0 if int(failed) == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
