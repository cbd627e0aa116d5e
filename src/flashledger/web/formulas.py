"""The explorer's formulas, written in LaTeX and served as MathML.

Each formula is a list of aligned lines ``(lhs, relation, rhs)``; every piece
is converted with latex2mathml and the lines are set in an ``<mtable>`` (MathML
Core, rendered natively by the browser; no script, no web font). The ``<math>``
element carries ``data-formula="<name>"`` and each line ``data-line="<n>"``
(0-based), so that the page can light up the line a step uses.
"""

from __future__ import annotations

import re
from functools import cache

import latex2mathml.converter

__all__ = ["FORMULAS", "render_formula"]

Line = tuple[str, str, str]

FORMULAS: dict[str, list[Line]] = {
    "running": [
        ("m'", "=", r"\max\left(m,\ \max_{j\in B} s_j\right)"),
        (r"\alpha", "=", r"e^{m-m'}"),
        (r"\ell'", "=", r"\alpha\,\ell+\sum_{j\in B} e^{s_j-m'}"),
        ("a'", "=", r"\alpha\,a+\sum_{j\in B} e^{s_j-m'}\,v_j"),
        ("o'", "=", r"a'/\ell'"),
    ],
    "initial": [
        ("m", "=", r"-\infty,\quad \ell=0,\quad a=0"),
    ],
    "softmax": [
        (r"p_j", "=", r"\frac{e^{s_j}}{\sum_k e^{s_k}}=\frac{e^{s_j-c}}{\sum_k e^{s_k-c}}"),
    ],
    "backward": [
        (r"\lambda_i", "=", r"\log\sum_j e^{S_{ij}}"),
        (r"P_{ij}", "=", r"e^{S_{ij}-\lambda_i}"),
        (r"D_i", "=", r"G_i\cdot O_i"),
        (r"\partial S_{ij}", "=", r"P_{ij}\left(G_i\cdot V_j-D_i\right)"),
        (r"\partial Q_i", "+=", r"\partial S_{ij}\,K_j/\sqrt{d}"),
        (r"\partial K_j", "+=", r"\partial S_{ij}\,Q_i/\sqrt{d}"),
        (r"\partial V_j", "+=", r"P_{ij}\,G_i"),
    ],
    "scores": [
        ("S", "=", r"Q K^{\mathsf{T}}/\sqrt{d}"),
    ],
    # with a softcap c the loop differentiates through the cap: dS (of the capped scores) reaches
    # Q and K multiplied by the cap's derivative 1 - t², which section 04 must show to be followed
    "backward_softcap": [
        (r"\lambda_i", "=", r"\log\sum_j e^{S_{ij}}"),
        (r"P_{ij}", "=", r"e^{S_{ij}-\lambda_i}"),
        (r"D_i", "=", r"G_i\cdot O_i"),
        (r"\partial S_{ij}", "=", r"P_{ij}\left(G_i\cdot V_j-D_i\right)"),
        (r"\partial Q_i", "+=", r"\partial S_{ij}\left(1-t_{ij}^2\right)K_j/\sqrt{d}"),
        (r"\partial K_j", "+=", r"\partial S_{ij}\left(1-t_{ij}^2\right)Q_i/\sqrt{d}"),
        (r"\partial V_j", "+=", r"P_{ij}\,G_i"),
    ],
    "scores_softcap": [
        ("S", "=", r"c\,\tanh\left(Q K^{\mathsf{T}}/(\sqrt{d}\,c)\right)"),
        (r"t_{ij}", "=", r"\tanh\left(Q_i\cdot K_j/(\sqrt{d}\,c)\right)"),
    ],
}

_MATH_TAG = re.compile(r"^<math[^>]*>(.*)</math>$", re.DOTALL)


def _inner(latex: str) -> str:
    """MathML content (without the ``<math>`` element) of one LaTeX fragment."""
    mathml = latex2mathml.converter.convert(latex)
    match = _MATH_TAG.match(mathml.strip())
    if match is None:
        raise ValueError(f"latex2mathml returned no <math> element for {latex!r}")
    return match.group(1)


@cache
def render_formula(name: str) -> str:
    """The formula ``name`` as one display ``<math>`` element with aligned lines."""
    if name not in FORMULAS:
        raise KeyError(f"unknown formula {name!r}; known: {', '.join(FORMULAS)}")
    rows = []
    for n, (lhs, relation, rhs) in enumerate(FORMULAS[name]):
        rel = "<mo>+=</mo>" if relation == "+=" else "<mo>=</mo>"
        rows.append(
            f"<mtr data-line='{n}'><mtd class='lhs'>{_inner(lhs)}</mtd>"
            f"<mtd class='rhs'><mrow>{rel}{_inner(rhs)}</mrow></mtd></mtr>"
        )
    return (
        f'<math xmlns="http://www.w3.org/1998/Math/MathML" display="block" data-formula="{name}">'
        f"<mtable class='eqn'>{''.join(rows)}</mtable></math>"
    )
