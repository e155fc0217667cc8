"""Exception types of the public contract (see API.md).

Every error a user can cause carries a one-line message that names the offending thing
(field, tensor, file) and, where there is one, the allowed range.
"""

from __future__ import annotations

from enum import StrEnum


class NInferError(Exception):
    """Base class of every error NInfer raises on purpose."""


class ConfigError(NInferError, ValueError):
    """An engine configuration value is out of range or inconsistent.

    The message names the field and the allowed range, e.g.
    ``max_concurrency=9 is out of range: allowed 1..8``.
    """


class ModelLoadError(NInferError):
    """A model directory is missing, unsupported or inconsistent (config or weights)."""


class DeploymentError(NInferError):
    """A Ray deployment cannot be started or attached: no cluster at the address, a healthy
    deployment of that name serving something else, or an actor that failed to start for a
    reason that is not a config or model error. The message says what to do.
    """


class CapacityContractError(NInferError):
    """The sole remaining request cannot get a legal unit after all legal reclaim.

    Raised instead of waiting for a releaser that does not exist (seed: 容量合同错误).
    """


class RequestError(NInferError, ValueError):
    """Bad input for one request (it fails alone; nothing else is lost)."""


class IntegrityError(NInferError, AssertionError):
    """The books of a store or of the engine do not balance (a leak, a double free, a
    negative count). ``engine.check_integrity()`` raises it."""


class MediaError(RequestError):
    """A media part of one request cannot be used: a remote URL (never fetched), a file outside
    the allowed local path, corrupt base64, an undecodable or too large image, or one whose
    prepared size exceeds the media budget; or image placeholders in the prompt that are not the
    images. The message names the part (``messages[1].content[0].image_url: ...``) or the prompt
    position. A RequestError, so it is that request's 400.
    """


class ErrorKind(StrEnum):
    """Why one request ended with finish_reason "error": ``Output.error["type"]`` (and the
    ``finished`` lifecycle event's ``error``). The value is the public spelling (docs/api.md,
    "Error types"); a failure carries one of these and nothing else (msgspec refuses any other
    value when it decodes an event)."""

    TIMEOUT = "timeout"                        # not admitted within request_timeout_s
    CAPACITY_CONTRACT = "capacity_contract"    # the sole remaining request cannot get a legal unit
    COPY_FAILED = "copy_failed"                # a copy of its content (a read-back) failed
    DEVICE_ERROR = "device_error"              # the forward call that computed its unit failed
    PROMPT_LOGPROBS = "prompt_logprobs"        # prompt positions whose entries were never computed
    REQUEST_ERROR = "RequestError"             # the controller's intake refused its spec
    RUNTIME_ERROR = "RuntimeError"             # the worker could not execute its intent, or the
    #                                            engine cycle failed (internal error)
    WORKER_LOST = "worker_lost"                # LOST_KINDS: retryable, the engine serves on
    CONTROLLER_LOST = "controller_lost"
    CONNECTION_LOST = "connection_lost"
    REPLICA_LOST = "replica_lost"


RETRY_HINT = "; nothing else was lost and the engine serves on: retry the request"
LOST_KINDS = (ErrorKind.WORKER_LOST, ErrorKind.CONTROLLER_LOST, ErrorKind.CONNECTION_LOST, ErrorKind.REPLICA_LOST)


def lost_error(kind: ErrorKind, message: str):
    """The ``Failure`` of a request that a lost worker or controller took down mid-generation
    (one that had produced no token yet is resubmitted instead): its kind (``LOST_KINDS``), what
    happened, and that a retry is served (``retryable``; HTTP: 503 with ``Retry-After``)."""
    from ninfer.protocol import Failure        # protocol imports this module
    if kind not in LOST_KINDS:
        raise ValueError(f"{kind!r} is not a lost kind ({', '.join(LOST_KINDS)})")
    return Failure(kind, message + RETRY_HINT, retryable=True)
