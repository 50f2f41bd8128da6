"""A user error's one line: printed once per distinct message, and named by torchrun as the root cause.

Bad input fails alike on every rank (validation runs before any collective), so N ranks would print
the same line N times, and torchrun's failure summary would end with "To enable traceback see: ...".
Under torchrun each rank has an error file (``TORCHELASTIC_ERROR_FILE``, in a folder per local rank
inside one folder per restart attempt on the node): the first rank to create a marker named by the
message's digest in that attempt folder prints the line, the others stay quiet; every rank writes the
line to its error file in place of a traceback, which torchrun's summary shows as it is. An unexpected
exception keeps torch's own ``record`` (its traceback goes to the error file).
"""
from __future__ import annotations

import hashlib
import json
import os
import sys
import time

ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"


def _first_to_say(line: str) -> bool:
    """True on the first rank of this node and restart attempt to report ``line`` (always without torchrun)."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file:
        return True
    attempt = os.path.dirname(os.path.dirname(os.path.abspath(error_file)))
    marker = os.path.join(attempt, "megazero-error-" + hashlib.sha256(line.encode()).hexdigest()[:16])
    try:
        os.close(os.open(marker, os.O_CREAT | os.O_EXCL | os.O_WRONLY))
    except FileExistsError:
        return False
    except OSError:  # no shared attempt folder to coordinate in: saying it twice beats not saying it
        return True
    return True


def _write_error_file(line: str) -> None:
    """The error file ``record`` writes, with the line where it puts the traceback (what torchrun's summary
    prints as the failure's "traceback").

    Written whole or not at all (a temporary file renamed into place): a rank that fails because a peer died is
    often still writing when the agent, having seen the peer's death, sends it SIGTERM; an error file left empty
    made the agent's JSON read raise, and the agent died instead of restarting the workers."""
    error_file = os.environ.get(ERROR_FILE_ENV)
    if not error_file:
        return
    record = {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
    partial = f"{error_file}.{os.getpid()}.partial"
    try:
        with open(partial, "w") as fh:
            json.dump({"message": record}, fh)
        os.replace(partial, error_file)
    except OSError:  # torchrun then shows its generic text; the line itself is already on stderr
        pass


def report_error(line: str) -> None:
    """Print ``line`` to stderr unless another rank of this node already did; record it for torchrun."""
    if _first_to_say(line):
        print(line, file=sys.stderr, flush=True)
    _write_error_file(line)
