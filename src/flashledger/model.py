"""A whole model's attention ledger: every attention call's counters, per layer.

    with fl.ledger_of(model) as book:
        loss = model(input_ids, labels=input_ids).loss
        loss.backward()
    print(book)          # one row per (attention module, pass), and the totals

Every attention call that flashledger runs for a module of ``model`` (a
transformers model loaded with the attention ``flashledger.integrations.
transformers.register()`` names) books its forward's ``Ledger`` counters, and
its backward's when the gradient flows, even after the block ends: tiles run
and skipped (full / partial), QK dot products computed and visible, FLOPs,
the storage a path that keeps P would need against the one LSE per row
flashledger keeps, and the slow-memory (HBM) traffic of the schedule.

``flashledger model --arch llama --layers 4 --seq 2048`` prints the ledger of
a random-initialised model from the command line (``add_cli_arguments`` /
``run_cli``); it needs transformers (``pip install flashledger[transformers]``).
Run ``python -m flashledger.model`` for a small demo.
"""

from __future__ import annotations

import argparse
import contextvars
import json
import sys
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from ._limits import check_fits
from .accounting import _Report
from .ledger import Counters, Ledger

__all__ = ["AttentionCall", "ModelLedger", "add_cli_arguments", "ledger_of", "run_cli"]

INSTALL_HINT = "pip install flashledger[transformers]"
_BOOKS: contextvars.ContextVar[tuple[ModelLedger, ...]] = contextvars.ContextVar(
    "flashledger_model_books", default=()
)


@dataclass(frozen=True)
class AttentionCall:
    """One pass of one attention call. Counts are totals over batch and query heads."""

    index: int  # the call's number in the book (a backward has its forward's number)
    module: str  # the attention module's qualified name in the model
    layer: int | None  # the module's ``layer_idx`` when it has one
    pass_name: str  # "forward" or "backward"
    batch: int
    heads: int  # query heads
    kv_heads: int
    lq: int
    lk: int  # keys the call ran (a key tail no row sees is left out)
    d: int
    d_v: int
    dtype: str
    mask: str  # how the mask was read: causal, window, full, intervals, dense; "+pad": padding
    counters: Counters

    @property
    def flops(self) -> int:
        """Matmul FLOPs: ``2(d + d_v)`` per QK dot computed forward, ``2(3d + 2d_v)`` backward."""
        per_dot = (
            2 * (self.d + self.d_v)
            if self.pass_name == "forward"
            else 2 * (3 * self.d + 2 * self.d_v)
        )
        return per_dot * self.counters.qk_dots_computed

    @property
    def p_elements(self) -> int:
        """Elements a path that keeps P for the backward would store: ``Lq·Lk`` per (batch, head)."""
        return self.batch * self.heads * self.lq * self.lk if self.pass_name == "forward" else 0

    @property
    def lse_elements(self) -> int:
        """Elements flashledger keeps instead: one LSE per row."""
        return self.batch * self.heads * self.lq if self.pass_name == "forward" else 0

    def to_dict(self) -> dict[str, Any]:
        out = {k: getattr(self, k) for k in self.__dataclass_fields__ if k != "counters"}
        out["counters"] = self.counters.to_dict()
        out.update(flops=self.flops, p_elements=self.p_elements, lse_elements=self.lse_elements)
        return out


_SUMMED = (
    "tiles_run",
    "tiles_skipped",
    "tiles_full",
    "tiles_partial",
    "qk_dots_computed",
    "qk_dots_visible",
    "flops",
    "p_elements",
    "lse_elements",
    "elements_read",
    "elements_written",
)
# the table's counted columns (JSON has every one of _SUMMED)
_SHOWN = tuple(n for n in _SUMMED if n not in ("tiles_full", "tiles_partial"))
_HEADER = [
    "layer",
    "pass",
    "calls",
    "mask",
    "Lq x Lk",
    "tiles",
    "skipped",
    "QK dots",
    "visible",
    "FLOPs",
    "P kept",
    "LSE kept",
    "HBM read",
    "HBM write",
]


def _count(x: int) -> str:
    """Exact below a million (``12,345``), three digits above (``5.37e+09``)."""
    return f"{x:,}" if abs(x) < 1_000_000 else f"{x:.3g}"


def _span(values: list[int]) -> str:
    lo, hi = min(values), max(values)
    return str(lo) if lo == hi else f"{lo}..{hi}"


@dataclass
class ModelLedger(_Report):
    """The attention calls of one model while the book was open (``ledger_of(model)``).

    ``calls`` holds one ``AttentionCall`` per pass in the order they ran;
    ``rows()`` sums them per (module, pass); ``totals()`` per pass. Renders as
    a text table (``str``), rich, HTML in a notebook, and ``to_dict()``.
    """

    title: str = "Attention ledger"
    calls: list[AttentionCall] = field(default_factory=list)
    _names: dict[int, str] = field(default_factory=dict, repr=False)
    _order: dict[str, int] = field(default_factory=dict, repr=False)
    _token: Any = field(default=None, repr=False)
    _forwards: int = field(default=0, repr=False)
    _model: str = field(default="the model", repr=False)
    _booked_at_enter: int = field(default=0, repr=False)

    # -- booking --------------------------------------------------------------------
    def _holds(self, module: Any) -> bool:
        return id(module) in self._names

    def _sink(
        self, module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str
    ) -> Callable[[Ledger], None]:
        index = self._forwards
        self._forwards += 1
        b, hq, lq, d = q.shape
        hkv, lk, dv = k.shape[1], k.shape[2], v.shape[-1]
        name = self._names[id(module)]
        layer = getattr(module, "layer_idx", None)
        layer = layer if isinstance(layer, int) else None
        dtype = str(q.dtype).removeprefix("torch.")

        def book(ledger: Ledger) -> None:
            self.calls.append(
                AttentionCall(
                    index, name, layer, ledger.pass_name, b, hq, hkv, lq, lk, d, dv, dtype, mask,
                    Counters(**ledger.counters.to_dict()),
                )
            )  # fmt: skip

        return book

    def __enter__(self) -> ModelLedger:
        self._token = _BOOKS.set((*_BOOKS.get(), self))
        self._booked_at_enter = len(self.calls)
        return self

    def __exit__(self, *exc: object) -> None:
        _BOOKS.reset(self._token)
        if exc[0] is None and len(self.calls) == self._booked_at_enter:
            warnings.warn(
                f"ledger_of: no attention call of {self._model} reached flashledger's attention "
                "while the book was open: the block did not run the model, or its attention "
                "modules compute attention themselves instead of calling the attention "
                "interface (a transformers model whose code does not dispatch through "
                "AttentionInterface, such as DeBERTa, runs its own attention whatever "
                "attn_implementation says)",
                stacklevel=2,
            )

    # -- summaries ------------------------------------------------------------------
    def rows(self) -> list[dict[str, Any]]:
        """Per (module, pass), in model order: calls, shapes, mask and summed counts."""
        groups: dict[tuple[str, str], list[AttentionCall]] = {}
        for c in self.calls:
            groups.setdefault((c.module, c.pass_name), []).append(c)
        keys = sorted(groups, key=lambda k: (self._order.get(k[0], 0), k[1] != "forward"))
        return [_summary(groups[k], module=k[0], pass_name=k[1]) for k in keys]

    def totals(self) -> dict[str, dict[str, Any]]:
        """Per pass (``"forward"``, ``"backward"``): every call summed."""
        out: dict[str, dict[str, Any]] = {}
        for p in ("forward", "backward"):
            calls = [c for c in self.calls if c.pass_name == p]
            if calls:
                out[p] = _summary(calls, module="all", pass_name=p)
        return out

    def to_dict(self) -> dict[str, Any]:
        return {
            "title": self.title,
            "rows": self.rows(),
            "totals": self.totals(),
            "calls": [c.to_dict() for c in self.calls],
        }

    # -- rendering (the _Report mixin: str, rich, HTML) --------------------------------
    def _title(self) -> str:
        n = sum(c.pass_name == "forward" for c in self.calls)
        return f"{self.title}: {n} attention call{'s' if n != 1 else ''}"

    def _header(self) -> list[str]:
        return list(_HEADER)

    def _rows(self) -> list[list[str]]:
        rows = [*self.rows(), *self.totals().values()]
        out = []
        for r in rows:
            layer = (
                "all" if r["module"] == "all" else ("-" if r["layer"] is None else str(r["layer"]))
            )
            cells = [_count(r[k]) for k in _SHOWN]
            if r["pass"] == "backward":  # the backward keeps nothing for later
                cells[_SHOWN.index("p_elements")] = cells[_SHOWN.index("lse_elements")] = "-"
            out.append([layer, r["pass"], _count(r["calls"]), r["mask"], r["shape"], *cells])
        if not out:
            out.append(["-", "-", "0", "-", "-"] + ["0"] * len(_SHOWN))
        return out


def _summary(calls: list[AttentionCall], *, module: str, pass_name: str) -> dict[str, Any]:
    layers = {c.layer for c in calls}
    row: dict[str, Any] = {
        "module": module,
        "layer": layers.pop() if len(layers) == 1 else None,
        "pass": pass_name,
        "calls": len(calls),
        "mask": masks.pop() if len(masks := {c.mask for c in calls}) == 1 else "mixed",
        "shape": f"{_span([c.lq for c in calls])} x {_span([c.lk for c in calls])}",
    }
    for k in _SUMMED:
        row[k] = sum(
            getattr(c, k) if hasattr(AttentionCall, k) else getattr(c.counters, k) for c in calls
        )
    return row


def _check_attention(model: torch.nn.Module) -> None:
    """A transformers model must run flashledger's attention, else nothing would be booked."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or "transformers" not in sys.modules:
        return
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from .integrations._hf_attention import attention_forward

    fn = ALL_ATTENTION_FUNCTIONS.get(impl)
    if getattr(fn, "func", fn) is not attention_forward:
        raise ValueError(
            f"ledger_of: the model's attention is {impl!r}, not flashledger's, so there would be "
            "nothing to book; load it with attn_implementation=flashledger.integrations."
            "transformers.register() (or call model.set_attn_implementation(register()))"
        )


def ledger_of(model: torch.nn.Module, *, title: str | None = None) -> ModelLedger:
    """A book of ``model``'s attention calls: use as ``with ledger_of(model) as book: ...``.

    Calls made by the model's modules while the block is open are booked
    (their backward too, whenever it runs); calls of other models are not.
    Raises ``ValueError`` for a transformers model whose attention is not
    flashledger's.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"ledger_of needs a torch.nn.Module, got {type(model).__name__}")
    _check_attention(model)
    names = {id(m): (n or type(m).__name__) for n, m in model.named_modules()}
    order = {n: i for i, n in enumerate(names.values())}
    name = title or f"Attention ledger of {type(model).__name__}"
    return ModelLedger(title=name, _names=names, _order=order, _model=type(model).__name__)


def _sink_for(
    module: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: str
) -> Callable[[Ledger], None] | None:
    """The booking callback of every open book holding ``module`` (None when there is none)."""
    sinks = [book._sink(module, q, k, v, mask) for book in _BOOKS.get() if book._holds(module)]
    if not sinks:
        return None
    if len(sinks) == 1:
        return sinks[0]

    def all_books(ledger: Ledger) -> None:
        for s in sinks:
            s(ledger)

    return all_books


# ----------------------------------------------------------------------------------------
# the `flashledger model` command
# ----------------------------------------------------------------------------------------
DTYPES = ("float32", "float64", "bfloat16")


def add_cli_arguments(parser: argparse.ArgumentParser) -> None:
    """Options of ``flashledger model`` (``--arch llama --layers 4 --seq 2048``)."""
    from ._progress import int_arg

    pos = int_arg(1)
    parser.add_argument(
        "--arch",
        default="llama",
        metavar="ARCH",
        help="architecture: llama, mistral, qwen2, gemma2, bert, gpt_oss (default llama)",
    )
    parser.add_argument("--layers", type=pos, default=4, help="hidden layers (default 4)")
    parser.add_argument("--seq", type=pos, default=512, help="tokens per sequence (default 512)")
    parser.add_argument("--batch", type=pos, default=1, help="sequences (default 1)")
    parser.add_argument("--hidden", type=pos, default=512, help="hidden size (default 512)")
    parser.add_argument("--heads", type=pos, default=8, help="query heads (default 8)")
    parser.add_argument(
        "--kv-heads", type=pos, default=None,
        help="key/value heads, dividing --heads (default 2, or 1 for an odd --heads; bert: --heads)",
    )  # fmt: skip
    parser.add_argument(
        "--window", type=pos, default=None,
        help="sliding window of mistral, qwen2, gemma2, gpt_oss (default: seq/4, at least 2)",
    )  # fmt: skip
    parser.add_argument(
        "--pad", type=int_arg(0), default=0,
        help="left-pad the first sequence with this many padding tokens (default 0)",
    )  # fmt: skip
    parser.add_argument(
        "--dtype", default="float32", metavar="DTYPE", help=f"one of {', '.join(DTYPES)}"
    )
    parser.add_argument("--backward", action="store_true", help="also run the backward pass")
    parser.add_argument(
        "--generate", type=int_arg(0), default=0, metavar="N",
        help="then decode N tokens greedily with a KV cache, booking every step (decoders)",
    )  # fmt: skip
    parser.add_argument("--seed", type=int_arg(0), default=0, help="seed of weights and tokens")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


MAX_FLOP = 2e13
"""Most work ``flashledger model`` takes on (about seven minutes at 50 GFLOP/s, eager
PyTorch on a few cores): more is refused with the estimate, before anything is built."""


def _estimate(args: argparse.Namespace, kv_heads: int) -> tuple[float, float]:
    """``(bytes of weights, FLOPs)`` of the run ``args`` asks for, roughly: per layer the
    projections (Q, O; K, V at ``kv_heads``) and a gated MLP of twice the width (gpt_oss: 4
    experts); attention's two products over the whole sequence; the backward twice the
    forward; each generated token one step against the cache."""
    h, hd = args.hidden, args.hidden // args.heads
    mlp = 3 * h * 2 * h * (4 if args.arch == "gpt_oss" else 1)
    per_layer = 2 * h * h + 2 * h * kv_heads * hd + mlp
    itemsize = getattr(torch, args.dtype).itemsize
    weights = float(args.layers * per_layer * itemsize)
    tokens, seq, n = args.batch * args.seq, args.seq, args.generate
    forward = args.layers * (2 * tokens * per_layer + 4 * args.batch * seq * seq * h)
    flop = forward * (3 if args.backward else 1)
    flop += n * args.layers * args.batch * (2 * per_layer + 4 * (seq + n) * h)
    return weights, float(flop)


def _check_size(args: argparse.Namespace, kv_heads: int) -> None:
    """Refuse a model whose weights would not fit in half this machine's memory, or a run
    over ``MAX_FLOP``, naming the estimate and what to lower."""
    weights, flop = _estimate(args, kv_heads)
    sizes = f"--layers {args.layers}, --hidden {args.hidden}"
    check_fits(f"{sizes}: the weights alone", weights, "lower --layers or --hidden")
    if flop > MAX_FLOP:
        raise ValueError(
            f"{sizes}, --seq {args.seq}, --batch {args.batch}"
            + (f", --generate {args.generate}" if args.generate else "")
            + f": about {flop:.1e} FLOPs, over the {MAX_FLOP:.0e} this command takes on (minutes "
            "on a CPU); lower --seq, --layers, --hidden, --batch or --generate"
        )


def run_cli(args: argparse.Namespace) -> int:
    """Build the model, run it under ``ledger_of`` and print the ledger; exit status 0."""
    try:
        from .integrations import transformers as hf
    except ImportError as exc:
        raise ImportError(f"flashledger model needs transformers ({exc})") from None
    if args.arch not in hf.ARCHS:
        raise ValueError(f"--arch must be one of {', '.join(hf.ARCHS)}, got {args.arch!r}")
    if args.dtype not in DTYPES:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {args.dtype!r}")
    if args.pad >= args.seq:
        raise ValueError(f"--pad must be smaller than --seq ({args.seq}), got {args.pad}")
    if args.generate and args.arch == "bert":
        raise ValueError("--generate needs a decoder; bert is an encoder")
    if args.window is not None and args.arch in ("llama", "bert"):
        raise ValueError(
            f"--window applies to mistral, qwen2, gemma2 and gpt_oss; {args.arch} has no "
            "sliding window"
        )
    if args.window == 1 and args.generate:
        raise ValueError(
            "--window 1 cannot decode: transformers' sliding-window cache keeps every key at "
            "a window of 1 while its mask covers only the newest; use --window 2 or more"
        )
    dtype = getattr(torch, args.dtype)
    kv_heads = args.kv_heads
    if kv_heads is None:
        kv_heads = args.heads if args.arch == "bert" else (2 if args.heads % 2 == 0 else 1)
    _check_size(args, kv_heads)
    model = hf.random_model(
        args.arch,
        layers=args.layers,
        hidden=args.hidden,
        heads=args.heads,
        kv_heads=kv_heads,
        sliding_window=args.window if args.window is not None else max(args.seq // 4, 2),
        max_positions=args.seq + args.generate,
        dtype=dtype,
        seed=args.seed,
        attn_implementation=hf.register(),
    )
    gen = torch.Generator().manual_seed(args.seed)
    vocab = model.config.vocab_size
    ids = torch.randint(1, vocab, (args.batch, args.seq), generator=gen)
    att = torch.ones(args.batch, args.seq, dtype=torch.long)
    att[0, : args.pad] = 0
    ids[0, : args.pad] = 0
    cfg = model.config
    hkv = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
    title = (
        f"Attention ledger: {args.arch}, {args.layers} layer{'s' if args.layers > 1 else ''}, "
        f"hidden {args.hidden}, heads "
        f"{cfg.num_attention_heads}/{hkv}, batch {args.batch}, seq {args.seq}"
        + (f" ({args.pad} padding)" if args.pad else "")
        + f", {args.dtype}"
    )
    with ledger_of(model, title=title) as book:
        if args.backward:
            model.train()
            out = model(input_ids=ids, attention_mask=att)
            out.logits.float().square().mean().backward()
        else:
            with torch.no_grad():
                model(input_ids=ids, attention_mask=att)
        if args.generate:
            model.eval()
            with torch.no_grad():
                model.generate(
                    input_ids=ids, attention_mask=att, max_new_tokens=args.generate,
                    min_new_tokens=args.generate, do_sample=False, pad_token_id=0,
                )  # fmt: skip
    if args.json:
        from .ledger import jsonable

        sys.stdout.write(json.dumps(jsonable(book.to_dict()), indent=2) + "\n")
        return 0
    from ._progress import make_console

    con = make_console()
    con.print(book)
    fwd = book.totals().get("forward")
    if fwd:
        from .ledger import STAT_MIN_BYTES

        size = torch.empty((), dtype=dtype).element_size()
        stat = max(STAT_MIN_BYTES, size)  # the LSE in float32 at least, as the loop keeps it
        con.print(
            f"P kept for the backward would take {_bytes(fwd['p_elements'] * size)}; "
            f"the LSE takes {_bytes(fwd['lse_elements'] * stat)}"
        )
    return 0


def _bytes(n: int) -> str:
    for unit, size in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.3g} {unit}"
    return f"{n} B"


def _demo() -> None:
    """A tiny Llama's forward and backward on a left-padded batch, booked."""
    try:
        import transformers  # noqa: F401
    except ImportError:
        print(f"the model ledger demo needs transformers: {INSTALL_HINT}")
        return
    # the package's module (under ``python -m`` this file also runs as __main__, whose
    # books the attention function would not see)
    from flashledger import model

    parser = argparse.ArgumentParser(prog="python -m flashledger.model")
    model.add_cli_arguments(parser)
    argv = ["--layers", "2", "--seq", "200", "--hidden", "64", "--heads", "4", "--batch", "2"]
    model.run_cli(parser.parse_args([*argv, "--pad", "37", "--backward"]))


if __name__ == "__main__":
    from flashledger._demo import run_demo

    run_demo("model", _demo, command="model")
