"""Handing members over: one member's state for the plain torch optimizer, sub-ensembles."""

from __future__ import annotations

from typing import Any, ClassVar

from torch import Tensor, nn

from .._checks import index_rows
from ._hyper import Hyper, params_of, pick_group

__all__ = ["MemberHandOff"]


class MemberHandOff:
    """``member_state_dict`` and ``select`` of :class:`~vmapens.optim.StackedOptimizer`."""

    num_members: int
    param_groups: list[dict[str, Any]]
    state: Any
    defaults: dict[str, Any]
    hyperparameters: ClassVar[dict[str, Hyper]]

    @property
    def _api(self) -> str:
        return type(self).__name__

    def member_state(
        self, state: dict[str, Tensor], group: dict[str, Any], i: int
    ) -> dict[str, Tensor]:
        raise NotImplementedError

    def prepare(self) -> None:
        raise NotImplementedError

    def _fresh(self, groups: list[dict[str, Any]], defaults: dict[str, Any]) -> Any:
        raise NotImplementedError

    def member_state_dict(self, i: int, module: nn.Module | None = None) -> dict[str, Any]:
        """Member ``i``'s optimizer state, loadable by the plain torch optimizer.

        Build ``torch_class`` over the member's parameters with the same param-group layout,
        then ``opt.load_state_dict(stacked.member_state_dict(i))`` continues member ``i``
        alone on exactly its ensemble trajectory.

        Args:
            i: Member index (negative counts from the end).
            module: Optional member module; its parameters are checked against the stacked
                ones (count and shapes, in order).

        Returns:
            A ``torch.optim.Optimizer`` state dict with member ``i``'s float hyperparameters
            and cloned slices of its state.

        Raises:
            IndexError: ``i`` out of range.
            ValueError: ``module``'s parameters do not match.
        """
        api = f"{self._api}.member_state_dict"
        n = self.num_members
        if not -n <= i < n:
            raise IndexError(f"{api}: `i`={i} out of range for n={n}")
        i %= n
        params = [p for g in self.param_groups for p in g["params"]]
        if module is not None:
            shapes = [tuple(p.shape) for p in module.parameters()]
            expected = [tuple(p.shape[1:]) for p in params]
            if shapes != expected:
                raise ValueError(
                    f"{api}: `module` parameters do not match the stacked ones; got shapes "
                    f"{shapes}, expected {expected} (same order)"
                )
        groups, state, start = [], {}, 0
        for group in self.param_groups:
            ids = list(range(start, start + len(group["params"])))
            start += len(ids)
            groups.append({**pick_group(group, self.hyperparameters, [i]), "params": ids})
            for k, p in zip(ids, group["params"], strict=True):
                member = self.member_state(self.state[p], group, i) if self.state[p] else {}
                if member:
                    state[k] = member
        return {"state": state, "param_groups": groups}

    def select(self, index: Any, params: Any) -> Any:
        """A new optimizer of this class for a sub-ensemble, with its members' state.

        Args:
            index: the members kept, as for ``Ensemble.select``.
            params: the sub-ensemble (``ens.select(index)``) or its stacked parameters, in the
                same order as this optimizer's.

        Returns:
            An optimizer whose member ``k`` has member ``index[k]``'s hyperparameters and state.

        Raises:
            ValueError: ``params`` does not match this optimizer's parameters.
        """
        rows = index_rows(f"{self._api}.select", index, self.num_members)
        new_params = params_of(params)
        old = [p for g in self.param_groups for p in g["params"]]
        shapes = [tuple(p.shape[1:]) for p in new_params]
        if shapes != [tuple(p.shape[1:]) for p in old]:
            raise ValueError(
                f"{self._api}.select: `params` do not match this optimizer's parameters "
                f"(member shapes {shapes})"
            )
        picked = rows.tolist()
        groups, start = [], 0
        for group in self.param_groups:
            size = len(group["params"])
            groups.append(
                {
                    **pick_group(group, self.hyperparameters, picked),
                    "params": new_params[start : start + size],
                }
            )
            start += size
        new = self._fresh(groups, pick_group(self.defaults, self.hyperparameters, picked))
        for p_old, p_new in zip(old, new_params, strict=True):
            if self.state[p_old]:
                new.state[p_new] = {
                    k: v[rows.to(v.device)].clone() for k, v in self.state[p_old].items()
                }
        if new.state:
            new.prepare()
        return new
