"""``frozen_param`` and ``requires_grad_false``: parameters that are trainable but never move, and those
frozen on purpose::

    >>> import torch
    >>> a, b = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
    >>> frozen, check = frozen_by_optimizer([("a", a), ("b", b)], [{"params": [a], "lr": 0.0}])
    >>> {cause.value: names for cause, names in frozen.items()}, check
    ({'not_in_optimizer': ['b'], 'lr_zero': ['a']}, 'done')
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import Any

import torch

from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.strenum import StrEnum
from lightning_debug.monitors.gradients.layout import Positions, input_to_output
from lightning_debug.monitors.gradients.verdict import NAMES_IN_DETAILS, Verdict, quoted


class FrozenCause(StrEnum):
    """Why a trainable parameter does not move (the ``cause`` of a ``frozen_param`` finding)."""

    NOT_IN_OPTIMIZER = "not_in_optimizer"
    LR_ZERO = "lr_zero"
    NO_UPDATE = "no_update"
    REQUIRES_GRAD_FALSE = "requires_grad_false"
    UNREGISTERED = "unregistered"


STATIC_ADVICE = {
    FrozenCause.NOT_IN_OPTIMIZER: ("get gradients but are in no optimizer param group, so the optimizer never changes "
                                   "them (an optimizer built over a copy of them, a deepcopy or a model re-created "
                                   "after it, steps the copy). Pass them to the optimizer in configure_optimizers "
                                   "(e.g. self.parameters()), or call requires_grad_(False) if they are meant to stay "
                                   "fixed."),
    FrozenCause.LR_ZERO: ("are in a param group whose base learning rate is 0, so no scheduler can make them move. "
                          "Set a learning rate, or call requires_grad_(False) if they are meant to stay fixed."),
    FrozenCause.REQUIRES_GRAD_FALSE: (
        "are in an optimizer param group but have requires_grad=False, so they never get a gradient and the "
        "optimizer never moves them. If they are meant to train, requires_grad_(True) (a freeze left over, or set "
        "after the optimizer was built); if they are frozen on purpose, leave them out of the optimizer "
        "(filter(lambda p: p.requires_grad, self.parameters()))."),
}


def number_equals_zero(value: Any) -> bool:
    """A plain-number learning rate of 0; tensor learning rates are not read (that would sync)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == 0


def trainability(named: Sequence[tuple[str, torch.Tensor]], param_groups: Sequence[dict[str, Any]] = (),
                 trainable_before: Collection[torch.Tensor] | None = None
                 ) -> tuple[dict[str, Any], Finding | None, list[str]]:
    """How many parameters (and elements) are trainable, the ``requires_grad_false`` info naming those frozen on
    purpose (None: none), and the names of those frozen by accident: held by an optimizer with
    ``requires_grad=False`` although they were trainable when the run first saw the model
    (``trainable_before``, None: not known), and fewer elements than the trainable ones. A parameter its module
    built frozen (a sinusoidal position table, an MoE bias updated outside the optimizer) sits in
    ``AdamW(model.parameters())`` harmlessly, as does the bulk of a model frozen for a fine-tune.

    Example::

        >>> trained, lost, table = (torch.nn.Parameter(torch.ones(n)) for n in (4, 2, 2))
        >>> _ = lost.requires_grad_(False), table.requires_grad_(False)
        >>> named, groups = [("a", trained), ("b", lost), ("t", table)], [{"params": [trained, lost, table]}]
        >>> summary, info, accident = trainability(named, groups, trainable_before=[trained, lost])
        >>> accident, info.details["parameters"], summary["requires_grad_false_in_optimizer"]
        (['b'], ['t'], 1)
    """
    held = {id(p) for group in param_groups for p in group.get("params", [])}
    was_trainable = {id(p) for p in trainable_before or ()}
    trainable = [(name, p) for name, p in named if p.requires_grad]
    in_optimizer = [(name, p) for name, p in named
                    if not p.requires_grad and id(p) in held and id(p) in was_trainable]
    trainable_elements = sum(p.numel() for _, p in trainable)
    accident = in_optimizer if sum(p.numel() for _, p in in_optimizer) < trainable_elements else []
    lost = {id(p) for _, p in accident}
    untrainable = [(name, p) for name, p in named if not p.requires_grad and id(p) not in lost]
    summary: dict[str, Any] = {
        "trainable_parameters": len(trainable),
        "trainable_elements": trainable_elements,
        "requires_grad_false_parameters": len(untrainable),
        "requires_grad_false_elements": sum(p.numel() for _, p in untrainable),
        "requires_grad_false_names": [name for name, _ in untrainable[:NAMES_IN_DETAILS]],
        "requires_grad_false_in_optimizer": len(accident),
    }
    if not untrainable:
        return summary, None, [name for name, _ in accident]
    listed = sum(id(p) in held for _, p in untrainable)
    still = (f" ({listed} of them still in an optimizer param group, which torch's optimizers skip: built frozen "
             "before the run saw the model, or the bulk of it frozen as a fine-tune does)") if listed else ""
    return summary, Finding(
        Kind.REQUIRES_GRAD_FALSE, Severity.INFO,
        f"{len(untrainable)} of {len(named)} parameters ({summary['requires_grad_false_elements']:,} "
        f"elements) have requires_grad=False and are not trained by design{still}: "
        f"{quoted(summary['requires_grad_false_names'])}.",
        {"count": len(untrainable), "elements": summary["requires_grad_false_elements"],
         "parameters": summary["requires_grad_false_names"], "in_optimizer": listed}), [name for name, _ in accident]


def frozen_by_optimizer(trainable: Sequence[tuple[str, torch.Tensor]], param_groups: Sequence[dict[str, Any]]
                        ) -> tuple[dict[FrozenCause, list[str]], str | None]:
    """Trainable parameters in no param group, or in one whose base learning rate (``initial_lr``: a warm-up from 0
    is no freeze) is 0, and how the check went (None: not done). An optimizer holding none of the module's
    parameters (FSDP/DeepSpeed's flat copies) is skipped, unless it holds copies of them (:func:`holds_copies`)::

        >>> import copy
        >>> layer = torch.nn.Linear(2, 2)
        >>> ghost = copy.deepcopy(layer)
        >>> found, check = frozen_by_optimizer(list(layer.named_parameters()), [{"params": list(ghost.parameters())}])
        >>> found[FrozenCause.NOT_IN_OPTIMIZER], check.startswith("done")
        (['weight', 'bias'], True)
    """
    if not param_groups or not trainable:
        return {}, None
    names = {id(p): name for name, p in trainable}
    in_optimizer: set[int] = set()
    zero_lr: set[int] = set()
    held: list[torch.Tensor] = []
    for group in param_groups:
        params = list(group.get("params", []))
        ids = {id(p) for p in params}
        held += [p for p in params if id(p) not in in_optimizer]
        in_optimizer |= ids
        if number_equals_zero(group.get("initial_lr", group.get("lr"))):
            zero_lr |= ids
    if not in_optimizer & set(names):
        if not holds_copies(held, [p for _, p in trainable]):
            return {}, ("skipped: the optimizer holds none of the module's parameters "
                        "(wrapped or flattened copies, e.g. FSDP/DeepSpeed)")
        return ({FrozenCause.NOT_IN_OPTIMIZER: list(names.values())},
                f"done: the optimizer holds {len(held)} tensor(s) of the shapes and dtypes of the module's parameters, "
                "but none of them (a copy)")
    found = {FrozenCause.NOT_IN_OPTIMIZER: [n for i, n in names.items() if i not in in_optimizer],
             FrozenCause.LR_ZERO: [n for i, n in names.items() if i in zero_lr]}
    return {cause: found_names for cause, found_names in found.items() if found_names}, "done"


class OutsideTraining:
    """Trainable parameters that gradients do not train on purpose (an ``AveragedModel`` copy, a teacher under
    ``no_grad``): one in no param group is ``frozen_param`` once it has a gradient, else ``outside_training``
    (info, once); one confirmed without a gradient whose version counter moved is updated by the user's code (an
    optimizer never writes a parameter without a gradient; ``.data`` writes are not seen)::

        >>> used, copy = torch.nn.Parameter(torch.ones(1)), torch.nn.Parameter(torch.ones(1))
        >>> averaged = torch.nn.Parameter(torch.ones(1))
        >>> outside = OutsideTraining([("head.bias", used), ("ema.bias", copy), ("avg.w", averaged)],
        ...                           ["head.bias", "ema.bias"])
        >>> (used * 2).sum().backward()
        >>> frozen, info = outside.judge(outside.look())
        >>> frozen, info.details["parameters"]
        (['head.bias'], ['ema.bias'])
        >>> with torch.no_grad():
        ...     _ = averaged.mul_(0.5)
        >>> kept, info = outside.updated_elsewhere(["avg.w"], had_gradient=set())
        >>> kept, info.details["parameters"]
        ([], ['avg.w'])
    """

    def __init__(self, trainable: Sequence[tuple[str, torch.Tensor]], not_in_optimizer: Collection[str]) -> None:
        self.names: set[str] = set()  # judged here, not by the missing-gradient rule
        self._versions: dict[str, tuple[torch.Tensor, int]] = {}
        self._waiting: list[tuple[str, torch.Tensor]] = []
        self._with_gradient: list[str] = []
        self._said = False
        self.extend(trainable, not_in_optimizer)

    def extend(self, trainable: Sequence[tuple[str, torch.Tensor]], not_in_optimizer: Collection[str]) -> None:
        """The trainable parameters (at fit start, again after a backbone was unfrozen): new ones are followed, those
        in no param group watched for a gradient."""
        for name, p in trainable:
            # a view shares its base's version counter, which a step of the other parameters it holds bumps (FSDP1's
            # original parameters are views of one flat parameter): only parameters that own their storage are read
            if name not in self._versions and p._base is None:
                self._versions[name] = (p, p._version)
        outside, known = set(not_in_optimizer), self.names | set(self._with_gradient)
        added = [(name, p) for name, p in trainable if name in outside and name not in known]
        self._waiting += added
        self.names.update(name for name, _ in added)

    def look(self) -> list[str]:
        """The names in no param group, not seen with a gradient yet, that have one now."""
        return [name for name, parameter in self._waiting if parameter.grad is not None]

    def judge(self, seen: Sequence[str]) -> tuple[list[str], Finding | None]:
        """Every name in no param group seen with a gradient so far, and on the first check the
        ``outside_training`` info for those without one."""
        if seen:
            newly = set(seen)
            self._with_gradient += [name for name, _ in self._waiting if name in newly]
            self._waiting = [(name, p) for name, p in self._waiting if name not in newly]
        info = None
        if not self._said and self._waiting:
            self._said = True
            info = self._info([p for _, p in self._waiting], [name for name, _ in self._waiting],
                              "are in no optimizer param group and get no gradient")
        return list(self._with_gradient), info

    def updated_elsewhere(self, names: Sequence[str],
                          had_gradient: Collection[str]) -> tuple[list[str], Finding | None]:
        """``names`` (without a gradient) less those judged here, and the ``outside_training`` info for those that
        never had one and whose values changed since the fit started (judged here from then on)."""
        versions = self._versions
        changed = [name for name in names if name not in self.names and name not in had_gradient
                   and name in versions and versions[name][0]._version != versions[name][1]]
        info = None
        if changed:
            self.names.update(changed)
            info = self._info([versions[name][0] for name in changed], changed,
                              "never had a gradient, but their values change: code other than the optimizer "
                              "updates them")
        return [name for name in names if name not in self.names], info

    @staticmethod
    def _info(params: Sequence[torch.Tensor], names: list[str], what: str) -> Finding:
        elements = sum(p.numel() for p in params)
        return Finding(
            Kind.OUTSIDE_TRAINING, Severity.INFO,
            f"{len(names)} parameter(s) with requires_grad=True ({elements:,} elements) {what}, so gradients do "
            f"not train them: {quoted(names)}. Expected for an averaged copy of the model or a teacher under "
            "torch.no_grad(); requires_grad_(False) says so.",
            {"parameters": names[:NAMES_IN_DETAILS], "count": len(names), "elements": elements})


def static_frozen_verdicts(frozen: dict[FrozenCause, list[str]]) -> list[Verdict]:
    """One ``frozen_param`` verdict per cause known before any step (repeated on every check step)."""
    return [Verdict(Finding(
        Kind.FROZEN_PARAM, Severity.WARNING,
        f"{len(names)} {'' if cause is FrozenCause.REQUIRES_GRAD_FALSE else 'trainable '}parameter(s) {quoted(names)} "
        f"{STATIC_ADVICE[cause]}",
        {"parameters": names[:NAMES_IN_DETAILS], "count": len(names), "cause": cause.value}), names, cause.value)
        for cause, names in frozen.items()]


def holds_copies(held: Sequence[torch.Tensor], trainable: Sequence[torch.Tensor]) -> bool:
    """Whether the tensors an optimizer holds (none of them the module's) are copies of its trainable parameters,
    each of the shape and dtype of a distinct one (a ``deepcopy``). Flattened shards have other shapes and master
    weights another dtype, so those optimizers stay skipped; no tensor is read::

        >>> weight = torch.nn.Parameter(torch.ones(3, 2))
        >>> holds_copies([torch.nn.Parameter(torch.zeros(3, 2))], [weight])
        True
        >>> holds_copies([torch.nn.Parameter(torch.zeros(6))], [weight]), holds_copies([], [weight])
        (False, False)
        >>> holds_copies([torch.nn.Parameter(torch.zeros(3, 2, dtype=torch.float64))], [weight])
        False
    """
    if not held:
        return False
    available = Counter((tuple(p.shape), p.dtype) for p in trainable)
    wanted = Counter((tuple(p.shape), p.dtype) for p in held)
    return all(available[key] >= count for key, count in wanted.items())


NOISE_FRACTION = 64 * torch.finfo(torch.float32).eps
"""Below this fraction of the global gradient norm a parameter's gradient is rounding noise (about 7.6e-6)."""


def judge_not_updated(step: int, names: Sequence[str], deltas: torch.Tensor, gradients: torch.Tensor,
                      had_grad: Sequence[bool], lr_zero_now: Sequence[bool], already_frozen: Collection[str],
                      positions: Positions, line_search: bool = False,
                      weights: torch.Tensor | None = None) -> Verdict | None:
    """``frozen_param`` (``no_update``): a parameter with a finite non-zero gradient that the optimizer step left
    exactly unchanged. Not flagged: a learning rate of 0 now, or 0 in effect (``lr_zero_now``:
    ``stalled.resting_slots``), parameters already frozen, a gradient under :data:`NOISE_FRACTION` of the global norm
    (contributions that cancel), a step where nothing moved under a ``line_search`` optimizer (L-BFGS declines
    steps), a step at the weights' precision (the tail of a decay to 0).
    """
    moved = deltas != 0
    if bool(moved.any()):
        if weights is not None and float(torch.linalg.vector_norm(deltas[moved])) \
                < NOISE_FRACTION * float(torch.linalg.vector_norm(weights[moved])):
            return None
    elif line_search:
        return None
    significant = gradients > NOISE_FRACTION * torch.linalg.vector_norm(gradients[torch.isfinite(gradients)])
    unchanged = (~moved & significant & torch.isfinite(gradients)).nonzero().flatten().tolist()
    not_updated = [names[i] for i in unchanged if had_grad[i] and names[i] not in already_frozen
                   and not (lr_zero_now and lr_zero_now[i])]
    if not not_updated:
        return None
    ordered = input_to_output(not_updated, positions)
    return Verdict(Finding(
        Kind.FROZEN_PARAM, Severity.WARNING,
        f"{len(not_updated)} trainable parameter(s) had a non-zero gradient but the optimizer step at step "
        f"{step} left them exactly unchanged: {quoted(ordered)}. Look for a learning rate of 0 or "
        "too small for the weights' precision (bf16/fp16 weights), a param group of an optimizer that is "
        "never stepped, or code that restores the weights.",
        {"parameters": ordered[:NAMES_IN_DETAILS], "count": len(not_updated),
         "cause": FrozenCause.NO_UPDATE.value}), not_updated, FrozenCause.NO_UPDATE.value)
