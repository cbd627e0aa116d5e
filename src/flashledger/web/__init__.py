"""flashledger's explorer: a local web page driven by the engine (``flashledger explore``).

Importing this package checks for the ``web`` extra and, when a part is
missing, raises ``ImportError`` with a one-line install hint.
"""

from __future__ import annotations

from importlib.util import find_spec

__all__ = ["INSTALL_HINT", "require_web_extra"]

INSTALL_HINT = "the explorer needs the web extra: pip install 'flashledger[web]'"
_MODULES = ("fastapi", "uvicorn", "pydantic", "latex2mathml")


def require_web_extra() -> None:
    """Raise ``ImportError`` naming the missing modules and the install command."""
    missing = [name for name in _MODULES if find_spec(name) is None]
    if missing:
        raise ImportError(f"{INSTALL_HINT} (missing: {', '.join(missing)})")


require_web_extra()
