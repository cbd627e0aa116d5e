"""Entry points that torch.compile treats as opaque calls, at no cost to eager callers."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def opaque_to_compile(fn: Callable[P, R]) -> Callable[P, R]:
    """``fn``, which dynamo does not trace into: under ``torch.compile`` the call goes
    through ``torch.compiler.disable(fn)`` (the graph breaks around it and it runs as it
    does eagerly: tracing into it fails, at ``autograd.Function.apply``'s override and
    the native step's ctypes calls); outside it, ``fn`` itself, where the disabled wrapper
    would swap dynamo's frame hook on every call (1.3 µs of a decode call's 36, 2-3 of its
    190 right after an SDPA call at 1024 keys: bfloat16, 32/8 heads, d = 128, Intel Xeon
    model 207). Dynamo reads ``torch.compiler.is_compiling()`` as True and takes the
    disabled call."""
    disabled = torch.compiler.disable(fn)

    @functools.wraps(fn)
    def call(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.compiler.is_compiling():
            return disabled(*args, **kwargs)
        return fn(*args, **kwargs)

    return call
