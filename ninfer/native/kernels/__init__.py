"""GPU kernels beside their torch references (fla's habit: same signature, same module).

Every op here comes in three names::

    op_ref(...)      pure torch; the semantics, and what runs on the CPU
    op_triton(...)   the Triton kernel (runs on CUDA tensors, or on CPU tensors under
                     TRITON_INTERPRET=1, which is how the tests check it)
    op(...)          dispatch: the kernel for CUDA tensors, the reference otherwise

The dispatch is decided by the tensors' device only, never by a flag. The model calls the
kernels through ``native/model/paths.py``'s ``KERNELS`` path, which a CUDA model runs
(``paths.for_device``) and the tests run on CPU tensors under the interpreter.

Modules: ``paged_attention`` (decode with split-K over pages, chunk/prefill over a cached
prefix), ``copies`` (KV write by slot mapping, tail copy-on-write of pages, StateImage
gather/scatter/copy between slots), ``norms`` (fused RMSNorm: plain, zero-centred, gated), ``gdn`` (the gated delta rule and the causal conv through
fla-core on CUDA when it is installed; see docs/structures.md for why those are fla's).
"""

from __future__ import annotations

import torch
import triton


def on_cuda(*tensors: torch.Tensor) -> bool:
    """The dispatch rule: the Triton path only when every tensor lives on a CUDA device."""
    return all(t.is_cuda for t in tensors)


def interpreting() -> bool:
    """True under TRITON_INTERPRET=1 (read by triton when a kernel is decorated)."""
    return bool(triton.knobs.runtime.interpret)
