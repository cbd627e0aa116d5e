"""The ``flashledger`` command: seed figures, JSON schemas, delegation and error handling."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import types
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from flashledger import Causal
from flashledger.accounting import memory_traffic, storage_and_work
from flashledger.cli import main


def run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def run_json(capsys: pytest.CaptureFixture[str], *argv: str) -> Any:
    code, out, err = run(capsys, *argv, "--json")
    assert code == 0, err
    return json.loads(out)


def table(out: str, title: str) -> list[list[str]]:
    """The whitespace-split data rows of the table whose title starts with ``title``."""
    lines = out.splitlines()
    start = next((i for i, line in enumerate(lines) if line.startswith(title)), None)
    assert start is not None, f"no table titled {title!r} in:\n{out}"
    rule = next(i for i in range(start, len(lines)) if lines[i].strip().startswith("─"))
    rows = []
    for line in lines[rule + 1 :]:
        if not line.strip():
            break
        rows.append(line.split())
    return rows


def row(rows: list[list[str]], first: str) -> list[str]:
    """The first row whose first cell is ``first``."""
    for cells in rows:
        if cells[0] == first:
            return cells
    raise AssertionError(f"no row starting with {first!r} in {rows}")


def assert_usage_error(code: int, out: str, err: str, *words: str) -> None:
    lines = err.strip().splitlines()
    assert code == 2, f"exit status {code}, stderr {err!r}"
    assert len(lines) == 1, f"expected one line on stderr, got {lines}"
    assert "Traceback" not in err and out == "", (out, err)
    for w in words:
        assert w in lines[0], f"{w!r} not in {lines[0]!r}"


# ----------------------------------------------------------------------------------------
# help
# ----------------------------------------------------------------------------------------
def test_help_starts_without_importing_torch() -> None:
    """``flashledger --help`` and argument errors answer at once: torch loads only when a
    command runs."""
    code = (
        "import sys; from flashledger.cli import main; "
        "rc = main(['--help']); assert 'torch' not in sys.modules, 'torch imported'; "
        "rc = main(['account', '--lq', '0']); assert 'torch' not in sys.modules"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr


def test_help_lists_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "--help")
    assert code == 0
    for name in ("online", "backward", "account", "traffic", "explore", "verify", "bench", "ring"):
        assert name in out, f"{name} missing from --help"


@pytest.mark.parametrize("command", ["online", "backward", "account", "traffic", "explore"])
def test_subcommand_help_has_examples(capsys: pytest.CaptureFixture[str], command: str) -> None:
    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and "examples:" in out and f"flashledger {command}" in out


@pytest.mark.parametrize("command", ["verify", "bench", "ring", "model"])
def test_a_delegated_command_s_help_describes_it_and_its_examples_parse(
    capsys: pytest.CaptureFixture[str], command: str
) -> None:
    """Its description and examples as the other commands show theirs; every example's
    options are the command's own (parsed by its parser, not run)."""
    import argparse
    import importlib
    import shlex

    from flashledger import cli

    code, out, _ = run(capsys, command, "--help")
    assert code == 0 and "examples:" in out, out
    assert out.split("\n\n")[1][0].isupper(), out  # a description, as a sentence
    parser = argparse.ArgumentParser(exit_on_error=False)
    importlib.import_module(f"flashledger.{command}").add_cli_arguments(parser)
    lines = [ln for ln in cli.DELEGATED_EXAMPLES[command].splitlines()[1:] if ln.strip()]
    assert lines
    for line in lines:
        words = shlex.split(line.split("  (")[0].split("   ")[0])
        assert words[:2] == ["flashledger", command], line
        parser.parse_args(words[2:])  # raises on an option the command does not have


# ----------------------------------------------------------------------------------------
# online
# ----------------------------------------------------------------------------------------
SEED_LEDGER = [
    # block, positions, scores, block max, running max, α, ℓ
    ["1", "0..1", "[1,", "2]", "2", "2", "0", "1.36788"],
    ["2", "2..3", "[-1,", "3]", "3", "3", "0.367879", "1.52153"],
    ["3", "4..5", "[0,", "2.5]", "2.5", "3", "1", "2.17785"],
]


def test_online_seed_ledger(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "online")
    assert code == 0
    ledger = table(out, "Block ledger")
    assert len(ledger) == 3
    for want in SEED_LEDGER:
        got = row(ledger, want[0])[: len(want)]
        assert got == want, f"block {want[0]}: {got} != {want}"
    assert "m = 3   ℓ = 2.17785" in out
    assert "prefix output after the last block: [-0.249367, 0.0152181]" in out
    assert "full-row reference:                 [-0.249367, 0.0152181]" in out
    assert "\x1b[" not in out, "no colour codes when writing to a pipe"


def test_online_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "online")
    assert set(out) == {
        "scores", "values", "block", "shift", "steps", "probabilities", "output",
        "reference", "max_abs_diff",
    }  # fmt: skip
    assert [s["m"] for s in out["steps"]] == [2.0, 3.0, 3.0]
    assert [s["block_max"] for s in out["steps"]] == [2.0, 3.0, 2.5]
    assert out["steps"][0]["alpha"] == 0.0
    assert set(out["steps"][0]) == {
        "block", "positions", "scores", "block_max", "m", "alpha", "ell", "acc", "output",
    }  # fmt: skip
    assert out["max_abs_diff"] < 1e-15
    assert abs(sum(out["probabilities"]) - 1) < 1e-15


def test_online_shift_changes_m_only(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "online", "--shift", "5")
    assert code == 0
    assert row(table(out, "Block ledger"), "3")[5] == "8", "running max after the shift"
    assert "running max 8 instead of 3; output unchanged (max |difference| vs unshifted: 0)" in out
    data = run_json(capsys, "online", "--shift", "5")
    assert data["shift_max_abs_diff"] == 0.0 and data["unshifted_m"] == 3.0


def test_online_counterexample(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "online", "--counterexample")
    assert code == 0
    assert "average of block outputs: [-0.0776717, 0.0703719]" in out
    assert "full-row output:          [-0.249367, 0.0152181]" in out
    data = run_json(capsys, "online", "--counterexample")
    assert data["counterexample"]["max_abs_diff"] > 0.1


def test_online_custom_scores(capsys: pytest.CaptureFixture[str]) -> None:
    neg = run_json(capsys, "online", "--scores", "-1,2", "--values", "-1,0;0,1", "--shift", "-2")
    assert neg["scores"] == [-3.0, 0.0] and neg["steps"][0]["m"] == 0.0
    data = run_json(
        capsys, "online", "--scores", "1,2,-1", "--values", "1,0;0,1;1,1", "--block", "1"
    )
    assert len(data["steps"]) == 3 and data["steps"][-1]["m"] == 2.0
    p = torch.softmax(torch.tensor([1.0, 2.0, -1.0], dtype=torch.float64), 0)
    want = (p[:, None] * torch.tensor([[1.0, 0], [0, 1], [1, 1]], dtype=torch.float64)).sum(0)
    assert max(abs(a - b) for a, b in zip(data["output"], want.tolist())) < 1e-15


def test_online_precision(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "online", "--precision", "3")
    assert code == 0 and row(table(out, "Block ledger"), "1")[7] == "1.37"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--scores", "1,2"], ["--scores needs --values"]),
        (["--values", "1,0"], ["--values needs --scores"]),
        (["--scores", "1,x", "--values", "1;2"], ["argument --scores", "expected a number"]),
        (["--scores", "1,2", "--values", "1;2;3"], ["--values has 3 rows", "one per score (2)"]),
        (["--scores", "1,2", "--values", "1,0;1"], ["argument --values", "same number"]),
        (["--block", "0"], ["argument --block", "integer >= 1"]),
        (["--shift", "nan"], ["argument --shift", "finite"]),
        (["--bogus"], ["unrecognized arguments: --bogus"]),
        (["--scores", "1,1", "--values", "1e308;1e308"], ["overflow float64 in the weighted sum"]),
    ],
)
def test_online_bad_input(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    assert_usage_error(*run(capsys, "online", *argv), *words)


def test_online_fully_masked_row(capsys: pytest.CaptureFixture[str]) -> None:
    """Every score -inf: the seed's fully-masked row, m = -inf, ℓ = 0, O = 0, and the
    reference and the probabilities 0 too (not NaN); in the table and in the JSON."""
    argv = ("online", "--scores=-inf,-inf,-inf", "--values", "1,0;0,1;1,1", "--block", "1")
    code, out, _ = run(capsys, *argv)
    assert code == 0
    assert "m = -inf   ℓ = 0" in out and "full-row reference:                 [0, 0]" in out
    assert "nan" not in out.lower()
    code, out, _ = run(capsys, *argv, "--json")
    data = json.loads(out)
    assert data["output"] == data["reference"] == [0.0, 0.0]
    assert data["probabilities"] == [0.0, 0.0, 0.0] and data["max_abs_diff"] == 0.0


# ----------------------------------------------------------------------------------------
# backward
# ----------------------------------------------------------------------------------------
def test_backward_seed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "backward")
    assert code == 0
    stats = table(out, "Forward's saved per-row statistics")
    # row 0 sees key 0 only: LSE = q0·k0/sqrt(2), O = V0, D = G0·V0
    assert row(stats, "0") == ["0", "-0.0636396", "[1,", "0]", "0.2"]
    assert len(stats) == 5
    steps = table(out, "Backward steps")
    # six steps, in backward order (key tile outer, query tile inner)
    assert [r[1:4] for r in steps] == [
        ["Q0", "x", "K0"], ["Q1", "x", "K0"], ["Q2", "x", "K0"],
        ["Q1", "x", "K1"], ["Q2", "x", "K1"], ["Q2", "x", "K2"],
    ]  # fmt: skip
    assert [r[6] for r in steps] == ["partial", "full", "full", "partial", "full", "full"]
    assert " ".join(steps[0][7:]) == "[[1, 0], [0.545833, 0.454167]]"
    assert "backward steps: 6 run, 3 skipped; QK dots rebuilt: 15 visible, 17 computed" in out
    grads = table(out, "Accumulated gradients")
    assert len(grads) == 15
    assert row(grads, "dQ[0]")[1:3] == ["[0,", "0]"], "row 0's only key is itself: dQ = 0"
    worst = max(float(r[-1]) for r in grads)
    assert worst < 1e-14, f"worst gradient difference {worst}"


BACKWARD_KEYS = {"config", "rows", "steps", "gradients", "max_abs_diff", "counters"}


def test_backward_json(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "backward")
    assert set(out) == BACKWARD_KEYS
    assert set(out["rows"][0]) == {"row", "lse", "o", "D"}
    assert set(out["steps"][0]) == {"step", "tile", "queries", "keys", "kind", "p"}
    assert set(out["gradients"]) == {"dq", "dk", "dv"}
    assert set(out["max_abs_diff"]) == {"o", "lse", "dq", "dk", "dv"}
    worst = max(out["max_abs_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-14, f"worst difference {worst}"
    assert out["counters"]["backward"]["qk_dots_visible"] == 15
    p0 = out["steps"][0]["p"]
    assert p0[0] == [1.0, 0.0] and abs(p0[1][0] - 0.545833) < 1e-6, p0


def test_backward_options(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(
        capsys, "backward", "--mask", "window:1,0", "--conventions", "flash_attn_2",
        "--dropout", "0.3", "--seed", "7", "--alibi", "--block-q", "3",
        "--block-k", "1", "--loop-order", "fa1",
    )  # fmt: skip
    worst = max(out["max_abs_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-12, f"worst difference {worst}"
    assert out["config"]["mask"] == "window:1,0" and out["config"]["conventions"] == "flash_attn_2"
    assert len(out["steps"]) == out["counters"]["backward"]["tiles_run"]
    out = run_json(
        capsys, "backward", "--mask", "window:1,0", "--dropout", "0.3", "--softcap", "2",
        "--alibi", "--block-q", "3", "--block-k", "1",
    )  # fmt: skip
    worst = max(out["max_abs_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-12, f"worst difference {worst} (softcap with dropout, seed)"
    # flash-attn 2 has no softcap with dropout: a one-line error, no traceback
    code, _, err = run(
        capsys, "backward", "--conventions", "flash_attn_2", "--dropout", "0.3", "--softcap", "2"
    )
    assert code == 2 and "refuse softcap together with dropout" in err and "Traceback" not in err
    assert len(err.strip().splitlines()) == 1, err


def test_backward_from_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(3)
    x = {n: torch.randn(2, 6, 3, generator=gen, dtype=torch.float64).numpy() for n in "qkvg"}
    np.savez(tmp_path / "in.npz", **x)
    mask = np.tril(np.ones((6, 6), dtype=bool))
    mask[4, :] = False  # a fully-masked row: O = 0, LSE -inf
    np.save(tmp_path / "mask.npy", mask)
    code, text, err = run(
        capsys, "backward", "--input", str(tmp_path / "in.npz"), "--mask",
        str(tmp_path / "mask.npy"), "--block-q", "4", "--block-k", "4",
    )  # fmt: skip
    assert code == 0, err
    stats = table(text, "Forward's saved per-row statistics")
    assert row(stats, "h1:4")[:2] == ["h1:4", "-inf"], "a fully-masked row shows LSE -inf"
    assert row(stats, "h1:4")[2:4] == ["[0,", "0,"], "and O = 0"
    assert "(first batch element and head)" in text
    (tmp_path / "in.json").write_text(json.dumps({n: a.tolist() for n, a in x.items()}))
    out = run_json(capsys, "backward", "--input", str(tmp_path / "in.json"))
    worst = max(out["max_abs_diff"].items(), key=lambda kv: kv[1])
    assert worst[1] < 1e-12, f"worst difference {worst}"
    assert out["config"]["block_q"] == 64 and out["config"]["mask"] == "none"


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--mask", "diagonal"], ["argument --mask", "unknown mask 'diagonal'", "window:L,R"]),
        (["--mask", "window:a,b"], ["argument --mask", "window:L,R"]),
        (["--mask", "window:-2,0"], ["argument --mask", "-1 for unbounded"]),
        (["--mask", "missing.npy"], ["argument --mask", "cannot read mask file"]),
        (["--dropout", "1"], ["argument --dropout", "[0, 1)"]),
        (["--softcap", "0"], ["argument --softcap", "> 0"]),
        (["--conventions", "fa9"], ["argument --conventions", "unknown preset", "seed"]),
        (["--loop-order", "fa3"], ["argument --loop-order", "invalid choice", "fa1"]),
        (["--input", "missing.json"], ["--input", "cannot read missing.json"]),
        (["--input", "x.txt"], ["--input must be a .json or .npz"]),
        (["--block-q", "-1"], ["argument --block-q", "integer >= 1"]),
        (["--seed", "5"], ["--seed picks dropout's keep mask", "add --dropout P"]),
    ],
)
def test_backward_bad_input(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    assert_usage_error(*run(capsys, "backward", *argv), *words)


def test_backward_bad_files(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    (tmp_path / "in.json").write_text(json.dumps({"q": [[1.0]], "k": [[1.0]]}))
    assert_usage_error(
        *run(capsys, "backward", "--input", str(tmp_path / "in.json")), "missing key(s) v, g"
    )
    (tmp_path / "bad.json").write_text(
        json.dumps({"q": [[1.0, 2.0]], "k": [[1.0, 2.0]], "v": [[1.0], [2.0]], "g": [[1.0]]})
    )
    code, out, err = run(capsys, "backward", "--input", str(tmp_path / "bad.json"))
    assert_usage_error(code, out, err, "k and v must agree")
    (tmp_path / "badg.json").write_text(
        json.dumps({n: [[1.0, 2.0]] for n in "qkv"} | {"g": [[1.0]]})
    )
    code, out, err = run(capsys, "backward", "--input", str(tmp_path / "badg.json"))
    assert_usage_error(code, out, err, "flashledger backward: error:", "g must have shape (1, 2)")
    (tmp_path / "mask.json").write_text(json.dumps([[1, 2], [0, 1]]))
    assert_usage_error(
        *run(capsys, "backward", "--mask", str(tmp_path / "mask.json")), "booleans (or 0/1)"
    )


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("empty.json", "[]", ["mask file", "every size >= 1", "got shape (0,)"]),
        ("ragged.json", "[[true], [false, true]]", ["rows of different lengths"]),
        ("object.json", '{"a": 1}', ["(Lq, Lk), (H, Lq, Lk) or (B, H, Lq, Lk)", "shape ()"]),
        ("junk.npy", "not numpy", ["is not a .npy file"]),
        ("half.json", "[[1.0, 0.5]]", ["booleans (or 0/1)", "with other values"]),
    ],
)
def test_mask_files_that_are_not_masks(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, content: str, words: list[str]
) -> None:
    (tmp_path / name).write_text(content)
    for command in ("account", "backward"):
        assert_usage_error(*run(capsys, command, "--mask", str(tmp_path / name)), *words)


def test_mask_file_of_float_zeros_and_ones(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    np.save(tmp_path / "m.npy", np.tril(np.ones((4, 6))))
    data = run_json(capsys, "account", "--mask", str(tmp_path / "m.npy"))
    assert (data["config"]["lq"], data["config"]["lk"]) == (4, 6)


@pytest.mark.parametrize(
    ("name", "content", "words"),
    [
        ("empty.json", json.dumps({n: [] for n in "qkvg"}), ["q must have shape", "got (0,)"]),
        ("deep.json", json.dumps({n: [[[[[1.0]]]]] for n in "qkvg"}), ["got (1, 1, 1, 1, 1)"]),
        ("junk.npz", "not a zip", ["not a .npz archive"]),
        (  # a key the command does not read is refused, not dropped unseen
            "extra.json",
            '{"q": [[1, 2]], "k": [[1, 2]], "v": [[1, 2]], "g": [[1, 1]], "scale": 100, '
            '"mask": [[true]]}',
            ["unknown key(s) 'scale', 'mask'", "q, k, v and g only", "--mask FILE"],
        ),
        (  # JSON keeps the last of two values of a key: which one was meant is not known
            "twice.json",
            '{"q": [[1, 2]], "k": [[1, 2]], "v": [[1, 2]], "g": [[1, 1]], "q": [[5, 5]]}',
            ["the key 'q' appears more than once"],
        ),
        (
            "bools.json",
            '{"q": [[true, false]], "k": [[1, 2]], "v": [[1, 2]], "g": [[1, 1]]}',
            ["q holds true/false values", "write 1 and 0"],
        ),
        (  # named as the file names it (g), not as the library's argument (do)
            "ginf.json",
            '{"q": [[1, 2]], "k": [[1, 2]], "v": [[1, 2]], "g": [[Infinity, 1]]}',
            ["g holds NaN or inf at index (0, 0)", "must be finite"],
        ),
    ],
)
def test_input_files_that_are_not_problems(
    capsys: pytest.CaptureFixture[str], tmp_path: Path, name: str, content: str, words: list[str]
) -> None:
    (tmp_path / name).write_text(content)
    assert_usage_error(*run(capsys, "backward", "--input", str(tmp_path / name)), *words)


# ----------------------------------------------------------------------------------------
# account
# ----------------------------------------------------------------------------------------
def test_account_seed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "account")
    assert code == 0
    rows = {" ".join(r[:4]): r for r in table(out, "Storage and work")}
    figures = {
        "full-P path keeps P": ("25", "200"),
        "LSE path keeps LSE": ("5", "40"),
        "temporary tile P block": ("4", "32"),
    }
    for key, (count, nbytes) in figures.items():
        assert rows[key][4:6] == [count, nbytes], f"{key}: {rows[key]}"
    assert rows["forward QK dots (visible)"][4] == "15"
    assert rows["backward QK dots (rebuild)"][4] == "15"
    assert rows["each pass QK dots"][5] == "17"
    assert rows["each pass tiles run"][4] == "6"
    assert rows["each pass tiles skipped"][4] == "3"


def test_account_json_is_the_ledger(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "account")
    want = storage_and_work(lq=5, lk=5, d=2, block_q=2, block_k=2, mask=Causal()).to_dict()
    assert set(out) == set(want), set(out) ^ set(want)
    assert out == want
    got = [out[k] for k in ("full_p_elements", "lse_elements", "temp_block_capacity",
                            "qk_dots_forward", "qk_dots_backward", "qk_dots_computed",
                            "tiles_run", "tiles_skipped")]  # fmt: skip
    assert got == [25, 5, 4, 15, 15, 17, 6, 3]


def test_account_check_against_the_loop(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = run(
        capsys, "account", "--lq", "9", "--lk", "7", "--d", "3", "--heads", "4",
        "--kv-heads", "2", "--batch", "2", "--block-q", "4", "--block-k", "3",
        "--mask", "causal-br", "--check",
    )  # fmt: skip
    assert code == 0, err
    assert " NO" not in out and out.count(" yes") == 9
    data = run_json(capsys, "account", "--lq", "64", "--mask", "none", "--dtype", "float16")
    assert data["full_p_elements"] == 64 * 64 and data["bytes"]["full_p"] == 2 * 64 * 64


def test_account_mask_file_sets_the_lengths(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    mask = np.zeros((3, 7), dtype=bool)
    mask[:, :2] = True  # every query sees the first two keys
    np.save(tmp_path / "m.npy", mask)
    data = run_json(capsys, "account", "--mask", str(tmp_path / "m.npy"), "--block-k", "4")
    assert (data["config"]["lq"], data["config"]["lk"]) == (3, 7)
    assert data["qk_dots_forward"] == 6 and data["tiles_run"] == 2 and data["tiles_skipped"] == 2


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--lq", "0"], ["argument --lq", "integer >= 1, got 0"]),
        (["--lq", "ten"], ["argument --lq", "got 'ten'"]),
        (["--dtype", "int8"], ["argument --dtype", "float64, float32, float16, bfloat16"]),
        (["--heads", "3", "--kv-heads", "2"], ["heads (3) must be a multiple of kv_heads (2)"]),
        (["--block-q", "99999999999999999999"], ["argument --block-q", "1..2147483647"]),
        (["--d", "2147483648"], ["argument --d", "1..2147483647"]),
        (
            ["--mask", "window:99999999999999999999,1"],
            ["argument --mask", "window sides", "0..2147483647", "-1 for unbounded"],
        ),
        # the seed's 2x2 tiles at 128k: 4.3e9 tiles to classify
        (["--lq", "131072"], ["at most 16,777,216", "65,536 x 65,536", "use larger tiles"]),
        (
            ["--lq", "20000000", "--block-q", "1000000", "--block-k", "1000000"],
            ["with a mask, Lq and Lk must be at most 16,777,216", "Without a mask"],
        ),
    ],
)
def test_account_bad_input(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    assert_usage_error(*run(capsys, "account", *argv), *words)


def test_account_long_context(capsys: pytest.CaptureFixture[str]) -> None:
    """Long sequences: closed form without a mask, tile classes with one (1M at 256 x 256)."""
    full = run_json(capsys, "account", "--lq", "100000000", "--d", "128", "--mask", "none")
    assert full["qk_dots_forward"] == 100_000_000**2
    n, b = 1_048_576, 256
    causal = run_json(
        capsys, "account", "--lq", str(n), "--d", "128", "--block-q", str(b), "--block-k", str(b)
    )
    tiles = n // b
    assert causal["tiles_run"] == tiles * (tiles + 1) // 2
    assert causal["qk_dots_forward"] == tiles * (tiles - 1) // 2 * b * b + tiles * b * (b + 1) // 2


def test_out_of_memory_is_a_one_line_error(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashledger.accounting

    def fail(**_: Any) -> None:
        raise RuntimeError(
            "[enforce fail at alloc_cpu.cpp:127] err == 0. DefaultCPUAllocator: can't allocate "
            "memory: you tried to allocate 8053063680 bytes. Error code 12"
        )

    monkeypatch.setattr(flashledger.accounting, "storage_and_work", fail)
    code, out, err = run(capsys, "account")
    assert code == 1 and not out
    assert err.strip().splitlines() == [
        "flashledger account: error: not enough memory for this size (one allocation of 7.5 GiB "
        "failed); try smaller lengths, heads or batch"
    ]


# ----------------------------------------------------------------------------------------
# traffic
# ----------------------------------------------------------------------------------------
def test_traffic_seed(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = run(capsys, "traffic")
    assert code == 0
    summary = table(out, "Slow-memory (HBM) traffic")
    assert row(summary, "standard")[1:] == ["-", "80", "60", "175", "80", "395", "3,160"]
    assert row(summary, "fa1")[1:] == ["2x2", "84", "61", "112", "53", "310", "2,480"]
    assert row(summary, "fa2")[1:] == ["2x2", "54", "15", "112", "53", "234", "1,872"]
    fa2 = table(out, "Memory traffic (fa2")
    assert row(fa2, "k")[1:] == ["22", "10"], (
        "K read once per tile run forward, once per key tile backward"
    )


def test_traffic_json_and_check(capsys: pytest.CaptureFixture[str]) -> None:
    out = run_json(capsys, "traffic", "--lq", "12", "--d", "3", "--sram", "30", "--check")
    assert set(out) == {"schedules", "check"}
    assert [s["schedule"] for s in out["schedules"]] == ["standard", "fa1", "fa2"]
    for s in out["schedules"]:
        want = memory_traffic(
            lq=12, lk=12, d=3, sram_elements=30, mask=Causal(), schedule=s["schedule"]
        ).to_dict()
        assert s == want, s["schedule"]
    assert out["schedules"][1]["config"]["block_k"] == 3  # ceil(30 / 12)
    bad = {k: v for k, v in out["check"].items() if v["closed_form"] != v["observed"]}
    assert len(out["check"]) == 8 and not bad, bad


def test_traffic_sweep_plot(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "t.png"
    code, out, err = run(
        capsys, "traffic", "--sweep", "--d", "16", "--lq", "512", "--out", str(png)
    )
    assert code == 0, err
    assert png.read_bytes()[:4] == b"\x89PNG"
    assert "FA1 moves no more elements than standard attention from M =" in out
    assert f"plot saved to {png}" in out


@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["--sram", "64", "--block-q", "2"], ["either --sram M", "--block-q"]),
        (["--sweep", "--heads", "3", "--check"], ["--heads, --check would be ignored"]),
        (["--sweep", "--dtype", "float16"], ["--dtype would be ignored; drop it"]),
        (["--schedule", "fa3"], ["argument --schedule", "invalid choice"]),
        (["--sweep", "--mask", "causal"], ["--sweep uses no mask"]),
        (["--sram", "0"], ["argument --sram", "integer >= 1"]),
        (["--schedule", "standard", "--check"], ["--check compares the blocked loop"]),
        (["--out", "t.png"], ["--out names the plot of --sweep"]),
        (["--sweep", "--out", "/nonexistent-dir/t.png"], ["its directory does not exist"]),
    ],
)
def test_traffic_bad_input(
    capsys: pytest.CaptureFixture[str], argv: list[str], words: list[str]
) -> None:
    assert_usage_error(*run(capsys, "traffic", *argv), *words)


def test_traffic_one_tile_side_takes_the_other_default_as_account_does(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(capsys, "traffic", "--block-q", "3")
    assert code == 0, err
    assert " 3x2 " in out, out
    code, out, _ = run(capsys, "account", "--block-q", "3")
    assert code == 0 and "tiles 3x2" in out, out


def test_traffic_sweep_says_when_fa1_never_catches_up(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """At N = 1 FA1 moves more than standard attention at every M: no crossover is claimed;
    an N whose largest tile would pass the size limit still sweeps."""
    code, out, err = run(
        capsys, "traffic", "--sweep", "--lq", "1", "--out", str(tmp_path / "a.png")
    )
    assert code == 0, err
    assert "N=1: FA1 moves more elements than standard attention at every M" in out, out
    code, out, err = run(
        capsys, "traffic", "--sweep", "--lq", "100000000", "--out", str(tmp_path / "b.png")
    )
    assert code == 0 and "N=100000000: FA1 moves no more elements" in out, err


# ----------------------------------------------------------------------------------------
# explore and the delegated subcommands
# ----------------------------------------------------------------------------------------
def test_explore_calls_serve(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    calls: list[dict[str, Any]] = []
    fake = types.ModuleType("flashledger.web.app")
    fake.serve = lambda **kw: calls.append(kw)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashledger.web.app", fake)
    code, _, err = run(capsys, "explore", "--port", "8123", "--open")
    assert code == 0, err
    assert calls == [{"host": "127.0.0.1", "port": 8123, "open_browser": True, "allow_hosts": []}]
    assert_usage_error(*run(capsys, "explore", "--port", "70000"), "argument --port", "0..65535")
    assert len(calls) == 1, "a refused option starts no server"


def test_explore_refuses_hosts_before_it_listens(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The real serve refuses an empty --host (every interface) or a name with spaces
    before it binds a port (as ``python -m flashledger.web`` does): no server starts."""
    pytest.importorskip("uvicorn")
    from flashledger.web import _guard

    def no_listen(*_args: Any) -> None:
        raise AssertionError("a refused host reached listen")

    monkeypatch.setattr(_guard, "listen", no_listen)
    assert_usage_error(*run(capsys, "explore", "--host", " "), "--host is empty")
    assert_usage_error(*run(capsys, "explore", "--allow-host", "a b"), "is not a host name")


def test_delegated_subcommand_parses_its_own_options(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[Any] = []
    fake = types.ModuleType("flashledger.verify")

    def add_cli_arguments(parser: Any) -> None:
        parser.add_argument("--quick", action="store_true", help="a short run")

    def run_cli(args: Any) -> int:
        seen.append(args.quick)
        return 0

    fake.add_cli_arguments = add_cli_arguments  # type: ignore[attr-defined]
    fake.run_cli = run_cli  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "flashledger.verify", fake)
    assert run(capsys, "verify", "--quick")[0] == 0 and seen == [True]
    code, out, _ = run(capsys, "verify", "--help")
    assert code == 0 and "--quick" in out and "flashledger verify" in out
    assert_usage_error(*run(capsys, "verify", "--nope"), "flashledger verify", "--nope")


def test_delegated_subcommand_missing(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "flashledger.bench", types.ModuleType("flashledger.bench"))
    assert_usage_error(*run(capsys, "bench"), "flashledger bench: error: not available", "run_cli")
    monkeypatch.setitem(sys.modules, "flashledger.ring", None)  # import raises ImportError
    assert_usage_error(
        *run(capsys, "ring", "--world", "2"), "flashledger ring: error: not available"
    )


def test_unknown_and_missing_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert_usage_error(*run(capsys, "frobnicate"), "invalid choice", "online")
    assert_usage_error(*run(capsys), "a command is required, one of: online, backward")


# ----------------------------------------------------------------------------------------
# as a program
# ----------------------------------------------------------------------------------------
def _program(*argv: str) -> subprocess.CompletedProcess[str]:
    env = dict(os.environ, NO_COLOR="1")
    return subprocess.run(
        [sys.executable, "-m", "flashledger", *argv],
        capture_output=True, text=True, env=env, timeout=120, check=False,
    )  # fmt: skip


def test_python_m_flashledger() -> None:
    bad = _program("account", "--lq", "0")
    assert bad.returncode == 2 and bad.stdout == ""
    assert bad.stderr.strip().splitlines() == [
        "flashledger account: error: argument --lq: expected an integer >= 1, got 0"
    ]


# ----------------------------------------------------------------------------------------
# consoles and progress bars
# ----------------------------------------------------------------------------------------
class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_console_colour_follows_the_terminal_and_no_color(monkeypatch: pytest.MonkeyPatch) -> None:
    from flashledger._progress import make_console

    monkeypatch.delenv("NO_COLOR", raising=False)
    monkeypatch.setenv("TERM", "xterm-256color")
    tty = _Tty()
    make_console(tty).print("x", style="bold red")
    assert "\x1b[" in tty.getvalue(), "a terminal gets colour"
    monkeypatch.setenv("NO_COLOR", "1")
    tty = _Tty()
    make_console(tty).print("x", style="bold red")
    assert "\x1b[3" not in tty.getvalue(), "NO_COLOR turns colour off"
    pipe = io.StringIO()
    make_console(pipe).print("[b0 h1 3]", style="bold")
    assert pipe.getvalue() == "[b0 h1 3]\n", "plain text on a pipe, no markup parsing"


def test_progress_bar_counts_and_stays_off_stdout(capsys: pytest.CaptureFixture[str]) -> None:
    from flashledger._progress import progress

    with progress("work", total=3, enabled=True) as advance:
        for _ in range(3):
            advance(1.0)
    with progress("quiet", total=3) as advance:  # stderr is not a terminal here: no bar
        advance(1.0)
    out, err = capsys.readouterr()
    assert out == "", "progress never writes to standard output"
    assert "quiet" not in err


# ----------------------------------------------------------------------------------------
# hostile files, inputs and output paths
# ----------------------------------------------------------------------------------------
def _deep(n: int) -> str:
    return "[" * n + "]" * n


def test_json_nested_deeper_than_the_parser_is_a_clear_error(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """100,000 levels of nesting: one line naming the file, not an internal RecursionError."""
    (tmp_path / "deep.json").write_text(_deep(100_000))
    (tmp_path / "deepq.json").write_text('{"q": ' + _deep(100_000) + "}")
    for command in ("account", "backward", "traffic"):
        assert_usage_error(
            *run(capsys, command, "--mask", str(tmp_path / "deep.json")),
            "mask file",
            "JSON nested too deeply to read",
            "a mask is a matrix",
        )
    for name in ("deep.json", "deepq.json"):
        assert_usage_error(
            *run(capsys, "backward", "--input", str(tmp_path / name)),
            f"--input {tmp_path / name}",
            "JSON nested too deeply to read",
        )
    # deep enough for numpy to refuse, shallow enough to parse
    (tmp_path / "m70.json").write_text(_deep(70))
    assert_usage_error(
        *run(capsys, "account", "--mask", str(tmp_path / "m70.json")), "lists nested 70 deep"
    )
    (tmp_path / "q70.json").write_text(
        json.dumps({n: [[1.0]] for n in "kvg"})[:-1] + ', "q": ' + _deep(70) + "}"
    )
    assert_usage_error(
        *run(capsys, "backward", "--input", str(tmp_path / "q70.json")),
        "q has lists nested 70 deep",
    )


def test_complex_inputs_are_refused(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """numpy would drop the imaginary part silently."""
    x = np.arange(8.0).reshape(4, 2)
    np.savez(tmp_path / "c.npz", q=x, k=x + 1j * x, v=x, g=x)
    assert_usage_error(
        *run(capsys, "backward", "--input", str(tmp_path / "c.npz")),
        "k holds complex numbers (complex128)",
        "attention inputs are real",
    )


def test_inputs_whose_scores_overflow_blame_the_inputs(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    """Finite 1e300 inputs: the message says the scores overflow, not that an internal LSE holds
    NaN."""
    gen = torch.Generator().manual_seed(5)
    x = {n: torch.randn(4, 2, generator=gen, dtype=torch.float64).numpy() for n in "qkvg"}
    np.savez(tmp_path / "big.npz", **{**x, "q": 1e300 * x["q"], "k": 1e300 * x["k"]})
    code, out, err = run(capsys, "backward", "--input", str(tmp_path / "big.npz"))
    assert_usage_error(code, out, err, "the scores of output row o[0, :] overflow float64")
    assert "scale q or k down" in err and "lse" not in err.lower(), err


def test_online_shift_that_loses_precision_says_so(capsys: pytest.CaptureFixture[str]) -> None:
    """Adding 1e17 rounds the seed's scores to multiples of 16: the output changes, and the
    command says why instead of claiming it is unchanged."""
    code, out, _ = run(capsys, "online", "--shift", "1e17")
    assert code == 0
    assert "output unchanged" not in out
    assert "output CHANGED (max |difference| vs unshifted: 0.4" in out, out
    assert "rounded the scores by up to 3" in out and "16 apart" in out, out
    data = run_json(capsys, "online", "--shift", "1e17")
    assert data["shift_output_unchanged"] is False and data["shift_rounding"] == 3.0
    assert data["shift_max_abs_diff"] > 0.1
    small = run_json(capsys, "online", "--shift", "0.1")
    assert small["shift_output_unchanged"] is True and small["shift_max_abs_diff"] < 1e-15
    assert_usage_error(
        *run(capsys, "online", "--scores", "1e308,1", "--values", "1;2", "--shift", "1e308"),
        "--shift 1e+308 makes a score overflow float64",
    )


def test_verify_html_to_an_unwritable_path_fails_before_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    import flashledger.verify

    def never(**_: Any) -> None:
        raise AssertionError("the matrix ran before the --html path was checked")

    monkeypatch.setattr(flashledger.verify, "run_matrix", never)
    for path in ("/proc/flashledger-report.html", str(tmp_path)):
        code, out, err = run(capsys, "verify", "--quick", "--html", path)
        assert code == 2 and out == "" and f"cannot write --html {path}" in err, (code, err)
    assert list(tmp_path.iterdir()) == []


def test_output_checks_leave_files_as_they_were(tmp_path: Path) -> None:
    from flashledger._progress import output_problem

    existing = tmp_path / "keep.txt"
    existing.write_text("keep me")
    assert output_problem(existing) == "" and existing.read_text() == "keep me"
    fresh = tmp_path / "new.html"
    assert output_problem(fresh) == "" and not fresh.exists()
    assert output_problem(tmp_path / "missing" / "x.png") == "its directory does not exist"
    assert output_problem("/proc/flashledger-x.png") != ""


@pytest.mark.skipif(not Path("/dev/full").exists(), reason="needs /dev/full (Linux)")
def test_a_plot_that_cannot_be_written_is_not_reported_saved(
    capsys: pytest.CaptureFixture[str],
) -> None:
    code, out, err = run(
        capsys, "traffic", "--sweep", "--d", "16", "--lq", "256", "--out", "/dev/full"
    )
    assert code == 2 and "plot saved" not in out, (code, out)
    assert "cannot write /dev/full: No space left on device" in err, err


def test_bench_out_that_cannot_be_written_fails_before_the_run(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import flashledger.bench

    def never(args: Any) -> None:
        raise AssertionError("the benchmark ran before --out was checked")

    monkeypatch.setattr(flashledger.bench, "run_benchmark", never)
    code, out, err = run(capsys, "bench", "--quick", "--out", "/proc")
    assert code == 2 and "--out /proc: cannot write bench.json there" in err, (code, err)


def test_backward_traces_only_what_it_prints(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """No full trace (S, P, dP, dS and gradients of every head): the command keeps the P rows
    it prints, through an observer."""
    import flashledger.blocked as blocked

    traces: list[Any] = []
    for name in ("blocked_forward", "blocked_backward"):
        real = getattr(blocked, name)

        def spy(*a: Any, _real: Any = real, **kw: Any) -> Any:
            traces.append(kw.get("trace", False))
            return _real(*a, **kw)

        monkeypatch.setattr(blocked, name, spy)
    out = run_json(capsys, "backward")
    assert traces == [False, False], traces
    p0 = out["steps"][0]["p"]
    assert len(out["steps"]) == 6 and p0[0] == [1.0, 0.0] and abs(p0[1][0] - 0.545833) < 1e-6


def test_backward_input_too_large_to_print_is_refused_with_the_limit(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    np.savez(
        tmp_path / "long.npz",
        q=np.zeros((2, 1025, 2)),
        k=np.zeros((2, 2048, 2)),
        v=np.zeros((2, 2048, 2)),
        g=np.zeros((2, 1025, 2)),
    )
    assert_usage_error(
        *run(capsys, "backward", "--input", str(tmp_path / "long.npz")),
        "make 4,198,400 scores (B·H·Lq·Lk)",
        "at most 4,194,304",
        "trace=flashledger.Trace(every=k)",
    )


@pytest.mark.parametrize(
    ("nbytes", "text"),
    [(8053063680, "7.5 GiB"), (3 * 2**20, "3.0 MiB"), (5000, "4.9 KiB"), (512, "512 bytes")],
)
def test_allocation_sizes_are_never_rounded_to_zero(nbytes: int, text: str) -> None:
    from flashledger.cli import _allocation

    exc = RuntimeError(
        f"DefaultCPUAllocator: can't allocate memory: you tried to allocate {nbytes} bytes."
    )
    assert _allocation(exc) == f"one allocation of {text} failed"


@pytest.mark.parametrize(
    "command", [["online"], ["account", "--lq", "2147483647", "--mask", "none"]]
)
def test_a_narrow_terminal_never_splits_a_number_or_a_label(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, command: list[str]
) -> None:
    """At 40 columns a table runs past the edge rather than fold a cell: every number and
    every short label stays whole on its row's line, and nothing is cut off with '…'."""
    monkeypatch.setenv("COLUMNS", "40")
    code, out, err = run(capsys, *command)
    assert code == 0, err
    assert "…" not in out, out
    monkeypatch.setenv("COLUMNS", "400")
    _, wide, _ = run(capsys, *command)
    cells = {c for line in wide.splitlines() for c in line.split() if any(ch.isdigit() for ch in c)}
    words = {c for line in out.splitlines() for c in line.split()}
    assert cells <= words, f"split or cut at 40 columns: {sorted(cells - words)[:5]}"


def test_empty_and_file_parent_output_paths_are_refused_before_the_work(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    afile = tmp_path / "f.txt"
    afile.write_text("")
    assert_usage_error(*run(capsys, "traffic", "--sweep", "--out", ""), "the path is empty")
    assert_usage_error(
        *run(capsys, "traffic", "--sweep", "--out", str(afile / "t.png")),
        f"{afile} is a file, not a directory",
    )


def test_account_names_the_alignment_a_preset_gives_the_mask(
    capsys: pytest.CaptureFixture[str],
) -> None:
    """Under flash_attn_2 'causal' is bottom-right: the header says so (the counts are)."""
    code, out, _ = run(capsys, "account", "--lq", "3", "--lk", "5", "--conventions", "flash_attn_2")
    assert code == 0 and "mask=causal(bottom_right, from flash_attn_2)" in out, out
    code, out, _ = run(capsys, "account")
    assert code == 0 and "mask=causal " in out, out


# ----------------------------------------------------------------------------------------
# sizes and options a command would not survive or would not read: refused up front
# ----------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("argv", "words"),
    [
        (["bench", "--calls", "5"], ["--calls would be ignored", "--decode's"]),
        (["bench", "--decode", "--tiles", "64x64"], ["--tiles would be ignored by --decode"]),
        (["bench", "--decode", "--heads", "8", "--causal", "yes"], ["--causal, --heads"]),
        (["bench", "--contention", "--lengths", "1024"], ["--lengths would be ignored"]),
        (["bench", "--no-naive", "--naive-max-gb", "1"], ["--naive-max-gb would be ignored"]),
        (["bench", "--lengths", "64,,128"], ["no empty item"]),
        (["bench", "--dtypes", "float32,"], ["--dtypes"]),
        (["bench", "--lengths", "100000"], ["over 65536", "allowed: 1..65536"]),
        (["bench", "--decode", "--lengths", "1000000"], ["over 262144"]),
        (["bench", "--out", ""], ["the path is empty"]),
        (["ring", "--seq", "100000000", "--world", "2"], ["dense reference", "lower --seq"]),
        (["ring", "--window", "-2,0"], ["--window LEFT must be -1 (unbounded) or an integer"]),
        (
            ["ring", "--seq", "8", "--seq-k", "12", "--align", "bottom_right"],
            ["--align bottom_right aligns a causal mask or a window", "add --causal or --window"],
        ),
        (["bench", "--lengths", "16,16"], ["16 given more than once in '16,16'"]),
        (["bench", "--dtypes", "float32,float32"], ["float32 given more than once"]),
        (["bench", "--tiles", "64x64,64X64"], ["64x64 given more than once"]),
        (  # a value pasted by mistake is echoed cut: its start, its end and its length
            ["backward", "--dtype", "x" * 5000],
            ["x" * 80 + "…" + "x" * 20 + " (5,000 characters)"],
        ),
        (["ring", "--world", "abc"], ["--world: expected an integer >= 1, got 'abc'"]),
        (["ring", "--conventions", "nope"], ["unknown preset 'nope'; allowed: flash_attn_2"]),
        (
            ["account", "--check", "--mask", "none", "--lq", "2147483647", "--heads", "2147483647"],
            ["--check's random inputs", "GiB", "or drop --check"],
        ),
        (["traffic", "--sweep", "--out", "plot.pdf"], ["--out plot.pdf: the sweep draws a PNG"]),
        (["explore", "--host", "not..a..host"], ["not a valid host name"]),
    ],
)
def test_what_a_command_cannot_do_is_one_line_before_it_starts(
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    argv: list[str],
    words: list[str],
) -> None:
    monkeypatch.chdir(tmp_path)  # nothing may be written; where it would be is a scratch folder
    code, out, err = run(capsys, *argv)
    assert_usage_error(code, out, err, *words)
    assert list(tmp_path.iterdir()) == [], list(tmp_path.iterdir())


def test_ring_reads_a_preset_as_the_other_commands_do(capsys: pytest.CaptureFixture[str]) -> None:
    from flashledger.conventions import preset_arg

    argv = ("ring", "--seq", "12", "--world", "2", "--causal", "--conventions")
    want = run_json(capsys, *argv, "flash_attn_2")
    for name in ("FLASH_ATTN_2", "flash-attn-2"):
        assert preset_arg(name) == "flash_attn_2"
        assert run_json(capsys, *argv, name) == want, name


def test_an_os_error_is_its_reason_without_the_errno(
    capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    (tmp_path / "file").write_text("x")
    code, out, err = run(capsys, "bench", "--lengths", "64", "--out", str(tmp_path / "file" / "b"))
    assert_usage_error(code, out, err, "cannot create the directory (Not a directory)")
    assert "[Errno" not in err
