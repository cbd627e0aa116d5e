"""The seed page's data sets, in float64.

Section 02 (block ledger): one query row with six scores ``[1, 2, -1, 3, 0, 2.5]``.
The page does not print its 2-D value vectors; flashledger uses ``SIX_VALUES``
below: unit vectors, their sum and their negations, so that each position's
contribution to the output is easy to see by eye. The default block holds 2
scores (3 blocks).

Section 04 (rebuild and differentiate): five positions, ``d = 2``, a causal
mask, loss ``L = Σ O ⊙ G``, no dropout, tiles of 2 queries × 2 keys.
"""

from __future__ import annotations

import torch

__all__ = [
    "FIVE_G",
    "FIVE_K",
    "FIVE_Q",
    "FIVE_V",
    "SIX_BLOCK",
    "SIX_SCORES",
    "SIX_VALUES",
    "five_position_example",
    "six_score_example",
]

_f64 = torch.float64

SIX_SCORES = torch.tensor([1.0, 2.0, -1.0, 3.0, 0.0, 2.5], dtype=_f64)  # (6,)
SIX_VALUES = torch.tensor(
    [[1.0, 0.0], [0.0, 1.0], [1.0, 1.0], [-1.0, 0.0], [0.0, -1.0], [0.5, -0.5]], dtype=_f64
)  # (6, 2)
SIX_BLOCK = 2

FIVE_Q = torch.tensor([[0.2, -0.3], [0.5, 0.1], [-0.4, 0.7], [0.6, -0.2], [0.1, 0.8]], dtype=_f64)
FIVE_K = torch.tensor([[0.3, 0.5], [-0.2, 0.4], [0.7, -0.1], [0.1, -0.6], [-0.5, 0.2]], dtype=_f64)
FIVE_V = torch.tensor([[1.0, 0.0], [0.0, 2.0], [-1.0, 1.0], [2.0, -1.0], [0.5, 0.3]], dtype=_f64)
FIVE_G = torch.tensor([[0.2, -0.1], [0.3, 0.5], [-0.4, 0.2], [0.1, -0.3], [0.6, 0.4]], dtype=_f64)
FIVE_BLOCK = 2


def six_score_example() -> dict[str, torch.Tensor | int]:
    """``{"scores": (6,), "values": (6, 2), "block": 2}`` (fresh copies)."""
    return {"scores": SIX_SCORES.clone(), "values": SIX_VALUES.clone(), "block": SIX_BLOCK}


def five_position_example() -> dict[str, torch.Tensor | int]:
    """``{"q", "k", "v", "g": (5, 2), "block_q": 2, "block_k": 2}`` (fresh copies); causal."""
    return {
        "q": FIVE_Q.clone(),
        "k": FIVE_K.clone(),
        "v": FIVE_V.clone(),
        "g": FIVE_G.clone(),
        "block_q": FIVE_BLOCK,
        "block_k": FIVE_BLOCK,
    }


def _demo() -> None:
    """The seed page's data sets."""
    print(f"section 02: scores {SIX_SCORES.tolist()}, blocks of {SIX_BLOCK}")
    print(f"            values {SIX_VALUES.tolist()}")
    print(f"section 04: causal, tiles {FIVE_BLOCK} x {FIVE_BLOCK}")
    for name, t in (("Q", FIVE_Q), ("K", FIVE_K), ("V", FIVE_V), ("G", FIVE_G)):
        print(f"            {name} {t.tolist()}")


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("examples", _demo)
