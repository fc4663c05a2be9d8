"""How the compiled step is compiled: inductor's options, and a code object per step.

Kept apart from ``step.py`` so tests that compile a function themselves take the same
options (``cache_keyed_options``) and the same per-function cache (``own_code``).
"""

from __future__ import annotations

import contextlib
import gc
import itertools
import re
import traceback
import types
from collections.abc import Callable, Iterable, Iterator
from typing import Any

import torch
from torch.autograd.function import BackwardCFunction

from ._matmuls import shared_operand_pass

__all__ = [
    "CompileFailed",
    "TooManyShapes",
    "cache_keyed_options",
    "check_shapes",
    "compile_arguments",
    "compile_failures",
    "compile_options",
    "dispatch_restored",
    "own_code",
    "refuse_custom_backwards",
    "refuse_grad_hooks",
    "refuse_kept_reads",
]


class CompileFailed(RuntimeError):
    """``torch.compile`` could not build the compiled training step; the step changed nothing.

    Raised by the step of ``make_step(compile=True)`` when dynamo cannot trace the step as
    one graph or inductor fails to compile it. ``fit(compile="auto")`` warns and goes on
    eagerly.
    """


def refuse_grad_hooks(named: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Refuse a trained stacked parameter with a gradient hook: the compiled step takes its
    gradients with ``torch.func`` and runs the update inside its graph, so no hook would run
    (a clamp in ``register_hook`` was dropped, silently). The eager step runs them.

    Raises:
        CompileFailed: naming the parameter; ``fit(compile="auto")`` goes on eagerly.
    """
    for name, p in named:
        if p.requires_grad and (
            p._backward_hooks or getattr(p, "_post_accumulate_grad_hooks", None)
        ):
            raise CompileFailed(
                f"step: the stacked parameter `{name}` has a gradient hook (Tensor.register_hook "
                "or register_post_accumulate_grad_hook), which the compiled step cannot run: its "
                "gradients come from torch.func inside the graph, and the update runs there too. "
                "Use compile=False (the eager step runs them as loss.backward() does), or "
                "fit(compile='auto'), which stays eager. Nothing was changed"
            )


class TooManyShapes(ValueError):
    """The compiled step would compile for more input shapes than it accepts; the step changed
    nothing. ``fit(compile="auto")`` warns and goes on eagerly."""


def check_shapes(shapes: set[tuple], key: tuple, limit: int) -> None:
    """Refuse input shapes ``key`` when the step has compiled for ``limit`` others (``shapes``).

    Raises:
        TooManyShapes: (a ValueError) ``key`` is new and ``shapes`` holds ``limit`` already.
    """
    if key not in shapes and len(shapes) >= limit:
        raise TooManyShapes(
            f"step: the compiled step has already compiled for {len(shapes)} input shapes "
            f"({sorted(shapes)[:3]}...) and would compile again for {key}; feed batches of a "
            "fixed size (e.g. DataLoader(drop_last=True), fit(batch_size=...) with a size "
            "that divides the data) or use compile=False"
        )


#: The prefix of the autograd.Function torch.library makes for a custom op's registered backward.
_CUSTOM_OP = "GeneratedBackwardFor_"


def refuse_custom_backwards(losses: torch.Tensor, module: str) -> None:
    """Refuse to compile a step whose forward calls a ``torch.autograd.Function`` with a
    backward of its own (a gradient reversal, a straight-through estimator), or a
    ``torch.library`` custom op with one (``register_autograd``: torch makes a Function for it).

    The compiled step takes its gradients from ``torch.func.grad`` inside the graph, and torch
    2.13's dynamo cannot run such a Function there: inside the step's ``vmap`` it fails in its
    own rewrite of the Function ("You tried to vmap over ApplyTemplate"), and where it traces
    ``grad`` itself it drops the backward and differentiates the forward, a wrong gradient
    without an error (pytorch/pytorch#193279). The compiled step's first-call check compares
    its gradients with eager ones only where the forward draws no random numbers, and says
    less than this: the Function is refused here, found in member 0's eager graph (``losses``)
    before anything is traced. vmapens's own Functions that a traced step replaces with plain
    ops (a class attribute ``traced_twin = True``) pass.

    Raises:
        CompileFailed: naming the Function's class.
    """
    seen: set[Any] = set()
    stack = [losses.grad_fn]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        made_by = getattr(node, "_forward_cls", None)
        if isinstance(node, BackwardCFunction) and not getattr(made_by, "traced_twin", False):
            name = re.sub(r"^(Vmapped)+", "", getattr(made_by, "__name__", type(node).__name__))
            op = name.removeprefix(_CUSTOM_OP)  # torch.library's Function for a custom op
            what = (
                f"{name}, a torch.autograd.Function with a backward of its own"
                if op == name
                else f"the custom op {op} (torch.library) with a backward (register_autograd)"
            )
            raise CompileFailed(
                f"step: the forward of {module} calls {what}, which torch.compile cannot run "
                "inside the torch.func transforms of the compiled step (torch 2.13 fails there, "
                "or differentiates the forward instead of calling the backward: "
                "pytorch/pytorch#193279). Train with compile=False (make_step or fit), which "
                "runs it as each member alone. Nothing was changed"
            )
        stack.extend(next_node for next_node, _ in node.next_functions)


@contextlib.contextmanager
def compile_failures() -> Iterator[None]:
    """Turn ``torch.compile``'s own errors about the step into a ``CompileFailed`` that says
    what it means and the way out (``compile=False``), and leave torch's dispatch state as it
    was before the call, whatever the error.

    dynamo traces the whole step and inductor compiles it before any of it runs, so nothing
    has changed when they fail: dynamo's ``Unsupported`` (a forward that calls a Python
    builtin dynamo cannot trace, such as ``time.perf_counter``, with ``fullgraph=True``),
    ``BackendCompilerFailed`` (inductor's C++ build), ``InternalTorchDynamoError`` (dynamo
    failing in its own code: its rewrite of an ``autograd.Function`` under ``vmap``) and
    ``TorchRuntimeError`` (an op that fails on fake tensors while tracing:
    ``torch.func.hessian`` in a physics-informed forward, which eager runs) and ``UserError``
    (a size that depends on tensor values: a boolean mask, ``bincount``) reached the user
    as torch's internals, and so did dynamo's "Hard failure due to
    fullgraph=True" once a graph met more variants than its recompile limit (the step's own
    limit counts input shapes only).
    """
    # Imported here: torch._dynamo takes seconds to import, which eager never needs.
    from torch._dynamo.exc import (
        BackendCompilerFailed,
        FailOnRecompileLimitHit,
        InternalTorchDynamoError,
        TorchDynamoException,
        TorchRuntimeError,
        Unsupported,
        UserError,
    )

    before = _dispatch_state()
    try:
        yield
    except BaseException as err:
        # dynamo's own errors carry its frames; others keep theirs (and their locals, for a
        # debugger): only the dispatch state is put back if it changed.
        _settle(err, before, free=isinstance(err, TorchDynamoException | FailOnRecompileLimitHit))
        if isinstance(err, FailOnRecompileLimitHit):
            limit = torch._dynamo.config.recompile_limit
            raise CompileFailed(
                f"step: the compiled step would compile one of its graphs more than {limit} "
                "times (dynamo's recompile_limit), once for each set of input shapes, mask or "
                "no mask, train/eval modes, parameter dtypes, optimizer flags and values of the "
                "attributes set on ens.template (a float read by the forward: a dropout rate, a "
                "temperature) it has met; keep them fixed, pass a changing value as an input, "
                "or train with compile=False. Nothing was changed"
            ) from err
        failed = Unsupported | BackendCompilerFailed | TorchRuntimeError | InternalTorchDynamoError
        if isinstance(err, failed | UserError):
            lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
            why = " ".join(lines[:2]) if lines else type(err).__name__
            likely = "the forward or the loss calls something dynamo cannot trace"
            if "storage of TensorWrapper" in why:
                likely = (
                    "a tensor of a member leaves the graph: the forward keeps one on its "
                    "module (`self.aux_loss = ...`), or a submodule sits at two paths"
                )
            elif isinstance(err, UserError) and ("data-dependent" in why or "specialized" in why):
                likely = (
                    "a size in the forward or the loss depends on tensor values (a boolean "
                    "mask, `nonzero`, `bincount`, `.item()`), which one graph cannot hold"
                )
            raise CompileFailed(
                f"step: torch.compile cannot compile this training step into one graph "
                f"({type(err).__name__}: {why[:400]}); most likely {likely}. Train with "
                "compile=False (make_step or fit), which runs the same step eagerly. Nothing "
                "was changed"
            ) from err
        raise


def refuse_kept_reads(err: AttributeError, kept: dict[str, Any]) -> None:
    """``CompileFailed`` for a loss failing on an attribute the forward keeps on its module
    (``ens.template.aux``, set by the forward alone): the compiled step hands no kept tensor
    to the loss (it leaves the graph). Nothing for other names (a typo is the user's)."""
    keys = {name.rpartition(":")[2] for name in kept}
    if getattr(err, "name", None) in keys:
        names = ", ".join(f"`{key}`" for key in sorted(keys))
        raise CompileFailed(
            f"step: the forward keeps {names} on its module and the loss reads it ({err}); "
            "the compiled step cannot hand a tensor the forward keeps to the loss (it leaves "
            "the graph). Return it from the forward (`return out, aux`), or train with "
            "compile=False (make_step or fit), whose loss reads each member's own. Nothing "
            "was changed"
        ) from err


@contextlib.contextmanager
def dispatch_restored() -> Iterator[None]:
    """torch's dispatch state (functorch's levels, the dispatch keys) put back as it was,
    whatever a failed trace left entered (``torch.export``'s: every later call of the
    process ran batched, ``torch.randn(2)`` a ``BatchedTensor``)."""
    before = _dispatch_state()
    try:
        yield
    except BaseException as err:
        if _dispatch_state() != before:  # frames kept only where they hold no guard
            _settle(err, before, free=True)
        raise


def _dispatch_state() -> tuple[Any, Any, int, bool]:
    """The thread's dispatch keys included and excluded, torch.func's transform depth, and
    whether saved-tensor hooks are enabled (``torch.func.grad`` disables them inside)."""
    return (
        torch._C._dispatch_tls_local_include_set(),
        torch._C._dispatch_tls_local_exclude_set(),
        torch._C._functorch.get_dynamic_layer_stack_depth(),
        torch._C._autograd._saved_tensors_hooks_is_enabled(),  # type: ignore[attr-defined]
    )


def _settle(err: BaseException, before: tuple[Any, Any, int, bool], free: bool) -> None:
    """Free the frames ``err`` holds (``free``), then put the dispatch state back as it was
    ``before``.

    A failed trace (dynamo on a ``torch.func`` transform: a hessian in the forward) leaves
    dispatch-key guards it entered in the frames of its traceback. Freed, each puts back the
    keys it saw when entered, in whatever order the collector frees them: functorch's and
    autograd's keys then read excluded, and every later forward of the process failed
    ("Cannot access storage of BatchedTensorImpl"), when the error happened to be collected
    (a test report, ``fit``'s fallback holding it). Freed here, at once, then set back.
    """
    seen: set[int] = set()
    chained: BaseException | None = err if free else None
    while chained is not None and id(chained) not in seen:
        seen.add(id(chained))
        traceback.clear_frames(chained.__traceback__)
        chained = chained.__cause__ or chained.__context__
    if free:
        gc.collect()  # what the frames held in reference cycles: freed now, not later
    include, exclude, depth, hooks = before
    if torch._C._functorch.get_dynamic_layer_stack_depth() > depth:
        torch._C._functorch.pop_dynamic_layer_stack_and_undo_to_depth(depth)
    if hooks and not torch._C._autograd._saved_tensors_hooks_is_enabled():  # type: ignore[attr-defined]
        # a grad transform the failed trace entered disabled them: every later
        # `torch.utils.checkpoint` or saved-tensor hook of the process was refused
        torch._C._autograd._saved_tensors_hooks_enable()
    if _dispatch_state()[:2] != (include, exclude):
        # torch has no setter for the whole sets, only a guard that puts them back when it
        # exits: entered, and kept, it holds them as they were for the rest of the thread.
        guard = torch._C._ForceDispatchKeyGuard(include, exclude)
        guard.__enter__()
        _KEPT.append(guard)


#: The guards ``_settle`` entered for good (one per failed trace that changed the keys).
_KEPT: list[Any] = []


def compile_options(device: torch.device) -> dict[str, Any]:
    """The inductor options of the compiled step on ``device``.

    torch.compile takes a ``mode`` or ``options``, not both, so CUDA's "reduce-overhead" (CUDA
    graphs: one launch per step) is given as its options.
    """
    options: dict[str, Any] = {}
    if device.type == "cpu":  # a member matmul on a shared input becomes one (_matmuls)
        options["post_grad_custom_pre_pass"] = shared_operand_pass()
        options.update(cache_keyed_options())
        # The compiled graph calls its kernels from C++, not Python: a step of many small
        # kernels (a recurrence, a CNN) ran 0.73-0.82x the time, the others 0.94-1.0x, and
        # its first compile took no longer (docs/performance.md).
        options["cpp_wrapper"] = True
    # Inductor otherwise keeps fused intermediates in float32 where eager rounds them to bf16 or
    # fp16: under autocast (make_step's ``precision``), and in an update that computes in bf16 itself
    # (StackedMuon's Newton-Schulz iteration, as torch.optim.Muon's) or on 16-bit parameters.
    options["emulate_precision_casts"] = True
    if device.type == "cuda":
        # Imported here: torch._inductor imports torch._dynamo (seconds), which eager never needs.
        from torch._inductor import list_mode_options

        options.update(list_mode_options("reduce-overhead"))
    return options


#: aten ops that inductor lowers to atomic adds at computed indices (the backward of an indexing:
#: a bilinear or nearest ``F.interpolate``, ``x[idx]``, an embedding, ``gather``).
_INDEXED_ADDS = frozenset(
    ("scatter_add", "scatter_reduce", "index_add", "embedding_dense_backward")
    + ("_unsafe_masked_index_put_accumulate",)
)
_INDEX_PUTS = frozenset(("index_put", "index_put_", "_unsafe_index_put"))


def adds_at_indices(gm: torch.fx.GraphModule) -> bool:
    """Whether the aten graph ``gm`` adds into a tensor at computed indices (``_INDEXED_ADDS``,
    ``index_put`` with ``accumulate=True``)."""
    for node in gm.graph.nodes:
        name = getattr(node.target, "_opname", "") if node.op == "call_function" else ""
        if name in _INDEXED_ADDS:
            return True
        if name in _INDEX_PUTS and (node.args[3:4] or [node.kwargs.get("accumulate", False)])[0]:
            return True
    return False


def _inner_compile(gm: torch.fx.GraphModule, example_inputs: Any, **kwargs: Any) -> Any:
    """Inductor's ``compile_fx_inner``, with the kernels that add at computed indices tiled in
    one dim only where ``gm`` has such adds.

    torch 2.13's C++ codegen (CPU) miscomputes the index of such an add (an ``atomic_add``
    store) in a kernel it tiles in two dims (one input with the member dim innermost, as vmap
    leaves it, another not): member ``m`` of a [N, 64]-element gradient wrote at ``128 * m``.
    ``vmap(grad(f))`` of a bilinear ``F.interpolate`` (tests/test_journey_vision.py) crashed the
    process (heap corruption) or, at N=3, gave every member a wrong gradient without an error.
    Vectorized along the innermost dim alone it is exact. Only those kernels: a CNN's max-pool
    backward is a ``scatter_add`` under vmap, and the whole graph unvectorized (sessions 28-29)
    took its step 3x as long, the add's kernel alone unvectorized 1.4x (docs/performance.md).
    """
    # Imported here: torch._inductor imports torch._dynamo (seconds), which eager never needs.
    from torch._inductor.codegen import cpp
    from torch._inductor.compile_fx import compile_fx_inner

    if not adds_at_indices(gm):
        return compile_fx_inner(gm, example_inputs, **kwargs)
    select = cpp.TilingSelect.select_tiling

    def one_dim_atomic_adds(self: Any, fn_list: Any, var_sizes_list: Any) -> Any:
        factors, indices, stats = select(self, fn_list, var_sizes_list)
        if len(indices) == 2 and _atomic_adds(cpp._get_loop_body(fn_list)):
            return factors[:1], indices[-1:], stats  # vectorized along the innermost dim only
        return factors, indices, stats

    cpp.TilingSelect.select_tiling = one_dim_atomic_adds  # type: ignore[method-assign]
    try:
        return compile_fx_inner(gm, example_inputs, **kwargs)
    finally:
        cpp.TilingSelect.select_tiling = select  # type: ignore[method-assign]


def _atomic_adds(loop_bodies: Any) -> bool:
    """Whether a kernel's loop bodies store with ``atomic_add`` (an add at computed indices)."""
    return any(
        node.target == "store" and "atomic_add" in node.args[4:]
        for body in loop_bodies
        for block in (body.root_block, *body.subblocks.values())
        for node in block.graph.nodes
    )


def compile_arguments(device: torch.device) -> dict[str, Any]:
    """``torch.compile``'s ``options`` for the compiled step on ``device`` and, on a CPU, its
    ``backend``: inductor, tiling the kernels that add at computed indices in one dim only
    (``_inner_compile``: torch 2.13 miscompiles them tiled in two)."""
    options = compile_options(device)
    return (
        {"options": options, "backend": _inductor} if device.type == "cpu" else {"options": options}
    )


def _inductor(gm: torch.fx.GraphModule, example_inputs: Any, options: dict[str, Any]) -> Any:
    """torch.compile's inductor backend with ``options``, through ``_inner_compile``."""
    # Imported here: torch._inductor imports torch._dynamo (seconds), which eager never needs.
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, inner_compile=_inner_compile, config_patches=options)


def cache_keyed_options() -> dict[str, Any]:
    """Inductor options that put this process's CPU vector ISA into the compile-cache key.

    ``cpp.simdlen`` is the bit width of the ISA inductor picks by itself; given as an option,
    it becomes part of the compiled-graph cache key. torch 2.13 keys its FX graph cache without
    it: a graph cached by a process on AVX-512 and loaded by one on AVX2 (another machine
    sharing ``TORCHINDUCTOR_CACHE_DIR``, or ``ATEN_CPU_CAPABILITY`` set) recompiled 16-wide
    kernel source with AVX2 flags and gave wrong results without an error (the other way
    round: heap corruption), docs/semantics.md. The tests that call ``torch.compile`` themselves pass them too.
    """
    # Imported here: torch._inductor imports torch._dynamo (seconds), which eager never needs.
    from torch._inductor.cpu_vec_isa import pick_vec_isa

    return {"cpp.simdlen": pick_vec_isa().bit_width()}


_made = itertools.count()


def own_code(fn: Callable) -> Callable:
    """``fn`` with a code object of its own (same bytecode, a unique name)."""
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{next(_made)}")
    made = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    # FunctionType takes no keyword-only defaults: without them `def f(x, *, k=1)` needed `k`.
    made.__kwdefaults__ = None if fn.__kwdefaults__ is None else dict(fn.__kwdefaults__)
    return made
