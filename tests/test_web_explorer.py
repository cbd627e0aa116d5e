"""What the explorer page relies on in the API: errors it can translate, one range per field,
the forward loop traced tile by tile, the row's exp(s - m) terms, storage against L, and
timing cards that warm up and say how many runs they timed.
"""

from __future__ import annotations

import math
import re
from typing import Any

import pytest
import torch

pytest.importorskip("fastapi", reason="the web extra is not installed")

from fastapi.testclient import TestClient

from flashledger import examples
from flashledger.web import compute
from flashledger.web import schemas as sc
from flashledger.web.app import create_app

ALLOWED = re.compile(r"allowed: (-?\d+)\.\.(-?\d+)")


@pytest.fixture(scope="module")
def client() -> TestClient:
    return TestClient(create_app(), base_url="http://127.0.0.1", raise_server_exceptions=False)


def _ledger(**changes: Any) -> dict[str, Any]:
    body = {"scores": examples.SIX_SCORES.tolist(), "values": examples.SIX_VALUES.tolist()}
    return body | changes


def _five(**changes: Any) -> dict[str, Any]:
    ex = examples.five_position_example()
    body: dict[str, Any] = {k: ex[k].tolist() for k in ("q", "k", "v", "g")}
    return body | {"block_q": 2, "block_k": 2, "mask": {"kind": "causal_top_left"}} | changes


def _refused(client: TestClient, path: str, body: Any) -> list[dict[str, Any]]:
    res = client.post(path, json=body)
    assert res.status_code == 422, f"{path} {body}: status {res.status_code} {res.text[:300]}"
    data = res.json()
    assert set(data) == {"detail", "errors"}, f"the error body's shape changed: {sorted(data)}"
    for err in data["errors"]:
        assert {"field", "path", "message", "kind", "limits"} <= set(err), err
        assert err["kind"] in sc.ERROR_KINDS, f"unknown kind {err['kind']!r}"
        assert isinstance(err["limits"], dict), err
        for value in err["limits"].values():
            assert isinstance(value, int | float | str), err
    return data["errors"]  # type: ignore[no-any-return]


# ----------------------------------------------------------------------------- one range per field

_RANGES: list[tuple[str, str, dict[str, Any], str, int, int]] = [
    # (id, path, body, field, min, max): every value out of range states the same range
    ("ledger-block-100", "/api/ledger", _ledger(block_size=100), "block_size", 1, 6),
    ("ledger-block-64", "/api/ledger", _ledger(block_size=64), "block_size", 1, 6),
    ("ledger-block-0", "/api/ledger", _ledger(block_size=0), "block_size", 1, 6),
    ("backward-bq-9", "/api/backward", _five(block_q=9), "block_q", 1, 5),
    ("backward-bk-65", "/api/backward", _five(block_k=65), "block_k", 1, 5),
    ("backward-seed", "/api/backward", _five(seed=-1), "seed", 0, 2**31 - 1),
    ("storage-bq", "/api/storage", {"lq": 4, "block_q": 5}, "block_q", 1, 4),
    ("storage-lq", "/api/storage", {"lq": 70000}, "lq", 1, sc.MAX_STORAGE_LEN),
    ("storage-d", "/api/storage", {"d": 0}, "d", 1, sc.MAX_STORAGE_DIM),
    ("measure-len", "/api/measure", {"length": 0}, "length", 1, sc.MAX_MEASURE_LEN),
    ("measure-block", "/api/measure", {"length": 1024, "block": 8}, "block", 64, 1024),
    ("measure-block-big", "/api/measure", {"length": 100, "block": 101}, "block", 7, 100),
    ("measure-runs", "/api/measure", {"repeats": 26}, "repeats", 1, sc.MAX_MEASURE_RUNS),
    ("ring-world", "/api/ring", {"world_size": 9}, "world_size", 1, sc.MAX_RING_WORLD),
    ("ring-length-short", "/api/ring", {"world_size": 4, "length": 6}, "length", 8, 64),
    ("ring-length-long", "/api/ring", {"length": 65}, "length", 8, 64),
    ("ring-block", "/api/ring", {"length": 8, "block": 9}, "block", 1, 8),
    ("ring-block-tiles", "/api/ring", {"length": 64, "block": 1}, "block", 2, 64),
    (
        "window-left",
        "/api/storage",
        {"mask": {"kind": "sliding_window", "left": -2}},
        "mask",
        -1,
        65536,
    ),
]


@pytest.mark.parametrize(
    ("path", "body", "field", "lo", "hi"), [r[1:] for r in _RANGES], ids=[r[0] for r in _RANGES]
)
def test_a_field_out_of_range_states_its_one_range(
    client: TestClient, path: str, body: dict[str, Any], field: str, lo: int, hi: int
) -> None:
    errors = _refused(client, path, body)
    err = next((e for e in errors if e["field"] == field), None)
    assert err is not None, f"no error names {field}: {errors}"
    assert err["kind"] == "range", err
    assert (err["limits"]["min"], err["limits"]["max"]) == (lo, hi), err
    # the message and the structured limits say the same range
    found = ALLOWED.search(err["message"])
    assert found and (int(found[1]), int(found[2])) == (lo, hi), err["message"]


def test_the_ring_block_range_is_the_smallest_block_that_fits(client: TestClient) -> None:
    # length 64 on 4 zigzag ranks: 8 chunks of 8; block 1 gives 64^2 tiles, block 2 gives 32^2
    err = _refused(client, "/api/ring", {"length": 64, "block": 1})[0]
    assert err["limits"]["min"] == 2
    ok = client.post("/api/ring", json={"length": 64, "block": 2})
    assert ok.status_code == 200, ok.text[:300]


@pytest.mark.parametrize(
    ("path", "body", "kind", "limits"),
    [
        ("/api/ledger", _ledger(values=[[1.0, 0.0]] * 3), "count", {"expected": 6, "got": 3}),
        # rows count from 1 (the sixth value vector is row 6), as the message does
        ("/api/ledger", _ledger(values=[[1.0, 0.0]] * 5 + [[1.0]]), "ragged", {"row": 6}),
        ("/api/ledger", _ledger(block_size=2.5), "not_integer", {}),
        ("/api/ledger", _ledger(scores=[1, "x", 3, 0, 0, 0]), "not_number", {}),
        ("/api/ledger", _ledger(scores=[0.0] * 65), "too_long", {"max": 64}),
        ("/api/ledger", _ledger(scores=[], values=[]), "too_short", {"min": 1}),
        ("/api/ledger", _ledger(shift=1e300), "range", {"max": 1000000}),
        ("/api/backward", _five(g=[[1.0]] * 5), "shape", {"expected_rows": 5, "expected_cols": 2}),
        ("/api/backward", _five(k=[[0.1, 0.2, 0.3]] * 5), "columns", {"expected": 2, "got": 3}),
        ("/api/backward", _five(conventions="xformers"), "not_allowed", {}),
        ("/api/backward", _five(softcap=0), "range_open", {"min": 0, "max": 10000}),
        ("/api/backward", _five(mask={"kind": "custom"}), "mask_dense", {}),
        ("/api/storage", {"lq": 65536, "lk": 65536, "block_q": 1}, "tiles", {"max": 16384}),
        ("/api/ring", {"data": "example", "length": 8}, "example", {"length": 5, "d": 2}),
        ("/api/ring", {"layout": "spiral"}, "not_allowed", {}),
        ("/api/ring", {"heads": 2}, "unknown_field", {}),
    ],
)
def test_every_error_names_its_kind_and_numbers(
    client: TestClient, path: str, body: dict[str, Any], kind: str, limits: dict[str, Any]
) -> None:
    errors = _refused(client, path, body)
    kinds = [e["kind"] for e in errors]
    assert kind in kinds, f"{kinds}: {errors}"
    err = errors[kinds.index(kind)]
    assert limits.items() <= err["limits"].items(), err


def test_bad_json_and_413_keep_the_shape(client: TestClient) -> None:
    res = client.post("/api/ledger", content=b"{nope", headers={"Content-Type": "application/json"})
    assert res.status_code == 422 and res.json()["errors"][0]["kind"] == "invalid_json"
    big = client.post("/api/ledger", json=_ledger(pad="x" * 200_000))
    assert big.status_code == 413
    assert big.json()["errors"][0]["kind"] == "too_large" and big.json()["detail"]


def test_the_schema_and_the_page_read_the_same_limits(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()["components"]["schemas"]
    limits = client.get("/api/examples").json()["limits"]
    assert spec["LedgerRequest"]["properties"]["block_size"]["maximum"] == limits["max_trace_len"]
    assert spec["RingRequest"]["properties"]["world_size"]["maximum"] == limits["max_ring_world"]
    assert spec["MeasureRequest"]["properties"]["length"]["maximum"] == limits["max_measure_len"]
    assert spec["MeasureRequest"]["properties"]["repeats"]["maximum"] == limits["max_measure_runs"]
    assert spec["StorageRequest"]["properties"]["d"]["maximum"] == limits["max_storage_dim"]


# ----------------------------------------------------------------------------- section 02 picture


def test_the_row_terms_are_exp_s_minus_m_and_sum_to_ell(client: TestClient) -> None:
    data = client.post("/api/ledger", json=_ledger(block_size=2, shift=5.0)).json()
    s = torch.tensor(data["scores"], dtype=torch.float64)  # (6,), shifted
    for st in data["steps"]:
        w = torch.tensor(st["weights"], dtype=torch.float64)  # (stop,)
        assert len(st["weights"]) == st["stop"]
        want = torch.exp(s[: st["stop"]] - st["m"])
        assert torch.equal(w, want), (st["index"], w, want)
        assert abs(float(w.sum()) - st["ell"]) <= 4e-16 * st["ell"] * st["stop"], st
        assert max(st["weights"]) == 1.0, "the running max itself has weight 1"


# ----------------------------------------------------------------------------- forward steps


def _check_forward(data: dict[str, Any]) -> None:
    steps = data["forward_steps"]
    assert len(steps) == data["forward_counters"]["tiles_run"]
    last_ell: dict[int, float] = {}
    for st in steps:
        a, b = st["q_range"]
        for r, i in enumerate(range(a, b)):
            assert st["ell_before"][r] == last_ell.get(i, 0.0), (st["index"], i)
            last_ell[i] = st["ell"][r]
            m_before, m, bmax = st["m_before"][r], st["m"][r], st["block_max"][r]
            if isinstance(m_before, str) or isinstance(bmax, str):
                continue  # -inf travels as a string; checked below
            assert m == max(m_before, bmax), (st["index"], i)
            assert st["alpha"][r] == pytest.approx(math.exp(m_before - m), abs=1e-15)
    assert data["forward_steps_max_diff"] < 1e-12, data["forward_steps_max_diff"]


def test_the_forward_loop_is_traced_tile_by_tile(client: TestClient) -> None:
    res = client.post("/api/backward", json=_five())
    assert res.status_code == 200 and "NaN" not in res.text
    data = res.json()
    _check_forward(data)
    assert [(s["q_tile"], s["k_tile"]) for s in data["forward_steps"]] == [
        (0, 0),
        (1, 0),
        (1, 1),
        (2, 0),
        (2, 1),
        (2, 2),
    ], "FlashAttention-2 order: the outer loop over query tiles"
    first = data["forward_steps"][0]
    assert first["m_before"] == ["-Infinity", "-Infinity"] and first["alpha"] == [0.0, 0.0]
    # each query tile's last step holds its rows' final O
    finals = {st["q_tile"]: st for st in data["forward_steps"]}
    for st in finals.values():
        a, b = st["q_range"]
        for r in range(b - a):
            got, want = st["o"][r], data["ref_o"][a + r]
            assert max(abs(x - y) for x, y in zip(got, want)) < 1e-12


def test_the_forward_trace_of_a_fully_masked_row(client: TestClient) -> None:
    dense = [[i != 2 and j <= i for j in range(5)] for i in range(5)]
    res = client.post("/api/backward", json=_five(mask={"kind": "custom", "dense": dense}))
    assert res.status_code == 200 and "NaN" not in res.text
    _check_forward(res.json())


# ----------------------------------------------------------------------------- section 05 sweep


def test_storage_against_length(client: TestClient) -> None:
    data = client.post("/api/storage", json={"lq": 100, "lk": 100, "d": 8}).json()
    lengths = [p["length"] for p in data["sweep"]]
    assert 100 in lengths and lengths[-1] == sc.MAX_STORAGE_LEN and lengths == sorted(lengths)
    for p in data["sweep"]:
        n = p["length"]
        assert (p["full_p"], p["lse"], p["common"]) == (n * n, n, 4 * n * 8), p


# ----------------------------------------------------------------------------- section 03 timing


def test_timing_warms_up_then_takes_the_median(
    client: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    calls = {"n": 0}
    real = compute.blocked_forward

    def counted(*args: Any, **kwargs: Any) -> Any:
        calls["n"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(compute, "blocked_forward", counted)
    data = client.post("/api/measure", json={"length": 32, "d": 4, "block": 8, "repeats": 5}).json()
    # one run for the result compared, one warm-up, then the timed runs
    assert calls["n"] == 2 + data["runs"]["blocked_forward"], (calls, data["runs"])
    for name, median in data["times_ms"].items():
        assert 1 <= data["runs"][name] <= 5
        assert data["min_ms"][name] <= median <= data["max_ms"][name], name
    monkeypatch.setattr(compute, "MEASURE_BUDGET_S", 0.0)
    data = client.post("/api/measure", json={"length": 32, "d": 4, "block": 8, "repeats": 9}).json()
    assert set(data["runs"].values()) == {compute.MEASURE_MIN_RUNS}, data["runs"]
    one = client.post("/api/measure", json={"length": 32, "d": 4, "block": 8, "repeats": 1}).json()
    assert set(one["runs"].values()) == {1}


# ----------------------------------------------------------------------------- errors the page states


def test_the_page_states_every_error_kind_in_both_languages() -> None:
    """The page words a server error from its kind and limits (``errorText``): every kind but
    ``invalid`` (whose message is free text) has a string in English and in Chinese, and
    each string uses only the limits that kind carries (ERROR_KINDS names them)."""
    from importlib import resources

    text = resources.files("flashledger.web").joinpath("static/i18n.js").read_text("utf-8")
    for kind, about in sc.ERROR_KINDS.items():
        if kind == "invalid":
            continue
        found = re.findall(rf'"err\.k\.{kind}": "([^"]*)"', text)
        assert len(found) == 2, f"kind {kind!r}: {len(found)} page strings, one per language wanted"
        named = re.search(r"\(limits: ([^)]*)\)", about)
        allowed = set(named.group(1).split(", ")) if named else set()
        for s in found:
            used = set(re.findall(r"\{(\w+)\}", s))
            assert used <= allowed, f"kind {kind!r}: {s!r} uses {used - allowed}, not in its limits"


def test_a_ragged_matrix_is_refused_with_rows_counted_from_one(client: TestClient) -> None:
    err = _refused(client, "/api/backward", _five(q=[[0.1, 0.2]] * 4 + [[0.1]]))[0]
    assert err["kind"] == "ragged" and err["limits"] == {"row": 5, "got": 1, "expected": 2}
    assert err["message"] == (
        "q: row 5 has 1 entry but row 1 has 2; every row must have the same length"
    )
    err = _refused(client, "/api/ledger", _ledger(values=[[1.0]] + [[1.0, 0.0, 2.0]] * 5))[0]
    assert err["message"].startswith("values: row 2 has 3 entries but row 1 has 1;"), err


def test_allowed_values_of_a_refused_mask_are_named(client: TestClient) -> None:
    """The page words ``not_allowed`` from ``limits.allowed``: it lists every kind there."""
    err = _refused(client, "/api/backward", _five(mask={"kind": "diagonal"}))[0]
    assert err["kind"] == "not_allowed", err
    for kind in ("none", "causal", "causal_top_left", "sliding_window", "custom"):
        assert f"'{kind}'" in err["limits"]["allowed"], err
