"""The compiled step's errors, as ``compile_failures`` words them (no compile needed: torch's
own exception types are raised by hand, as dynamo raises them)."""

from __future__ import annotations

import pytest
import torch
from torch._dynamo.exc import BackendCompilerFailed, InternalTorchDynamoError

import vmapens
from vmapens._compiling import compile_failures


def _inductor_failed(message: str) -> BackendCompilerFailed:
    return BackendCompilerFailed(lambda *a: None, NotImplementedError(message), None)


def test_a_batched_tensor_leaving_the_graph_names_the_forwards_kept_tensor() -> None:
    # What inductor says when a forward keeps a tensor on its module (`self.pen = ...`) inside
    # the compiled member map: the plain message pointed at an untraceable call.
    leaked = _inductor_failed("Cannot access storage of TensorWrapper")
    with pytest.raises(vmapens.CompileFailed, match=r"keeps one") as failed, compile_failures():
        raise leaked
    assert "compile=False" in str(failed.value)
    assert "dynamo cannot trace" not in str(failed.value)


def test_another_backend_failure_keeps_the_general_way_out() -> None:
    other = _inductor_failed("C++ compile error")
    with pytest.raises(vmapens.CompileFailed, match=r"cannot trace") as failed, compile_failures():
        raise other
    assert "keeps one on its module" not in str(failed.value)
    assert torch._C._functorch.get_dynamic_layer_stack_depth() == 0


def test_dynamos_internal_error_becomes_compile_failed() -> None:
    # dynamo failing inside its own code while it traces the step (its rewrite of an
    # autograd.Function under vmap, torch 2.13) reached the user raw, and fit(compile="auto")
    # stopped instead of going on eagerly: nothing has run when dynamo fails.
    internal = InternalTorchDynamoError("RuntimeError: You tried to vmap over ApplyTemplate")
    with (
        pytest.raises(
            vmapens.CompileFailed, match=r"InternalTorchDynamoError.*ApplyTemplate"
        ) as failed,
        compile_failures(),
    ):
        raise internal
    assert "compile=False" in str(failed.value)
