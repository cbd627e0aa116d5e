"""The public surface: pinned names, typing marker, keyword-only options, the presets."""

from __future__ import annotations

import dataclasses
import doctest
import importlib
import importlib.metadata
import importlib.resources
import inspect
import math
import re
import sys

import pytest
import torch

import flashledger as fl

PUBLIC = [
    "AttentionOptions",
    "BackwardResult",
    "BackwardTileStep",
    "Causal",
    "Conventions",
    "Counters",
    "DenseMask",
    "FLASH_ATTN_2",
    "FLASH_ATTN_3",
    "FLEX_ATTENTION",
    "ForwardResult",
    "ForwardTileStep",
    "KVCacheLedger",
    "KVCacheResult",
    "KeyPadding",
    "Ledger",
    "Mask",
    "MaskMod",
    "ModelLedger",
    "OnlineSoftmax",
    "OnlineState",
    "PRESETS",
    "Padding",
    "Placement",
    "ReferenceBackward",
    "ReferenceForward",
    "RingLedger",
    "SDPA_CPU",
    "SEED",
    "SlidingWindow",
    "Trace",
    "__version__",
    "alibi_slopes",
    "apply_rotary",
    "assert_attention_close",
    "attention_with_kvcache",
    "blocked_backward",
    "blocked_forward",
    "create_block_mask",
    "flash_attention",
    "flex_attention",
    "ledger_of",
    "lse_from_base2",
    "lse_to_base2",
    "memory_traffic",
    "merge",
    "merge_partials",
    "native_status",
    "reference_backward",
    "reference_forward",
    "ring_attention",
    "ring_comm_totals",
    "run_matrix",
    "shard_sequence",
    "simulate_ring",
    "split_kv_forward",
    "storage_and_work",
    "unshard_sequence",
]


def test_all_is_pinned():
    assert len(fl.__all__) == len(set(fl.__all__)), "duplicate names in __all__"
    extra = sorted(set(fl.__all__) - set(PUBLIC))
    missing = sorted(set(PUBLIC) - set(fl.__all__))
    assert not extra and not missing, f"__all__ changed: added {extra}, removed {missing}"


def test_every_public_name_is_importable():
    for name in PUBLIC:
        assert getattr(fl, name, None) is not None, f"flashledger.{name} is missing"
    namespace: dict[str, object] = {}
    exec("from flashledger import *", namespace)
    assert set(PUBLIC) <= set(namespace)


def test_py_typed_marker_and_version():
    marker = importlib.resources.files("flashledger") / "py.typed"
    assert marker.is_file(), "flashledger/py.typed is missing"
    assert fl.__version__ == importlib.metadata.version("flashledger")


ENTRY_POINTS = {
    "reference_forward": 3,
    "reference_backward": 6,
    "blocked_forward": 3,
    "blocked_backward": 6,
    "split_kv_forward": 3,
    "flash_attention": 3,
    "attention_with_kvcache": 5,
}


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_options_are_keyword_only(name):
    params = list(inspect.signature(getattr(fl, name)).parameters.values())
    n = ENTRY_POINTS[name]
    positional = [p.name for p in params if p.kind is p.POSITIONAL_OR_KEYWORD]
    assert len(positional) == n, f"{name}: positional parameters {positional}"
    rest = params[n:]
    assert rest and all(p.kind is p.KEYWORD_ONLY for p in rest[:-1]), f"{name}: {rest}"
    # the attention options, spelled once: ``**opts: Unpack[AttentionOptions]``
    assert rest[-1].kind is rest[-1].VAR_KEYWORD and "AttentionOptions" in str(rest[-1].annotation)
    for option in ("mask", "scale", "conventions", "dropout_p", "seed", "softcap", "bias"):
        assert option in fl.AttentionOptions.__annotations__, option


@pytest.mark.parametrize("name", list(ENTRY_POINTS))
def test_an_unknown_option_is_named(name):
    q = torch.randn(4, 3, dtype=torch.float64)
    args = [q] * ENTRY_POINTS[name]
    kw: dict[str, object] = {"num_splits": 2} if name == "split_kv_forward" else {}
    if name == "attention_with_kvcache":
        kw = {"cache_seqlens": 1}
    with pytest.raises(TypeError, match=rf"{name}\(\) got an unexpected keyword argument 'maks'"):
        getattr(fl, name)(*args, maks=fl.Causal(), **kw)


def test_split_kv_refuses_varlen():
    q = torch.randn(4, 3, dtype=torch.float64)
    cu = torch.tensor([0, 4])
    with pytest.raises(ValueError, match="does not take cu_seqlens_q"):
        fl.split_kv_forward(q, q, q, num_splits=2, cu_seqlens_q=cu, cu_seqlens_k=cu)


def test_presets():
    assert list(fl.PRESETS) == [
        "seed",
        "flash_attn_2",
        "flash_attn_3",
        "flex_attention",
        "sdpa_cpu",
    ]
    table = {  # name: (masked-row LSE, causal alignment, dropout keep test, LSE differentiable,
        #        window sides, ALiBi under causal, softcap with dropout)
        "seed": (-math.inf, "top_left", "bernoulli", True, "none", "distance", True),
        "flash_attn_2": (
            math.inf, "bottom_right", "fa2_8bit", False, "flash_attn_2", "key_index", False
        ),
        "flash_attn_3": (-math.inf, "bottom_right", "bernoulli", False, "none", "distance", False),
        "flex_attention": (-math.inf, "top_left", "bernoulli", True, "none", "distance", True),
        "sdpa_cpu": (0.0, "top_left", "bernoulli", False, "none", "distance", True),
    }  # fmt: skip
    for name, conv in fl.PRESETS.items():
        got = (
            conv.masked_row_lse,
            conv.causal_align,
            conv.dropout_keep,
            conv.lse_differentiable,
            conv.window_rewrite,
            conv.alibi_causal,
            conv.softcap_with_dropout,
        )
        assert got == table[name], f"{name}: {got}"
        assert conv.name == name and conv.description
    assert fl.PRESETS["seed"] is fl.SEED and fl.PRESETS["flash_attn_2"] is fl.FLASH_ATTN_2
    with pytest.raises(dataclasses.FrozenInstanceError):
        fl.SEED.masked_row_lse = 0.0  # type: ignore[misc]


def test_conventions_by_name_and_custom_values(assert_close):
    q = torch.randn(4, 6, 3, dtype=torch.float64)
    vis = torch.ones(6, 6, dtype=torch.bool)
    vis[2] = False
    by_name = fl.blocked_forward(q, q, q, mask=vis, conventions="flash-attn-2", block_q=4)
    assert float(by_name.lse[0, 2]) == math.inf
    custom = fl.Conventions(name="mine", masked_row_lse=0.0, causal_align="bottom_right")
    res = fl.blocked_forward(q[:, :5], q, q, mask=vis[:5] & fl.Causal(), conventions=custom)
    ref = fl.reference_forward(q[:, :5], q, q, mask=vis[:5] & fl.Causal("bottom_right"))
    assert float(res.lse[0, 2]) == 0.0
    assert_close(res.o, ref.o, rtol=1e-12, name="O under a custom conventions value")


def test_results_are_frozen():
    q = torch.randn(3, 2, dtype=torch.float64)
    fwd = fl.blocked_forward(q, q, q)
    with pytest.raises(dataclasses.FrozenInstanceError):
        fwd.o = q  # type: ignore[misc]
    ref = fl.reference_forward(q, q, q)
    with pytest.raises(dataclasses.FrozenInstanceError):
        ref.lse = q  # type: ignore[misc]


@pytest.mark.parametrize("module", ["flashledger", "flashledger.conventions", "flashledger.online"])
def test_docstring_examples_run(module):
    mod = importlib.import_module(module)
    result = doctest.testmod(mod, optionflags=doctest.ELLIPSIS)
    assert result.attempted > 0, f"{module} has no doctest examples"
    assert result.failed == 0, f"{result.failed} doctest failures in {module}"


# every public module runs on its own and prints a small demo
MODULE_DEMOS = {
    "online": "full-row reference",
    "blocked": "max |O - dense oracle| = ",
    "ledger": "backward ledger: tiles 2x2",
    "reference": "LSE [-0.06364, 0.746864",
    "accounting": "Memory traffic (fa2",
    "masks": "Causal(align='bottom_right')\n  F p . .",
    "conventions": "flash_attn_2    causal bottom_right masked-row LSE inf",
    "examples": "section 04: causal, tiles 2 x 2",
    "scores": "4 heads: [0.25, 0.0625, 0.015625, 0.003906]",
    "dropout": "fa2_8bit: expected keep rate",
    "autograd": "dV: max |autograd - oracle| = ",
    "model": "Attention ledger: llama, 2 layers, hidden 64, heads 4/2, batch 2, seq 200",
    "integrations.transformers": "max |logits - SDPA's| on real tokens = ",
}


@pytest.mark.parametrize("name", list(MODULE_DEMOS))
def test_a_module_demo_refuses_options(
    name: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A demo takes no options: one given (``--scores 1,2``, which ``flashledger online``
    reads) is refused with where the options are, not dropped while the demo prints its
    defaults."""
    import runpy
    import warnings

    if name in ("model", "integrations.transformers"):
        pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "argv", [f"flashledger.{name}", "--scores", "1,2"])
    with warnings.catch_warnings(), pytest.raises(SystemExit) as exc:
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
        runpy.run_module(f"flashledger.{name}", run_name="__main__")
    out, err = capsys.readouterr()
    assert exc.value.code == 2 and out == "", out[:300]
    assert "the demo takes no options, got '--scores 1,2'" in err, err
    assert "takes options (flashledger " in err, err


def test_every_public_module_has_a_demo() -> None:
    import pkgutil

    public = {m.name for m in pkgutil.iter_modules(fl.__path__) if not m.name.startswith("_")}
    with_cli = {"cli", "verify", "bench", "ring", "web"}  # options (`--help`) or a server
    demos = {name.split(".")[0] for name in MODULE_DEMOS}  # a package's modules: by package
    assert public - with_cli == demos, public - with_cli ^ demos


@pytest.mark.parametrize(("name", "shows"), MODULE_DEMOS.items(), ids=list(MODULE_DEMOS))
def test_module_demo_runs(
    name: str, shows: str, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    import runpy
    import warnings

    if name in ("model", "integrations.transformers"):
        pytest.importorskip("transformers")
    monkeypatch.setattr(sys, "argv", [f"flashledger.{name}"])  # as `python -m` runs it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # runpy: module already imported
        runpy.run_module(f"flashledger.{name}", run_name="__main__")
    out = capsys.readouterr().out
    assert shows in out, out[:500]
    if "|" in shows:  # a demo that checks itself prints a roundoff-sized difference
        diffs = [float(x) for x in re.findall(r"= ([0-9.e+-]+)", out)]
        assert diffs and max(diffs) < 1e-12, diffs
