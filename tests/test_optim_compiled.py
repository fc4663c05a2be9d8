"""RAdam, Adadelta, Rprop, ASGD, Adafactor and Muon traced whole, as ``make_step(compile=True)``
traces them: the compiled update equals the eager one, with every hyperparameter a shared
float (which the compiled step bakes into its graph as constants until one changes) and with
every hyperparameter per member (tensor inputs). The other optimizers: tests/test_optim_family.py.
"""

from __future__ import annotations

import pytest
import torch
from test_optim_new import CASES, SPECS, TOL, Rig, batches

from vmapens._compiling import own_code

COMPILED = [
    f"{name}-{case}"
    for name in SPECS
    if name != "Muon-batched"  # the same trace as Muon's, another Newton-Schulz kernel
    for case in ("default", "default-per_member")
]


@pytest.mark.parametrize("case", COMPILED)
def test_compiled_apply_gradients_equals_eager(case: str) -> None:
    spec, kwargs = CASES[case]
    rig = Rig(spec, kwargs)  # the eager optimizer, stepped from p.grad
    params = [p.detach().clone().requires_grad_() for p in rig.stacked()]
    compiled = spec.cls(params, **kwargs, **spec.stacked_only)
    compiled.prepare()  # state exists before tracing

    def apply(grads: list) -> None:
        compiled.apply_gradients(grads)

    # aot_eager traces the whole graph (fullgraph fails on any break) without inductor's C++
    # compile; tests/test_step.py runs inductor on a whole step.
    apply_c = torch.compile(own_code(apply), fullgraph=True, backend="aot_eager")
    for x, y in batches(3):
        rig.step(x, y)
        apply_c([None if p.grad is None else p.grad.clone() for p in rig.stacked()])
    for p, q in zip(params, rig.stacked(), strict=True):
        torch.testing.assert_close(p, q, **TOL)
        for key, value in rig.opt.state[q].items():
            torch.testing.assert_close(compiled.state[p][key], value, **TOL, msg=key)
