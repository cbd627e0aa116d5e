"""The ``flashledger`` command: the seed's ledgers as tables, ``--json`` for machines.

Subcommands: ``online`` (the running state, block by block), ``backward``
(rebuild and differentiate), ``account`` (storage and work), ``traffic``
(slow-memory traffic, ``--sweep`` for the plot), ``explore`` (the web
explorer), and ``verify``, ``bench``, ``ring``, ``model``, whose options live
in their own modules and are loaded only when used.

Bad input never shows a traceback: the command prints one line naming the
option and what is allowed, and exits with status 2.
"""

from __future__ import annotations

import argparse
import importlib
import json
import math
import os
import re
import sys
import textwrap
import zipfile
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

from ._limits import BACKWARD_CLI_MAX_SCORES, MAX_SIZE, check_fits
from ._progress import (
    int_arg,
    join_dash_values,
    make_console,
    output_problem,
    progress,
    titled_table,
)
from .conventions import preset_arg

if TYPE_CHECKING:
    import torch
    from rich.console import Console

    from .accounting import StorageWork, Traffic
    from .masks import Mask

__all__ = ["build_parser", "main"]

PROG = "flashledger"
DELEGATED = {
    "verify": "check attention against PyTorch and an exact answer",
    "bench": "time the blocked loop against PyTorch",
    "ring": "ring attention (context parallelism) over torch.distributed",
    "model": "the attention ledger of a random-initialised transformers model",
}
COMMANDS = ("online", "backward", "account", "traffic", "explore", *DELEGATED)
DTYPES = ("float64", "float32", "float16", "bfloat16")
MASK_HELP = (
    "none, causal (the conventions' alignment), causal-tl, causal-br, window:L,R "
    "(L, R integers >= 0, -1 = unbounded), or a .json/.npy file holding a boolean matrix"
)


class UsageError(Exception):
    """Bad input on the command line: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    """argparse, but errors become ``UsageError`` (one line, no usage dump)."""

    def error(self, message: str) -> NoReturn:
        if "required: COMMAND" in message:
            message = f"a command is required, one of: {', '.join(COMMANDS)}"
        raise UsageError(f"{self.prog}: error: {message}")


class _Formatter(argparse.RawDescriptionHelpFormatter):
    """Keep the examples' line breaks; show a default unless it is None, False or stated."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        text = action.help or ""
        if action.default in (None, False, argparse.SUPPRESS) or "default" in text:
            return text
        return f"{text} (default: %(default)s)"


def _describe(text: str) -> str:
    """A description wrapped for the help screen (descriptions are kept raw, like examples)."""
    return textwrap.fill(" ".join(text.split()), width=78)


# ----------------------------------------------------------------------------------------
# option types: each names what is allowed
# ----------------------------------------------------------------------------------------
_port = int_arg(0, 65535)
_precision = int_arg(1, 17)


def _number(text: str, *, allow_neg_inf: bool = False) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if math.isnan(value) or value == math.inf or (value == -math.inf and not allow_neg_inf):
        allowed = "a finite number or -inf" if allow_neg_inf else "a finite number"
        raise argparse.ArgumentTypeError(f"expected {allowed}, got {text!r}")
    return value


def _finite(text: str) -> float:
    return _number(text)


def _positive_number(text: str) -> float:
    value = _number(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"expected a number > 0, got {text!r}")
    return value


def _probability(text: str) -> float:
    value = _number(text)
    if not 0.0 <= value < 1.0:
        raise argparse.ArgumentTypeError(f"expected a probability in [0, 1), got {text!r}")
    return value


def _score_list(text: str) -> list[float]:
    parts = [p.strip() for p in text.split(",")]
    if not text.strip() or any(not p for p in parts):
        raise argparse.ArgumentTypeError(
            f"expected comma-separated numbers like 1,2,-1 (-inf = masked), got {text!r}"
        )
    try:
        values = [_number(p, allow_neg_inf=True) for p in parts]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"in {text!r}: {exc}") from None
    return values  # all -inf: a fully-masked row (O = 0, LSE -inf), as the seed defines it


def _matrix(text: str) -> list[list[float]]:
    rows = [r.strip() for r in text.split(";")]
    hint = "expected rows separated by ';' and entries by ',', like \"1,0;0,1\""
    if not text.strip() or any(not r for r in rows):
        raise argparse.ArgumentTypeError(f"{hint}, got {text!r}")
    try:
        out = [[_number(x.strip()) for x in r.split(",")] for r in rows]
    except argparse.ArgumentTypeError as exc:
        raise argparse.ArgumentTypeError(f"{hint}; in {text!r}: {exc}") from None
    if len({len(r) for r in out}) != 1:
        raise argparse.ArgumentTypeError(
            f"every row needs the same number of entries, got {[len(r) for r in out]}"
        )
    return out


def _dtype(text: str) -> torch.dtype:
    import torch

    if text not in DTYPES:
        raise argparse.ArgumentTypeError(f"expected one of {', '.join(DTYPES)}, got {text!r}")
    dtype: torch.dtype = getattr(torch, text)
    return dtype


@dataclass(frozen=True)
class MaskSpec:
    """A parsed ``--mask`` value."""

    label: str  # as given: "causal", "window:1,0", "mask.npy", ...
    mask: Mask | None  # None: no mask


def _mask(text: str) -> MaskSpec:
    from .masks import Causal, DenseMask, SlidingWindow

    spec = text.strip()
    if spec == "none":
        return MaskSpec("none", None)
    if spec == "causal":
        return MaskSpec("causal", Causal())
    if spec == "causal-tl":
        return MaskSpec("causal-tl", Causal(align="top_left"))
    if spec == "causal-br":
        return MaskSpec("causal-br", Causal(align="bottom_right"))
    if spec.startswith("window:"):
        parts = spec.removeprefix("window:").split(",")
        try:
            left, right = (int(p) for p in parts)
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"expected window:L,R with integers L, R >= 0 or -1 (unbounded), got {text!r}"
            ) from None
        if not (-1 <= left <= MAX_SIZE and -1 <= right <= MAX_SIZE):
            raise argparse.ArgumentTypeError(
                f"window sides must be integers in 0..{MAX_SIZE}, or -1 for unbounded, got {text!r}"
            )
        return MaskSpec(spec, SlidingWindow(left, right))
    if spec.endswith((".json", ".npy")):
        return MaskSpec(spec, DenseMask(_load_bool_matrix(spec)))
    raise argparse.ArgumentTypeError(f"unknown mask {text!r}; allowed: {MASK_HELP}")


def _load_bool_matrix(path: str) -> torch.Tensor:
    import numpy as np
    import torch

    try:
        if path.endswith(".json"):
            data = _read_json(path, f"mask file {path}", "a mask is a matrix of true/false")
            depth = _nesting(data)
            if depth > MAX_NESTING:
                raise argparse.ArgumentTypeError(
                    f"mask file {path}: lists nested {depth} deep; a mask is a (Lq, Lk), "
                    "(H, Lq, Lk) or (B, H, Lq, Lk) matrix of true/false"
                )
            try:
                arr = np.asarray(data)
            except ValueError:
                raise argparse.ArgumentTypeError(
                    f"mask file {path}: rows of different lengths; a mask is a rectangular "
                    "matrix of true/false"
                ) from None
        else:
            with open(path, "rb") as fh:
                if fh.read(6) != b"\x93NUMPY":
                    raise argparse.ArgumentTypeError(
                        f"mask file {path} is not a .npy file (numpy.save writes one)"
                    )
            arr = np.load(path, allow_pickle=False)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(f"cannot read mask file {path}: {exc}") from None
    if arr.ndim not in (2, 3, 4) or 0 in arr.shape:
        raise argparse.ArgumentTypeError(
            f"mask file {path} must hold a (Lq, Lk), (H, Lq, Lk) or (B, H, Lq, Lk) matrix "
            f"with every size >= 1, got shape {arr.shape}"
        )
    if arr.dtype != np.bool_:
        if arr.dtype.kind not in "iuf" or not np.isin(arr, (0, 1)).all():
            raise argparse.ArgumentTypeError(
                f"mask file {path} must hold booleans (or 0/1), got dtype {arr.dtype}"
                + (" with other values" if arr.dtype.kind in "iuf" else "")
            )
        arr = arr.astype(bool)
    return torch.from_numpy(np.ascontiguousarray(arr))


def _read_json(path: str, what: str, hint: str) -> Any:
    """Parse a JSON file; nesting deeper than Python's parser can follow, or an object that
    names a key twice (where one would silently win), is a clear error."""
    from ._text import RepeatedKey, unique_keys

    text = Path(path).read_text()
    try:
        return json.loads(text, object_pairs_hook=unique_keys)
    except RecursionError:
        raise argparse.ArgumentTypeError(
            f"{what}: JSON nested too deeply to read (more than {sys.getrecursionlimit():,} "
            f"levels); {hint}"
        ) from None
    except RepeatedKey as exc:
        raise argparse.ArgumentTypeError(
            f"{what}: {exc} (only the last would count); give it once"
        ) from None


MAX_NESTING = 32
"""Deepest list nesting read from a JSON file (numpy stops at 64 dimensions; inputs have 4)."""


def _nesting(data: Any) -> int:
    """How deep lists nest in ``data`` (0 for a scalar), walking without recursion."""
    depth, level = 0, [data]
    while level:
        lists = [x for x in level if isinstance(x, list)]
        if not lists:
            break
        depth += 1
        level = [y for x in lists for y in x]
    return depth


# ----------------------------------------------------------------------------------------
# output helpers
# ----------------------------------------------------------------------------------------
class _Out:
    """Prints rich renderables; off a terminal, plain lines without trailing blanks."""

    def __init__(self) -> None:

        self.console: Console = make_console(sys.stdout)

    def print(self, renderable: Any) -> None:
        con = self.console
        if con.is_terminal:
            con.print(renderable)
            return
        with con.capture() as cap:
            con.print(renderable)
        lines = [line.rstrip() for line in cap.get().splitlines()]
        con.file.write("\n".join(lines) + "\n")


def _console() -> _Out:
    return _Out()


def _fmt(x: float, p: int) -> str:
    """A number with ``p`` significant digits; infinities as ``-inf`` / ``inf``."""
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "-inf" if x < 0 else "inf"
    text = f"{x:.{p}g}"
    return "0" if text == "-0" else text


def _fmt_any(x: Any, p: int) -> str:
    """Numbers, (nested) lists and tensors, formatted like ``[1, 0.5]``."""
    if hasattr(x, "tolist"):
        x = x.tolist()
    if isinstance(x, list):
        return "[" + ", ".join(_fmt_any(v, p) for v in x) + "]"
    if isinstance(x, bool):
        return str(x)
    if isinstance(x, (int, float)):
        return _fmt(float(x), p)
    return str(x)


def _print_json(obj: Any) -> None:
    from .ledger import jsonable

    sys.stdout.write(json.dumps(jsonable(obj), indent=2) + "\n")


def _max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    """Largest ``|a - b|``, counting equal infinities as 0 (0 for empty tensors)."""
    import torch

    a, b = a.double(), b.double()
    diff = torch.where(a == b, torch.zeros_like(a), (a - b).abs())
    diff = torch.nan_to_num(diff, nan=math.inf)
    return float(diff.max()) if diff.numel() else 0.0


# ----------------------------------------------------------------------------------------
# online: the running state, block by block (the seed's sections 01 and 02)
# ----------------------------------------------------------------------------------------
def _cmd_online(args: argparse.Namespace) -> int:
    import torch

    from .examples import six_score_example
    from .online import (
        OnlineSoftmax,
        blockwise_softmax_average,
        softmax_output,
        softmax_probabilities,
    )

    demo = six_score_example()
    if args.scores is None:
        if args.values is not None:
            raise UsageError(
                "--values needs --scores (without both, the seed's six-score demo runs)"
            )
        scores, values = demo["scores"], demo["values"]
    else:
        if args.values is None:
            raise UsageError('--scores needs --values: one value vector per score, like "1,0;0,1"')
        scores = torch.tensor(args.scores, dtype=torch.float64)  # (L,)
        values = torch.tensor(args.values, dtype=torch.float64)  # (L, d_v)
        if values.shape[0] != scores.shape[0]:
            raise UsageError(
                f"--values has {values.shape[0]} rows; it needs one per score ({scores.shape[0]})"
            )
    assert isinstance(scores, torch.Tensor) and isinstance(values, torch.Tensor)
    block = int(demo["block"]) if args.block is None else args.block
    p = args.precision
    shifted = scores + args.shift  # (L,)
    finite = torch.isfinite(scores)
    if not bool(torch.isfinite(shifted[finite]).all()):
        raise UsageError(
            f"--shift {args.shift:g} makes a score overflow float64 (|score + shift| above "
            f"{torch.finfo(torch.float64).max:.3g}); use a smaller shift"
        )
    # what the shift itself rounded away: float64 keeps 53 bits, so s + shift - shift != s
    # once the shift is many orders above the scores
    rounding = (
        float(((shifted - args.shift) - scores)[finite].abs().amax()) if finite.any() else 0.0
    )
    osm = OnlineSoftmax.run(shifted, values, block=block)
    if not all(bool(torch.isfinite(torch.as_tensor(st.acc)).all()) for st in osm.steps):
        top = float(values.abs().max())
        raise UsageError(
            f"--values up to {top:.3g} overflow float64 in the weighted sum acc (a sum of "
            f"values times weights up to 1; float64 ends at {torch.finfo(torch.float64).max:.3g})"
            "; use smaller values"
        )
    ref = softmax_output(shifted, values)  # (d_v,)
    probs = softmax_probabilities(shifted)  # (L,); zeros for a fully-masked row
    diff = _max_abs_diff(osm.output(), ref)
    base = OnlineSoftmax.run(scores, values, block=block) if args.shift else osm
    shift_diff = _max_abs_diff(osm.output(), base.output())
    # "unchanged" only within float64 rounding of the output (its size is max |v|)
    unchanged = shift_diff <= 1e-12 * max(1.0, float(values.abs().max()))
    wrong = blockwise_softmax_average(shifted, values, block=block) if args.counterexample else None

    if args.json:
        out: dict[str, Any] = {
            "scores": shifted,
            "values": values,
            "block": block,
            "shift": args.shift,
            "steps": [
                {
                    "block": st.index + 1,
                    "positions": list(st.positions),
                    "scores": st.scores,
                    "block_max": float(st.block_max),
                    "m": float(st.m_after),
                    "alpha": float(st.alpha),
                    "ell": float(st.ell),
                    "acc": st.acc,
                    "output": st.output,
                }
                for st in osm.steps
            ],
            "probabilities": probs,
            "output": osm.output(),
            "reference": ref,
            "max_abs_diff": diff,
        }
        if args.shift:
            out["unshifted_m"] = float(base.m)
            out["shift_max_abs_diff"] = shift_diff
            out["shift_rounding"] = rounding
            out["shift_output_unchanged"] = unchanged
        if wrong is not None:
            out["counterexample"] = {
                "block_average": wrong,
                "full_row": ref,
                "max_abs_diff": _max_abs_diff(wrong, ref),
            }
        _print_json(out)
        return 0

    con = _console()
    rows = [
        [
            str(st.index + 1),
            f"{st.positions[0]}..{st.positions[1] - 1}",
            _fmt_any(st.scores, p),
            _fmt_any(st.block_max, p),
            _fmt_any(st.m_after, p),
            _fmt_any(st.alpha, p),
            _fmt_any(st.ell, p),
            _fmt_any(st.acc, p),
            _fmt_any(st.output, p),
        ]
        for st in osm.steps
    ]
    header = ["block", "positions", "scores", "block max", "running max m", "α", "ℓ", "acc",
              "prefix output"]  # fmt: skip
    con.print(titled_table("Block ledger (online softmax, float64)", header, rows))
    whole = [
        [str(j), _fmt_any(shifted[j], p), _fmt_any(values[j], p), _fmt_any(probs[j], p)]
        for j in range(shifted.shape[0])
    ]
    con.print(titled_table("Whole row", ["position", "score", "V", "full-row probability"], whole))
    con.print(f"blocks read: {len(osm.steps)} of {len(osm.steps)}")
    con.print(f"m = {_fmt_any(osm.m, p)}   ℓ = {_fmt_any(osm.ell, p)}")
    con.print(f"prefix output after the last block: {_fmt_any(osm.output(), p)}")
    con.print(f"full-row reference:                 {_fmt_any(ref, p)}")
    con.print(f"max |difference|: {diff:.3g}")
    if args.shift:
        head = (
            f"shift {args.shift:+g}: running max {_fmt_any(osm.m, p)} instead of "
            f"{_fmt_any(base.m, p)}; "
        )
        if unchanged:
            con.print(f"{head}output unchanged (max |difference| vs unshifted: {shift_diff:.3g})")
        else:
            spacing = math.ulp(float(shifted[finite].abs().max()))
            con.print(
                f"{head}output CHANGED (max |difference| vs unshifted: {shift_diff:.3g}): "
                f"float64 keeps about 16 significant digits, so adding {args.shift:g} rounded "
                f"the scores by up to {rounding:.3g} (neighbouring float64 numbers there are "
                f"{spacing:.3g} apart) and the row is no longer the same row; softmax is "
                "shift-invariant only while score + shift keeps the scores' digits"
            )
    if wrong is not None:
        _print_counterexample(con, shifted, values, block, wrong, ref, p)
    return 0


def _print_counterexample(
    con: _Out,
    scores: torch.Tensor,
    values: torch.Tensor,
    block: int,
    wrong: torch.Tensor,
    ref: torch.Tensor,
    p: int,
) -> None:
    from .online import softmax_output

    rows = []
    for b, a in enumerate(range(0, scores.shape[0], block)):
        s = scores[a : a + block]
        rows.append(
            [str(b + 1), _fmt_any(s, p), _fmt_any(softmax_output(s, values[a : a + block]), p)]
        )
    con.print(
        titled_table(
            "Counterexample: softmax inside each block, then the average of the block outputs",
            ["block", "scores", "block softmax output"],
            rows,
        )
    )
    con.print(f"average of block outputs: {_fmt_any(wrong, p)}")
    con.print(f"full-row output:          {_fmt_any(ref, p)}")
    con.print(
        f"max |difference|: {_max_abs_diff(wrong, ref):.3g}  (averaging weighs every block "
        "equally; the full row weighs block b by its share ℓ_b·exp(m_b - m) / ℓ)"
    )


# ----------------------------------------------------------------------------------------
# backward: rebuild and differentiate (the seed's section 04)
# ----------------------------------------------------------------------------------------
def _load_inputs(path: str) -> dict[str, torch.Tensor]:
    import numpy as np
    import torch

    from ._text import shown

    keys = ("q", "k", "v", "g")
    if not path.endswith((".json", ".npz")):
        raise UsageError(f"--input must be a .json or .npz file with keys q, k, v, g, got {path!r}")
    try:
        if path.endswith(".json"):
            try:
                data = _read_json(
                    path, f"--input {path}", "q, k, v, g are at most 4-D arrays of numbers"
                )
            except argparse.ArgumentTypeError as exc:
                raise UsageError(str(exc)) from None
            if not isinstance(data, dict):
                raise UsageError(f"--input {path}: expected a JSON object with keys q, k, v, g")
        else:
            if Path(path).is_file() and not zipfile.is_zipfile(path):
                raise UsageError(
                    f"--input {path}: not a .npz archive (numpy.savez writes one, a zip of arrays)"
                )
            with np.load(path, allow_pickle=False) as npz:
                data = {k: npz[k] for k in npz.files}
    except (OSError, ValueError) as exc:
        raise UsageError(f"--input: cannot read {path}: {exc}") from None
    missing = [k for k in keys if k not in data]
    if missing:
        raise UsageError(f"--input {path}: missing key(s) {', '.join(missing)}; needs q, k, v, g")
    unknown = [shown(str(k), 40) for k in data if k not in keys]
    if unknown:
        raise UsageError(
            f"--input {path}: unknown key(s) {', '.join(unknown)}; it holds q, k, v "
            "and g only (a mask is --mask FILE, the conventions --conventions, the tiles "
            "--block-q and --block-k)"
        )
    out = {}
    for k in keys:
        if isinstance(data[k], list) and _nesting(data[k]) > MAX_NESTING:
            raise UsageError(
                f"--input {path}: {k} has lists nested {_nesting(data[k])} deep; it must have "
                "shape (L, d), (H, L, d) or (B, H, L, d)"
            )
        try:
            raw = np.asarray(data[k])
            if raw.dtype.kind == "c":
                raise UsageError(
                    f"--input {path}: {k} holds complex numbers ({raw.dtype}); attention "
                    "inputs are real (the imaginary part would be dropped)"
                )
            if raw.dtype.kind == "b" or _holds_bool(data[k]):
                raise UsageError(
                    f"--input {path}: {k} holds true/false values; attention inputs are numbers "
                    "(write 1 and 0 if that is what you mean)"
                )
            arr = np.asarray(raw, dtype=np.float64)
        except (TypeError, ValueError):
            raise UsageError(f"--input {path}: {k} must be a numeric array") from None
        if arr.ndim not in (2, 3, 4) or 0 in arr.shape:
            raise UsageError(
                f"--input {path}: {k} must have shape (L, d), (H, L, d) or (B, H, L, d) with "
                f"every size >= 1, got {arr.shape}"
            )
        bad = np.argwhere(~np.isfinite(arr))
        if len(bad):
            at = tuple(int(i) for i in bad[0])
            raise UsageError(
                f"--input {path}: {k} holds NaN or inf at index {at}; every value of q, k, v "
                "and g must be finite"
            )
        out[k] = torch.from_numpy(arr)
    q, v, g = out["q"], out["v"], out["g"]
    want = (*q.shape[:-1], v.shape[-1])
    if q.ndim == v.ndim and tuple(g.shape) != want:
        raise UsageError(
            f"--input {path}: g must have shape {want} (q's rows by v's last dim), "
            f"got {tuple(g.shape)}"
        )
    return out


def _holds_bool(x: Any) -> bool:
    """A JSON value (nested lists) holds a true or false somewhere."""
    if isinstance(x, bool):
        return True
    return isinstance(x, list) and any(_holds_bool(y) for y in x)


def _row_labels(shape: Sequence[int]) -> list[str]:
    """Labels of the rows of a ``(..., L, X)`` tensor: ``"3"``, ``"h1:3"`` or ``"b0:h1:3"``."""
    lead, length = list(shape[:-2]), shape[-2]
    names = ["b", "h"][-len(lead) :] if lead else []
    labels = [""]
    for name, n in zip(names, lead):
        labels = [f"{lab}{name}{i}:" for lab in labels for i in range(n)]
    return [f"{lab}{i}" for lab in labels for i in range(length)]


def _first_head(x: torch.Tensor, lead: int) -> torch.Tensor:
    for _ in range(lead):
        x = x[0]
    return x


class _TileProgress:
    """Observer that advances a progress bar once per tile step (indices only)."""

    wants_tensors = False

    def __init__(self, advance: Callable[[float], None]) -> None:
        self.advance = advance

    def forward_tile(self, step: Any) -> None:
        self.advance(1.0)

    def backward_tile(self, step: Any) -> None:
        self.advance(1.0)


class _PrintedSteps(_TileProgress):
    """Keeps what ``backward`` prints of each backward step, and no more: the tile, its
    kind and the rebuilt P rows of the first batch element and head (a full trace would keep
    S, P, dP, dS and the gradients of every head)."""

    wants_tensors = True

    def __init__(self, advance: Callable[[float], None], lead: int) -> None:
        super().__init__(advance)
        self.lead = lead
        self.steps: list[dict[str, Any]] = []

    def backward_tile(self, step: Any) -> None:
        self.advance(1.0)
        self.steps.append(
            {
                "step": step.index + 1,
                "tile": f"Q{step.q_tile} x K{step.k_tile}",
                "queries": f"{step.q_range[0]}..{step.q_range[1] - 1}",
                "keys": f"{step.k_range[0]}..{step.k_range[1] - 1}",
                "kind": step.kind,
                "p": _first_head(step.p, self.lead).clone(),
            }
        )


def _cmd_backward(args: argparse.Namespace) -> int:
    import torch

    from .blocked import blocked_backward, blocked_forward
    from .examples import five_position_example
    from .reference import reference_backward, reference_forward
    from .scores import alibi_slopes

    if args.seed and not args.dropout:
        raise UsageError("--seed picks dropout's keep mask: add --dropout P, or drop --seed")
    if args.input is None:
        demo = five_position_example()
        q, k, v, g = (demo[n] for n in ("q", "k", "v", "g"))
        assert all(isinstance(t, torch.Tensor) for t in (q, k, v, g))
        default_mask, default_block = _mask("causal"), int(demo["block_q"])
    else:
        x = _load_inputs(args.input)
        q, k, v, g = x["q"], x["k"], x["v"], x["g"]
        default_mask, default_block = MaskSpec("none", None), 64
        scores = math.prod(q.shape[:-1]) * k.shape[-2]
        if scores > BACKWARD_CLI_MAX_SCORES:
            raise UsageError(
                f"--input {args.input}: q {tuple(q.shape)} and k {tuple(k.shape)} make "
                f"{scores:,} scores (B·H·Lq·Lk); this command prints every tile's rebuilt P "
                "and checks it against the dense reference, so it takes at most "
                f"{BACKWARD_CLI_MAX_SCORES:,} (one head of length 2048); use a shorter input, "
                "or the library with trace=flashledger.Trace(every=k) for long ones"
            )
    assert isinstance(q, torch.Tensor) and isinstance(k, torch.Tensor)
    assert isinstance(v, torch.Tensor) and isinstance(g, torch.Tensor)
    spec: MaskSpec = default_mask if args.mask is None else args.mask
    block_q = default_block if args.block_q is None else args.block_q
    block_k = default_block if args.block_k is None else args.block_k
    slopes = None
    if args.alibi:
        slopes = alibi_slopes(q.shape[-3] if q.ndim >= 3 else 1)
    opts: dict[str, Any] = dict(
        mask=spec.mask, conventions=args.conventions, dropout_p=args.dropout, seed=args.seed,
        softcap=args.softcap, alibi_slopes=slopes,
    )  # fmt: skip
    tiles = -(-q.shape[-2] // block_q) * -(-k.shape[-2] // block_k)
    lead = q.ndim - 2
    with progress("forward + backward", total=2 * tiles) as advance:
        printed = _PrintedSteps(advance, lead)
        fwd = blocked_forward(
            q, k, v, block_q=block_q, block_k=block_k, loop_order=args.loop_order,
            observer=_TileProgress(advance), **opts,
        )  # fmt: skip
        bwd = blocked_backward(
            q, k, v, fwd.o, fwd.lse, g, block_q=block_q, block_k=block_k,
            loop_order=args.loop_order, observer=printed, **opts,
        )  # fmt: skip
    ref = reference_forward(q, k, v, **opts)
    rb = reference_backward(q, k, v, ref.o, ref.lse, g, **opts)
    diffs = {
        "o": _max_abs_diff(fwd.o, ref.o),
        "lse": _max_abs_diff(fwd.lse, ref.lse),
        "dq": _max_abs_diff(bwd.dq, rb.dq),
        "dk": _max_abs_diff(bwd.dk, rb.dk),
        "dv": _max_abs_diff(bwd.dv, rb.dv),
    }
    steps = printed.steps
    config = {
        "input": args.input or "seed five-position example",
        "shape_q": list(q.shape), "shape_k": list(k.shape), "shape_v": list(v.shape),
        "mask": spec.label, "block_q": block_q, "block_k": block_k,
        "loop_order": args.loop_order, "conventions": args.conventions,
        "dropout": args.dropout, "seed": args.seed, "softcap": args.softcap, "alibi": args.alibi,
    }  # fmt: skip
    labels = _row_labels([*q.shape[:-1], 1])
    flat_o = fwd.o.reshape(-1, fwd.o.shape[-1])  # (rows, d_v)
    flat_lse, flat_d = fwd.lse.reshape(-1), bwd.D.reshape(-1)  # (rows,)
    if args.json:
        _print_json(
            {
                "config": config,
                "rows": [
                    {"row": lab, "lse": float(flat_lse[i]), "o": flat_o[i], "D": float(flat_d[i])}
                    for i, lab in enumerate(labels)
                ],
                "steps": steps,
                "gradients": {
                    name: {"blocked": got, "reference": want}
                    for name, got, want in (
                        ("dq", bwd.dq, rb.dq),
                        ("dk", bwd.dk, rb.dk),
                        ("dv", bwd.dv, rb.dv),
                    )
                },
                "max_abs_diff": diffs,
                "counters": {
                    "forward": fwd.ledger.counters.to_dict(),
                    "backward": bwd.ledger.counters.to_dict(),
                },
            }
        )
        return 0

    p = args.precision
    con = _console()
    con.print(
        f"Rebuild and differentiate: q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}, "
        f"mask {spec.label}, tiles {block_q}x{block_k}, {args.loop_order} order, "
        f"conventions {args.conventions}"
    )
    stat_rows = [
        [lab, _fmt_any(flat_lse[i], p), _fmt_any(flat_o[i], p), _fmt_any(flat_d[i], p)]
        for i, lab in enumerate(labels)
    ]
    con.print(
        titled_table(
            "Forward's saved per-row statistics", ["row", "LSE", "O", "D = G·O"], stat_rows
        )
    )
    step_rows = [
        [*(str(s[k]) for k in ("step", "tile", "queries", "keys", "kind")), _fmt_any(s["p"], p)]
        for s in steps
    ]
    title = "Backward steps: probability rows rebuilt from the saved LSE"
    if lead:
        title += " (first batch element and head)"
    con.print(
        titled_table(
            title, ["step", "tile", "queries", "keys", "kind", "rebuilt P rows"], step_rows
        )
    )
    grad_rows = []
    for name, got, want in (("dQ", bwd.dq, rb.dq), ("dK", bwd.dk, rb.dk), ("dV", bwd.dv, rb.dv)):
        g2, w2 = got.reshape(-1, got.shape[-1]), want.reshape(-1, want.shape[-1])
        for i, lab in enumerate(_row_labels(got.shape)):
            grad_rows.append(
                [f"{name}[{lab}]", _fmt_any(g2[i], p), _fmt_any(w2[i], p),
                 _fmt(_max_abs_diff(g2[i], w2[i]), 3)]
            )  # fmt: skip
    con.print(
        titled_table(
            "Accumulated gradients next to the full reference",
            ["object", "accumulated (blocked)", "full reference", "max |diff|"],
            grad_rows,
        )
    )
    c = bwd.ledger.counters
    con.print(
        f"backward steps: {c.tiles_run} run, {c.tiles_skipped} skipped; "
        f"QK dots rebuilt: {c.qk_dots_visible} visible, {c.qk_dots_computed} computed"
    )
    con.print(f"largest forward-output difference: {diffs['o']:.3g} (LSE {diffs['lse']:.3g})")
    con.print(
        "largest final-gradient difference: "
        f"{max(diffs['dq'], diffs['dk'], diffs['dv']):.3g} "
        f"(dQ {diffs['dq']:.3g}, dK {diffs['dk']:.3g}, dV {diffs['dv']:.3g})"
    )
    return 0


# ----------------------------------------------------------------------------------------
# account and traffic: closed forms (the seed's section 05, and the HBM model)
# ----------------------------------------------------------------------------------------
def _observed(
    args: argparse.Namespace, spec: MaskSpec, block_q: int, block_k: int, order: str
) -> Any:
    """Run the blocked loop on random inputs of the configuration; return both ledgers' counters."""
    import torch

    from .blocked import blocked_backward, blocked_forward

    gen = torch.Generator().manual_seed(0)
    lead = (args.batch, args.heads)
    kv = (args.batch, args.kv_heads or args.heads)
    dv = args.dv or args.d
    # Q, K, V, dO and the loop's O, dQ, dK, dV: twice the inputs
    elements = 2 * (
        lead[0] * lead[1] * args.lq * (args.d + dv) + kv[0] * kv[1] * args.lk * (args.d + dv)
    )
    check_fits(
        f"--check's random inputs and gradients ({elements:,} values)",
        elements * args.dtype.itemsize,
        "lower --lq, --lk, --d, --heads or --batch, or drop --check",
    )
    q = torch.randn(*lead, args.lq, args.d, generator=gen, dtype=args.dtype)
    k = torch.randn(*kv, args.lk, args.d, generator=gen, dtype=args.dtype)
    v = torch.randn(*kv, args.lk, dv, generator=gen, dtype=args.dtype)
    g = torch.randn(*lead, args.lq, dv, generator=gen, dtype=args.dtype)
    opts: dict[str, Any] = dict(
        mask=spec.mask, conventions=args.conventions, block_q=block_q, block_k=block_k,
        loop_order=order,
    )  # fmt: skip
    tiles = -(-args.lq // block_q) * -(-args.lk // block_k)
    with progress(f"running the {order} loop", total=2 * tiles) as advance:
        obs = _TileProgress(advance)
        fwd = blocked_forward(q, k, v, observer=obs, **opts)
        bwd = blocked_backward(q, k, v, fwd.o, fwd.lse, g, observer=obs, **opts)
    return fwd.ledger.counters, bwd.ledger.counters


def _seed_defaults(args: argparse.Namespace) -> MaskSpec:
    """Fill the seed's sizes (5 x 5, d = 2, causal) where not given; a mask file sets Lq, Lk."""
    from .masks import DenseMask

    spec: MaskSpec = _mask("causal") if args.mask is None else args.mask
    if isinstance(spec.mask, DenseMask):
        lq, lk = spec.mask.mask.shape[-2:]
        args.lq = lq if args.lq is None else args.lq
        args.lk = lk if args.lk is None else args.lk
    args.lq = 5 if args.lq is None else args.lq
    args.lk = args.lq if args.lk is None else args.lk
    args.d = 2 if args.d is None else args.d
    return spec


def _cmd_account(args: argparse.Namespace) -> int:
    from .accounting import storage_and_work

    spec = _seed_defaults(args)
    block_q = 2 if args.block_q is None else args.block_q
    block_k = 2 if args.block_k is None else args.block_k
    sw = storage_and_work(
        lq=args.lq, lk=args.lk, d=args.d, d_v=args.dv, heads=args.heads,
        kv_heads=args.kv_heads, batch=args.batch, block_q=block_q, block_k=block_k,
        mask=spec.mask, conventions=args.conventions, dtype=args.dtype,
    )  # fmt: skip
    checks = (
        _account_checks(sw, _observed(args, spec, block_q, block_k, "fa2")) if args.check else None
    )
    if args.json:
        out = sw.to_dict()
        out["config"]["mask"] = spec.label
        if checks is not None:
            out["check"] = {name: {"closed_form": a, "observed": b} for name, a, b in checks}
        _print_json(out)
    else:
        con = _console()
        con.print(sw)
        if checks is not None:
            _print_checks(con, checks)
    return 1 if checks and any(a != b for _, a, b in checks) else 0


def _account_checks(sw: StorageWork, counters: Any) -> list[tuple[str, int, int]]:
    fwd, bwd = counters
    return [
        ("qk_dots_forward", sw.qk_dots_forward, fwd.qk_dots_visible),
        ("qk_dots_backward", sw.qk_dots_backward, bwd.qk_dots_visible),
        ("qk_dots_computed", sw.qk_dots_computed, fwd.qk_dots_computed),
        ("tiles_run", sw.tiles_run, fwd.tiles_run),
        ("tiles_skipped", sw.tiles_skipped, fwd.tiles_skipped),
        ("tiles_full", sw.tiles_full, fwd.tiles_full),
        ("tiles_partial", sw.tiles_partial, fwd.tiles_partial),
        ("exps_forward", sw.exps_forward, fwd.exps),
        ("exps_backward", sw.exps_backward, bwd.exps),
    ]


def _print_checks(con: _Out, checks: list[tuple[str, int, int]]) -> None:
    rows = [[n, f"{a:,}", f"{b:,}", "yes" if a == b else "NO"] for n, a, b in checks]
    con.print(
        titled_table(
            "Closed form against the blocked loop's counters (random inputs, same tiles)",
            ["figure", "closed form", "observed", "equal"],
            rows,
        )
    )


def _cmd_traffic(args: argparse.Namespace) -> int:
    if args.sweep:
        return _traffic_sweep(args)
    if args.out is not None:
        raise UsageError("--out names the plot of --sweep: add --sweep, or drop --out")
    from .accounting import SCHEDULES, memory_traffic

    spec = _seed_defaults(args)
    if args.sram is None:  # a tile side left out is 2, as in account
        args.block_q = 2 if args.block_q is None else args.block_q
        args.block_k = 2 if args.block_k is None else args.block_k
    elif args.block_q is not None or args.block_k is not None:
        raise UsageError(
            "give either --sram M (tiles from the paper's rule) or --block-q/--block-k"
        )
    schedules = SCHEDULES if args.schedule == "all" else (args.schedule,)
    if args.check and schedules == ("standard",):
        raise UsageError(
            "--check compares the blocked loop's counters: use it with --schedule fa1, fa2 or all"
        )
    reports = [
        memory_traffic(
            lq=args.lq, lk=args.lk, d=args.d, d_v=args.dv, heads=args.heads,
            kv_heads=args.kv_heads, batch=args.batch, schedule=sch, sram_elements=args.sram,
            block_q=args.block_q, block_k=args.block_k, mask=spec.mask,
            conventions=args.conventions, dtype=args.dtype,
        )
        for sch in schedules
    ]  # fmt: skip
    checks: list[tuple[str, int, int]] = []
    if args.check:
        for t in reports:
            if t.schedule == "standard":
                continue
            bq, bk = t.config["block_q"], t.config["block_k"]
            fwd, bwd = _observed(args, spec, bq, bk, t.schedule)
            checks += [
                (f"{t.schedule} forward read", t.forward_read, fwd.elements_read),
                (f"{t.schedule} forward written", t.forward_written, fwd.elements_written),
                (f"{t.schedule} backward read", t.backward_read, bwd.elements_read),
                (f"{t.schedule} backward written", t.backward_written, bwd.elements_written),
            ]
    if args.json:
        out: dict[str, Any] = {"schedules": [_traffic_json(t, spec) for t in reports]}
        if args.check:
            out["check"] = {name: {"closed_form": a, "observed": b} for name, a, b in checks}
        _print_json(out)
    else:
        con = _console()
        _print_traffic_summary(con, reports)
        for t in reports:
            con.print(t)
        if args.check:
            _print_checks(con, checks)
    return 1 if any(a != b for _, a, b in checks) else 0


def _traffic_json(t: Traffic, spec: MaskSpec) -> dict[str, Any]:
    out = t.to_dict()
    out["config"]["mask"] = spec.label
    return out


def _print_traffic_summary(con: _Out, reports: Sequence[Traffic]) -> None:
    rows = [
        [t.schedule,
         "-" if t.config["block_q"] is None else f"{t.config['block_q']}x{t.config['block_k']}",
         f"{t.forward_read:,}", f"{t.forward_written:,}", f"{t.backward_read:,}",
         f"{t.backward_written:,}", f"{t.total:,}", f"{t.total_bytes:,}"]
        for t in reports
    ]  # fmt: skip
    con.print(
        titled_table(
            "Slow-memory (HBM) traffic, elements (totals over batch and heads)",
            ["schedule", "tiles", "fwd read", "fwd written", "bwd read", "bwd written",
             "total", "total bytes"],
            rows,
        )
    )  # fmt: skip


def _traffic_sweep(args: argparse.Namespace) -> int:
    from .accounting import traffic_sweep

    if args.mask is not None or args.block_q is not None or args.block_k is not None:
        raise UsageError(
            "--sweep uses no mask and the paper's tile rule: drop --mask/--block-q/--block-k"
        )
    unused = [
        flag
        for flag, at_default in (
            ("--lk", args.lk is None), ("--dv", args.dv is None), ("--heads", args.heads == 1),
            ("--kv-heads", args.kv_heads is None), ("--batch", args.batch == 1),
            ("--dtype", args.dtype == _dtype("float64")), ("--conventions", args.conventions == "seed"),
            ("--check", not args.check), ("--schedule", args.schedule == "all"),
        )
        if not at_default
    ]  # fmt: skip
    if unused:
        raise UsageError(
            f"--sweep plots one head of N x N (N = --lq) at head dim --d for every M: "
            f"{', '.join(unused)} would be ignored; drop {'it' if len(unused) == 1 else 'them'}"
        )
    args.out = "traffic.png" if args.out is None else args.out
    if Path(args.out).suffix.lower() not in ("", ".png"):
        raise UsageError(
            f"--out {args.out}: the sweep draws a PNG; name a .png file (or a path without an "
            "extension, such as a device)"
        )
    problem = output_problem(args.out)
    if problem:
        raise UsageError(f"cannot write --out {args.out}: {problem}")
    d = 64 if args.d is None else args.d
    n = 4096 if args.lq is None else args.lq
    sram = 32768 if args.sram is None else args.sram
    with progress("sweeping M and N, drawing the plot", total=2) as advance:
        sweep = traffic_sweep(d=d, n=n, sram_elements=sram)
        advance(1.0)
        sweep.plot(args.out)
        advance(1.0)
    if args.json:
        out = sweep.to_dict()
        out["plot"] = args.out
        _print_json(out)
        return 0
    con = _console()
    con.print(sweep)
    for line in sweep.crossover_lines():
        con.print(line)
    con.print(f"plot saved to {args.out}")
    return 0


# ----------------------------------------------------------------------------------------
# explore and the delegated subcommands
# ----------------------------------------------------------------------------------------
def _cmd_explore(args: argparse.Namespace) -> int:
    try:
        from .web.app import serve
    except ImportError as exc:
        raise UsageError(f"the explorer is not available: {exc}") from None
    # serve refuses an empty --host or a bad --allow-host name (ValueError, one line) before
    # it binds, as it does for python -m flashledger.web
    # a busy port or an unknown host raises OSError with one line, before the server starts
    serve(host=args.host, port=args.port, open_browser=args.open, allow_hosts=args.allow_host)
    return 0


def _run_delegated(name: str, rest: list[str]) -> int:
    try:
        module = importlib.import_module(f"flashledger.{name}")
    except ImportError as exc:
        raise UsageError(f"not available in this installation ({exc})") from None
    add = getattr(module, "add_cli_arguments", None)
    run = getattr(module, "run_cli", None)
    if not callable(add) or not callable(run):
        raise UsageError(
            f"not available: flashledger.{name} has no command line (add_cli_arguments / run_cli)"
        )
    parser = _Parser(
        prog=f"{PROG} {name}",
        description=_describe(DELEGATED_DESCRIPTIONS[name]),
        epilog=DELEGATED_EXAMPLES[name],
        formatter_class=_Formatter,
    )
    add(parser)
    ns = parser.parse_args(rest)
    return int(run(ns) or 0)


# ----------------------------------------------------------------------------------------
# the parser
# ----------------------------------------------------------------------------------------
DESCRIPTIONS = {  # shown by each subcommand's --help
    "online": (
        "One row of scores read block by block: the running max, the rescale factor α, "
        "the denominator ℓ and the weighted sum acc, next to the full-row softmax."
    ),
    "backward": (
        "The blocked forward saves one LSE per row; each backward step rebuilds its "
        "probability block from it and adds its gradient contributions. Shown next to "
        "the dense reference."
    ),
    "account": (
        "Storage of the path that keeps P against the path that keeps one LSE per row, "
        "and the work of both passes, computed from the schedule and the mask's tiles."
    ),
    "traffic": (
        "Element reads and writes of slow memory, by tensor, for standard attention (S "
        "and P in HBM) and the FlashAttention-1/-2 schedules. Tiles from --sram M by the "
        "paper's rule (Bc = ceil(M/4d), Br = min(Bc, d)) or from --block-q/--block-k."
    ),
    "explore": (
        "Serve the explorer (the seed's sections and beyond) on a local port. It answers "
        "only to loopback names and the address it listens on (add names with "
        "--allow-host); listening beyond this machine (--host 0.0.0.0) prints a warning."
    ),
}
DELEGATED_DESCRIPTIONS = {
    "verify": "Check attention implementations (flashledger's own paths, PyTorch's SDPA back "
    "ends and FlexAttention) against an exact float64 answer, each under its own conventions "
    "(masked rows, causal alignment, LSE), with error bounds derived case by case; exit "
    "status 1 on a failure.",
    "bench": "Time flashledger's attention against PyTorch's SDPA (and a naive materialised "
    "version) in one process, interleaved rounds, medians; beside each ratio the FMA and "
    "GEMM peaks of this machine and the native step's choices. --decode and --contention "
    "run the decode and busy-machine benchmarks instead.",
    "ring": "Ring attention's in-process twin: every rank's shard, hop and saved state, the "
    "communication counted against its closed form, the result checked against the dense "
    "reference (the distributed form runs under torchrun: examples/ring_demo.py).",
    "model": "Run a random-initialised transformers model (llama, mistral, qwen2, gemma2, bert, "
    "gpt_oss) with flashledger's attention and print the ledger of every attention call: "
    "masks, tiles run and skipped, dot products, FLOPs, memory kept and moved.",
}
DELEGATED_EXAMPLES = {
    "verify": """\
examples:
  flashledger verify --quick                every system and convention, small cases (seconds)
  flashledger verify                        the full sweep
  flashledger verify --quick --html report.html
""",
    "bench": """\
examples:
  flashledger bench --quick                 one minute: L = 1024, 2048, float32
  flashledger bench --lengths 4096,8192 --dtypes float32,float64 --no-naive
  flashledger bench --decode                one query row against a KV cache
  flashledger bench --contention            with one other busy process beside it
""",
    "ring": """\
examples:
  flashledger ring --world 3 --layout zigzag --seq 24 --d 8 --causal
  flashledger ring --world 4 --layout contiguous --seq 64 --causal   (unbalanced work)
  flashledger ring --window 8,0 --conventions flash_attn_2 --json
""",
    "model": """\
examples:
  flashledger model --arch llama --layers 4 --seq 2048
  flashledger model --arch mistral --window 64 --backward
  flashledger model --arch qwen2 --generate 8 --json
""",
}
ONLINE_EXAMPLES = """\
examples:
  flashledger online                        the seed's six scores [1, 2, -1, 3, 0, 2.5], blocks of 2
  flashledger online --shift 5              same probabilities and output, running max 8
  flashledger online --counterexample       per-block softmax averaging gives the wrong answer
  flashledger online --scores 1,2,-1 --values "1,0;0,1;1,1" --block 1
  flashledger online --json
"""
BACKWARD_EXAMPLES = """\
examples:
  flashledger backward                      the seed's five positions, causal, tiles 2x2
  flashledger backward --block-q 1 --block-k 5
  flashledger backward --mask window:1,0 --conventions flash_attn_2
  flashledger backward --dropout 0.2 --seed 7 --softcap 2 --alibi
  flashledger backward --input qkvg.npz --mask mask.npy --json
"""
ACCOUNT_EXAMPLES = """\
examples:
  flashledger account                       the seed: P 25, LSE 5, tile 4, 15 + 15 dots, 17 computed
  flashledger account --lq 4096 --d 64 --heads 8 --block-q 128 --block-k 128 --dtype float16
  flashledger account --lq 1024 --mask window:128,0 --block-q 64 --block-k 64 --check
  flashledger account --json
"""
TRAFFIC_EXAMPLES = """\
examples:
  flashledger traffic                       the seed's configuration, tiles 2x2, three schedules
  flashledger traffic --lq 4096 --d 64 --sram 32768 --mask none
  flashledger traffic --schedule fa1 --lq 64 --d 8 --block-q 16 --block-k 8 --check
  flashledger traffic --sweep --out docs/img/traffic.png
"""
EXPLORE_EXAMPLES = """\
examples:
  flashledger explore                       http://127.0.0.1:8000
  flashledger explore --port 8080 --open
  flashledger explore --port 0              any free port (the address is printed)
"""


def _common() -> _Parser:
    """Options every report shares: ``--json`` and ``--precision``."""
    common = _Parser(add_help=False)
    common.add_argument("--json", action="store_true", help="machine-readable output")
    common.add_argument(
        "--precision", type=_precision, default=6, metavar="N",
        help="significant digits in tables",
    )  # fmt: skip
    return common


def _add_shape(sp: argparse.ArgumentParser) -> None:
    pos = int_arg(1)
    sp.add_argument("--lq", type=pos, help="query length (default: the seed's 5)")
    sp.add_argument("--lk", type=pos, help="key length (default: Lq)")
    sp.add_argument("--d", type=pos, help="head dim of Q and K (default: the seed's 2)")
    sp.add_argument("--dv", type=pos, help="head dim of V (default: d)")
    sp.add_argument("--heads", type=pos, default=1, help="query heads")
    sp.add_argument("--kv-heads", type=pos, help="key/value heads (default: heads; fewer = GQA)")
    sp.add_argument("--batch", type=pos, default=1, help="batch size")
    sp.add_argument("--block-q", type=pos, help="query tile size Br (default 2)")
    sp.add_argument("--block-k", type=pos, help="key tile size Bc (default 2)")
    sp.add_argument("--mask", type=_mask, metavar="MASK", help=f"{MASK_HELP} (default causal)")
    sp.add_argument(
        "--dtype", type=_dtype, default="float64", metavar="DTYPE",
        help=f"element type for bytes: {', '.join(DTYPES)}",
    )  # fmt: skip
    sp.add_argument(
        "--conventions", type=preset_arg, default="seed", metavar="PRESET",
        help="conventions preset (sets causal alignment)",
    )  # fmt: skip
    sp.add_argument(
        "--check", action="store_true",
        help="also run the blocked loop on random inputs and compare its counters",
    )  # fmt: skip


def build_parser() -> argparse.ArgumentParser:
    """The ``flashledger`` argument parser (subcommand modules are not imported here)."""
    parser = _Parser(
        prog=PROG,
        description=_describe(
            "Exact blocked attention (the FlashAttention algorithm), observed: "
            "ledgers, accounting and checks."
        ),
        epilog="Run 'flashledger COMMAND --help' for a command's options and examples.",
        formatter_class=_Formatter,
    )
    from . import __version__

    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    kw: dict[str, Any] = {"formatter_class": _Formatter}

    on = sub.add_parser(
        "online", parents=[_common()], help="the running state (m, ℓ, acc) block by block",
        description=_describe(DESCRIPTIONS["online"]),
        epilog=ONLINE_EXAMPLES, **kw,
    )  # fmt: skip
    on.add_argument(
        "--scores", type=_score_list, help="comma-separated scores (default: the seed's six)"
    )
    on.add_argument("--values", type=_matrix, help='one value vector per score: "1,0;0,1;..."')
    on.add_argument("--block", type=int_arg(1), help="scores per block (default 2)")
    on.add_argument("--shift", type=_finite, default=0.0, help="add this constant to every score")
    on.add_argument(
        "--counterexample", action="store_true",
        help="also show that averaging per-block softmax outputs is wrong",
    )  # fmt: skip
    on.set_defaults(handler=_cmd_online)

    bw = sub.add_parser(
        "backward", parents=[_common()],
        help="rebuild P from the saved LSE and accumulate dQ, dK, dV",
        description=_describe(DESCRIPTIONS["backward"]),
        epilog=BACKWARD_EXAMPLES, **kw,
    )  # fmt: skip
    bw.add_argument(
        "--input",
        metavar="FILE",
        help=".json or .npz with keys q, k, v, g, computed in float64 whatever their dtype "
        "(default: the seed's five positions)",
    )
    bw.add_argument(
        "--block-q",
        type=int_arg(1),
        help="query tile size (default 2 for the seed, 64 for files)",
    )
    bw.add_argument(
        "--block-k", type=int_arg(1), help="key tile size (default 2 for the seed, 64 for files)"
    )
    bw.add_argument(
        "--mask",
        type=_mask,
        metavar="MASK",
        help=f"{MASK_HELP} (default causal for the seed, none for files)",
    )
    bw.add_argument(
        "--loop-order", choices=("fa2", "fa1"), default="fa2", help="forward loop order"
    )
    bw.add_argument(
        "--conventions",
        type=preset_arg,
        default="seed",
        metavar="PRESET",
        help="conventions preset",
    )
    bw.add_argument(
        "--dropout",
        type=_probability,
        default=0.0,
        metavar="P",
        help="dropout probability in [0, 1)",
    )
    bw.add_argument("--seed", type=int_arg(0), default=0, help="dropout seed")
    bw.add_argument(
        "--softcap", type=_positive_number, metavar="C", help="softcap C > 0: s = C tanh(s / C)"
    )
    bw.add_argument("--alibi", action="store_true", help="add ALiBi biases (standard slopes)")
    bw.set_defaults(handler=_cmd_backward)

    ac = sub.add_parser(
        "account", parents=[_common()], help="the storage-and-work ledger (closed form)",
        description=_describe(DESCRIPTIONS["account"]),
        epilog=ACCOUNT_EXAMPLES, **kw,
    )  # fmt: skip
    _add_shape(ac)
    ac.set_defaults(handler=_cmd_account)

    tr = sub.add_parser(
        "traffic", parents=[_common()], help="slow-memory (HBM) traffic of standard, FA1, FA2",
        description=_describe(DESCRIPTIONS["traffic"]),
        epilog=TRAFFIC_EXAMPLES, **kw,
    )  # fmt: skip
    _add_shape(tr)
    tr.add_argument(
        "--sram",
        type=int_arg(1),
        metavar="M",
        help="on-chip memory in elements (paper's tile rule); "
        "with --sweep: M of the N sweep (default 32768)",
    )
    tr.add_argument(
        "--schedule",
        choices=("all", "standard", "fa1", "fa2"),
        default="all",
        help="schedule(s) to show",
    )
    tr.add_argument(
        "--sweep",
        action="store_true",
        help="sweep M and N (no mask, d default 64, N = --lq default 4096) and save a plot",
    )
    tr.add_argument(
        "--out", metavar="PNG", help="where --sweep saves its plot (default traffic.png)"
    )
    tr.set_defaults(handler=_cmd_traffic)

    ex = sub.add_parser(
        "explore", help="start the local web explorer",
        description=_describe(DESCRIPTIONS["explore"]),
        epilog=EXPLORE_EXAMPLES, **kw,
    )  # fmt: skip
    ex.add_argument("--host", default="127.0.0.1", help="interface to listen on")
    ex.add_argument("--port", type=_port, default=8000, help="port to listen on (0: any free)")
    ex.add_argument("--open", action="store_true", help="open a browser tab")
    ex.add_argument(
        "--allow-host", action="append", default=[], metavar="NAME",
        help="another name the explorer answers to in the Host header (repeatable)",
    )  # fmt: skip
    ex.set_defaults(handler=_cmd_explore)

    for name, text in DELEGATED.items():
        sub.add_parser(
            name, help=f"{text} (options: flashledger {name} --help)", add_help=False,
            description=text,
        )  # fmt: skip
    return parser


VALUE_OPTIONS = ("--scores", "--values", "--shift", "--window", "--tiles", "--lengths")
"""Options whose values may start with '-' (``--scores -1,2``, ``ring --window -1,0``)."""


def main(argv: Sequence[str] | None = None) -> int:
    """Run the command line; returns the exit status (2 for bad input)."""
    args_list = join_dash_values(list(sys.argv[1:] if argv is None else argv), VALUE_OPTIONS)
    parser = build_parser()
    command = "?"
    try:
        try:
            args, rest = parser.parse_known_args(args_list)
        except SystemExit as exc:  # --help / --version
            return int(exc.code or 0)
        command = args.command
        if command in DELEGATED:
            try:
                return _run_delegated(command, rest)
            except SystemExit as exc:
                return int(exc.code or 0)
        if rest:
            raise UsageError(f"{PROG} {command}: error: unrecognized arguments: {' '.join(rest)}")
        handler: Callable[[argparse.Namespace], int] = args.handler
        return handler(args)
    except UsageError as exc:
        msg = str(exc)
        _fail(msg if msg.startswith(PROG) else f"{PROG} {command}: error: {msg}")
        return 2
    except BrokenPipeError:
        # the reader went away (``| head``): stop quietly, as a filter should
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
        return 0
    except OSError as exc:  # its text without the "[Errno N]" prefix
        where = f": {exc.filename}" if exc.filename else ""
        _fail(f"{PROG} {command}: error: {f'{exc.strerror}{where}' if exc.strerror else exc}")
        return 2
    except (ValueError, TypeError, ImportError) as exc:
        _fail(f"{PROG} {command}: error: {exc}")
        return 2
    except KeyboardInterrupt:
        _fail(f"{PROG} {command}: interrupted")
        return 130
    except Exception as exc:
        if _out_of_memory(exc) and not os.environ.get("FLASHLEDGER_DEBUG"):
            _fail(
                f"{PROG} {command}: error: not enough memory for this size "
                f"({_allocation(exc)}); try smaller lengths, heads or batch"
            )
            return 1
        if os.environ.get("FLASHLEDGER_DEBUG"):
            raise
        _fail(
            f"{PROG} {command}: internal error: {type(exc).__name__}: {exc} "
            "(set FLASHLEDGER_DEBUG=1 for the traceback)"
        )
        return 1


def _out_of_memory(exc: BaseException) -> bool:
    """An allocation failure: Python's MemoryError or PyTorch's (CPU or CUDA) allocator error."""
    if isinstance(exc, MemoryError) or type(exc).__name__ == "OutOfMemoryError":
        return True
    return isinstance(exc, RuntimeError) and "can't allocate memory" in str(exc)


def _allocation(exc: BaseException) -> str:
    """What failed to allocate, from PyTorch's message when it says."""
    found = re.search(r"allocate (\d+) bytes", str(exc))
    if found is None:
        return type(exc).__name__
    n = int(found.group(1))
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"one allocation of {n / scale:,.1f} {unit} failed"
    return f"one allocation of {n:,} bytes failed"


LONGEST_WORD = 200
"""Longest run without spaces an error line echoes whole (a value given by mistake, such
as a file's contents pasted as an option, is cut: its start, its end and its length)."""


def _fail(message: str) -> None:
    """One line on standard error."""
    from ._text import cut_middle

    words = (cut_middle(w, LONGEST_WORD) for w in message.split())
    sys.stderr.write(" ".join(words) + "\n")


if __name__ == "__main__":
    sys.exit(main())
