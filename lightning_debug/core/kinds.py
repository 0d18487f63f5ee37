"""The vocabulary of findings: kinds, severities, and the one table of what to do about each, which events.jsonl,
the report, the console and TensorBoard all read, so a finding reads the same everywhere.

    >>> Kind.NONFINITE_LOSS == "nonfinite_loss", Severity.ERROR.at_least(Severity.WARNING)
    (True, True)
    >>> sorted([Severity.INFO, Severity.CRITICAL, Severity.WARNING])
    [<Severity.CRITICAL: 'critical'>, <Severity.WARNING: 'warning'>, <Severity.INFO: 'info'>]
"""

from __future__ import annotations

import textwrap
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

from lightning_debug.config import Area
from lightning_debug.core.error_categories import ERROR_ADVICE, ErrorCategory
from lightning_debug.core.strenum import StrEnum


class Severity(StrEnum):
    """How bad a finding is; sorting puts the most severe first."""

    CRITICAL = "critical"
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return list(Severity).index(self)

    def at_least(self, other: "Severity") -> bool:
        return self.rank <= other.rank

    def __lt__(self, other: object) -> bool:  # type: ignore[override]
        return isinstance(other, Severity) and self.rank < other.rank

    @classmethod
    def parse(cls, value: Any) -> "Severity":
        """A severity from a file someone else wrote; anything unknown counts as info."""
        try:
            return cls(str(value).lower())
        except ValueError:
            return cls.INFO


def severity_rank(value: Any) -> int:
    """The sort rank of a severity given as an enum or a string (unknown strings sort last)."""
    try:
        return Severity(str(value)).rank
    except ValueError:
        return len(Severity)


class Kind(StrEnum):
    """Every kind of finding the checks write (the ``kind`` of an event)."""

    NONFINITE_LOSS = "nonfinite_loss"
    NONFINITE_GRAD = "nonfinite_grad"
    NONFINITE_PARAM = "nonfinite_param"
    NONFINITE_ACTIVATION = "nonfinite_activation"
    NONFINITE_BUFFER = "nonfinite_buffer"
    AMP_OVERFLOW_SKIPPED = "amp_overflow_skipped"
    EXPLODING_GRAD = "exploding_grad"
    VANISHING_GRAD = "vanishing_grad"
    MISSING_GRAD = "missing_grad"
    FROZEN_PARAM = "frozen_param"
    REQUIRES_GRAD_FALSE = "requires_grad_false"
    OUTSIDE_TRAINING = "outside_training"
    MEMORY_GROWTH = "memory_growth"
    MEMORY_HIGH = "memory_high"
    OOM = "oom"
    SLOW_STEP = "slow_step"
    DATALOADER_BOTTLENECK = "dataloader_bottleneck"
    STRAGGLER_RANK = "straggler_rank"
    HOST_SYNC = "host_sync"
    PROFILER_TRACE = "profiler_trace"
    NONFINITE_INPUT = "nonfinite_input"
    DEAD_ACTIVATION = "dead_activation"
    SATURATED_ACTIVATION = "saturated_activation"
    EVAL_MODE_IN_TRAINING = "eval_mode_in_training"
    TRAIN_MODE_IN_EVAL = "train_mode_in_eval"
    GRAD_NOT_ZEROED = "grad_not_zeroed"
    EXCEPTION = "exception"
    LOSS_SPIKE = "loss_spike"
    LOSS_OUTLIER = "loss_outlier"
    LOSS_DIVERGENCE = "loss_divergence"
    UPDATE_RATIO_HIGH = "update_ratio_high"
    INTERMITTENT_GRAD = "intermittent_grad"
    WEIGHT_DECAY_ON_NORM = "weight_decay_on_norm"
    LEARNING_STALLED = "learning_stalled"
    REPEATED_BATCH = "repeated_batch"
    REPLICAS_DIVERGED = "replicas_diverged"
    SINGLE_CLASS_BATCHES = "single_class_batches"
    SYMMETRIC_UNITS = "symmetric_units"
    BATCH_MIXING = "batch_mixing"
    STEPS_NOT_COUNTED = "steps_not_counted"
    SAME_BATCH_ON_RANKS = "same_batch_on_ranks"


class AtEnd(StrEnum):
    """What a suspicion still held when the run ends becomes."""

    DISMISS = "dismiss"
    REPORT = "report"
    IF_FOLLOWED = "if_followed"
    """Reported when at least one reading came after it and every one confirmed it; dismissed otherwise."""
    ELSE_KIND = "else_kind"


class Until(StrEnum):
    """A condition that ends a hold, for a suspicion that lasts as long as it is suspected again."""

    BACK_UNDER = "back_under"
    """Held while suspected again; ended by the first observation that is not: confirmed when its reading is back
    under the bound (a burst that ended), else reported as ``else_kind`` (the level moved)."""


@dataclass(frozen=True)
class Confirm:
    """A kind's confirmation policy, applied by :class:`lightning_debug.core.verdicts.VerdictEngine`; its fields are
    in docs/architecture.md ("Suspect, hold, confirm"). ``max_held``: held per scope at most (the oldest is then
    decided as at the end). A non-finite value is never held back.
        >>> policy = Confirm(patience=3, variants={"exactly_zero": 8})
        >>> policy.needed(""), policy.needed("exactly_zero"), policy.holds, Confirm().holds
        (3, 8, True, False)
    """

    patience: int | None = None
    variants: dict[str, int] = field(default_factory=dict)
    follow_up: int = 0
    else_kind: "Kind | None" = None
    at_end: AtEnd = AtEnd.DISMISS
    backdate: bool = True
    max_held: int = 64
    until: Until | None = None

    def needed(self, variant: str = "") -> int | None:
        """Observations in a row that confirm a suspicion of ``variant`` (None: persisting does not)."""
        return self.variants.get(variant, self.patience)

    @property
    def holds(self) -> bool:
        """Whether a suspicion of this kind waits before it is reported."""
        return bool(self.follow_up) or self.until is not None or any(needed > 1 for needed in (self.patience or 1, *self.variants.values()))

    def describe(self) -> str:
        """The policy in words, for the docs' table of policies.

            >>> Confirm(follow_up=2, at_end=AtEnd.IF_FOLLOWED).describe()
            'the 2 readings after it above its bound (or not finite); at the end: reported if every reading after it confirmed it'
            >>> Confirm(until=Until.BACK_UNDER, else_kind=Kind.SLOW_STEP, at_end=AtEnd.REPORT).describe()
            'as long as it lasts, then a reading back under its bound; unconfirmed: `slow_step`; at the end: reported'
        """
        parts = []
        if self.patience is not None and self.patience > 1:
            parts.append(f"{self.patience} observations in a row")
        parts += [f"{f'{needed} in a row' if needed > 1 else 'at once'} when {variant.replace('_', ' ')}"
                  for variant, needed in self.variants.items()]
        if self.follow_up:
            readings = f"the {self.follow_up} readings after it" if self.follow_up > 1 else "the next reading"
            parts.append(f"{readings} above its bound (or not finite)")
        if self.until is Until.BACK_UNDER:
            parts.append("as long as it lasts, then a reading back under its bound")
        if not parts:
            return "at once"
        unconfirmed = f"; unconfirmed: `{self.else_kind.value}`" if self.else_kind is not None else ""
        return " or ".join(parts) + unconfirmed + f"; at the end: {_AT_END_WORDS[self.at_end]}"


_AT_END_WORDS = {AtEnd.DISMISS: "dismissed", AtEnd.REPORT: "reported",
                 AtEnd.IF_FOLLOWED: "reported if every reading after it confirmed it",
                 AtEnd.ELSE_KIND: "reported as the unconfirmed kind"}

_NONFINITE_LOSS_CAUSES = ("log or division of a value that reaches 0 (add an epsilon or clamp), sqrt of a negative, "
                          "a learning rate too high, NaN in the input batch")


@dataclass(frozen=True)
class KindSpec:
    """Everything said about one kind of finding: the ``area`` whose monitor writes it, its ``severity`` (None: it
    depends on what was found), ``summary`` (one line for the callback's docstring and ``--help``), ``advice``
    (report.md), ``hint`` (console), ``causal_rank`` in :data:`CAUSAL_ORDER`, ``one_off`` (opens no episode: not among
    its monitor's ``kinds``) and ``confirm``, its policy: making a rule stricter or looser is this field.

        >>> spec = KIND_SPECS[Kind.EXPLODING_GRAD]
        >>> spec.area, spec.severity, spec.confirm.follow_up
        (<Area.GRADIENTS: 'gradients'>, <Severity.WARNING: 'warning'>, 2)
    """

    area: Area
    severity: Severity | None = None
    summary: str = ""
    advice: str | None = None
    hint: str | None = None
    common_causes: str | None = None
    causal_rank: int | None = None
    confirm: Confirm = Confirm()
    one_off: bool = False


KIND_SPECS: dict[Kind, KindSpec] = {
    Kind.NONFINITE_LOSS: KindSpec(
        Area.ANOMALY, Severity.ERROR,
        summary="the loss is NaN/Inf at a check step (with ``level=ADVANCED``, the replay names the operation "
                "and its source line)",
        advice=f"Find the operation that produces it: a {_NONFINITE_LOSS_CAUSES}. "
               "`level: ADVANCED` replays the step to name the operation and its source line; "
               "`anomaly_detection_mode: skip` keeps training past rare bad batches.",
        hint="clamp or add an epsilon before log/div/sqrt; level=ADVANCED names the operation",
        common_causes=_NONFINITE_LOSS_CAUSES,
        causal_rank=2),
    Kind.NONFINITE_GRAD: KindSpec(
        Area.ANOMALY, Severity.ERROR,
        summary="a finite loss with NaN/Inf gradients: the backward pass is at fault; names the parameters",
        advice="With a finite loss the backward pass is at fault (sqrt/pow/norm at 0, division by a tiny "
               "value, an overflow): clamp inputs of those operations, clip gradients "
               "(`Trainer(gradient_clip_val=1.0)`), lower the learning rate.",
        hint="the backward is at fault: epsilon inside sqrt/pow/norm, clip gradients",
        causal_rank=3),
    Kind.NONFINITE_PARAM: KindSpec(
        Area.ANOMALY, Severity.CRITICAL,
        summary="the weights themselves hold NaN/Inf",
        advice="The weights are already broken; skipping steps cannot repair them. Restart from the last "
               "good checkpoint with a lower learning rate, gradient clipping, and check weight decay and "
               "fp16 loss scaling.",
        hint="the weights are broken: restart from a checkpoint with a lower learning rate",
        causal_rank=4),
    Kind.NONFINITE_ACTIVATION: KindSpec(
        Area.ANOMALY, Severity.ERROR,
        summary="the first module whose output is not finite, found by the replay of the step",
        advice="A layer's output is not finite: look at the named module's inputs and its "
               "normalisation; clamp or add epsilons where it divides, logs or exponentiates.",
        hint="look at that module's inputs; clamp or add epsilons",
        causal_rank=1),
    Kind.NONFINITE_BUFFER: KindSpec(
        Area.ANOMALY, Severity.CRITICAL,
        summary="BatchNorm running statistics or other module buffers hold NaN/Inf",
        advice="Module buffers (BatchNorm running statistics) hold NaN/Inf: evaluation uses them, so "
               "every validation loss is NaN. Restart from a checkpoint or call "
               "`module.reset_running_stats()`; with `anomaly_detection_mode='skip'` check every step "
               "(`anomaly_check_frequency=1`) so that a NaN batch's forward is undone.",
        hint="restart from a checkpoint or reset_running_stats(); check every step with skip",
        causal_rank=4),
    Kind.AMP_OVERFLOW_SKIPPED: KindSpec(
        Area.ANOMALY, Severity.INFO,
        summary="with fp16 and a GradScaler, non-finite gradients with a finite loss: the scaler skipped the "
                "step",
        advice="Nothing to do unless it happens on most steps; then values overflow fp16: scale "
               "inputs down or train in bf16.",
        hint="expected with fp16 unless it happens on most steps"),
    Kind.EXPLODING_GRAD: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="the global gradient norm jumps over 10x the median of the recent check steps, grows 1000x, "
                "turns Inf/NaN, or exceeds ``gradient_explosion_threshold``; names the largest and suggests a "
                "``gradient_clip_val`` from the run's healthy norms",
        advice="Clip gradients (`Trainer(gradient_clip_val=...)`, see the suggestion under Gradient "
               "health), lower the learning rate, use a learning-rate warm-up, check initialisation and "
               "normalisation.",
        hint="clip gradients (Trainer(gradient_clip_val=...)), lower the learning rate",
        confirm=Confirm(follow_up=2, at_end=AtEnd.IF_FOLLOWED, max_held=3)),
    Kind.VANISHING_GRAD: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="layers whose gradient norm stays below ``gradient_vanishing_threshold``, from the input side to "
                "the output side",
        advice="Gradients do not reach these layers: prefer ReLU/GELU to saturating sigmoid/tanh, use "
               "xavier/kaiming initialisation, normalisation layers or residual connections; check that "
               "the loss is not detached or scaled to nothing.",
        hint="ReLU/GELU, a better initialisation, normalisation or residual connections",
        confirm=Confirm(patience=3, variants={"exactly_zero": 8, "flat_loss": 2, "fade": 2})),
    Kind.MISSING_GRAD: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="trainable parameters that never receive a gradient (a layer not used in forward, a detached "
                "branch)",
        advice="A trainable parameter never got a gradient on any step observed (a confirmation window, "
               "so experts and dropped layers that skip some steps are not it): a layer defined but not used "
               "in forward, a branch cut by `.detach()`/`.item()`/`torch.no_grad()`, or an output left out of "
               "the loss. Use it, remove it, or set `requires_grad=False` (under DDP it also needs "
               "`find_unused_parameters`).",
        hint="use the layer, remove it, or requires_grad_(False)",
        confirm=Confirm(patience=64, variants={"no_graph": 8}, at_end=AtEnd.REPORT)),
    Kind.FROZEN_PARAM: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="trainable parameters the optimizer cannot move (in no param group, base lr 0), or, with "
                "``log_weights`` or level ADVANCED, left unchanged by the optimizer step",
        advice="The optimizer cannot move these parameters: add them to the optimizer's param groups, check "
               "for a learning rate of 0 or a `requires_grad=False` left over, or, if they are frozen on purpose, "
               "set `requires_grad=False` and leave them out of the optimizer.",
        hint="add them to the optimizer, or check for a learning rate of 0"),
    Kind.REQUIRES_GRAD_FALSE: KindSpec(
        Area.GRADIENTS, Severity.INFO,
        summary="parameters frozen on purpose, counted at fit start",
        one_off=True),
    Kind.OUTSIDE_TRAINING: KindSpec(
        Area.GRADIENTS, Severity.INFO,
        summary="parameters gradients do not train on purpose: an EMA copy, a teacher under ``no_grad``",
        advice="Parameters with `requires_grad=True` that no optimizer holds and that get no gradient: not part "
               "of this run's training (an averaged copy of the model, a teacher or reference model under "
               "`torch.no_grad()`). `requires_grad_(False)` on them says so.",
        hint="requires_grad_(False) on them says they are not trained"),
    Kind.MEMORY_GROWTH: KindSpec(
        Area.MEMORY, Severity.WARNING,
        summary="memory rises steadily over the last readings (a robust trend beyond allocator and warm-up "
                "noise), explained from a census of live tensors",
        advice="Memory grows step after step: a tensor kept across steps together with its graph "
               "(`losses.append(loss)` instead of `loss.item()` or `loss.detach()`), a cache or list that "
               "only grows (in the training process, or in the Dataset of each DataLoader worker), or gradients "
               "accumulated without `zero_grad()`.",
        hint="a tensor kept with its graph (keep loss.item()), or a cache that only grows?",
        confirm=Confirm(patience=2, backdate=False)),
    Kind.MEMORY_HIGH: KindSpec(
        Area.MEMORY, Severity.WARNING,
        summary="CUDA reserved memory, or the machine's used memory, above ``memory_high_fraction``",
        advice="Close to the limit: reduce the batch size, accumulate gradients, use mixed precision or "
               "activation checkpointing, and free tensors you keep between steps.",
        hint="smaller batch, gradient accumulation, mixed precision"),
    Kind.OOM: KindSpec(
        Area.MEMORY, Severity.CRITICAL,
        summary="an out-of-memory error: ``oom_step<N>.md`` says what held the memory and the fixes, then the "
                "error propagates unchanged",
        one_off=True,
        advice="Out of memory: see the post-mortem for what held the memory; reduce the batch size, accumulate "
               "gradients, use mixed precision or activation checkpointing.",
        hint="see the post-mortem; smaller batch, mixed precision, checkpointing"),
    Kind.SLOW_STEP: KindSpec(
        Area.PERFORMANCE, Severity.WARNING,
        summary="steps ``slow_step_factor`` times slower than the recent median, a robust outlier that recurs, "
                "with the phase that was slow",
        advice="See which phase was slow (data, forward, backward, optimizer): a checkpoint save, garbage "
               "collection, validation, or a host sync; `profile_steps` records a torch.profiler trace.",
        hint="see the slow phase; profile_steps records a torch.profiler trace",
        confirm=Confirm(until=Until.BACK_UNDER, else_kind=Kind.SLOW_STEP, at_end=AtEnd.REPORT)),
    Kind.DATALOADER_BOTTLENECK: KindSpec(
        Area.PERFORMANCE, Severity.WARNING,
        summary="a sustained data wait above ``dataloader_bottleneck_share`` of the step time, with the loader's "
                "settings and what to change",
        advice="The model waits for data: raise `num_workers`, set `pin_memory=True` on GPU and "
               "`persistent_workers=True`, and move heavy preprocessing out of `__getitem__`.",
        hint="raise num_workers; pin_memory and persistent_workers"),
    Kind.STRAGGLER_RANK: KindSpec(
        Area.PERFORMANCE, Severity.WARNING,
        summary="under DDP, the rank that is consistently slowest before the gradient all-reduce",
        advice="One rank is consistently slower: check its data shard, its device (clocks, temperature) "
               "and other jobs on that node.",
        hint="check that rank's data shard, device and node"),
    Kind.HOST_SYNC: KindSpec(
        Area.PERFORMANCE, Severity.WARNING,
        summary="at ``level=EXPERT`` on CUDA, the lines that forced host-device synchronizations during a short "
                "sync-debug window",
        one_off=True,
        advice="Keep values on the device inside the step: log tensors instead of `.item()`, and do not print "
               "or branch on tensor values.",
        hint="keep values on the device inside the step (no .item())"),
    Kind.PROFILER_TRACE: KindSpec(
        Area.PERFORMANCE, Severity.INFO,
        summary="the ``torch.profiler`` trace of ``profile_steps`` was written",
        one_off=True,
        advice="Open the trace in https://ui.perfetto.dev, chrome://tracing or TensorBoard's profiler "
               "plugin; the top operators are listed below.",
        hint="open it in https://ui.perfetto.dev"),
    Kind.NONFINITE_INPUT: KindSpec(
        Area.ANOMALY, Severity.ERROR,
        summary="the batch holds NaN/Inf before the model sees it, with the sample indices",
        advice="The data holds NaN/Inf before the model sees it: find the samples named in the event "
               "(a missing value, a division by a zero std in normalisation, a corrupt file), clean or drop "
               "them, or guard with torch.nan_to_num in the dataset.",
        hint="clean or drop those samples; check the normalisation (a zero std)",
        causal_rank=0),
    Kind.DEAD_ACTIVATION: KindSpec(
        Area.ACTIVATIONS, Severity.WARNING,
        summary="with ``log_activations``, a ReLU whose outputs are almost all zero",
        advice="The layer outputs (almost) only zeros, so no gradient flows through it: usually a large "
               "negative bias or a too-large step pushed every pre-activation below zero. Use Kaiming "
               "initialisation, normalisation before the activation, a lower learning rate (or a warm-up), "
               "or LeakyReLU/GELU.",
        hint="lower the learning rate, check the bias init, or use LeakyReLU/GELU"),
    Kind.SATURATED_ACTIVATION: KindSpec(
        Area.ACTIVATIONS, Severity.WARNING,
        summary="with ``log_activations``, a sigmoid/tanh pinned at its limits",
        advice="The sigmoid/tanh outputs sit at their limits, where the derivative is ~0 and gradients "
               "vanish: normalise the layer's inputs (BatchNorm/LayerNorm), use Xavier initialisation, "
               "lower the learning rate, or use ReLU/GELU in hidden layers.",
        hint="normalise the inputs, a better initialisation, or ReLU/GELU",
        confirm=Confirm(patience=2)),
    Kind.BATCH_MIXING: KindSpec(
        Area.ACTIVATIONS, Severity.WARNING,
        summary="the model's output for one sample depends, in order, on the other samples of its batch (an LSTM "
                "with batch_first=False fed batch-first data, a view where a transpose was meant), read once by "
                "backpropagating from one output row to the inputs",
        one_off=True,
        advice="The model's output for one sample depends on other samples of the batch, in their order, so it "
               "learns from a mixture of records and its predictions change with what else is in the batch. "
               "Recurrent layers (`nn.LSTM`, `nn.GRU`, `nn.RNN`) and `nn.MultiheadAttention` take (time, batch, "
               "features) unless built with `batch_first=True`; a `view`/`reshape` does not move dimensions, a "
               "`transpose`/`permute` does (`x.view(T, B, F)` of a (B, T, F) tensor regroups samples). Check the "
               "shapes in `forward` with one sample changed: only its own output should change.",
        hint="batch_first=True on recurrent layers; permute/transpose, not view, to move the batch dimension"),
    Kind.EVAL_MODE_IN_TRAINING: KindSpec(
        Area.LOOP, Severity.WARNING,
        summary="modules left in eval mode during training (dropout off, frozen BatchNorm statistics)",
        advice="Dropout and BatchNorm of these modules behave as in inference during training "
               "(no dropout, frozen running statistics). Call `model.train()` after evaluating, and "
               "do not call `.eval()` on trainable submodules; if frozen BatchNorm statistics are "
               "intended, freeze their parameters too (`requires_grad_(False)`).",
        hint="call .train() on it, unless it is frozen on purpose"),
    Kind.TRAIN_MODE_IN_EVAL: KindSpec(
        Area.LOOP, Severity.WARNING,
        summary="dropout that still drops, or BatchNorm that still updates its running statistics, while the model "
                "is evaluated (``F.dropout`` with its default ``training=True``, a submodule put back in train mode)",
        one_off=True,
        advice="Every evaluation runs a random sub-network, so validation metrics are noisy and lower than the "
               "model's: pass `training=self.training` to functional dropout (`F.dropout(x, p, "
               "training=self.training)`, its default is True) or use an `nn.Dropout` module; do not call `.train()` "
               "inside `forward`. Monte Carlo dropout on purpose: ignore this.",
        hint="pass training=self.training to F.dropout"),
    Kind.GRAD_NOT_ZEROED: KindSpec(
        Area.LOOP, Severity.ERROR,
        summary="gradients accumulate across optimizer steps: ``zero_grad()`` is not called",
        advice="Gradients accumulate across optimizer steps, so each update uses the sum of all past "
               "gradients: call `optimizer.zero_grad()` after `optimizer.step()` (or before the backward).",
        hint="call optimizer.zero_grad() once per optimizer step"),
    Kind.EXCEPTION: KindSpec(
        Area.ERRORS, Severity.ERROR,
        summary="the training step raised: report.md explains it (module, shapes, devices) and the error "
                "propagates unchanged",
        one_off=True,
        advice="The step raised; report.md's \"Runtime error\" section says what the plugin could name (the "
               "module, the shapes, devices or parameters involved) and the fix for that kind of error.",
        hint="see the explanation in report.md; your exception is raised unchanged"),
    Kind.LOSS_SPIKE: KindSpec(
        Area.ANOMALY, Severity.WARNING,
        summary="the loss jumps 10x above its recent level and its start and stays high at the next check",
        advice="The loss jumped far above its recent level and stayed high at the next check (or became "
               "NaN/Inf), usually the first sign of a learning rate that is too high: lower it (often 10x), add a "
               "learning-rate warm-up, clip gradients (`Trainer(gradient_clip_val=1.0)`).",
        hint="lower the learning rate, add a warm-up, clip gradients",
        confirm=Confirm(follow_up=1, else_kind=Kind.LOSS_OUTLIER, at_end=AtEnd.ELSE_KIND)),
    Kind.LOSS_OUTLIER: KindSpec(
        Area.ANOMALY, Severity.INFO,
        summary="one check step's loss far above its level, the next one back near it: one bad batch",
        advice="One check step's loss was far above its recent level and the next one was back near it: one batch "
               "far from the others (an outlier target under a squared error, a mislabelled example, single-example "
               "batches of heavy-tailed data), not a blow-up. Look at that batch if it recurs; a robust loss "
               "(`smooth_l1_loss`) or larger batches damp it.",
        hint="one batch far from the others: look at it if it recurs"),
    Kind.LOSS_DIVERGENCE: KindSpec(
        Area.ANOMALY, Severity.WARNING,
        summary="the loss rises on most of the last checked steps and at least doubled (or climbs, settles far "
                "above its start, oscillates, or falls below 0 without bound)",
        advice="The loss rises step after step instead of falling: the optimizer overshoots. Lower the "
               "learning rate, add a warm-up, clip gradients; check the sign of the loss and that "
               "`zero_grad()` runs every step.",
        hint="lower the learning rate, add a warm-up, clip gradients",
        confirm=Confirm(patience=4, backdate=False)),
    Kind.UPDATE_RATIO_HIGH: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="with ``log_weights`` or level ADVANCED, a layer whose optimizer step moved its weights by more "
                "than their own norm",
        advice="One optimizer step changes these weights by more than their own size (a healthy ratio "
               "||update||/||weight|| is around 1e-3): the learning rate is far too high for them. Lower "
               "it, add a warm-up, clip gradients.",
        hint="the learning rate is far too high: lower it, add a warm-up",
        confirm=Confirm(patience=2, follow_up=1)),
    Kind.INTERMITTENT_GRAD: KindSpec(
        Area.GRADIENTS, Severity.INFO,
        summary="parameters with a gradient on some steps only: experts, LayerDrop",
        advice="Parameters that had gradients on earlier steps got none on this one: conditional "
               "computation (experts a router did not pick, layers LayerDrop skipped, branches taken "
               "on some inputs only). Expected for such models; under DDP they need "
               "`find_unused_parameters`. A parameter that never gets a gradient is `missing_grad`.",
        hint="conditional computation (routing, LayerDrop): expected; DDP needs find_unused_parameters"),
    Kind.WEIGHT_DECAY_ON_NORM: KindSpec(
        Area.GRADIENTS, Severity.INFO,
        summary="weight decay on biases, normalization weights or embeddings, at fit start",
        advice="Weight decay pulls these biases, normalization weights or embedding rows toward 0, which "
               "shrinks the scale a LayerNorm/BatchNorm restores and erodes rare tokens' embeddings between "
               "their updates. Give them a param group of their own with `weight_decay=0.0`: "
               "`[{'params': decayed, 'weight_decay': 0.01}, {'params': biases_norms_embeddings, "
               "'weight_decay': 0.0}]`. If you decay them on purpose, ignore this.",
        hint="put biases, norm weights and embeddings in a param group with weight_decay=0"),
    Kind.LEARNING_STALLED: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="every param group's learning rate is 0 (or a millionth of its base) far from the end of the run, "
                "or the weights barely move "
                "and the loss stays where it started, or the model's output is probabilities that cross_entropy "
                "softmaxes again (the loss sits at its floor), or the model's answers are no better than one "
                "answer for every sample (log C for balanced classes: labels that do not belong to their inputs), "
                "or the loss normalises the "
                "output over the batch (a softmax over dim 0), or fits every output to the targets' mean (an (N,) "
                "target broadcast against an (N, 1) output), or applies a sigmoid again to an output of "
                "probabilities (an nn.Sigmoid before BCEWithLogitsLoss), or training batches run and the optimizer "
                "never steps (the weights stay bit for bit the same)",
        advice="The weights no longer change far from the end of the run: every param group's learning rate is 0 "
               "(a scheduler that reaches 0 early: a LambdaLR factor, a step schedule with gamma 0, a decay written "
               "for fewer steps, a step decay meant per epoch and registered per step, which is 0 in effect at a "
               "millionth of its base; or code that sets it to 0: print scheduler.get_last_lr() or the param "
               "groups' lr around that step), or it is so small that the weights move by ~1e-7 of their size per step and "
               "the loss stays where it started (raise it, often 100x-1000x). When the model's output is "
               "probabilities (a softmax as its last layer) and the loss is cross_entropy, the loss is stuck at "
               "log(1 + (C-1)/e): drop the softmax (cross_entropy applies log_softmax itself) or use "
               "nll_loss(torch.log(p)). A loss that stays at log C (or, with unbalanced classes, at what one "
               "answer for every sample costs) for hundreds of steps learns nothing from its inputs: check that "
               "each label belongs to its input (a shuffle or sort applied to one of them, a misaligned join, the "
               "wrong column). A loss that starts at log N (the N rows of the batch) and stays above log(N / C) "
               "normalises the output over the batch: a log_softmax over dim 0 (use cross_entropy on the raw "
               "logits). An output whose every row is fitted to one value that changes "
               "from batch to batch learns the targets' mean: an (N,) target broadcast against an (N, 1) output "
               "(give both the same shape). An output of probabilities fed to binary_cross_entropy_with_logits "
               "cannot say no (a sigmoid of a value in [0, 1] is at least 0.5): drop the sigmoid from the model or "
               "use binary_cross_entropy. Training batches that run with no optimizer step after their backward leave "
               "the weights as they are: call optimizer.step() after the backward (under manual optimization "
               "opt.step() after self.manual_backward(loss)), and return the loss from training_step (Lightning "
               "skips the backward of a batch without one).",
        hint="the learning rate is 0 or far too small (or the output is softmaxed or sigmoided before a loss that "
             "does it again, or the "
             "labels do not match the inputs, or the optimizer never steps): check the scheduler, the lr, the model's "
             "last layer, the labels and the optimizer's step",
        confirm=Confirm(patience=3, variants={"lr_zero": 2, "probabilities_into_log_softmax": 2, "loss_at_chance": 4,
                                              "softmax_over_batch": 2, "shared_target": 2,
                                              "probabilities_into_sigmoid": 2, "optimizer_not_stepping": 1},
                        backdate=False)),
    Kind.STEPS_NOT_COUNTED: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="the weights are trained and the run's optimizer-step counter does not move: an optimizer stepped "
                "outside the framework's wrapper, or one the run was never given",
        advice="The weights change while the optimizer-step counter (Lightning's `trainer.global_step`) stays "
               "where it was: the steps bypass the wrapper that counts them (`self.optimizers(use_pl_optimizer="
               "False)`, `opt.optimizer.step()`, an optimizer from `trainer.optimizers` stepped by hand), or come from "
               "an optimizer made outside `configure_optimizers` (in `training_step`) or from weights updated by "
               "hand. Everything keyed to optimizer steps stops: `max_steps` is never reached (with `max_epochs` "
               "unset the fit never ends), checkpoints `every_n_train_steps` are never saved, step-interval "
               "schedulers never step, and this plugin's checks never run. Return the optimizer from "
               "`configure_optimizers` and step the object `self.optimizers()` returns.",
        hint="step the optimizer self.optimizers() returns (not a raw or new torch optimizer): the step counter "
             "does not move"),
    Kind.SAME_BATCH_ON_RANKS: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="(several processes) every rank of a data-parallel (DDP) run trains on the same batch: the training "
                "DataLoader is not sharded across the ranks",
        advice="Every rank reads the same batches, so the run does N times the work for one rank's data and each "
               "averaged gradient is one batch's. The training DataLoader is not sharded: give it to "
               "`accelerator.prepare()` (Accelerate), keep Lightning's distributed sampler "
               "(`use_distributed_sampler=True`, the default) or shard a sampler of your own by rank "
               "(`DistributedSampler`), and do not seed one shuffling generator alike on every rank.",
        hint="shard the training DataLoader across ranks (accelerator.prepare, DistributedSampler)",
        confirm=Confirm(patience=2)),
    Kind.REPEATED_BATCH: KindSpec(
        Area.LOOP, Severity.WARNING,
        summary="the data loader hands the model the same batch several times within an epoch (workers sharing "
                "one random seed)",
        advice="The data loader hands the model the same batch several times within an epoch: data-loader workers "
               "that share one random state (a NumPy or Python generator created in the dataset's `__init__` and "
               "copied into every worker) draw the same records, so each batch is trained on once per worker and "
               "most of the data never. Reseed each worker (`worker_init_fn=lambda i: np.random.seed("
               "torch.initial_seed() % 2**32)`), or draw with `torch`'s generator, which the DataLoader seeds per "
               "worker.",
        hint="data-loader workers share one random seed: reseed them in worker_init_fn",
        confirm=Confirm(patience=2, backdate=False)),
    Kind.SINGLE_CLASS_BATCHES: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="every row of a batch has one label, another at the next judgement: the training data sorted by "
                "label and not shuffled (read from cross_entropy's gradient of the model's output)",
        advice="Each batch holds a single class, and the class changes from batch to batch: the training data is "
               "in label order and the loader does not shuffle it (`DataLoader(..., shuffle=False)`, a sequential "
               "sampler, a dataset built class by class). The model learns one class at a time and forgets the "
               "others, so the training loss looks low while the model answers only the class it saw last. Pass "
               "`shuffle=True` to the training DataLoader (or a `RandomSampler`); with an `IterableDataset`, shuffle "
               "a buffer or the shards. Classes presented one after another on purpose (class-incremental "
               "learning) give the same finding.",
        hint="the training data is sorted by label: shuffle=True in the training DataLoader",
        confirm=Confirm(patience=2, backdate=False)),
    Kind.SYMMETRIC_UNITS: KindSpec(
        Area.GRADIENTS, Severity.WARNING,
        summary="a layer's units are copies of one another, weights and gradient alike (a constant init)",
        advice="Every unit of this layer has the same weights and gets the same gradient, so every step keeps them "
               "the same: the layer computes one feature however wide it is. It comes from an init that gives all "
               "units one value (`nn.init.constant_(layer.weight, 0.1)`, `fill_`, `ones_`, a row copied into every "
               "unit); only random values break the tie. Remove the constant init and keep PyTorch's default, or "
               "use `nn.init.kaiming_uniform_` / `xavier_uniform_`. A layer initialized to zeros on purpose (LoRA's "
               "`B`, a zero-initialized projection) is not named: its units get different gradients.",
        hint="the layer's units are identical: initialize its weights with random values, not a constant",
        confirm=Confirm(patience=2)),
    Kind.REPLICAS_DIVERGED: KindSpec(
        Area.GRADIENTS, Severity.ERROR,
        advice="Under DDP every rank must hold the same weights; these ranks now train different models, and "
               "averaging their gradients no longer means anything. DDP keeps them equal only if every rank applies "
               "the same all-reduced gradients to the same weights: look for code that runs on some ranks only "
               "(`if self.global_rank == ...`, `if trainer.is_global_zero`) and changes gradients after the "
               "backward (`clip_grad_norm_`, scaling, zeroing in `on_before_optimizer_step`) or weights outside the "
               "optimizer (re-initialising a module, loading a state dict, `.to()`/`.data =` replacing a tensor), "
               "and for a forward through the unwrapped module (`model.module(x)`), whose gradients DDP never "
               "reduces. Do such things on every rank, before wrapping, or broadcast the weights from rank 0 after.",
        hint="gradients or weights changed on some ranks only: clipping, a reload or a forward around DDP",
        summary="(several processes) the ranks of a data-parallel (DDP) run hold different copies of parameters "
                "every rank holds whole, compared from their norms on check steps (shards of FSDP2 or tensor "
                "parallelism are not replicas): clipping or a gradient edit on one rank, a reload or "
                "re-initialisation there, a forward around the DDP wrapper"),
}
"""The one table of kinds; the dicts below are views of it."""

ADVICE: dict[Kind, str] = {kind: spec.advice for kind, spec in KIND_SPECS.items() if spec.advice is not None}
HINTS: dict[Kind, str] = {kind: spec.hint for kind, spec in KIND_SPECS.items() if spec.hint is not None}
COMMON_CAUSES: dict[Kind, str] = {kind: spec.common_causes for kind, spec in KIND_SPECS.items()
                                  if spec.common_causes is not None}
CAUSAL_ORDER: dict[Kind, int] = {kind: spec.causal_rank for kind, spec in KIND_SPECS.items()
                                 if spec.causal_rank is not None}
"""Within one step a NaN flows input batch -> activation -> loss -> gradient -> parameter: the report lists
findings of the same step in this order, so the root cause comes before what follows from it."""


def kinds_of(area: Area) -> frozenset[Kind]:
    """The kinds whose episodes ``area``'s monitor closes: its rows of the table, less the one-off ones.

        >>> sorted(kind.value for kind in kinds_of(Area.MEMORY))
        ['memory_growth', 'memory_high']
    """
    return frozenset(kind for kind, spec in KIND_SPECS.items() if spec.area is area and not spec.one_off)


def kind_lines(areas: Iterable[Area], indent: int = 4, width: int = 112) -> list[str]:
    """One docstring line per kind of ``areas`` (table order): ``- ``kind`` (severity): summary``, wrapped.

        >>> print(kind_lines([Area.MEMORY], indent=0, width=200)[1])
        - ``memory_high`` (warning): CUDA reserved memory, or the machine's used memory, above ``memory_high_fraction``
    """
    wanted = set(areas)
    lines: list[str] = []
    for kind, spec in KIND_SPECS.items():
        if spec.area in wanted:
            severity = f" ({spec.severity.value})" if spec.severity is not None else ""
            lines += textwrap.wrap(f"- ``{kind.value}``{severity}: {spec.summary}", width, initial_indent=" " * indent,
                                   subsequent_indent=" " * (indent + 2), break_on_hyphens=False)
    return lines


KINDS_HEADING = "What it reports, one line per kind (from the table of kinds, ``lightning_debug.core.kinds``):"


def with_kinds(doc: str | None, areas: Iterable[Area]) -> str:
    """``doc`` (a callback's docstring) with the list of the kinds of ``areas``, before its ``Args:`` section, else
    its ``Example::``: a new kind appears in ``help()`` and ``--help`` without an edit of the callback.

        >>> with_kinds("Summary.\\n\\n    Example::\\n        1 + 1\\n", [Area.ERRORS]).splitlines()[2:4]
        ['    What it reports, one line per kind (from the table of kinds, ``lightning_debug.core.kinds``):', '']
    """
    doc = (doc or "").rstrip() + "\n"
    block = "\n    " + KINDS_HEADING + "\n\n" + "\n".join(kind_lines(areas)) + "\n"
    for marker in ("\n    Args:\n", "\n    Example::"):
        if marker in doc:
            at = doc.index(marker)
            return doc[:at] + block + doc[at:]
    return doc + block


def _known(kind: Any) -> Kind | None:
    """``kind`` given as an enum or a string; None for kinds this version does not know."""
    try:
        return Kind(str(kind))
    except ValueError:
        return None


def causal_rank(kind: Any) -> int:
    """Where ``kind`` sits in :data:`CAUSAL_ORDER` (kinds outside the chain come after it)."""
    return CAUSAL_ORDER.get(_known(kind), len(CAUSAL_ORDER))  # type: ignore[arg-type]


def hint_for(kind: Any, width: int = 90) -> str | None:
    """A short hint for a console line: :data:`HINTS`, else the advice cut to ``width`` at a word.

        >>> hint_for("exploding_grad")
        'clip gradients (Trainer(gradient_clip_val=...)), lower the learning rate'
    """
    known = _known(kind)
    text = HINTS.get(known) or ADVICE.get(known)  # type: ignore[arg-type]
    if text is None or len(text) <= width:
        return text
    return text[:width - 3].rsplit(" ", 1)[0].rstrip(",;:") + "..."


def advice_for(kind: Any) -> str | None:
    """The advice of a kind given as an enum or a string (None for kinds this version does not know)."""
    return ADVICE.get(_known(kind))  # type: ignore[arg-type]


def advice_for_cause(where: str, operation: str | None) -> str:
    """The seed checklist's fix for what a replay found (``where`` and ``operation`` of a cause)."""
    operation = (operation or "").lower()
    if where == "inputs":
        return "Clean or filter the data (torch.nan_to_num, drop bad samples) and check the normalization. "
    if where == "backward":
        return ("A backward-only NaN: sqrt/pow/norm/atan2 at exactly 0 has an infinite derivative; add an epsilon "
                "inside (torch.sqrt(x + 1e-12)) or clamp the argument. ")
    if any(name in operation for name in ("log", "div", "reciprocal", "rsqrt")):
        return "Add an epsilon or clamp the argument (torch.log(x.clamp_min(1e-12)), x / (y + 1e-8)). "
    if any(name in operation for name in ("sqrt", "pow")):
        return "The argument is negative or zero: clamp it (x.clamp_min(0) + 1e-12) or use torch.abs. "
    if any(name in operation for name in ("exp", "softmax", "matmul", "linear", "mm", "bmm", "conv")):
        return ("An overflow: values grew too large (max |x| above); lower the learning rate, clip gradients, "
                "normalize inputs or use a numerically stable form (log_softmax, logsumexp). ")
    return ""


def policy_rows() -> list[str]:
    """docs/architecture.md's table of confirmation policies: one row per kind whose suspicions are held.

        >>> policy_rows()[0].startswith("| `")
        True
    """
    return [f"| `{kind.value}` | {spec.confirm.describe()} |" for kind, spec in KIND_SPECS.items() if spec.confirm.holds]

