"""The explorer's JSON API: every endpoint, the seed's figures, and every kind of bad input.

Bad input must give 422 (413 for an oversized body) with a readable one-line
``detail`` and an ``errors`` list naming the field; never a 500.
"""

from __future__ import annotations

import json
import math
from typing import Any

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("fastapi", reason="the web extra is not installed")

from fastapi.testclient import TestClient

from flashledger import PRESETS, examples
from flashledger.web import require_web_extra
from flashledger.web.__main__ import main as web_main
from flashledger.web.app import create_app, serve
from flashledger.web.compute import backward_steps
from flashledger.web.schemas import BackwardRequest


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(), base_url="http://127.0.0.1", raise_server_exceptions=False)


def _seed_ledger(**changes: Any) -> dict[str, Any]:
    body = {
        "scores": examples.SIX_SCORES.tolist(),
        "values": examples.SIX_VALUES.tolist(),
        "block_size": 2,
        "shift": 0.0,
    }
    body.update(changes)
    return body


def _seed_backward(**changes: Any) -> dict[str, Any]:
    ex = examples.five_position_example()
    body: dict[str, Any] = {
        "q": ex["q"].tolist(),
        "k": ex["k"].tolist(),
        "v": ex["v"].tolist(),
        "g": ex["g"].tolist(),
        "block_q": 2,
        "block_k": 2,
        "mask": {"kind": "causal_top_left"},
    }
    body.update(changes)
    return body


def _masked_row_dense(row: int = 2, n: int = 5) -> list[list[bool]]:
    """Causal top-left with query ``row`` seeing no key."""
    return [[i != row and j <= i for j in range(n)] for i in range(n)]


def _ok(response: Any) -> dict[str, Any]:
    assert response.status_code == 200, f"status {response.status_code}: {response.text[:400]}"
    assert "NaN" not in response.text, "a NaN reached the response"
    return response.json()  # type: ignore[no-any-return]


def _worst(a: list[Any], b: list[Any]) -> tuple[float, tuple[int, ...]]:
    """Largest |a - b| over equally shaped nested lists, and where it is."""
    ta, tb = torch.tensor(a, dtype=torch.float64), torch.tensor(b, dtype=torch.float64)
    assert ta.shape == tb.shape, f"shape {tuple(ta.shape)} != {tuple(tb.shape)}"
    diff = (ta - tb).abs()
    idx = tuple(int(i) for i in torch.nonzero(diff == diff.max())[0].tolist())
    return float(diff.max()), idx


# ----------------------------------------------------------------------------- examples and page


def test_examples_are_the_seed_data(client: TestClient) -> None:
    data = _ok(client.get("/api/examples"))
    assert data["ledger"]["scores"] == [1.0, 2.0, -1.0, 3.0, 0.0, 2.5]
    assert data["ledger"]["values"] == examples.SIX_VALUES.tolist()
    assert data["backward"]["q"] == examples.FIVE_Q.tolist()
    assert data["backward"]["g"] == examples.FIVE_G.tolist()
    assert [p["name"] for p in data["presets"]] == list(PRESETS)
    assert data["limits"]["max_trace_len"] == 64
    assert data["limits"]["max_body_bytes"] == 192 * 1024


def test_page_is_self_contained(client: TestClient) -> None:
    page = client.get("/")
    assert page.status_code == 200
    html = page.text
    assert html.count("<math") >= 4, "the formulas must be served as MathML"
    assert "<!--formula:" not in html, "a formula marker was left unrendered"
    for attr in ('src="http', "src='http", 'href="http', "href='http", "//cdn"):
        assert attr not in html, f"the page refers to an outside resource ({attr})"
    csp = page.headers["content-security-policy"]
    assert "default-src 'self'" in csp and "connect-src 'self'" in csp
    for name in ("main.js", "ledger.js", "backward.js", "gpu.js", "storage.js", "style.css"):
        res = client.get(f"/static/{name}")
        assert res.status_code == 200, f"/static/{name}: {res.status_code}"
        assert "http://" not in res.text and "https://" not in res.text, f"{name} refers outside"


def test_docs_and_openapi(client: TestClient) -> None:
    docs = client.get("/docs")
    assert docs.status_code == 200 and "/static/apidocs.js" in docs.text
    assert "cdn" not in docs.text.lower()
    spec = _ok(client.get("/openapi.json"))
    paths = set(spec["paths"])
    want = {
        "/api/examples",
        "/api/ledger",
        "/api/backward",
        "/api/storage",
        "/api/conventions",
        "/api/measure",
    }
    assert want <= paths, f"missing from OpenAPI: {sorted(want - paths)}"


# ----------------------------------------------------------------------------- section 02


def test_ledger_seed_figures(client: TestClient) -> None:
    raw = client.post("/api/ledger", json=_seed_ledger())
    data = _ok(raw)
    steps = data["steps"]
    assert [s["start"] for s in steps] == [0, 2, 4] and [s["stop"] for s in steps] == [2, 4, 6]
    assert [s["m"] for s in steps] == [2.0, 3.0, 3.0]
    assert steps[0]["m_before"] == "-Infinity", "the initial m is -inf, sent as a string"
    assert steps[0]["alpha"] == 0.0, "the first block's old-state scale must be 0"
    assert steps[1]["alpha"] == pytest.approx(math.exp(-1.0), abs=1e-15)
    assert steps[-1]["m"] == 3.0
    assert steps[-1]["max_diff"] < 1e-12, f"final prefix output off by {steps[-1]['max_diff']}"
    assert steps[0]["max_diff"] > 0.1, "after one block the prefix must not equal the full row"
    s = examples.SIX_SCORES
    for st_ in steps:
        ell = float(torch.exp(s[: st_["stop"]] - st_["m"]).sum())
        assert st_["ell"] == pytest.approx(ell, abs=1e-14), f"ell of block {st_['index']}"
    assert sum(data["p"]) == pytest.approx(1.0, abs=1e-15)
    assert data["lse"] == pytest.approx(float(torch.logsumexp(s, 0)), abs=1e-14)
    off = data["per_block"]["max_diff"]
    assert off > 0.05, f"the per-block softmax average should be visibly wrong, off by {off}"


def test_ledger_shift_changes_max_not_output(client: TestClient) -> None:
    base = _ok(client.post("/api/ledger", json=_seed_ledger()))
    shifted = _ok(client.post("/api/ledger", json=_seed_ledger(shift=10.0)))
    assert shifted["steps"][-1]["m"] == 13.0
    worst, idx = _worst(shifted["o"], base["o"])
    assert worst < 1e-12, f"shift changed the output by {worst} at {idx}"
    worst, idx = _worst(shifted["p"], base["p"])
    assert worst < 1e-12, f"shift changed the probabilities by {worst} at {idx}"


@pytest.mark.parametrize("block", [1, 3, 4, 6])
def test_ledger_block_sizes(client: TestClient, block: int) -> None:
    data = _ok(client.post("/api/ledger", json=_seed_ledger(block_size=block)))
    assert len(data["steps"]) == -(-6 // block)
    assert data["steps"][-1]["m"] == 3.0
    assert data["steps"][-1]["max_diff"] < 1e-12


# ----------------------------------------------------------------------------- section 04


def test_backward_seed_figures(client: TestClient) -> None:
    data = _ok(client.post("/api/backward", json=_seed_backward()))
    assert data["forward_max_diff"] < 1e-12, f"forward off by {data['forward_max_diff']}"
    assert data["grad_max_diff"] < 1e-12, f"gradients off by {data['grad_max_diff']}"
    assert data["autograd"]["ok"] and data["autograd"]["max_diff"] < 1e-12, data["autograd"]
    c = data["counters"]
    assert (c["qk_dots_visible"], c["qk_dots_computed"]) == (15, 17), c
    assert (c["tiles_run"], c["tiles_skipped"]) == (6, 3), c
    assert data["forward_counters"]["qk_dots_visible"] == 15
    assert len(data["steps"]) == 6
    assert data["tile_kinds"] == [
        ["partial", "empty", "empty"],
        ["full", "partial", "empty"],
        ["full", "full", "full"],
    ]
    assert data["fully_masked_rows"] == []
    # adding the tiles' contributions in loop order gives the final gradients (the page does this)
    acc = {name: torch.zeros(5, 2, dtype=torch.float64) for name in ("dq", "dk", "dv")}
    for step in data["steps"]:
        q0, q1 = step["q_range"]
        k0, k1 = step["k_range"]
        acc["dq"][q0:q1] += torch.tensor(step["dq"], dtype=torch.float64)
        acc["dk"][k0:k1] += torch.tensor(step["dk"], dtype=torch.float64)
        acc["dv"][k0:k1] += torch.tensor(step["dv"], dtype=torch.float64)
    for name in ("dq", "dk", "dv"):
        worst, idx = _worst(acc[name].tolist(), data["reference"][name])
        assert worst < 1e-12, f"accumulated {name} off the reference by {worst} at {idx}"
    # every rebuilt probability equals the reference P
    for step in data["steps"]:
        q0, q1 = step["q_range"]
        k0, k1 = step["k_range"]
        ref = [row[k0:k1] for row in data["p"][q0:q1]]
        worst, idx = _worst(step["p"], ref)
        assert worst < 1e-12, f"step {step['index']}: rebuilt P off by {worst} at {idx}"


@pytest.mark.parametrize(
    ("preset", "lse"), [("seed", "-Infinity"), ("flash_attn_2", "Infinity"), ("sdpa_cpu", 0.0)]
)
def test_backward_fully_masked_row(client: TestClient, preset: str, lse: Any) -> None:
    body = _seed_backward(
        mask={"kind": "custom", "dense": _masked_row_dense(2)}, conventions=preset
    )
    data = _ok(client.post("/api/backward", json=body))
    assert data["fully_masked_rows"] == [2]
    assert data["lse"][2] == lse, f"{preset}: LSE of the empty row is {data['lse'][2]!r}"
    assert data["o"][2] == [0.0, 0.0]
    assert data["grads"]["dq"][2] == [0.0, 0.0]
    assert data["grad_max_diff"] < 1e-12 and data["autograd"]["ok"], data["autograd"]


@pytest.mark.parametrize(
    "options",
    [
        {"dropout_p": 0.3, "seed": 7},
        {"softcap": 0.5},
        {"alibi": True, "alibi_slope": 0.75},
        {"mask": {"kind": "sliding_window", "left": 1, "right": 0}},
        {"mask": {"kind": "causal"}, "conventions": "flash_attn_2", "block_q": 3, "block_k": 1},
        {"mask": {"kind": "none"}, "block_q": 5, "block_k": 5},
    ],
    ids=["dropout", "softcap", "alibi", "window", "fa2-causal", "no-mask"],
)
def test_backward_options_match_reference_and_autograd(
    client: TestClient, options: dict[str, Any]
) -> None:
    data = _ok(client.post("/api/backward", json=_seed_backward(**options)))
    assert data["grad_max_diff"] < 1e-12, f"{options}: gradients off by {data['grad_max_diff']}"
    assert data["forward_max_diff"] < 1e-12, f"{options}: forward off by {data['forward_max_diff']}"
    assert data["autograd"]["ok"], f"{options}: autograd check {data['autograd']}"
    if "dropout_p" in options:
        dropped = sum(not x for row in data["keep"] for x in row)
        assert dropped > 0 and data["counters"]["dropped"] > 0, "dropout dropped nothing"


@pytest.mark.parametrize(
    "options",
    [{"softcap": 0.5}, {"softcap": 0.5, "alibi": True, "alibi_slope": 0.75}, {}],
    ids=["softcap", "softcap-alibi", "no-softcap"],
)
def test_a_softcap_step_carries_the_factor_its_gradients_take(
    client: TestClient, options: dict[str, Any]
) -> None:
    """Under a softcap a tile's ``ds`` is the gradient of the capped scores and ``ds @ K/√d``
    is not its ``dq``; ``ds_qk = ds·(1 − t²)`` is the factor dq and dk take (section 04 shows
    it). Before: no step carried it, and a step could not be followed by hand."""
    body = _seed_backward(**options)
    data = _ok(client.post("/api/backward", json=body))
    q, k = (torch.tensor(body[name], dtype=torch.float64) for name in ("q", "k"))
    scale = data["scale"]
    eps = torch.finfo(torch.float64).eps
    plain_off = 0.0
    for step in data["steps"]:
        if "softcap" not in options:
            assert step["ds_qk"] is None, step
            continue
        q0, q1 = step["q_range"]
        k0, k1 = step["k_range"]
        factor = torch.tensor(step["ds_qk"], dtype=torch.float64)  # (rows, cols)
        for name, got, terms in [
            ("dq", factor @ k[k0:k1] * scale, factor.abs() @ k[k0:k1].abs() * scale),
            ("dk", factor.T @ q[q0:q1] * scale, factor.T.abs() @ q[q0:q1].abs() * scale),
        ]:
            want = torch.tensor(step[name], dtype=torch.float64)
            # a few roundings of each term apart (the loop's t and order are its own)
            assert ((got - want).abs() <= 64 * eps * terms + 1e-300).all(), (name, step)
        ds = torch.tensor(step["ds"], dtype=torch.float64)
        plain = ds @ k[k0:k1] * scale - torch.tensor(step["dq"], dtype=torch.float64)
        plain_off = max(plain_off, float(plain.abs().max()))
    if "softcap" in options:
        assert plain_off > 1e-6, "ds @ K/√d gave dq: the softcap case no longer shows a difference"


# ----------------------------------------------------------------------------- sections 05, 06, 03


def test_storage_seed_figures(client: TestClient) -> None:
    data = _ok(
        client.post(
            "/api/storage",
            json={"lq": 5, "lk": 5, "d": 2, "block_q": 2, "block_k": 2, "mask": {"kind": "causal"}},
        )
    )
    ledger = data["ledger"]
    figures = {
        key: ledger[key]
        for key in (
            "full_p_elements",
            "lse_elements",
            "temp_block_capacity",
            "qk_dots_forward",
            "qk_dots_backward",
            "qk_dots_computed",
            "tiles_run",
            "tiles_skipped",
        )
    }
    assert figures == {
        "full_p_elements": 25,
        "lse_elements": 5,
        "temp_block_capacity": 4,
        "qk_dots_forward": 15,
        "qk_dots_backward": 15,
        "qk_dots_computed": 17,
        "tiles_run": 6,
        "tiles_skipped": 3,
    }
    assert set(data["traffic"]) == {"standard", "fa1", "fa2"}
    assert data["traffic"]["fa2"]["forward"]["elements_read"] > 0
    assert sum(row.count("empty") for row in data["tile_kinds"]) == 3


def test_storage_books_a_custom_grid_and_a_value_width(client: TestClient) -> None:
    """Section 05 books section 04's problem exactly: its mask as a grid, V's own width."""
    causal = [[j <= i for j in range(5)] for i in range(5)]
    by_kind = _ok(client.post("/api/storage", json={"mask": {"kind": "causal_top_left"}}))
    by_grid = _ok(client.post("/api/storage", json={"mask": {"kind": "custom", "dense": causal}}))
    for key in ("full_p_elements", "lse_elements", "temp_block_capacity", "qk_dots_forward"):
        assert by_grid["ledger"][key] == by_kind["ledger"][key], key
    assert by_grid["ledger"]["qk_dots_forward"] == by_grid["ledger"]["qk_dots_backward"] == 15
    assert by_grid["tile_kinds"] == by_kind["tile_kinds"]
    one_row_masked = [row if i != 2 else [False] * 5 for i, row in enumerate(causal)]
    data = _ok(
        client.post("/api/storage", json={"mask": {"kind": "custom", "dense": one_row_masked}})
    )
    assert data["ledger"]["qk_dots_forward"] == 12  # row 2 saw 3 keys
    wide = _ok(client.post("/api/storage", json={"d_v": 3}))
    assert wide["ledger"]["common_elements"] == {"q": 10, "k": 10, "v": 15, "o": 15}
    assert all(p["common"] == 2 * p["length"] * (2 + 3) for p in wide["sweep"])


def test_storage_books_the_statistics_in_float32_for_half_inputs(client: TestClient) -> None:
    """float16: P and O at 2 bytes, the LSE at 4 (as the loop and flash-attn keep it); the
    traffic bars' bytes are the API's per pass, the statistics counted at 4."""
    data = _ok(client.post("/api/storage", json={"dtype": "float16"}))
    ledger = data["ledger"]
    assert ledger["bytes"]["full_p"] == 25 * 2 and ledger["bytes"]["lse"] == 5 * 4
    fa2 = data["traffic"]["fa2"]["forward"]
    assert fa2["writes"] == {"o": 10, "lse": 5}
    assert fa2["bytes_written"] == 10 * 2 + 5 * 4


def test_storage_big_grid_is_not_drawn(client: TestClient) -> None:
    data = _ok(
        client.post("/api/storage", json={"lq": 4096, "lk": 4096, "block_q": 64, "block_k": 64})
    )
    assert data["tile_kinds"] is None
    assert data["ledger"]["tiles_run"] + data["ledger"]["tiles_skipped"] == 64 * 64


def test_conventions_table(client: TestClient) -> None:
    ex = examples.five_position_example()
    body = {
        "q": ex["q"].tolist(),
        "k": ex["k"][:3].tolist(),
        "v": ex["v"][:3].tolist(),
        "mask": {"kind": "causal"},
    }
    data = _ok(client.post("/api/conventions", json=body))
    by_name = {p["name"]: p for p in data["presets"]}
    assert set(by_name) == set(PRESETS)
    masked = {
        name: [r["row"] for r in p["rows"] if r["fully_masked"]] for name, p in by_name.items()
    }
    assert masked["seed"] == [] and masked["sdpa_cpu"] == []
    assert masked["flash_attn_2"] == [0, 1] and masked["flash_attn_3"] == [0, 1]
    assert [by_name["flash_attn_2"]["rows"][i]["lse"] for i in (0, 1)] == ["Infinity"] * 2
    assert [by_name["flash_attn_3"]["rows"][i]["lse"] for i in (0, 1)] == ["-Infinity"] * 2
    for name, preset in by_name.items():
        for row in preset["rows"]:
            assert row["max_diff"] < 1e-12, f"{name} row {row['row']}: O off by {row['max_diff']}"
            if row["fully_masked"]:
                assert row["o"] == [0.0, 0.0], f"{name} row {row['row']}: O = {row['o']}"


def test_measure_small_run(client: TestClient) -> None:
    data = _ok(client.post("/api/measure", json={"length": 24, "d": 4, "block": 8, "repeats": 1}))
    assert set(data["times_ms"]) == {
        "blocked_forward",
        "blocked_backward",
        "reference_forward",
        "reference_backward",
    }
    assert all(t > 0 for t in data["times_ms"].values()), data["times_ms"]
    assert data["forward_max_diff"] < 1e-12 and data["grad_max_diff"] < 1e-12
    assert data["full_p_bytes"] == 24 * 24 * 8 and data["lse_bytes"] == 24 * 8


# ----------------------------------------------------------------------------- rejected input

_BAD: list[tuple[str, str, Any, str, str]] = [
    # (id, path, body, field named, text in the message)
    ("scores-text", "/api/ledger", _seed_ledger(scores="1, 2"), "scores", "scores"),
    ("scores-word", "/api/ledger", _seed_ledger(scores=[1, "x", 3]), "scores", "scores[1]"),
    ("scores-empty", "/api/ledger", _seed_ledger(scores=[], values=[]), "scores", "at least 1"),
    ("scores-long", "/api/ledger", _seed_ledger(scores=[0.0] * 65), "scores", "at most 64"),
    ("scores-inf", "/api/ledger", _seed_ledger(scores=[1, "inf", 0, 0, 0, 0]), "scores", "finite"),
    ("scores-huge", "/api/ledger", _seed_ledger(scores=[1e300] * 6), "scores", "1000000"),
    ("block-zero", "/api/ledger", _seed_ledger(block_size=0), "block_size", "block_size"),
    ("block-big", "/api/ledger", _seed_ledger(block_size=7), "block_size", "1..6"),
    ("block-float", "/api/ledger", _seed_ledger(block_size=2.5), "block_size", "integer"),
    ("values-rows", "/api/ledger", _seed_ledger(values=[[1, 0]] * 5), "values", "one value"),
    (
        "values-ragged",
        "/api/ledger",
        _seed_ledger(values=[[1, 0]] * 5 + [[1]]),
        "values",
        "same length",
    ),
    ("values-wide", "/api/ledger", _seed_ledger(values=[[0.0] * 17] * 6), "values", "at most 16"),
    ("shift-nan", "/api/ledger", _seed_ledger(shift="nan"), "shift", "finite"),
    ("unknown-field", "/api/ledger", _seed_ledger(colour=1), "colour", "unknown field"),
    (  # rows count from 1, as a person reads the lines of a matrix; "1 entry", not "1 entries"
        "q-ragged",
        "/api/backward",
        _seed_backward(q=[[0.1, 0.2]] * 4 + [[0.1]]),
        "q",
        "row 5 has 1 entry but row 1 has 2",
    ),
    ("k-dim", "/api/backward", _seed_backward(k=[[0.1, 0.2, 0.3]] * 5), "k", "share d"),
    ("v-rows", "/api/backward", _seed_backward(v=[[1.0, 0.0]] * 4), "v", "one value row"),
    ("g-shape", "/api/backward", _seed_backward(g=[[1.0]] * 5), "g", "Lq x d_v"),
    ("q-long", "/api/backward", _seed_backward(q=[[0.0, 0.0]] * 65), "q", "at most 64"),
    ("bq-big", "/api/backward", _seed_backward(block_q=6), "block_q", "1..5"),
    ("bk-zero", "/api/backward", _seed_backward(block_k=0), "block_k", "block_k"),
    (
        "mask-kind",
        "/api/backward",
        _seed_backward(mask={"kind": "diagonal"}),
        "mask",
        "mask.kind",
    ),
    (
        "mask-no-grid",
        "/api/backward",
        _seed_backward(mask={"kind": "custom"}),
        "mask",
        "needs 'dense'",
    ),
    (
        "mask-grid-shape",
        "/api/backward",
        _seed_backward(mask={"kind": "custom", "dense": [[True] * 5] * 4}),
        "mask",
        "5 x 5",
    ),
    (
        "window-left",
        "/api/backward",
        _seed_backward(mask={"kind": "sliding_window", "left": -3}),
        "mask",
        "mask.left",
    ),
    (  # a field the kind does not read is refused, not ignored
        "causal-align",
        "/api/backward",
        _seed_backward(mask={"kind": "causal", "align": "bottom_right"}),
        "mask",
        "'align' applies only to kind 'sliding_window', not 'causal'; leave it out; a causal "
        "mask aligned bottom-right is kind 'causal_bottom_right'",
    ),
    (
        "none-window-sides",
        "/api/backward",
        _seed_backward(mask={"kind": "none", "left": 1, "right": 0}),
        "mask",
        "'left' and 'right' apply only to kind 'sliding_window', not 'none'; leave them out",
    ),
    (
        "seed-without-dropout",
        "/api/backward",
        _seed_backward(seed=5),
        "seed",
        "dropout_p is 0",
    ),
    (
        "slope-without-alibi",
        "/api/backward",
        _seed_backward(alibi_slope=3.0),
        "alibi_slope",
        "alibi is off",
    ),
    (
        "conventions-seed-without-dropout",
        "/api/conventions",
        {"q": [[1.0]], "k": [[1.0]], "v": [[1.0]], "seed": 3},
        "seed",
        "dropout_p is 0",
    ),
    ("conventions", "/api/backward", _seed_backward(conventions="xformers"), "conventions", "seed"),
    ("dropout-one", "/api/backward", _seed_backward(dropout_p=1.0), "dropout_p", "0.9"),
    ("softcap-zero", "/api/backward", _seed_backward(softcap=0), "softcap", "allowed: (0, 10000]"),
    ("seed-negative", "/api/backward", _seed_backward(seed=-1), "seed", "seed"),
    ("storage-block", "/api/storage", {"lq": 4, "block_q": 5}, "block_q", "1..4"),
    ("storage-tiles", "/api/storage", {"lq": 65536, "lk": 65536, "block_q": 1}, "block_q", "tiles"),
    (  # a custom grid (section 04's, booked in section 05) must be Lq x Lk
        "storage-custom-shape",
        "/api/storage",
        {"mask": {"kind": "custom", "dense": [[True]]}},
        "mask",
        "it must be 5 x 5",
    ),
    ("storage-dv", "/api/storage", {"d_v": 0}, "d_v", "1..1024"),
    ("storage-len", "/api/storage", {"lq": 0}, "lq", "lq"),
    ("measure-len", "/api/measure", {"length": 5000}, "length", "1024"),
    ("measure-block", "/api/measure", {"length": 16, "block": 32}, "block", "1..16"),
    ("measure-tiles", "/api/measure", {"length": 1024, "block": 32}, "block", "at most 256"),
    ("conventions-k", "/api/conventions", {"q": [[1.0]], "k": [], "v": []}, "k", "at least 1"),
    (
        "conventions-preset",  # the request runs every preset: one named would do nothing
        "/api/conventions",
        {"q": [[1.0]], "k": [[1.0]], "v": [[1.0]], "conventions": "seed"},
        "conventions",
        "runs every preset",
    ),
    (
        "backward-softcap-dropout",  # flash_attn_2 refuses the pair, as its kernel does
        "/api/backward",
        _seed_backward(conventions="flash_attn_2", dropout_p=0.3, softcap=5.0),
        "softcap",
        "take no softcap together with dropout",
    ),
    (
        "ledger-huge-block",
        "/api/ledger",
        _seed_ledger(block_size=10**40),
        "block_size",
        "41 digits",
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "field", "text"), [b[1:] for b in _BAD], ids=[b[0] for b in _BAD]
)
def test_rejected_input_is_422_with_reason(
    client: TestClient, path: str, body: Any, field: str, text: str
) -> None:
    res = client.post(path, json=body)
    assert res.status_code == 422, f"{path}: status {res.status_code}, body {res.text[:300]}"
    data = res.json()
    assert isinstance(data["detail"], str) and data["detail"], data
    assert "\n" not in data["detail"], f"detail must be one line: {data['detail']!r}"
    fields = [e["field"] for e in data["errors"]]
    assert field in fields, f"no error names field {field!r}: {data['errors']}"
    assert text in data["detail"], f"{text!r} not in {data['detail']!r}"


def test_malformed_and_missing_bodies(client: TestClient) -> None:
    res = client.post(
        "/api/ledger", content=b"{not json", headers={"Content-Type": "application/json"}
    )
    assert res.status_code == 422 and "not valid JSON" in res.json()["detail"], res.text
    res = client.post("/api/ledger")
    assert res.status_code == 422 and "request body" in res.json()["detail"], res.text
    res = client.post("/api/ledger", json=[1, 2, 3])
    assert res.status_code == 422, res.text


def test_a_key_named_twice_or_an_encoded_body_is_refused(client: TestClient) -> None:
    """A JSON object that names a key twice would have its last value win unseen: 422,
    the key named. A body with a Content-Encoding the API does not decode: 415, the
    header named (it was read as if it were plain, or failed as not UTF-8)."""
    body = b'{"scores": [1], "values": [[1]], "scores": [5]}'
    res = client.post("/api/ledger", content=body, headers={"Content-Type": "application/json"})
    assert res.status_code == 422, res.text
    err = res.json()["errors"][0]
    assert err["kind"] == "invalid_json" and "'scores' more than once" in err["message"], err
    nested = b'{"lq": 8, "mask": {"kind": "none", "kind": "causal"}}'
    res = client.post("/api/storage", content=nested)
    assert res.status_code == 422 and "'kind' more than once" in res.json()["detail"], res.text
    for coding in ("gzip", "br"):
        res = client.post(
            "/api/storage",
            content=b'{"lq": 8}',
            headers={"Content-Type": "application/json", "Content-Encoding": coding},
        )
        assert res.status_code == 415, res.text
        assert f"Content-Encoding '{coding}'" in res.json()["detail"], res.text
    plain = client.post(
        "/api/storage", content=b'{"lq": 8}', headers={"Content-Encoding": "identity"}
    )
    assert _ok(plain) == _ok(client.post("/api/storage", json={"lq": 8}))


def test_bodies_that_are_not_json_objects_are_named(client: TestClient) -> None:
    """A body labelled as a form (curl's -d) gets 415 and the header to send; a JSON value
    that is not an object, where one is wanted, gets a message that says so."""
    res = client.post(
        "/api/storage",
        content=b'{"lq": 8}',
        headers={"Content-Type": "application/x-www-form-urlencoded"},
    )
    assert res.status_code == 415, res.text
    err = res.json()["errors"][0]
    assert err["kind"] == "media_type" and "Content-Type: application/json" in err["message"]
    res = client.post("/api/storage", content=b'{"lq": 8}')  # unlabelled: read as JSON
    assert _ok(res) == _ok(client.post("/api/storage", json={"lq": 8}))
    for body in (None, [], 1, "x"):
        res = client.post("/api/storage", json=body)
        assert res.status_code == 422, res.text
        detail = res.json()["detail"]
        assert "JSON object" in detail and "valid dictionary" not in detail, detail
    res = client.post("/api/storage", json={"mask": 3})
    err = res.json()["errors"][0]
    assert res.status_code == 422 and err["kind"] == "not_object", res.text
    assert err["message"] == "mask: must be a JSON object {...}, not 3", err
    # a mask's kind alone stands for {"kind": ...}: what /api/examples serves is accepted
    example = _ok(client.get("/api/examples"))["backward"]
    assert isinstance(example["mask"], str)
    res = client.post("/api/backward", json=example | {"block_q": 2, "block_k": 2})
    assert _ok(res)["lq"] == len(example["q"])


def test_unparsable_json_is_not_blamed_on_the_encoding(client: TestClient) -> None:
    for body in (b"[" * 5000 + b"]" * 5000, b'{"lq": ' + b"9" * 5000 + b"}"):
        res = client.post(
            "/api/storage", content=body, headers={"Content-Type": "application/json"}
        )
        assert res.status_code == 422, res.text[:200]
        detail = res.json()["detail"]
        assert "could not be read as JSON" in detail and "nested too deeply" in detail, detail


def test_one_request_lists_at_most_twenty_errors_and_is_answered_at_once(
    client: TestClient,
) -> None:
    """A custom grid row far longer than any length allows is one error, not one per cell;
    and however many cells are wrong, 20 errors are listed and the rest counted."""
    row = [1] * 95_000
    res = client.post("/api/backward", json={"mask": {"kind": "custom", "dense": [row]}})
    assert res.status_code == 422 and len(res.content) < 20_000, len(res.content)
    assert any(e["kind"] == "too_long" and e["limits"] == {"max": 64} for e in res.json()["errors"])
    grid = [[1] * 64 for _ in range(64)]  # 4096 cells, each not a boolean
    res = client.post("/api/backward", json=_seed_backward(mask={"kind": "custom", "dense": grid}))
    errors = res.json()["errors"]
    assert res.status_code == 422 and len(errors) == 21, len(errors)
    assert errors[-1]["kind"] == "more_errors" and errors[-1]["limits"]["count"] == 4096 - 20


@pytest.mark.parametrize(
    ("path", "body", "field"),
    [
        ("/api/ledger", {"scores": [1.0], "values": [[1.0]]}, "block_size"),
        ("/api/storage", {"lq": 1, "lk": 1}, "block_q"),
        ("/api/conventions", {"q": [[1.0]], "k": [[1.0]], "v": [[1.0]]}, "block_q"),
    ],
)
def test_a_block_left_out_fits_a_length_of_one(
    client: TestClient, path: str, body: dict[str, Any], field: str
) -> None:
    """The default block, 2, is the length where that is 1: no error about a field the
    client never sent. Sent explicitly, 2 is still refused."""
    _ok(client.post(path, json=body))
    res = client.post(path, json=body | {field: 2})
    assert res.status_code == 422 and "allowed: 1..1" in res.json()["detail"], res.text


def test_conventions_mark_the_preset_that_refuses_softcap_with_dropout(
    client: TestClient,
) -> None:
    ex = examples.five_position_example()
    body = {"q": ex["q"].tolist(), "k": ex["k"].tolist(), "v": ex["v"].tolist()}
    data = _ok(client.post("/api/conventions", json=body | {"softcap": 5.0, "dropout_p": 0.3}))
    refusing = {n for n, c in PRESETS.items() if not c.softcap_with_dropout}
    assert refusing, "no preset refuses the pair: the test is void"
    for preset in data["presets"]:
        if preset["name"] in refusing:
            assert preset["rows"] == [] and "softcap" in preset["refused"], preset
        else:
            assert preset["refused"] is None and len(preset["rows"]) == len(body["q"]), preset


def test_gradient_check_tolerance_follows_the_scores_magnitude(client: TestClient) -> None:
    """Entries near the 1e6 limit make scores near 1e12, which float64 keeps to 1e-4: the
    blocked and the autograd gradients differ by that much relative, and the check says
    so within the rounding it derives, not against 1e-10."""
    big = 1e6
    body = {
        "q": [[big, -big], [1, 2], [-big, big], [0, 0], [3, big]],
        "k": [[big, big], [-big, 3], [0, big], [1, 1], [2, 2]],
        "v": [[big, 1]] * 5,
        "g": [[big, -big]] * 5,
        "mask": {"kind": "none"},
    }
    data = _ok(client.post("/api/backward", json=body))
    assert data["autograd"]["ok"], data["autograd"]
    assert data["grad_max_diff"] <= data["tolerance"], (data["grad_max_diff"], data["tolerance"])
    seed = _ok(client.post("/api/backward", json=_seed_backward()))
    assert seed["tolerance"] <= 1e-10 * 10, seed["tolerance"]  # ordinary inputs: 1e-10 rel


def test_gradient_check_tolerance_follows_the_terms_a_gradient_cancels() -> None:
    """Rows that each see one key with a score near 6e11 (P = 1 within the scores'
    rounding, 1e-4 relative): dV[0] = P[0,0] g[0] + P[1,0] g[1] cancels to 0 from terms of
    1e6, so the blocked and the autograd dV differ by about 1e2 where every gradient is
    near 0. The tolerance scales with the terms summed, not with the (cancelled) result."""
    body = {
        "q": [[1e6, -1, 0], [1e6, 0, 1], [0, -358393.75, 1]],
        "k": [[1e6, 977199.125, 0], [1e-300, -1, 0], [0, 1.5767, 2.0304]],
        "v": [[3.0857941140421747], [-1], [0]],
        "g": [[1e6], [-1e6], [0]],
        "block_q": 1,
        "block_k": 1,
    }
    req = BackwardRequest.model_validate(body)
    data = backward_steps(req).model_dump()
    largest = max(abs(x) for grad in data["grads"].values() for row in grad for x in row)
    assert data["autograd"]["max_diff"] > 1e-10 * max(1.0, largest), (
        "the case no longer cancels: it checks nothing"
    )
    assert data["autograd"]["ok"], data["autograd"]
    assert data["grad_max_diff"] <= data["tolerance"], (data["grad_max_diff"], data["tolerance"])


def test_oversized_headers_are_431(client: TestClient) -> None:
    res = client.get("/api/examples", headers={"X-Pad": "x" * 60_000})
    assert res.status_code == 431, res.status_code
    err = res.json()["errors"][0]
    assert err["kind"] == "too_large" and err["limits"]["max"] == 16384, err


def test_oversized_body_is_413(client: TestClient) -> None:
    body = json.dumps(_seed_ledger(pad="x" * 200_000)).encode()
    res = client.post("/api/ledger", content=body, headers={"Content-Type": "application/json"})
    assert res.status_code == 413, res.text[:200]
    assert "196608" in res.json()["detail"]

    def chunks() -> Any:  # no Content-Length: the limit must hold while streaming
        for _ in range(50):
            yield b" " * 4096

    res = client.post("/api/ledger", content=chunks(), headers={"Content-Type": "application/json"})
    assert res.status_code == 413, res.text[:200]


def test_unknown_routes_and_methods_answer_json(client: TestClient) -> None:
    res = client.get("/api/nothing")
    assert res.status_code == 404 and res.json()["detail"]
    res = client.get("/api/ledger")
    assert res.status_code == 405 and res.json()["detail"]


_json_scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**6), max_value=10**6),
    st.floats(allow_nan=False, allow_infinity=False, width=32),
    st.text(max_size=4),
)


@settings(max_examples=40, deadline=None)
@given(
    scores=st.one_of(_json_scalars, st.lists(_json_scalars, max_size=8)),
    values=st.one_of(_json_scalars, st.lists(st.lists(_json_scalars, max_size=3), max_size=8)),
    block=_json_scalars,
)
def test_ledger_never_500(client: TestClient, scores: Any, values: Any, block: Any) -> None:
    res = client.post("/api/ledger", json={"scores": scores, "values": values, "block_size": block})
    assert res.status_code in (200, 422), f"status {res.status_code}: {res.text[:300]}"
    if res.status_code == 422:
        assert res.json()["detail"], res.text
    else:
        assert "NaN" not in res.text


# ----------------------------------------------------------------------------- entry points


def test_missing_web_extra_gives_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    import flashledger.web as web

    monkeypatch.setattr(web, "find_spec", lambda name: None if name == "uvicorn" else object())
    with pytest.raises(ImportError, match=r"pip install 'flashledger\[web\]'.*uvicorn"):
        require_web_extra()


def test_serve_and_module_reject_bad_port(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="port"):
        serve(port=70000)
    with pytest.raises(SystemExit) as exc:
        web_main(["--port", "70000"])
    assert exc.value.code == 2
    assert "--port must be in 0..65535" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "text"),
    [
        (["--host", ""], "--host is empty"),
        (["--host", "  "], "--host is empty"),
        (["--allow-host", ""], "is not a host name"),
        (["--allow-host", "a b"], "is not a host name"),
    ],
)
def test_serve_and_module_reject_what_explore_rejects(
    capsys: pytest.CaptureFixture[str], argv: list[str], text: str
) -> None:
    """``python -m flashledger.web`` refuses the hosts ``flashledger explore`` refuses
    (an empty --host would listen on every interface), before any port is bound."""
    with pytest.raises(SystemExit) as exc:
        web_main([*argv, "--port", "0"])
    assert exc.value.code == 2
    assert text in capsys.readouterr().err
    host, allow = (argv[1], ()) if argv[0] == "--host" else ("127.0.0.1", (argv[1],))
    with pytest.raises(ValueError, match=text):
        serve(host=host, port=0, allow_hosts=allow)


# ----------------------------------------------------------------------------- section 07


def _ring(client: TestClient, **body: Any) -> dict[str, Any]:
    return _ok(client.post("/api/ring", json=body))


_RING_CASES: list[dict[str, Any]] = [
    {},  # the page's default: 4 ranks, zigzag, L = 16, d = 4, causal
    {"world_size": 3, "layout": "contiguous", "length": 13, "d": 5, "block": 3, "seed": 7},
    {"world_size": 2, "length": 11, "block": 2, "mask": {"kind": "sliding_window", "left": 3}},
    {"world_size": 5, "layout": "contiguous", "length": 9, "mask": {"kind": "none"}},
    {"world_size": 2, "length": 5, "d": 2, "block": 2, "data": "example"},
    {"world_size": 1, "layout": "contiguous", "length": 7, "d": 3},
]


@pytest.mark.parametrize(
    "body", _RING_CASES, ids=lambda b: ",".join(f"{k}={v}" for k, v in b.items()) or "default"
)
def test_ring_equals_oracle_and_closed_form(client: TestClient, body: dict[str, Any]) -> None:
    data = _ring(client, **body)
    w, length, d = data["world_size"], data["length"], data["d"]
    for check in data["checks"]:
        assert check["max_diff"] <= 1e-12 and check["ok"], (
            f"{check['name']}: ring off the dense oracle by {check['max_diff']} at {check['index']}"
        )
    assert data["final_state_max_diff"] == 0.0, "the last recorded states must be the result"
    # communication against the closed form, written out here: kv = L (d + d_v) float64 values
    kv_bytes = length * 2 * d * 8
    want = {
        ("forward", "kv"): (w * (w - 1), (w - 1) * kv_bytes),
        ("backward", "kv"): (w * (w - 1), (w - 1) * kv_bytes),
        ("backward", "dkv"): ((w * w, w * kv_bytes) if w > 1 else (0, 0)),
    }
    got = {(c["pass_name"], c["payload"]): (c["hops"], c["nbytes"]) for c in data["comm"]}
    assert got == want, f"observed {got}, closed form {want}"
    assert all(c["ok"] for c in data["comm"]) and data["comm_match"], data["comm"]
    assert len(data["hops"]) == sum(h for h, _ in want.values())
    # the stepper's ends: nothing merged before step 0, the oracle after step W
    assert len(data["forward"]) == len(data["backward"]) == w + 1
    first, last = data["forward"][0], data["forward"][-1]
    lse0 = [float(x) for r in first["ranks"] for x in r["lse"]]  # -inf travels as "-Infinity"
    assert lse0 == [-math.inf] * length, f"LSE before step 0: {lse0}"
    assert last["max_diff"] <= 1e-12, f"forward after the last step: {last['max_diff']}"
    assert data["backward"][-1]["max_diff"] <= 1e-12, data["backward"][-1]["max_diff"]
    assert data["backward"][0]["max_diff"] > 1e-3, "before the backward no gradient is there"
    for r in last["ranks"]:
        rows = data["ranks"][r["rank"]]["rows"]
        assert r["o_max_diff"] == 0.0, f"rank {r['rank']}: O after the last step is not final"
        assert r["lse"] == [data["lse"][i] for i in rows], f"rank {r['rank']}: LSE not final"


def test_ring_example_lse_is_the_reference(client: TestClient) -> None:
    """The five-position example: the ring's LSE against flashledger's dense reference."""
    from flashledger import Causal, reference_forward

    data = _ring(client, world_size=2, length=5, d=2, data="example")
    ex = examples.five_position_example()
    ref = reference_forward(ex["q"], ex["k"], ex["v"], mask=Causal())
    worst, idx = _worst(data["lse"], ref.lse.tolist())
    assert worst <= 1e-12, f"LSE off by {worst} at row {idx}"
    assert data["bounds"] == [0, 1, 2, 3, 5] and data["owners"] == [0, 1, 1, 0]
    assert [r["rows"] for r in data["ranks"]] == [[0, 3, 4], [1, 2]]


def test_ring_zigzag_balances_causal_work(client: TestClient) -> None:
    zig = _ring(client, world_size=4, length=64, layout="zigzag")
    con = _ring(client, world_size=4, length=64, layout="contiguous")
    for pass_name in ("forward", "backward"):
        z = zig["passes"][pass_name]
        runs = [r["tiles_run"] for r in z["work"]]
        assert len(set(runs)) == 1, f"zigzag {pass_name}: tiles run per rank {runs}"
        assert z["balance"] == 1.0 and z["critical_path"] == z["ideal"] == runs[0], z
        c = con["passes"][pass_name]
        runs_c = [r["tiles_run"] for r in c["work"]]
        assert runs_c == sorted(runs_c) and runs_c[0] < runs_c[-1], f"contiguous: {runs_c}"
        assert c["balance"] > 1.5 and c["critical_path"] > c["ideal"], c
        assert sum(runs_c) == sum(runs), "both layouts run the same tiles in total"
        grid = (64 // 4 // 4) * (64 // 4)  # query tiles of 16 rows x key tiles of 64, block 4
        for work in (z["work"], c["work"]):  # run + skipped = every tile of the rank's grid
            totals = {r["tiles_run"] + r["tiles_skipped"] for r in work}
            assert totals == {grid}, f"tiles per rank {totals}, want {grid}"


def test_ring_hops_and_accumulators_travel_a_full_circle(client: TestClient) -> None:
    w = 3
    data = _ring(client, world_size=w, length=12, layout="zigzag")
    for hop in data["hops"]:
        assert hop["receiver"] == (hop["sender"] + 1) % w, hop
        if hop["payload"] == "kv":  # a rank passes on the shard it held during the step
            assert hop["shard"] == (hop["sender"] - hop["step"]) % w, hop
    last = [h for h in data["hops"] if h["payload"] == "dkv" and h["step"] == w - 1]
    assert sorted((h["receiver"], h["shard"]) for h in last) == [(r, r) for r in range(w)], last
    for n, step in enumerate(data["backward"]):
        for r in step["ranks"]:
            assert r["shard"] == (r["rank"] - max(n - 1, 0)) % w, (n, r)
            if n == 0:
                assert r["acc_shard"] is None and r["acc_count"] == 0, r
            else:  # after step n-1 rank q holds shard q - n's accumulators, n contributions
                assert (r["acc_shard"], r["acc_count"]) == ((r["rank"] - n) % w, n), (n, r)
    for r in data["backward"][-1]["ranks"]:
        assert r["acc_shard"] == r["rank"] and r["acc_max_diff"] == 0.0, r
        assert r["dq_max_diff"] == 0.0, r
    assert data["backward"][1]["ranks"][0]["acc_max_diff"] > 0, "one contribution is not all"
    for pass_name in ("forward", "backward"):  # tiles so far, summed to the end, are the pass's
        end = {
            r["rank"]: (r["tiles_run"], r["tiles_skipped"]) for r in data[pass_name][-1]["ranks"]
        }
        work = {
            x["rank"]: (x["tiles_run"], x["tiles_skipped"])
            for x in data["passes"][pass_name]["work"]
        }
        assert end == work, (pass_name, end, work)
        grid_runs = [sum(c["tiles_run"] for c in row) for row in data["passes"][pass_name]["grid"]]
        assert grid_runs == [work[r][0] for r in range(w)], grid_runs


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_ring_states_are_the_rings_own_records(client: TestClient, layout: str) -> None:
    """Every per-step state the page gets is a RankState the ring recorded, sent unchanged."""
    from flashledger import Causal
    from flashledger.ring import simulate_ring

    w, length, d = 3, 14, 3
    data = _ring(client, world_size=w, length=length, d=d, block=2, layout=layout, seed=5)
    gen = torch.Generator().manual_seed(5)
    q, k, v, g = (torch.randn(length, d, generator=gen, dtype=torch.float64) for _ in range(4))
    res = simulate_ring(
        q,
        k,
        v,
        world_size=w,
        layout=layout,  # type: ignore[arg-type]
        do=g,
        mask=Causal(),
        block_q=2,
        block_k=2,
        record_states=True,
    )
    led = res.ledger
    assert res.dk is not None
    for n in range(1, w + 1):
        for r, (fwd, bwd) in enumerate(
            zip(data["forward"][n]["ranks"], data["backward"][n]["ranks"])
        ):
            own = led.state("forward", n - 1, r)
            assert own.lse is not None and fwd["lse"] == own.lse.tolist(), (n, r)
            assert fwd["shard"] == own.shard == bwd["shard"], (n, r)
            # rank r holds what rank r - 1 recorded passing on at the end of step n - 1
            sent = led.state("backward", n - 1, (r - 1) % w)
            assert (bwd["acc_shard"], bwd["acc_count"]) == (sent.shard, n), (n, r, bwd)
            rows = data["ranks"][sent.shard]["rows"]
            assert sent.dk is not None and sent.dv is not None and res.dv is not None
            acc_diff = max(
                float((sent.dk - res.dk[rows]).abs().max()),
                float((sent.dv - res.dv[rows]).abs().max()),
            )
            assert bwd["acc_max_diff"] == acc_diff, (n, r, bwd["acc_max_diff"], acc_diff)
    mid = data["forward"][1]["ranks"]
    assert any(r["o_max_diff"] > 1e-3 for r in mid), "after one step O is not final anywhere"


_RING_BAD: list[tuple[str, dict[str, Any], str, str]] = [
    # (id, body, field named, text in the message)
    ("world-zero", {"world_size": 0}, "world_size", "world_size"),
    ("world-nine", {"world_size": 9}, "world_size", "allowed: 1..8"),
    ("world-float", {"world_size": 2.5}, "world_size", "integer"),
    ("layout", {"layout": "ring"}, "layout", "'contiguous' or 'zigzag'"),
    ("length-long", {"length": 65}, "length", "allowed: 8..64"),
    ("length-short", {"world_size": 8, "length": 10}, "length", "allowed: 16..64"),
    ("d-wide", {"d": 17}, "d", "allowed: 1..16"),
    ("block-zero", {"block": 0}, "block", "block"),
    ("block-big", {"length": 8, "block": 9}, "block", "allowed: 1..8"),
    ("tiles", {"length": 64, "block": 1}, "block", "at most 1024"),
    ("mask-custom", {"mask": {"kind": "custom", "dense": [[True]]}}, "mask", "not custom"),
    ("mask-kind", {"mask": {"kind": "diagonal"}}, "mask", "mask.kind"),
    ("window-left", {"mask": {"kind": "sliding_window", "left": -2}}, "mask", "mask.left"),
    ("example-length", {"data": "example", "length": 8}, "data", "length 5 and d 2"),
    ("data-kind", {"data": "file"}, "data", "'random' or 'example'"),
    ("seed-negative", {"seed": -1}, "seed", "seed"),
    (
        "seed-with-example",
        {"data": "example", "length": 5, "d": 2, "world_size": 2, "seed": 5},
        "seed",
        "data is 'example'",
    ),
    (
        "causal-align",
        {"mask": {"kind": "causal", "align": "top_left"}},
        "mask",
        "kind 'causal_bottom_right'",
    ),
    ("unknown-field", {"heads": 2}, "heads", "unknown field"),
]


@pytest.mark.parametrize(
    ("body", "field", "text"), [b[1:] for b in _RING_BAD], ids=[b[0] for b in _RING_BAD]
)
def test_ring_rejected_input_is_422_with_reason(
    client: TestClient, body: dict[str, Any], field: str, text: str
) -> None:
    res = client.post("/api/ring", json=body)
    assert res.status_code == 422, f"status {res.status_code}, body {res.text[:300]}"
    data = res.json()
    assert isinstance(data["detail"], str) and "\n" not in data["detail"], data
    fields = [e["field"] for e in data["errors"]]
    assert field in fields, f"no error names field {field!r}: {data['errors']}"
    assert text in data["detail"], f"{text!r} not in {data['detail']!r}"


@settings(max_examples=25, deadline=None)
@given(
    world=st.integers(min_value=-1, max_value=9),
    length=st.integers(min_value=-1, max_value=20),
    d=st.integers(min_value=0, max_value=4),
    block=st.integers(min_value=0, max_value=21),
    layout=st.sampled_from(["contiguous", "zigzag", "spiral"]),
)
def test_ring_never_500(
    client: TestClient, world: int, length: int, d: int, block: int, layout: str
) -> None:
    body = {"world_size": world, "length": length, "d": d, "block": block, "layout": layout}
    res = client.post("/api/ring", json=body)
    assert res.status_code in (200, 422), f"{body}: status {res.status_code}: {res.text[:300]}"
    if res.status_code == 200:
        assert all(c["ok"] for c in res.json()["checks"]), res.json()["checks"]
    else:
        assert res.json()["detail"], res.text


def test_ring_is_in_the_api_and_the_page(client: TestClient) -> None:
    assert "/api/ring" in _ok(client.get("/openapi.json"))["paths"]
    assert _ok(client.get("/api/examples"))["limits"]["max_ring_world"] == 8
    page = client.get("/").text
    assert 'data-sec="ring"' in page and 'id="sec-ring"' in page
    res = client.get("/static/ring.js")
    assert res.status_code == 200 and "http://" not in res.text and "https://" not in res.text
