"""The native step's source compiles for every x86-64 instruction set it has code for.

The step is built with ``-march=native``, so a machine compiles only its own branches of
``_native.c``: an AMD EPYC with AVX2 never compiles the AVX-512, bfloat16-pair or AMX code,
an Intel Xeon with AMX never compiles the AVX2 kernel. A change that breaks a branch the
machine at hand skips would surface only when the next machine, of the other vendor,
builds the step. Here each build (float32, float64, bfloat16, float16) is compiled for
each instruction set, with the step's own flags and ``-Wall -Werror``; at ``-O0`` (the
branches are the same, and a compile takes a second instead of three). What runs is
tested on the machine that runs it (``test_native.py``); this only keeps every branch
compiling.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from flashledger import _native

# -march value -> (macros it must define, macros it must not): the branches of _native.c
# it selects
ISAS = {
    "sapphirerapids": ({"__AVX512F__", "__AVX512BF16__", "__AMX_TILE__", "__AMX_BF16__"}, set()),
    "cooperlake": ({"__AVX512F__", "__AVX512BF16__"}, {"__AMX_TILE__"}),  # as AMD Zen 4
    "skylake-avx512": ({"__AVX512F__"}, {"__AVX512BF16__", "__AMX_TILE__"}),
    "haswell": ({"__AVX2__", "__FMA__", "__F16C__"}, {"__AVX512F__"}),
    "sandybridge": ({"__AVX__"}, {"__AVX2__", "__FMA__", "__F16C__"}),
    "x86-64": ({"__SSE2__"}, {"__AVX__"}),
}
BUILDS = {"f32": (0, 0), "f64": (1, 0), "bf16": (0, 1), "f16": (0, 2)}


def _compiler() -> str:
    cc = shutil.which("gcc") or shutil.which("cc")
    if cc is None:
        pytest.skip("no C compiler")
    return cc


def _macros(cc: str, march: str) -> set[str]:
    """The instruction-set macros ``cc -march=<march>`` predefines (the step's own reading,
    ``_native._isa_macros``), or a skip where it has no such target."""
    found = _native._isa_macros(cc, march)
    if found is None:
        pytest.skip(f"{Path(cc).name} has no -march={march} (not an x86-64 compiler?)")
    return found


def _flags(march: str) -> list[str]:
    flags = [f for f in _native._FLAGS if f not in ("-march=native", "-O3")]
    assert len(flags) == len(_native._FLAGS) - 2, _native._FLAGS  # both were there to replace
    return [*flags, f"-march={march}", "-O0", "-Wall", "-Werror"]


@pytest.mark.parametrize("march", list(ISAS))
def test_every_build_compiles_for(march, tmp_path):
    cc = _compiler()
    have = _macros(cc, march)
    want, lack = ISAS[march]
    assert want <= have, f"-march={march} no longer defines {sorted(want - have)}"
    assert not lack & have, f"-march={march} now defines {sorted(lack & have)}"

    def compile_(name: str, double: int, half: int) -> subprocess.Popen[str]:
        defs = [f"-DFL_DOUBLE={double}", f"-DFL_HALF={half}"]
        out = str(tmp_path / f"{name}.o")
        cmd = [cc, *_flags(march), *defs, "-c", str(_native._SOURCE), "-o", out]
        return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)

    procs = {name: compile_(name, *build) for name, build in BUILDS.items()}  # side by side
    errors = {name: p.communicate()[1] for name, p in procs.items()}
    failed = {name: errors[name].strip()[-2000:] for name, p in procs.items() if p.returncode}
    assert not failed, f"-march={march}: " + "\n".join(f"{n}: {e}" for n, e in failed.items())
    assert all((tmp_path / f"{name}.o").stat().st_size > 0 for name in BUILDS)


# ----------------------------------------------------------------------------------------
# FLASHLEDGER_NATIVE_ARCH: the step built for another target than this CPU
# ----------------------------------------------------------------------------------------
HOST = {"__SSE2__", "__AVX__", "__AVX2__", "__FMA__", "__F16C__"}  # an AVX2 CPU, as AMD Zen 3


def _fake_macros(monkeypatch, targets: dict[str, set[str]]) -> None:
    """``_isa_macros`` as a compiler that knows ``targets`` (and native: ``HOST``) says."""
    known = {"native": HOST, **targets}
    monkeypatch.setattr(_native, "_isa_macros", lambda cc, arch="native": known.get(arch))


@pytest.mark.parametrize("value", [None, "", "native", "  native "])
def test_the_step_is_built_for_this_cpu_by_default(monkeypatch, value):
    if value is None:
        monkeypatch.delenv("FLASHLEDGER_NATIVE_ARCH", raising=False)
    else:
        monkeypatch.setenv("FLASHLEDGER_NATIVE_ARCH", value)
    assert _native._target("gcc") == (_native._FLAGS, "")


def test_a_target_within_this_cpu_replaces_march_native(monkeypatch):
    _fake_macros(monkeypatch, {"x86-64-v3": HOST, "x86-64": {"__SSE2__"}})
    for arch in ("x86-64-v3", "x86-64"):
        monkeypatch.setenv("FLASHLEDGER_NATIVE_ARCH", arch)
        flags, got = _native._target("gcc")
        assert got == arch
        assert "-march=native" not in flags and f"-march={arch}" in flags, flags
        assert "-mtune=native" in flags  # the target's instructions, scheduled for this CPU
        assert set(_native._FLAGS) - {"-march=native"} <= set(flags), flags


@pytest.mark.parametrize(
    "arch, why",
    [
        ("skylake-avx512", r"uses AVX512F, which this CPU does not have"),
        ("nosuchcpu", r"is not a target gcc knows \(-march=nosuchcpu\)"),
        ("x86-64 -O0", r"is not a -march value"),
        ("$(reboot)", r"is not a -march value"),
    ],
)
def test_a_target_this_cpu_cannot_run_is_refused_with_the_reason(monkeypatch, arch, why):
    """Its code would stop on an illegal instruction: a warning says why and what is
    allowed, and the step is built for this CPU."""
    _fake_macros(monkeypatch, {"skylake-avx512": HOST | {"__AVX512F__"}})
    monkeypatch.setenv("FLASHLEDGER_NATIVE_ARCH", arch)
    with pytest.warns(UserWarning, match=why) as seen:
        assert _native._target("/usr/bin/gcc") == (_native._FLAGS, "")
    assert "Allowed: 'native'" in str(seen[0].message) and "x86-64-v3" in str(seen[0].message)


def test_a_compiler_that_does_not_run_leaves_the_flags_to_the_build(monkeypatch):
    """The build itself then fails and says so (``native_status``); no warning about the
    target first."""
    monkeypatch.setattr(_native, "_isa_macros", lambda cc, arch="native": None)
    monkeypatch.setenv("FLASHLEDGER_NATIVE_ARCH", "x86-64-v3")
    assert _native._target("false") == (_native._FLAGS, "")


def test_the_real_compiler_names_the_macros_of_a_target():
    cc = _compiler()
    if _native._isa_macros(cc, "haswell") is None:
        pytest.skip(f"{Path(cc).name} has no -march=haswell (not an x86-64 compiler?)")
    assert _native._isa_macros(cc, "haswell") == {
        "__SSE2__",
        "__AVX__",
        "__AVX2__",
        "__FMA__",
        "__F16C__",
    }
    assert "__AVX512F__" in (_native._isa_macros(cc, "skylake-avx512") or set())
    assert _native._isa_macros(cc, "nosuchcpu") is None
