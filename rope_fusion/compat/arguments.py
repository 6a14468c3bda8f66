"""A drop-in's errors in its caller's words: the op's argument names become the drop-in's.

A drop-in hands the op tables it made from the caller's arguments (diffusers' `freqs_cis` becomes the op's `cos`
and `sin`), so the op's ValueError named an argument the caller never passed: "cos must have last dim 32". Every
drop-in declares once how its arguments map onto the op's (`@caller_names(cos="freqs_cis", sin="freqs_cis")`), and
its errors read "apply_rotary_emb: freqs_cis must have last dim 32 ...". The widths and shapes in the message are
still those the op received, which the message says; a drop-in that reshapes or slices an argument before the op
declares it under its own name too (`cos="cos"`), so that its errors say that as well.

A drop-in that calls another (vllm-omni's Helios helper calls its Wan helper) is translated once, by the outermost:
the error carries the op's own message (`DropInArgumentError.op_message`), and each level words it anew with its
own names.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any, TypeVar

F = TypeVar("F", bound=Callable[..., Any])


class DropInArgumentError(ValueError):
    """A ValueError of the op or a drop-in, worded with the drop-in's argument names; `op_message` is the
    message as it was raised."""

    def __init__(self, message: str, op_message: str):
        super().__init__(message)
        self.op_message = op_message


def in_caller_terms(message: str, names: dict[str, str], function: str) -> str:
    """`message` with each op argument of `names` said as the caller's argument, prefixed by the drop-in's name.
    Two op arguments made from one caller argument ("cos and sin" from freqs_cis) are said once."""
    for a, b in (("cos", "sin"), ("sin", "cos")):
        if a in names and names.get(b) == names[a]:
            message = re.sub(rf"\b{a} and {b}\b", names[a], message)
    if names:  # an argument declared under its own name counts: the drop-in reshaped or sliced it
        message, renamed = re.subn(r"\b(" + "|".join(map(re.escape, names)) + r")\b", lambda m: names[m.group(1)],
                                   message)
        if renamed and ("shape" in message or "dim" in message):  # its widths and shapes are the drop-in's making
            message += f" (the shapes the fused op received from {function})"
    return f"{function}: {message}"


def caller_names(**names: str) -> Callable[[F], F]:
    """Decorate a drop-in whose arguments reach the op under other names: `cos="freqs_cis"` says that the op's
    `cos` is made from the caller's `freqs_cis`. Its ValueErrors are raised again in those words."""
    def decorate(fn: F) -> F:
        @functools.wraps(fn)
        def drop_in(*args: Any, **kwargs: Any) -> Any:
            try:
                return fn(*args, **kwargs)
            except ValueError as e:
                raw = e.op_message if isinstance(e, DropInArgumentError) else str(e)
                raise DropInArgumentError(in_caller_terms(raw, names, fn.__name__), raw) from None
        return drop_in  # type: ignore[return-value]
    return decorate


__all__ = ["DropInArgumentError", "caller_names", "in_caller_terms"]
