"""A rank out of step (it skipped a backward and is at the next call's agreement) makes
every rank raise a RuntimeError naming it; gloo aborted a process (SIGABRT) on the
all-gather of unequal sizes."""

from __future__ import annotations

import datetime
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.distributed


def _worker(rank: int, world: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    from flashledger.ring import ring_attention

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"file://{init_file}",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=30),
    )
    said = "no error"
    try:
        x = [torch.randn(1, 8, 4, dtype=torch.float64, requires_grad=True) for _ in range(3)]
        o = ring_attention(*x, timeout=20)
        if rank == 1:  # skips this backward: its own loss check failed
            ring_attention(*x, timeout=20)
        else:
            o.sum().backward()
    except Exception as e:
        said = f"{type(e).__name__}: {e}"
    Path(out_dir, f"rank{rank}.txt").write_text(said)
    dist.destroy_process_group()


def test_a_rank_out_of_step_makes_every_rank_raise(tmp_path: Path) -> None:
    import torch.multiprocessing as mp

    ctx = mp.start_processes(
        _worker,
        args=(2, str(tmp_path / "init"), str(tmp_path)),
        nprocs=2,
        join=False,
        start_method="spawn",
    )
    ctx.join(timeout=120)  # raises if a process died (gloo's abort: SIGABRT)
    for r in range(2):
        said = (tmp_path / f"rank{r}.txt").read_text()
        assert said.startswith(
            "RuntimeError: ring attention: the ranks are at different ring "
            "collectives (values gathered per rank: [1, "
        ), said
