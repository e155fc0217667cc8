"""How an actor's failure to start reaches the person who started it: as the original NInfer
error, in one line.

Two routes exist, and the actors take the first wherever they can:

    an actor keeps the exception of its     Ray hands the caller RayTaskError(ConfigError) with
    start and raises it from a method       the original object as ``cause``, however many
    (ready, info): typed, no log noise      actors it passed through
    an actor dies in its constructor        only text is left (and a threaded actor aborts with
    (anything unexpected)                   a native stack dump in its log): the last
                                            ``SomethingError: message`` line of the traceback
"""

from __future__ import annotations

import re

from ray.exceptions import RayError, RayTaskError

from ninfer import errors
from ninfer.errors import DeploymentError, NInferError

_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_ERROR_LINE = re.compile(r"^\s*(?:[\w.]+\.)?(\w+(?:Error|Exception|Lost)): (.+?)\s*$")
LOGS_HINT = "the actors' logs are in Ray's session directory, e.g. /tmp/ray/session_latest/logs"


def original_cause(exc: BaseException) -> BaseException:
    """The exception an actor raised, without Ray's task-error wrappers around it."""
    while isinstance(exc, RayTaskError) and exc.cause is not None and exc.cause is not exc:
        exc = exc.cause
    return exc


def last_error_line(text: str) -> tuple[str, str] | None:
    """(exception name, message) of the last ``…Error: message`` line of a traceback text."""
    found = None
    for line in _ANSI.sub("", text).splitlines():
        m = _ERROR_LINE.match(line)
        if m:
            found = (m.group(1), m.group(2))
    return found


def startup_error(exc: BaseException) -> NInferError:
    """The NInfer error behind a failed start, with its own type and one-line message.

    A NInfer error named only in text comes back as its own class; anything else (an
    unexpected exception, an actor that died) becomes a DeploymentError that names the deepest
    error and where the actors' logs are.
    """
    cause = original_cause(exc)
    if isinstance(cause, NInferError) and not isinstance(cause, RayError):
        return cause
    if not isinstance(cause, RayError):        # an exception object an actor kept from its start
        text = (str(cause).strip().splitlines() or [""])[-1]
        return DeploymentError(f"the deployment failed to start: {type(cause).__name__}: {text}; {LOGS_HINT}")
    found = last_error_line(str(cause))
    if found is None:
        return DeploymentError(f"the deployment failed to start ({type(cause).__name__}); {LOGS_HINT}")
    name, message = found
    cls = getattr(errors, name, None)
    if isinstance(cls, type) and issubclass(cls, NInferError) and cls is not NInferError:
        return cls(message)
    return DeploymentError(f"the deployment failed to start: {name}: {message}; {LOGS_HINT}")
