"""The child interpreter of `qsa ab`: measures points with one revision's `qsa/`.

Run as a script, `python ab_child.py ROOT`, by `qsa.workbench.ab.ChildSide`; the package never
imports it. Before any other import it puts ROOT in place of this file's folder at the head of
the path, so `import qsa` loads that revision's package and no module of `qsa/workbench/`
shadows a standard one (`profile.py` would). It imports only the standard library itself, so
it runs against any revision that has `qsa.workbench.ops.measure`.

Protocol, one JSON object per line: {"ready": <the qsa/__init__.py imported>} (or {"error"})
once on stdout; then, for each line of `measure()` keywords on stdin, {"record": ...} or
{"error": "Type: message"}. The revision's own prints go to stderr, so stdout carries the
protocol alone.
"""

import sys

if __name__ == "__main__":
    sys.path[0] = sys.argv[1]

import json
import os
from collections.abc import Callable
from typing import Any


def _channel() -> Callable[[dict[str, Any]], None]:
    """A writer on the real stdout, after pointing file descriptor 1 at stderr: whatever the
    revision, Triton or a C library prints can not break a reply."""
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(message: dict[str, Any]) -> None:
        # numpy scalars and arrays as plain values; anything else by its text
        out.write(json.dumps(message, default=lambda v: v.tolist() if hasattr(v, "tolist")
                             else str(v)) + "\n")

    return reply


def main() -> int:
    reply = _channel()
    try:
        import qsa
        from qsa.workbench.ops import measure
    except Exception as e:  # noqa: BLE001 - a revision that does not import: said, not raised
        reply({"error": f"{type(e).__name__}: {e}"})
        return 1
    reply({"ready": qsa.__file__})
    for line in sys.stdin:
        try:
            record = measure(**json.loads(line))
        except Exception as e:  # noqa: BLE001 - a point the revision can not measure; next
            reply({"error": f"{type(e).__name__}: {e}"})
        else:
            reply({"record": record})
    return 0


if __name__ == "__main__":
    sys.exit(main())
