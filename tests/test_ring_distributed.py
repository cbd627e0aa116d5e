"""Ring attention on real processes (gloo, CPU): oracle, twin and ledger agree.

One spawn of four processes runs every case on rings of 4, 3, 2 and 1
processes (the world group and sub-groups ``[1, 2, 3]``, ``[0, 2]``, ``[3]``:
the ring maps group ranks to global ranks). The first rank of each ring
gathers the outputs, gradients and ledger, compares them with the float64
dense oracle (1e-12) and with the in-process twin (bitwise, ledger equal),
and writes a JSON report that the test reads back. A second test runs the
torchrun entry point ``examples/ring_demo.py`` with torchrun's environment.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import torch

import flashledger as fl

pytestmark = pytest.mark.distributed

ROOT = Path(__file__).resolve().parents[1]
F64 = torch.float64
WORLD = 4
GROUPS = ([0, 1, 2, 3], [1, 2, 3], [0, 2], [3])
TIMEOUT_S = 60


def _case(name: str) -> dict[str, Any]:
    """Full tensors and options of one case (identical on every process: seeded)."""
    g = torch.Generator().manual_seed(sum(map(ord, name)))
    shapes = {
        "plain": (1, 2, 2, 24, 24, "contiguous"),
        "causal-contiguous": (1, 2, 2, 24, 24, "contiguous"),
        "causal-zigzag-gqa": (2, 4, 2, 24, 24, "zigzag"),
        "window-zigzag-uneven": (1, 2, 1, 29, 29, "zigzag"),
        "masked-rows-fa2": (2, 2, 1, 30, 18, "zigzag"),
        "flex-mods-zigzag": (2, 4, 2, 26, 26, "zigzag"),
    }
    b, hq, hkv, lq, lk, layout = shapes[name]
    d = 8
    table = torch.randn(hq, lq + lk, generator=g, dtype=F64).requires_grad_(True)

    def rel_bias(
        s: torch.Tensor, b_: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return s + table[h, qi - kv + lk]

    def documents(
        b_: torch.Tensor, h: torch.Tensor, qi: torch.Tensor, kv: torch.Tensor
    ) -> torch.Tensor:
        return (qi // 9 == kv // 9) & (qi >= kv)

    opts: dict[str, Any] = {
        "plain": {},
        "causal-contiguous": {"mask": fl.Causal()},
        "causal-zigzag-gqa": {"mask": fl.Causal()},
        "window-zigzag-uneven": {"mask": fl.SlidingWindow(5, 2)},
        # Lq > Lk, bottom-right: rows 0..11 see no key; batch 1 sees no key at all
        "masked-rows-fa2": {
            "mask": fl.Causal("bottom_right") & fl.KeyPadding([18, 0]),
            "conventions": fl.FLASH_ATTN_2,
        },
        # a mask_mod and a score_mod with a learnable table: each rank gets its share of
        # the table's gradient
        "flex-mods-zigzag": {
            "mask": fl.MaskMod(documents),
            "score_mod": rel_bias,
            "conventions": fl.FLEX_ATTENTION,
        },
    }[name]
    return {
        "q": torch.randn(b, hq, lq, d, generator=g, dtype=F64),
        "k": torch.randn(b, hkv, lk, d, generator=g, dtype=F64),
        "v": torch.randn(b, hkv, lk, d, generator=g, dtype=F64),
        "do": torch.randn(b, hq, lq, d, generator=g, dtype=F64),
        "dlse": torch.randn(b, hq, lq, generator=g, dtype=F64),
        "layout": layout,
        "opts": opts,
        "table": table,
    }


CASES = (
    "plain",
    "causal-contiguous",
    "causal-zigzag-gqa",
    "window-zigzag-uneven",
    "masked-rows-fa2",
    "flex-mods-zigzag",
)


def _worst(got: torch.Tensor, want: torch.Tensor) -> tuple[float, str]:
    """Largest |got - want| (equal infinities count as equal) and a note on where."""
    same = got == want
    diff = torch.where(same, torch.zeros_like(got), (got - want).abs()).nan_to_num(nan=math.inf)
    flat = int(diff.argmax())
    idx = tuple(int(i) for i in torch.unravel_index(torch.tensor(flat), diff.shape))
    return float(
        diff.reshape(-1)[flat]
    ), f"{idx}: got {float(got[idx])!r}, want {float(want[idx])!r}"


def _run_case(name: str, group: Any, members: list[int]) -> dict[str, Any] | None:
    import torch.distributed as dist

    from flashledger.ring import (
        RingLedger,
        ring_attention,
        shard_sequence,
        simulate_ring,
        unshard_sequence,
    )

    c = _case(name)
    w, r = len(members), dist.get_rank(group)
    layout, opts = c["layout"], c["opts"]
    xs = [shard_sequence(c[n], r, w, layout).requires_grad_() for n in ("q", "k", "v")]
    ledger = RingLedger(record_states=True)
    o, lse = ring_attention(
        *xs,
        group=group,
        layout=layout,
        block_q=4,
        block_k=4,
        return_lse=True,
        ledger=ledger,
        **opts,
    )
    torch.autograd.backward(
        [o, lse],
        [shard_sequence(c["do"], r, w, layout), shard_sequence(c["dlse"], r, w, layout, dim=-1)],
    )
    table = c["table"]
    table_grad = torch.zeros_like(table) if table.grad is None else table.grad
    mine = [t.detach() for t in (o, lse, *(x.grad for x in xs), table_grad)]
    every: list[Any] = [None] * w
    dist.all_gather_object(every, mine, group=group)
    full_ledger = ledger.gather(group)
    if r != 0:
        return None
    names = ("o", "lse", "dq", "dk", "dv")
    got = {
        n: unshard_sequence([e[i] for e in every], layout, dim=-1 if n == "lse" else -2)
        for i, n in enumerate(names)
    }
    q, k, v, do, dlse = (c[n] for n in ("q", "k", "v", "do", "dlse"))
    conv = fl.conventions.get_conventions(opts.get("conventions", fl.SEED))
    ref = fl.reference_forward(q, k, v, **opts)
    use_dlse = dlse if conv.lse_differentiable else None
    refb = fl.reference_backward(q, k, v, ref.o, ref.lse, do, dlse=use_dlse, **opts)
    want = {"o": ref.o, "lse": ref.lse, "dq": refb.dq, "dk": refb.dk, "dv": refb.dv}
    twin = simulate_ring(
        q,
        k,
        v,
        world_size=w,
        layout=layout,
        do=do,
        dlse=dlse,
        block_q=4,
        block_k=4,
        record_states=True,
        **opts,
    )
    errors, diffs = [], {}
    for n in names:
        err, where = _worst(got[n], want[n])
        diffs[n] = err
        if not err <= 1e-12:
            errors.append(f"{n} vs oracle: {err:.3g} > 1e-12 at {where}")
        if not torch.equal(got[n], getattr(twin, n)):
            errors.append(f"{n} differs from the twin: worst {_worst(got[n], getattr(twin, n))[1]}")
        if bool(torch.isnan(got[n]).any()):
            errors.append(f"{n} has NaN")
    has_table = "score_mod" in opts
    d_table = sum(e[5] for e in every)  # the ranks' shares
    want_table = refb.captured_grads[0][1] if has_table else torch.zeros_like(table)
    err, where = _worst(d_table, want_table)
    diffs["d_table"] = err
    if not err <= 1e-12:
        errors.append(f"d table vs oracle: {err:.3g} > 1e-12 at {where}")
    if has_table and not torch.allclose(d_table, twin.captured_grads[0][1], rtol=0, atol=1e-14):
        errors.append("d table differs from the twin's")
    if full_ledger != twin.ledger:
        errors.append("the gathered ledger (hops, pairs, per-step states) differs from the twin's")
    if not full_ledger.comm_matches():
        errors.append(
            f"comm {full_ledger.comm_totals()} != closed form {full_ledger.expected_comm()}"
        )
    return {
        "case": name,
        "world": w,
        "members": members,
        "diffs": diffs,
        "hops": len(full_ledger.hops),
        "errors": errors,
    }


def _bad_inputs_fail_everywhere(rank: int) -> list[str]:
    """A wrong shard on one rank, NaN on another: every rank raises, none hangs."""
    from flashledger.ring import ring_attention

    msgs = []
    q = torch.randn(1, 6 if rank != 1 else 7, 4, dtype=F64)
    try:
        ring_attention(q, q, q)
    except ValueError as e:
        msgs.append(str(e))
    x = torch.randn(1, 6, 4, dtype=F64)
    if rank == 2:
        x[0, 0, 0] = math.nan
    try:
        ring_attention(x, x, x)
    except ValueError as e:
        msgs.append(str(e))
    return msgs


BAD_OPTIONS: dict[str, tuple[int, dict[str, Any]]] = {
    # name: (the rank that differs, its options); the others pass SHARED
    "softcap": (1, {"softcap": -1.0}),
    "block_q": (3, {"block_q": 0}),
    "scale": (3, {"scale": 0.5}),
    "mask": (0, {"mask": None}),
    "bias-shape": (2, {"bias": torch.zeros(1, 1, 6, 5, dtype=F64)}),
}
SHARED: dict[str, Any] = {"mask": fl.Causal(), "softcap": 3.0}


def _bad_options_fail_everywhere(rank: int) -> dict[str, str]:
    """One rank's invalid or different option, then a NaN gradient on one rank in the
    backward: every rank raises (a short timeout turns a wait into a TimeoutError, which
    the test rejects)."""
    from flashledger.ring import ring_attention

    out = {}
    x = torch.randn(1, 6, 4, dtype=F64)
    for name, (odd, opts) in BAD_OPTIONS.items():
        try:
            ring_attention(x, x, x, timeout=20, **(opts if rank == odd else SHARED))  # type: ignore[arg-type]
            out[name] = "no error"
        except (ValueError, TypeError, TimeoutError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    xs = [torch.randn(1, 6, 4, dtype=F64, requires_grad=True) for _ in range(3)]
    o = ring_attention(*xs, timeout=20, mask=fl.Causal())
    do = torch.full_like(o, math.nan) if rank == 0 else torch.ones_like(o)
    try:
        o.backward(do)
        out["backward"] = "no error"
    except (ValueError, TimeoutError) as e:
        out["backward"] = f"{type(e).__name__}: {e}"
    return out


def _alone_times_out(rank: int, group: Any) -> str:
    """Rank 0 calls the ring on a group whose other rank never does: it gives up after its
    timeout instead of gloo's 30 minutes."""
    from flashledger.ring import ring_attention

    if rank != 0:
        return ""
    x = torch.randn(1, 6, 4, dtype=F64)
    try:
        ring_attention(x, x, x, group=group, timeout=1.5)
    except TimeoutError as e:
        return str(e)
    return "no error"


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )
    try:
        groups = [None] + [dist.new_group(m) for m in GROUPS[1:]]  # every rank, same order
        lonely = dist.new_group([0, 1])  # rank 1 never calls the ring on it
        report: list[dict[str, Any]] = []
        for group, members in zip(groups, GROUPS):
            if rank in members:
                for name in CASES:
                    res = _run_case(name, group, list(members))
                    if res is not None:
                        report.append(res)
        bad = _bad_inputs_fail_everywhere(rank)
        options = _bad_options_fail_everywhere(rank)
        alone = _alone_times_out(rank, lonely)
        Path(out_dir, f"rank{rank}.json").write_text(
            json.dumps({"cases": report, "bad": bad, "options": options, "alone": alone})
        )
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_ring_on_real_processes_equals_oracle_and_twin(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _worker,
        args=(WORLD, str(tmp_path / "init"), str(tmp_path)),
        nprocs=WORLD,
        join=False,
        start_method="spawn",
    )
    deadline = time.monotonic() + 4 * TIMEOUT_S
    while not ctx.join(timeout=2):
        if time.monotonic() > deadline:
            for p in ctx.processes:
                p.kill()
            pytest.fail(f"ring processes did not finish within {4 * TIMEOUT_S} s")
    reports = {r: json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(WORLD)}
    cases = [c for rep in reports.values() for c in rep["cases"]]
    seen = {(c["world"], c["case"]) for c in cases}
    assert seen == {(len(m), n) for m in GROUPS for n in CASES}, sorted(seen)
    failures = [f"W={c['world']} {c['case']}: {e}" for c in cases for e in c["errors"]]
    assert not failures, "\n".join(failures)
    for c in cases:
        w = c["world"]
        assert c["hops"] == (2 * w * (w - 1) + w * w if w > 1 else 0), c
    for r, rep in reports.items():
        assert len(rep["bad"]) == 2, f"rank {r} did not raise for both bad calls: {rep['bad']}"
        assert "the ranks hold [6, 7, 6, 6] query rows (25 in all)" in rep["bad"][0], rep["bad"][0]
        assert ("rejected their inputs" in rep["bad"][1]) == (r != 2), rep["bad"][1]
        assert r != 2 or "q contains NaN" in rep["bad"][1], rep["bad"][1]
        got = rep["options"]
        own = {
            "softcap": "softcap must be None or a finite number > 0, got -1.0",
            "block_q": "block_q must be an integer in 1..",
        }
        for name, text in own.items():
            odd = BAD_OPTIONS[name][0]
            want = text if r == odd else f"rank(s) [{odd}] rejected their inputs or options"
            assert want in got[name] and text in got[name], (r, name, got[name])
        assert "scale: rank 3 has 0.5, ranks 0, 1, 2 have default 1/sqrt(d)" in got["scale"]
        assert "mask: rank 0 has None, ranks 1, 2, 3 have Causal(align=None)" in got["mask"]
        assert "bias: rank 2 has tensor of shape (1, 1, 6, 5)" in got["bias-shape"]
        assert "ranks 0, 1, 3 have None" in got["bias-shape"], got["bias-shape"]
        want_bwd = "do (the gradient of o) contains NaN" if r == 0 else "rank(s) [0] rejected"
        assert got["backward"].startswith("ValueError") and want_bwd in got["backward"], got
    assert "did not arrive within 1.5 s" in reports[0]["alone"], reports[0]["alone"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_torchrun_demo_entry_point_passes() -> None:
    world, port = 2, _free_port()
    env = {
        **os.environ,
        "MASTER_ADDR": "127.0.0.1",
        "MASTER_PORT": str(port),
        "WORLD_SIZE": str(world),
        "LOCAL_WORLD_SIZE": str(world),
        "OMP_NUM_THREADS": "1",
        "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [sys.executable, str(ROOT / "examples" / "ring_demo.py")]
    argv += ["--seq", "20", "--d", "8", "--block", "4", "--causal", "--timeout", str(TIMEOUT_S)]
    procs = [
        subprocess.Popen(
            argv,
            env={**env, "RANK": str(r), "LOCAL_RANK": str(r)},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for r in range(world)
    ]
    outs = []
    try:
        for p in procs:
            outs.append(p.communicate(timeout=2 * TIMEOUT_S)[0])
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n".join(outs)
    assert "result: ok" in outs[0] and "communication equals the closed form: yes" in outs[0], outs[
        0
    ]
    assert "max |dk - reference|" in outs[0] and outs[1].strip() == "", outs[1]
