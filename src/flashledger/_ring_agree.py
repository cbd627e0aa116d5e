"""Before anything travels, the ranks of a ring agree, or all raise together.

A rank that raised on its own would leave the others waiting for its shard
(gloo's default timeout is 30 minutes), and a rank given other options would
compute a different attention with no error at all. So every ring call starts
with one all-gather of small integers, from every rank, whatever happened:

- a flag: did this rank's own validation (inputs, option values, layout) fail;
- its shapes, dtype and layout (``_ring_core._META``);
- a 64-bit digest of each option's canonical text (``FIELDS``): mask (a dense
  mask, under ``&`` or ``|`` too, a bias and a dropout_mask by content),
  scale, conventions, dropout, seed, softcap,
  ALiBi slopes, bias, a score_mod (by its qualified name: a callable has no
  content to compare), tiles, state recording.

Every rank then sees the same table and takes the same decision. A failed
rank raises its own error and the others raise a ``ValueError`` quoting it; a
digest that differs makes every rank raise a ``ValueError`` naming the ranks
that differ and what each was given (the texts are gathered only then). A
mismatch or an invalid option therefore fails every rank at once, never a hang.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from ._ring_transport import Transport
from .conventions import Conventions
from .masks import And, DenseMask, Mask, Or

__all__ = ["FIELDS", "describe_options", "digest", "gather_texts", "raise_together"]

FIELDS = (
    "mask",
    "scale",
    "conventions",
    "dropout_p",
    "dropout_mask",
    "seed",
    "softcap",
    "alibi_slopes",
    "bias",
    "score_mod",
    "block_q",
    "block_k",
    "record_states",
)
"""The options every rank must share, in digest order."""

_SHOWN = 160
"""Characters of an option's text quoted in a mismatch message."""


def _tensor_text(t: torch.Tensor) -> str:
    """Shape, dtype and a content hash: equal texts mean equal tensors."""
    raw = t.detach().reshape(-1).contiguous().cpu().view(torch.uint8).numpy().tobytes()
    sha = hashlib.sha256(raw).hexdigest()[:16]
    return f"tensor of shape {tuple(t.shape)}, {str(t.dtype).removeprefix('torch.')}, sha256 {sha}"


def _value_text(x: Any) -> str:
    return _tensor_text(x) if isinstance(x, torch.Tensor) else repr(x)


def describe_mask(mask: Mask | None) -> str:
    """A mask as text that is equal on two ranks exactly when the masks are."""
    if mask is None:
        return "None"
    if isinstance(mask, (And, Or)):  # each side by content (a DenseMask under | too)
        op = "&" if isinstance(mask, And) else "|"
        return f"({describe_mask(mask.a)} {op} {describe_mask(mask.b)})"
    if isinstance(mask, DenseMask):
        return f"DenseMask({_tensor_text(mask.mask)})"
    text = repr(mask)
    attrs = sorted(getattr(mask, "__dict__", {}).items())
    if " at 0x" in text:  # the default repr names an address, different in every process
        return f"{type(mask).__qualname__}({', '.join(f'{n}={_value_text(x)}' for n, x in attrs)})"
    tensors = [f"{n}: {_tensor_text(x)}" for n, x in attrs if isinstance(x, torch.Tensor)]
    return text + (f" [{'; '.join(tensors)}]" if tensors else "")  # a repr may summarise them


def _conventions_text(c: Conventions) -> str:
    return (
        f"{c.name} (masked-row LSE {c.masked_row_lse}, causal {c.causal_align}, dropout "
        f"{c.dropout_keep}, LSE gradient {'propagated' if c.lse_differentiable else 'ignored'})"
    )


def _callable_text(fn: Any) -> str:
    """A score_mod by its module and qualified name (the same code on every rank)."""
    if fn is None:
        return "None"
    return f"{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__qualname__)}"


def _number(x: Any) -> str:
    return "None" if x is None else repr(float(x))


def describe_options(
    mask: Mask | None,
    conventions: Conventions,
    rest: Mapping[str, Any],
    *,
    block_q: int,
    block_k: int,
    record_states: bool,
) -> dict[str, str]:
    """The canonical text of every field of ``FIELDS`` (values already validated)."""
    alibi, bias = rest.get("alibi_slopes"), rest.get("bias")
    keep = rest.get("dropout_mask")
    scale = rest.get("scale")
    return {
        "mask": describe_mask(mask),
        "scale": "default 1/sqrt(d)" if scale is None else _number(scale),
        "conventions": _conventions_text(conventions),
        "dropout_p": _number(rest.get("dropout_p", 0.0)),
        "dropout_mask": "None" if keep is None else _value_text(keep),
        "seed": str(int(rest.get("seed", 0))),
        "softcap": _number(rest.get("softcap")),
        "alibi_slopes": "None" if alibi is None else _tensor_text(alibi),
        "bias": "None" if bias is None else _tensor_text(bias),
        "score_mod": _callable_text(rest.get("score_mod")),
        "block_q": str(block_q),
        "block_k": str(block_k),
        "record_states": str(bool(record_states)),
    }


def digest(texts: Mapping[str, str]) -> list[int]:
    """One signed 64-bit integer per field of ``FIELDS`` (what the all-gather carries)."""
    return [
        int.from_bytes(hashlib.sha256(texts[f].encode()).digest()[:8], "little", signed=True)
        for f in FIELDS
    ]


def gather_texts(tp: Transport, text: str, *, device: torch.device) -> list[str]:
    """Every rank's ``text`` on every rank (two all-gathers: the lengths, then the bytes)."""
    data = list(text.encode())
    lengths = [row[0] for row in tp.all_gather_ints([len(data)], device=device)]
    n = max(1, *lengths)
    rows = tp.all_gather_ints(data + [0] * (n - len(data)), device=device)
    return [bytes(row[:m]).decode(errors="replace") for row, m in zip(rows, lengths)]


def raise_together(
    tp: Transport,
    err: BaseException | None,
    failed: Sequence[int],
    what: str,
    *,
    device: torch.device,
) -> None:
    """After an all-gather whose rows carried ``failed[r]`` (1: rank ``r`` raised on its own):
    if any rank failed, every rank raises, the failed ones their own error, the others a
    ``ValueError`` quoting it. Collective: every rank must call it with the same ``failed``."""
    bad = [r for r, f in enumerate(failed) if f]
    if not bad:
        return
    texts = gather_texts(tp, "" if err is None else f"{type(err).__name__}: {err}", device=device)
    if err is not None:
        raise err
    quoted = "; ".join(f"rank {r}: {texts[r]}" for r in bad)
    raise ValueError(
        f"ring attention: rank(s) {bad} rejected their {what} (every rank stops): {quoted}"
    )


def mismatch_message(fields: Sequence[str], texts: Sequence[str]) -> str:
    """What differs between the ranks: ``texts[r]`` is rank r's texts of ``fields``, joined
    by ``\\x1f``. Ranks are grouped by value, the largest group last."""
    per_rank = [t.split("\x1f") for t in texts]
    parts = []
    for i, field in enumerate(fields):
        groups: dict[str, list[int]] = {}
        for r, vals in enumerate(per_rank):
            groups.setdefault(vals[i], []).append(r)
        ordered = sorted(groups.items(), key=lambda kv: (len(kv[1]), -kv[1][0]))
        said = []
        for value, ranks in ordered:
            shown = value if len(value) <= _SHOWN else value[: _SHOWN - 1] + "…"
            who = f"rank {ranks[0]} has" if len(ranks) == 1 else f"ranks {_ranks(ranks)} have"
            said.append(f"{who} {shown}")
        parts.append(f"{field}: " + ", ".join(said))
    return (
        "ring attention: the ranks were given different options (every rank must pass the "
        "same ones; every rank stops): " + "; ".join(parts)
    )


def _ranks(ranks: Sequence[int]) -> str:
    return ", ".join(str(r) for r in ranks)
