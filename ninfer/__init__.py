"""NInfer: exact context reuse and preemption for hybrid LLMs, served as Ray actors.

Public surface (see API.md). Heavy modules (torch, ray) load on first use of a name.
"""

from __future__ import annotations

from importlib import import_module

from ninfer.config import ContextCacheConfig, EngineConfig
from ninfer.errors import (CapacityContractError, ConfigError, DeploymentError, ModelLoadError, NInferError,
                           RequestError)
from ninfer.sampling_params import Constraint, SamplingParams

__version__ = "0.1.0"

_LAZY = {
    "Engine": "ninfer.api",
    "connect": "ninfer.api",
    "reference_generate": "ninfer.reference",
    "reference_prompt_logprobs": "ninfer.reference",
    "render_chat": "ninfer.frontend.render",
    "make_tiny_model": "ninfer.tiny.build",
    "TokenLogprob": "ninfer.protocol",
    "PromptLogprob": "ninfer.protocol",
}

__all__ = [
    "CapacityContractError", "ConfigError", "ContextCacheConfig", "DeploymentError", "EngineConfig", "ModelLoadError",
    "NInferError", "RequestError", "SamplingParams", "Constraint", *_LAZY,
]


def __getattr__(name: str):
    if name in _LAZY:
        value = getattr(import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module 'ninfer' has no attribute {name!r}")
