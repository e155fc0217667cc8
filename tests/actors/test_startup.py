"""A failed start reaches the user as the original NInfer error, in one line (no Ray needed:
the error objects are built here as Ray builds them)."""

from __future__ import annotations

import pytest

pytest.importorskip("ray")

from ray.exceptions import RayActorError, RayTaskError  # noqa: E402

from ninfer.actors.startup import startup_error  # noqa: E402
from ninfer.errors import ConfigError, DeploymentError  # noqa: E402


def _task_error(cause: BaseException, fn: str) -> RayTaskError:
    """What ray.get raises for an exception raised in an actor method: RayTaskError(cause)."""
    return RayTaskError(fn, f"Traceback ...\n{type(cause).__name__}: {cause}", cause).as_instanceof_cause()


def test_an_error_raised_through_two_actors_comes_back_as_itself():
    original = ConfigError("max_context=32768 is out of range: allowed 1..4096 (the model's max_position_embeddings)")
    nested = _task_error(_task_error(original, "EngineControllerActor.info"), "FrontendActor.ready")
    assert startup_error(nested) is original


def test_an_unexpected_exception_is_named_with_its_message():
    err = startup_error(_task_error(RuntimeError("DefaultCPUAllocator: can't allocate memory"), "info"))
    assert isinstance(err, DeploymentError)
    assert str(err).startswith("the deployment failed to start: RuntimeError: DefaultCPUAllocator: can't allocate")


def test_an_actor_that_died_in_its_constructor_leaves_text_only():
    text = ("The actor died because of an error raised in its creation task, \x1b[36mray::w:GpuWorkerActor.__init__()"
            "\x1b[39m (pid=1)\nTraceback (most recent call last):\n  File \"x.py\", line 1, in <module>\n"
            "ninfer.errors.ConfigError: kv_capacity=64 (1 pages of 64 tokens) is out of range: allowed 64..256")
    err = startup_error(RayActorError(error_msg=text, actor_init_failed=True))
    assert type(err) is ConfigError and str(err).startswith("kv_capacity=64 (1 pages")
    err = startup_error(RayActorError(error_msg=text.replace("ninfer.errors.ConfigError", "ImportError")))
    assert isinstance(err, DeploymentError) and "ImportError: kv_capacity=64" in str(err)
