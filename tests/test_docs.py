"""The command blocks in the README and docs/ show what the commands print today, and the
Python blocks run and give what their comments say (a size, a shape, a dict's entries).

Each fenced ``console`` block that starts with ``$ flashledger ...`` is run
in-process; every line shown (``...`` marks an elision) must appear in the
output, in order. Timed or slow commands (bench, verify) and blocks that
write files or pipe into another program are listed, not run.
"""

from __future__ import annotations

import re
import shlex
from pathlib import Path
from typing import Any

import pytest

from flashledger import cli

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
NOT_RUN = ("bench", "verify")  # timings, or a minute of sweeping: shown as examples
FENCE = re.compile(r"^```console\n(.*?)^```", re.S | re.M)
ROUNDOFF = re.compile(r"(?<![\w.])\d(?:\.\d+)?e-(?:1[3-9]|[2-9]\d)\b")


def _norm(line: str) -> str:
    """Roundoff-sized numbers (below 1e-12) read as 0, and runs of spaces as one.

    Differences of 1e-16 against a reference move with the BLAS build and the
    CPU's vector width; everything else must match exactly.
    """
    return " ".join(ROUNDOFF.sub("0", line).split())


def _blocks() -> list[tuple[str, str, list[str]]]:
    found = []
    for path in DOCS:
        for body in FENCE.findall(path.read_text(encoding="utf-8")):
            lines = body.rstrip("\n").split("\n")
            lines = [x for x in lines if not x.startswith("$ torchrun ")]
            if not lines[0].startswith("$ flashledger "):
                continue
            argv = shlex.split(lines[0].removeprefix("$ flashledger "), comments=True)
            if argv[0] in NOT_RUN or "|" in argv or "--sweep" in argv:
                continue
            found.append((f"{path.name}: {lines[0][2:]}", lines[0], lines[1:]))
    return found


BLOCKS = _blocks()


def test_the_docs_have_runnable_blocks() -> None:
    names = {b[0].split(": ", 1)[1].split()[1] for b in BLOCKS}
    assert {"online", "backward", "account", "traffic", "ring"} <= names, names


@pytest.mark.parametrize(("label", "command", "shown"), BLOCKS, ids=[b[0] for b in BLOCKS])
def test_block_matches_the_command(
    label: str, command: str, shown: list[str], capsys: pytest.CaptureFixture[str]
) -> None:
    argv = shlex.split(command.removeprefix("$ flashledger "), comments=True)
    if argv[0] == "model":
        pytest.importorskip("transformers")  # the optional extra flashledger[transformers]
    assert cli.main(argv) == 0, label
    out = [_norm(line) for line in capsys.readouterr().out.splitlines()]
    at = 0
    for want in map(_norm, shown):
        if want in ("...", "…"):
            continue
        try:
            at = out.index(want, at) + 1
        except ValueError:
            near = [o for o in out if o.split()[:2] == want.split()[:2]][:1]
            pytest.fail(
                f"{label}: the docs show\n  {want!r}\nwhich the command no longer prints"
                + (f"; it prints\n  {near[0]!r}" if near else "")
            )


# ----------------------------------------------------------------------------------------
# python blocks
# ----------------------------------------------------------------------------------------
PY_FENCE = re.compile(r"^```python\n(.*?)^```", re.S | re.M)
PY_SHOWN_ONLY = {
    ("README.md", 2): "calls the reader's own kernel (my_attention)",
    ("internals.md", 0): "signatures, not code",
    ("ring.md", 0): "runs on every rank of a torchrun group (tests/test_ring_distributed.py)",
    ("verify.md", 0): "a signature, not code",
    ("verify.md", 2): "the full matrix; `flashledger verify --quick` is tested in test_verify.py",
}


def _py_blocks() -> list[tuple[str, int, str]]:
    return [
        (path.name, i, body)
        for path in DOCS
        for i, body in enumerate(PY_FENCE.findall(path.read_text(encoding="utf-8")))
    ]


PY_BLOCKS = [b for b in _py_blocks() if (b[0], b[1]) not in PY_SHOWN_ONLY]


def test_every_python_block_is_run_or_listed() -> None:
    listed = {(name, i) for name, i, _ in _py_blocks()}
    assert set(PY_SHOWN_ONLY) <= listed, set(PY_SHOWN_ONLY) - listed
    assert len(PY_BLOCKS) >= 3


@pytest.mark.parametrize(
    ("name", "index", "body"), PY_BLOCKS, ids=[f"{b[0]}#{b[1]}" for b in PY_BLOCKS]
)
def test_python_block_runs(name: str, index: int, body: str) -> None:
    if "integrations.transformers" in body:
        pytest.importorskip("transformers")  # the optional extra flashledger[transformers]
    scope: dict[str, object] = {"__name__": f"docs_{name}_{index}", "_claim": _claim}
    exec(compile(_with_claims(body), f"{name} python block {index}", "exec"), scope)
    for fn in [v for k, v in scope.items() if k.startswith("test_") and callable(v)]:
        fn()  # the block's own tests (verify.md shows how to write them)


# what a line's comment says of its value, checked where the block runs: "~1e-15" (an
# expression, or print(expression), of about that size or less), "(2, 1, 512, 512)" (the
# shape of the name assigned), "key=value, ..." (entries of the dict the expression gives)
SMALL = re.compile(r"^(?P<code>.*?)\s+#\s*~(?P<bound>1e-\d+)\s*$")
SHAPE = re.compile(r"^(?P<ind>\s*)(?P<name>\w+) = .*?#\s*(?P<shape>\((?:\d+,\s*)*\d*\))")
ENTRIES = re.compile(r"^(?P<code>[^#=]*?\S)\s+#\s*(?P<pairs>(?:\w+=\d+,\s*)+)\.\.\.\s*$")


def _claim(kind: str, value: Any, want: Any, line: str) -> None:
    if kind == "small":
        got = float(value)
        assert got <= 100 * want, f"{line!r}: the docs say ~{want:g}, it gives {got:.3g}"
    elif kind == "shape":
        assert tuple(value.shape) == want, f"{line!r}: shape {tuple(value.shape)}, not {want}"
    else:
        for key, n in want.items():
            assert value[key] == n, f"{line!r}: {key} = {value[key]}, not {n}"


def _with_claims(body: str) -> str:
    """``body`` with each checkable comment turned into a ``_claim`` call on its line's
    value (``CLAIMS_CHECKED`` lists the ones the docs hold)."""
    out = []
    for line in body.split("\n"):
        small, shape, entries = SMALL.match(line), SHAPE.match(line), ENTRIES.match(line)
        if small:
            code = small["code"].rstrip()
            inner = code[len("print(") : -1] if code.lstrip().startswith("print(") else code
            indent = code[: len(code) - len(code.lstrip())]
            out.append(f"{indent}_claim('small', {inner.strip()}, {small['bound']}, {line!r})")
        elif shape:
            out.append(line)
            want = tuple(int(x) for x in re.findall(r"\d+", shape["shape"]))
            out.append(f"{shape['ind']}_claim('shape', {shape['name']}, {want!r}, {line!r})")
        elif entries:
            pairs = dict(re.findall(r"(\w+)=(\d+)", entries["pairs"]))
            want_d = {k: int(n) for k, n in pairs.items()}
            out.append(f"_claim('entries', {entries['code']}, {want_d!r}, {line!r})")
        else:
            out.append(line)
    return "\n".join(out)


CLAIMS_CHECKED = 6  # README: two ~1e-N, three shapes; ledgers.md: one dict


def test_the_docs_claims_are_all_found() -> None:
    """Every comment of those forms in a run block is checked (a rewording that the
    patterns miss would silently stop checking it)."""
    found = sum(
        line.count("_claim(") for _, _, body in PY_BLOCKS for line in _with_claims(body).split("\n")
    )
    assert found == CLAIMS_CHECKED, found


# ----------------------------------------------------------------------------------------
# verify.md's "What a failure says": the message shown is the message a kernel gets
# ----------------------------------------------------------------------------------------
def test_verify_failure_example_matches() -> None:
    import torch
    import torch.nn.functional as F

    from flashledger.verify import assert_attention_close

    text = (ROOT / "docs" / "verify.md").read_text(encoding="utf-8")
    shown = text.split("### What a failure says", 1)[1].split("```\n", 2)[1]

    def my_kernel(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, case: Any) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=case.scale, enable_gqa=case.shape.gqa
        )

    with pytest.raises(AssertionError) as err:
        assert_attention_close(
            my_kernel,
            dtypes=(torch.float16,),
            quick=True,
            masks=("causal_bottom_right",),
            check_grads=False,
        )
    got = [_norm(line) for line in str(err.value).splitlines()]
    want = [_norm(line) for line in shown.rstrip("\n").splitlines()]
    # the header and every case's name and quantity; the element values move with the BLAS
    keep = [w for w in want if not w.startswith(("worst element", "error "))]
    assert [g for g in got if not g.startswith(("worst element", "error "))] == keep
