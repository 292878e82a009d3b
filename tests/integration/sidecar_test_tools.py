"""Tools the sidecar tests register (`spin=sidecar_test_tools:spin`): runaways a real tool could be."""
from __future__ import annotations

from ampd.tools import ToolInput, ToolOutput


def spin(call: ToolInput) -> ToolOutput:
    """((9**999)**999)**999 without the calculator's bound: one C call that holds the GIL for minutes."""
    x = 9 ** 999
    x = x ** 999
    x = x ** 999
    return ToolOutput(0, str(x.bit_length()))


def hog(call: ToolInput) -> ToolOutput:
    """Asks for more memory than a tool process may have."""
    return ToolOutput(0, str(len(bytearray(call.arguments.get("mb", 4096) << 20))))
