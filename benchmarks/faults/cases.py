"""The registry of cases: a builder per problem class, expanded over a compact table of parameters.

Each :class:`Case` is a buggy :class:`~benchmarks.faults.programs.Program`, its fixed twin (the same program
with the bug corrected, nothing else changed unless the fix needs it) and the ground truth: the kinds of
lightning-debug's vocabulary that name the problem, the window of optimizer steps where the first finding
must start, and, where the bug sits in one place, a regular expression the finding's message or details
must match (a module, a parameter, the operation).

Classes: AutoTrainer's eight (ICSE 2021: vanishing and exploding gradients, dying ReLU, oscillating loss,
slow convergence, improper data, improper activation, loss issue; its monitor's thresholds: gradient
ratio first/last layer < 1e-3 and first-layer norm < 1e-4 vanishing, ratio > 70 exploding, >= 70% zero
gradients dying ReLU, accuracy swings >= 0.03 on 20% of epochs oscillating, < 1% accuracy gain slow),
the numerical bugs of DeepLocalize/DeepDiagnosis (log(0), division by 0, sqrt of a negative, exp
overflow, a learning rate far too high, NaN in the data) and TrainCheck's silent errors that run on CPU.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Iterator

from benchmarks.faults.programs import STEPS, Program

NONFINITE = ("nonfinite_loss", "nonfinite_grad", "nonfinite_param", "nonfinite_activation", "nonfinite_input")
BLOW_UP = ("exploding_grad", "loss_divergence", "loss_spike", "update_ratio_high") + NONFINITE
UNSTABLE = ("loss_divergence", "loss_spike", "update_ratio_high")
DEAD = ("dead_activation", "vanishing_grad")


@dataclasses.dataclass(frozen=True)
class Case:
    """A buggy program, its twin, and what must be named (``kinds``, from step ``window[0]`` to
    ``window[1]``, matching ``where`` when given). ``needs`` says which check would name it when no kind
    of today's vocabulary fits (then ``kinds`` holds the kinds that would at least point at it)."""

    name: str
    klass: str
    source: str
    buggy: Program
    twin: Program
    kinds: tuple[str, ...]
    window: tuple[int, int]
    where: str | None = None
    what: str = ""
    needs: str = ""


def _pair(buggy: Program, **fix: object) -> tuple[Program, Program]:
    return buggy, dataclasses.replace(buggy, **fix)


def vanishing() -> Iterator[Case]:
    for depth, act, opt in itertools.product((8, 12), ("sigmoid", "tanh"), ("sgd", "adam")):
        lr = 0.05 if opt == "sgd" else 1e-3
        init = "small" if act == "tanh" else "default"
        buggy, twin = _pair(Program(depth=depth, act=act, init=init, optimizer=opt, lr=lr),
                            act="relu", init="kaiming")
        yield Case(f"vanish-{act}{depth}-{opt}", "vanishing_gradient", "AutoTrainer", buggy, twin,
                   ("vanishing_grad", "saturated_activation"), (0, buggy.steps), r"layers\.0\b",
                   f"{depth} {act} layers ({init} init), {opt}: the first layers get ~nothing")


def exploding() -> Iterator[Case]:
    for lr, scale, depth in itertools.product((1.0, 5.0), (10.0, 100.0), (3, 5)):
        buggy, twin = _pair(Program(depth=depth, lr=lr, input_scale=scale, init="large"),
                            lr=0.05, momentum=0.9, input_scale=1.0, init="default")
        yield Case(f"explode-lr{lr:g}-x{scale:g}-d{depth}", "exploding_gradient", "AutoTrainer", buggy, twin,
                   ("exploding_grad", "nonfinite_grad"), (0, 3), None,
                   f"SGD lr {lr:g}, inputs x{scale:g}, N(0, 1.5) weights, {depth} layers")


def dying_relu() -> Iterator[Case]:
    for bias, width, opt in itertools.product((-4.0, -20.0), (16, 64), ("sgd", "adam")):
        lr = 0.05 if opt == "sgd" else 1e-3
        buggy, twin = _pair(Program(init="neg_bias", bias_value=bias, width=width, optimizer=opt, lr=lr),
                            init="default", bias_value=0.0)
        yield Case(f"dead-relu-b{bias:g}-w{width}-{opt}", "dying_relu", "AutoTrainer", buggy, twin,
                   ("dead_activation", "vanishing_grad"), (0, buggy.steps), r"(acts|layers)\.\d",
                   f"hidden biases initialised to {bias:g}: every ReLU is 0 from the start",
                   needs="dead_activation at the defaults (log_activations is off by default), or vanishing_grad's "
                         "dead-part rule on the default schedule")
    for lr in (8.0, 30.0):
        buggy, twin = _pair(Program(lr=lr, width=16, depth=4), lr=0.05)
        yield Case(f"dead-relu-lr{lr:g}", "dying_relu", "AutoTrainer", buggy, twin,
                   DEAD + BLOW_UP, (0, buggy.steps), None,
                   f"SGD lr {lr:g} knocks the ReLUs below 0 in a few steps")


def weight_init() -> Iterator[Case]:
    for opt in ("sgd", "adam"):
        buggy, twin = _pair(Program(init="constant", optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3),
                            init="default")
        yield Case(f"init-constant-{opt}", "weight_init", "Humbatova et al. 2020 (wrong weights initialisation)",
                   buggy, twin, ("symmetric_units",), (0, buggy.steps), r"layers\.\d",
                   "every hidden layer initialised to one constant (nn.init.constant_(weight, 0.1)): its units "
                   "never stop being copies", needs="weights and gradient compared unit by unit")


def oscillating() -> Iterator[Case]:
    needs = "an oscillation rule (the loss swings up and down by a large share of its level with no trend)"
    for lr in (0.8, 0.9, 1.0):
        buggy, twin = _pair(Program(task="regress", lr=lr), lr=0.1)
        yield Case(f"oscillate-regress-sgd{lr:g}", "oscillating_loss", "AutoTrainer", buggy, twin,
                   UNSTABLE + DEAD, (0, buggy.steps), None,
                   f"SGD lr {lr:g} on a regression: just past the stable step size. The first steps overshoot and "
                   "kill every ReLU of a hidden layer (the output's spread over 256 inputs is 1e-8 to 1e-5 by step "
                   "200, the twin's 0.62), so the model predicts a constant whose error cycles with the unshuffled "
                   "batches (16 steps, one epoch): the dying ReLU of dead-relu-lr*, hence its kinds too",
                   needs=needs)
    for lr in (0.1, 0.2, 1.0):
        buggy, twin = _pair(Program(optimizer="adam", lr=lr), lr=1e-3)
        yield Case(f"oscillate-adam{lr:g}", "oscillating_loss", "AutoTrainer", buggy, twin, UNSTABLE,
                   (0, buggy.steps), None, f"Adam lr {lr:g}: the loss falls to ~0 and jumps back", needs=needs)


def slow_convergence() -> Iterator[Case]:
    for lr, opt in itertools.product((1e-5, 1e-6), ("sgd", "adam")):
        buggy, twin = _pair(Program(lr=lr, optimizer=opt), lr=0.05 if opt == "sgd" else 1e-3)
        yield Case(f"slow-{opt}{lr:g}", "slow_convergence", "AutoTrainer", buggy, twin, ("learning_stalled",),
                   (0, buggy.steps), None, f"{opt} lr {lr:g}: the loss does not move in {STEPS} steps",
                   needs="a no-progress rule (loss flat within noise while the lr is > 0; update/weight ratio ~1e-7)")
    buggy, twin = _pair(Program(depth=6, act="sigmoid", lr=0.01), act="relu", optimizer="adam", lr=1e-3)
    yield Case("slow-sigmoid6", "slow_convergence", "AutoTrainer", buggy, twin,
               ("learning_stalled", "vanishing_grad", "saturated_activation"), (0, buggy.steps), None,
               "6 sigmoid layers, SGD 0.01: learns far too slowly", needs="a no-progress rule")


def improper_data() -> Iterator[Case]:
    variants = {"sgd0.05-d2": dict(lr=0.05, depth=2), "sgd0.05-d4": dict(lr=0.05, depth=4),
                "sgd0.005-d2": dict(lr=0.005, depth=2), "sigmoid-adam": dict(act="sigmoid", optimizer="adam", lr=1e-3)}
    for label, options in variants.items():
        buggy, twin = _pair(Program(input_scale=1e3, **options), input_scale=1.0)  # type: ignore[arg-type]
        yield Case(f"data-scale1e3-{label}", "improper_data", "AutoTrainer", buggy, twin,
                   BLOW_UP + ("saturated_activation", "dead_activation"), (0, 5), r"layers\.0\b",
                   f"inputs at scale 1e3 (not normalised), {label}",
                   needs="an input-scale check (first layer pre-activations ~1e3 x its init scale)")
    for opt in ("sgd", "adam"):
        lr = 0.05 if opt == "sgd" else 1e-3
        buggy, twin = _pair(Program(shuffle_labels=True, optimizer=opt, lr=lr, samples=STEPS * 32),
                            shuffle_labels=False)
        yield Case(f"data-shuffled-labels-{opt}", "improper_data", "AutoTrainer", buggy, twin,
                   ("learning_stalled",), (0, buggy.steps), None, "labels shuffled against the inputs",
                   needs="a no-progress rule (loss stays at log(classes))")
        buggy, twin = _pair(Program(shuffle_labels=True, majority=0.5, optimizer=opt, lr=lr, samples=STEPS * 32),
                            shuffle_labels=False)
        yield Case(f"data-shuffled-labels-unbalanced-{opt}", "improper_data", "AutoTrainer", buggy, twin,
                   ("learning_stalled",), (0, buggy.steps), None,
                   "labels shuffled against the inputs, half of them one class: the loss falls to the labels' "
                   "entropy, under log(classes)",
                   needs="the rows' cross-entropy against what their average prediction costs")
    for opt in ("sgd", "adam"):
        buggy, twin = _pair(Program(silent="sorted_unshuffled", optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3),
                            fixed=True)
        yield Case(f"data-sorted-unshuffled-{opt}", "improper_data", "Humbatova et al. ICSE 2020", buggy, twin,
                   ("single_class_batches",), (0, buggy.steps), r"\bhead\b",
                   "the training data in label order, shuffle=False: one class per batch",
                   needs="the labels of a batch, read from cross_entropy's gradient of the output")
    buggy, twin = _pair(Program(silent="sorted_unshuffled", optimizer="adam", lr=1e-3, samples=3200), fixed=True)
    yield Case("data-sorted-unshuffled-epoch100-adam", "improper_data", "Humbatova et al. ICSE 2020", buggy, twin,
               ("single_class_batches",), (0, buggy.steps), r"\bhead\b",
               "the training data in label order, shuffle=False, in an epoch of 100 batches: every hundredth step "
               "is the first batch again", needs="a judgement moved off the batch the one before it saw")
    for step in (3, 9):
        buggy, twin = _pair(Program(fault="nan_input", fault_step=step, optimizer="adam", lr=1e-3), fixed=True)
        yield Case(f"data-nan-sample-s{step}", "improper_data", "DeepDiagnosis", buggy, twin, ("nonfinite_input",),
                   (step, step), r'"samples": \[3\]', f"a NaN in record 3 of step {step}'s batch")
    for opt in ("sgd", "adam"):
        buggy, twin = _pair(Program(fault="const_feature", optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3),
                            fixed=True)
        yield Case(f"data-zero-std-{opt}", "improper_data", "DeepDiagnosis", buggy, twin, ("nonfinite_input",),
                   (0, 0), None, "a constant feature standardised by its std of 0 (0/0 in every record)")


def improper_activation() -> Iterator[Case]:
    for width, opt in itertools.product((32, 128), ("sgd", "adam")):
        buggy, twin = _pair(Program(out_act="relu", width=width, optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3),
                            out_act=None)
        yield Case(f"act-relu-logits-w{width}-{opt}", "improper_activation", "AutoTrainer", buggy, twin,
                   ("dead_activation",), (0, buggy.steps), r"out_act",
                   "a ReLU on the output logits: classes whose logit is < 0 get no gradient",
                   needs="dead_activation on the output at the defaults")
    buggy, twin = _pair(Program(out_fn="relu", optimizer="adam", lr=1e-3), out_fn=None)
    yield Case("act-relu-logits-functional-adam", "improper_activation", "AutoTrainer", buggy, twin,
               ("dead_activation",), (0, buggy.steps), r"`model` \(",
               "F.relu written at the end of forward on the output logits (a ReLU after every layer, the last "
               "included): classes whose logit is < 0 get no gradient",
               needs="dead_activation on what forward returns, judged from its values (no ReLU module gives it)")
    for depth in (6, 10):
        buggy, twin = _pair(Program(depth=depth, act="sigmoid", lr=0.1), act="relu", init="kaiming", lr=0.02)
        yield Case(f"act-sigmoid-stack{depth}", "improper_activation", "AutoTrainer", buggy, twin,
                   ("vanishing_grad", "saturated_activation"), (0, buggy.steps), r"(layers|acts)\.0\b",
                   f"{depth} sigmoid layers stacked: a steady fade of gradients",
                   needs="a per-depth gradient fade rule (first/last layer ratio < 1e-3, as AutoTrainer)")
    for scale in (5.0, 20.0):
        buggy, twin = _pair(Program(task="regress", out_act="tanh", target_scale=scale, optimizer="adam", lr=1e-2),
                            out_act=None)
        yield Case(f"act-tanh-output-y{scale:g}", "improper_activation", "AutoTrainer", buggy, twin,
                   ("saturated_activation",), (0, buggy.steps), r"out_act",
                   f"tanh on a regression output whose targets reach +-{scale:g}",
                   needs="saturated_activation at the defaults")


def loss_issue() -> Iterator[Case]:
    for opt, width in itertools.product(("sgd", "adam"), (32, 128)):
        buggy, twin = _pair(Program(out_act="softmax", optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3,
                                    width=width), out_act=None)
        yield Case(f"loss-softmax-twice-{opt}-w{width}", "loss_issue", "AutoTrainer", buggy, twin,
                   ("vanishing_grad", "learning_stalled"), (0, buggy.steps), None,
                   "probabilities fed to cross_entropy (softmax applied twice)",
                   needs="a loss-input check (cross_entropy's input rows sum to 1 and lie in [0, 1])")
    for opt in ("sgd", "adam"):
        buggy, twin = _pair(Program(out_act="sigmoid", loss="bce_logits", optimizer=opt,
                                    lr=0.05 if opt == "sgd" else 1e-3), out_act=None)
        yield Case(f"loss-sigmoid-twice-{opt}", "loss_issue", "PyTorch docs (BCEWithLogitsLoss)", buggy, twin,
                   ("learning_stalled",), (0, buggy.steps), r"\bout_act\b",
                   "a sigmoid output fed to binary_cross_entropy_with_logits (the sigmoid applied twice)",
                   needs="the output's gradient (sigmoid(p) - label) / n on an output in [0, 1]")
    for loss, out_act in (("ce", "softmax"), ("bce_logits", "sigmoid")):
        buggy, twin = _pair(Program(out_act=out_act, loss=loss, criterion=True, optimizer="adam", lr=1e-3),
                            out_act=None)
        yield Case(f"loss-{out_act}-twice-module-adam", "loss_issue",
                   "AutoTrainer" if loss == "ce" else "PyTorch docs (BCEWithLogitsLoss)", buggy, twin,
                   ("learning_stalled",), (0, buggy.steps), r"\bout_act\b",
                   f"an nn.{'Softmax' if loss == 'ce' else 'Sigmoid'} output fed to the loss as a module, "
                   f"self.criterion = nn.{'CrossEntropyLoss' if loss == 'ce' else 'BCEWithLogitsLoss'}() (the "
                   f"{out_act} applied twice)", needs="the model's output taken from the call before the loss's")
    buggy, twin = _pair(Program(out_act="softmax", loss="ce_smooth", criterion=True, optimizer="adam", lr=1e-3),
                        out_act=None)
    yield Case("loss-softmax-twice-smoothing-adam", "loss_issue", "PyTorch docs (CrossEntropyLoss)", buggy, twin,
               ("learning_stalled",), (0, buggy.steps), r"\bout_act\b",
               "an nn.Softmax output fed to nn.CrossEntropyLoss(label_smoothing=0.1) (the softmax applied twice)",
               needs="the loss read as cross_entropy of the rows at the output gradient's labels, with the label "
                     "smoothing the loss gives")
    for loss, written in (("ce_sum", "cross_entropy(z, y, reduction=\"sum\")"),
                          ("ce_quarter", "cross_entropy(z, y) / 4 (an accumulation written by hand)")):
        buggy, twin = _pair(Program(out_act="softmax", loss=loss, optimizer="adam", lr=1e-3), out_act=None)
        yield Case(f"loss-softmax-twice-{loss.removeprefix('ce_')}-adam", "loss_issue",
                   "PyTorch docs (CrossEntropyLoss)", buggy, twin, ("learning_stalled",), (0, buggy.steps),
                   r"\bout_act\b", f"an nn.Softmax output fed to {written} (the softmax applied twice)",
                   needs="the loss's factor read from the output's gradient")
    buggy, twin = _pair(Program(out_act="sigmoid", loss="bce_logits_pos_weight", criterion=True, optimizer="adam",
                                lr=1e-3), out_act=None)
    yield Case("loss-sigmoid-twice-pos-weight-adam", "loss_issue", "PyTorch docs (BCEWithLogitsLoss)", buggy, twin,
               ("learning_stalled",), (0, buggy.steps), r"\bout_act\b",
               "an nn.Sigmoid output fed to nn.BCEWithLogitsLoss(pos_weight=...) for imbalanced labels (the sigmoid "
               "applied twice)", needs="the output's gradient with one constant per label (pos_weight)")
    for loss, out_fn in (("ce", "softmax"), ("bce_logits", "sigmoid")):
        buggy, twin = _pair(Program(out_fn=out_fn, loss=loss, optimizer="adam", lr=1e-3), out_fn=None)
        yield Case(f"loss-{out_fn}-twice-functional-adam", "loss_issue",
                   "AutoTrainer" if loss == "ce" else "PyTorch docs (BCEWithLogitsLoss)", buggy, twin,
                   ("learning_stalled",), (0, buggy.steps), r"`model` \(",
                   f"{'F.softmax' if loss == 'ce' else 'torch.sigmoid'} written at the end of forward, its output "
                   f"fed to {'cross_entropy' if loss == 'ce' else 'binary_cross_entropy_with_logits'} (the {out_fn} "
                   "applied twice)", needs="the model's output taken from what forward returns")
    buggy, twin = _pair(Program(out_act="sigmoid", optimizer="adam", lr=1e-3), out_act=None)
    yield Case("loss-sigmoid-into-ce-adam", "loss_issue", "PyTorch docs (CrossEntropyLoss)", buggy, twin,
               ("learning_stalled",), (0, buggy.steps), r"\bout_act\b",
               "an nn.Sigmoid output fed to cross_entropy as logits (values bounded to [0, 1]: a floor of "
               "log(1 + 3/e) = 0.744)", needs="an output in [0, 1] made by no affine map, with cross_entropy's gradient")
    for opt in ("sgd", "adam"):
        buggy, twin = _pair(Program(loss="bce_raw", optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3),
                            out_act="sigmoid")
        yield Case(f"loss-bce-on-logits-{opt}", "loss_issue", "DeepDiagnosis", buggy, twin, ("exception",), (0, 0),
                   r"binary_cross_entropy|between 0 and 1", "binary_cross_entropy on raw logits (raises)")
    for opt in ("sgd", "adam"):
        buggy, twin = _pair(Program(loss="nll_raw", optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3),
                            loss="ce")
        yield Case(f"loss-nll-on-logits-{opt}", "loss_issue", "AutoTrainer", buggy, twin, BLOW_UP, (0, buggy.steps),
                   None,
                   "nll_loss on raw logits: the loss is unbounded below and falls forever",
                   needs="a loss-sign check (a negative-log-likelihood below 0)")


def numerical() -> Iterator[Case]:
    """DeepLocalize/DeepDiagnosis's NaN bugs, each at two steps and two optimizers."""
    faults = {"log_zero": r"Cause: `[^`]*log", "div_zero": r"Cause: `[^`]*(div|/)",
              "sqrt_neg": r"Cause: `[^`]*sqrt", "exp_overflow": r"Cause: `[^`]*(exp|div)"}
    for (fault, where), (step, opt) in itertools.product(faults.items(), ((4, "adam"), (11, "sgd"))):
        buggy, twin = _pair(Program(fault=fault, fault_step=step, optimizer=opt, lr=0.05 if opt == "sgd" else 1e-3),
                            fixed=True)
        yield Case(f"nan-{fault}-s{step}-{opt}", "numerical", "DeepDiagnosis", buggy, twin, NONFINITE, (step, step),
                   where, f"{fault.replace('_', ' ')} planted at step {step}")
    for lr, opt in ((1e4, "sgd"), (1e6, "sgd"), (1e3, "adam")):
        buggy, twin = _pair(Program(lr=lr, optimizer=opt, input_scale=10.0), lr=0.05 if opt == "sgd" else 1e-3,
                            input_scale=1.0)
        yield Case(f"nan-lr{lr:g}-{opt}", "numerical", "DeepLocalize", buggy, twin, BLOW_UP, (0, 3), None,
                   f"{opt} lr {lr:g} on inputs x10: overflow to Inf/NaN")


def silent() -> Iterator[Case]:
    """TrainCheck's silent errors that run in one CPU process (see benchmarks/faults/silent.py)."""
    table = (
        ("optimizer_on_copy", ("frozen_param",), (0, 5), r"layers\.0|head", {},
         "the optimizer holds a copy of the layers, not the trained ones",
         "frozen_param on parameters that get gradients but no optimizer holds"),
        ("clip_before_backward", ("exploding_grad", "nonfinite_grad") + UNSTABLE, (0, 10), None,
         {"lr": 0.5, "input_scale": 10.0, "init": "large"}, "clip_grad_norm_ before the backward: clips nothing",
         "a clipping-has-no-effect check (norm after clipping still above max_norm)"),
        ("scheduler_per_epoch", ("learning_stalled",), (0, STEPS), r"LambdaLR|learning rate",
         {"samples": 2 * STEPS * 32},
         "a per-step warm-up from 0 stepped per epoch: lr 0 for the whole run",
         "learning_stalled on the default schedule (it wants 3 gradient check steps in a row: 300 steps)"),
        ("lr_zeroed", ("learning_stalled",), (15, STEPS), None, {},
         f"every param group's lr set to 0 at step 15 of {STEPS}",
         "learning_stalled without a scheduler (the base of a group without initial_lr is its lr at fit start)"),
        ("dropout_at_eval", ("train_mode_in_eval",), (0, STEPS), r"functional\.dropout", {"val": True},
         "F.dropout(training=True): dropout on at validation",
         "train_mode_in_eval (dropout calls with training=True during the first evaluation batch)"),
        ("workers_share_seed", ("repeated_batch",), (0, STEPS), None, {},
         "2 workers copy one NumPy generator: every batch twice", ""),
        ("no_zero_grad", ("grad_not_zeroed",), (1, STEPS), None, {"lr": 0.01}, "optimizer_zero_grad does nothing",
         "grad_not_zeroed on a gradient check step after step 0 (step 100 at the defaults)"),
        ("frozen_in_optimizer", ("frozen_param",), (0, 5), r"layers\.0", {},
         "requires_grad_(False) on layers the optimizer still holds",
         "requires_grad=False inside a param group as a warning (issue 45 invariant 6)"),
    )
    for name, kinds, window, where, extra, what, needs in table:
        buggy, twin = _pair(Program(silent=name, **extra), fixed=True)  # type: ignore[arg-type]
        yield Case(f"tc-{name.replace('_', '-')}", "traincheck_silent", "TrainCheck", buggy, twin, kinds, window, where,
                   what, needs)


def autograd_misuse() -> Iterator[Case]:
    """A backward that leaves no gradient at the optimizer step (see benchmarks/faults/silent.py)."""
    table = (
        ("loss_from_number", (0, 5), r"reaches no parameter",
         "the loss rebuilt with torch.tensor(loss.item(), requires_grad=True): no backward reaches a parameter"),
        ("step_before_backward", (0, 105), r"cleared between the backward and the step",
         "manual optimization: step(), manual_backward(loss), zero_grad(): every step finds no gradient"),
        ("detached_hidden", (0, 5), r"layers\.0",
         "h.detach() left after the first layer: the layer before it never gets a gradient"),
    )
    for name, window, where, what in table:
        buggy, twin = _pair(Program(silent=name), fixed=True)
        yield Case(f"grad-{name.replace('_', '-')}", "autograd_misuse", "PyTorch autograd, Lightning manual "
                   "optimization", buggy, twin, ("missing_grad",), window, where, what,
                   "missing_grad when a backward ran and no parameter holds a gradient at the step")


def api_misuse() -> Iterator[Case]:
    """Calls that run and train the wrong thing (see benchmarks/faults/silent.py)."""
    table = (
        ("softmax_over_the_batch", {}, ("learning_stalled",), r"dim|batch",
         "nll_loss(log_softmax(logits, dim=0)): normalised over the batch, not the classes",
         "a loss normalised over the batch: the output's gradient a softmax down each column (softmax_over_batch)"),
        ("target_broadcast", {"task": "regress"}, ("learning_stalled",), r"broadcast|shape|size",
         "mse_loss on an (N, 1) output and an (N,) target: broadcast to (N, N), the model learns the mean",
         "every output fitted to one target that moves from batch to batch: the output's gradient affine in the "
         "output (shared_target)"),
        ("eval_mode_in_training", {"batchnorm": True}, ("eval_mode_in_training",), r"norms\.0",
         "self.eval() in on_train_batch_start: BatchNorm frozen at its running statistics", ""),
        ("step_decay_per_step", {"steps": 601}, ("learning_stalled",), r"StepLR",
         "StepLR(step_size=30, gamma=0.1), the example of torch's docs, meant per epoch and registered with interval "
         "'step' (601 steps: a millionth of its base from step 210, three check steps in a row from 300)",
         "a learning rate that is 0 in effect (a millionth of its base) far from the end"),
        ("layer_in_forward", {}, ("frozen_param",), r"head\.weight",
         "self.head = nn.Linear(...) inside forward: a new layer every step, in no optimizer", ""),
        ("step_forgotten", {"epochs": 25}, ("learning_stalled",), r"opt\.step\(\)",
         "manual optimization with zero_grad() and manual_backward(loss) and no step(): the weights never move and "
         "the step counter stays at 0 (25 epochs of 16 batches)",
         "training batches that no optimizer step follows, the weights bit for bit the same (optimizer_not_stepping)"),
        ("loss_not_returned", {"epochs": 25}, ("learning_stalled",), r"return loss",
         "training_step logs its loss and does not return it: Lightning skips every backward and steps on no "
         "gradient", "training batches with no backward, the weights bit for bit the same (optimizer_not_stepping)"),
        ("round_in_loss", {"task": "regress"}, ("vanishing_grad",), r"round",
         "mse_loss(output.round(), y): round has a zero gradient, nothing is learnt",
         "every gradient of the model exactly zero under a loss that is not 0, on 2 check steps (flat_loss)"),
        ("layers_in_list", {}, ("frozen_param",), r"layers\[0\]",
         "self.layers = [nn.Linear(...), ...]: a Python list, so the optimizer holds the head alone",
         "leaves of the loss's graph that the model does not register, bit for bit the same 100 steps on (unregistered)"),
        ("clip_to_zero", {"task": "regress"}, ("learning_stalled", "frozen_param"), r"max_norm 0",
         "clip_grad_norm_(params, 0.0) before each step: every gradient scaled to 0, the weights never move",
         "weights bit for bit the same over 100 steps at a learning rate above 0, the loss not fallen 10x "
         "(negligible_updates)"),
        ("rnn_batch_first", {"optimizer": "adam", "lr": 3e-3}, ("batch_mixing",), r"LSTM|batch_first",
         "nn.LSTM without batch_first=True fed (batch, time, features): the recurrence runs across the samples",
         "an output row that depends, in order, on other rows' inputs (a probe of the first batch)"),
        ("view_for_transpose", {"optimizer": "adam", "lr": 3e-3}, ("batch_mixing",), r"view|transpose",
         "x.view(T, B, F) where x.transpose(0, 1) was meant, before a sequence-first GRU: samples regrouped",
         "an output row that depends, in order, on other rows' inputs (a probe of the first batch)"),
        ("warm_up_endless", {}, ("learning_stalled",), r"warm-up",
         "LambdaLR(lambda s: min(1, s / 1e6)): a warm-up of a million steps where a thousand were meant, the learning "
         "rate near 0 for the whole run",
         "weights that barely move under a learning rate that rises too slowly to reach 10% of its base by the run's "
         "end (negligible_updates)"),
        ("adam_eps_large", {"lr": 1e-3}, ("learning_stalled",), r"eps",
         "Adam(lr=1e-3, eps=1.0): every update divided by eps, not by the gradient's scale (Adam as SGD at lr / eps)",
         "Adam's eps over ten times the root of the bias-corrected exp_avg_sq for 90% of the sampled weights while "
         "the loss has not halved (negligible_updates)"),
        ("plateau_watching_a_rise", {}, ("learning_stalled",), r"ReduceLROnPlateau",
         "ReduceLROnPlateau(mode='max') on the training loss: every falling step is no improvement, the lr halved at "
         "every patience of 5 steps",
         "every param group's lr at most 1e-6 of its base on 2 check steps in a row spanning 1% of the run, before "
         "90% of it (lr_zero)"),
        ("scheduler_stepped_twice", {}, ("learning_stalled",), r"LambdaLR",
         "lr_schedulers().step() in training_step beside Lightning's own stepping: a linear decay to 0 over the run "
         "reaches 0 at its middle",
         "every param group's lr at 0 on 2 check steps in a row spanning 1% of the run, before 90% of it (lr_zero)"),
        ("head_replaced_late", {}, ("frozen_param",), r"head",
         "self.head replaced by a new nn.Linear in the module's on_train_start, after configure_optimizers: the "
         "optimizer holds the old head, the new one never moves",
         "trainable parameters with a gradient in no param group, looked up at the first check step "
         "(not_in_optimizer)"),
        ("weight_decay_huge", {}, ("learning_stalled",), r"Weight decay takes",
         "SGD(lr=0.05, momentum=0.9, weight_decay=0.5): decay takes a quarter of every weight a step, the weights "
         "held near 0",
         "a loss at chance (log C) held 4 judgements, with a param group whose decay takes 1% or more of a weight a "
         "step named first (loss_at_chance)"),
        ("gradient_clip_tiny", {"gradient_clip": 1e-4}, ("learning_stalled",), r"gradient_clip_val",
         "Trainer(gradient_clip_val=1e-4): every gradient's norm clipped to 1e-4 after the checks read it, each step "
         "thousands of times smaller than the learning rate makes it; the twin clips at 1.0",
         "weights that barely move at a learning rate above 0, the loss where it started, with clipping that cuts "
         "the gradients read 100 times or more named (negligible_updates)"),
        ("optimizer_unwrapped", {"epochs": 25}, ("steps_not_counted",), r"use_pl_optimizer=False",
         "manual optimization stepping self.optimizers(use_pl_optimizer=False): the model learns, the step counter "
         "stays at 0 (max_steps never reached; 25 epochs of 16 batches)",
         "optimizer steps, hooked on the torch optimizer, over 100 batches at one value of the step counter"),
        ("optimizer_in_step", {"epochs": 25}, ("steps_not_counted",), r"configure_optimizers",
         "manual optimization with torch.optim.SGD(...) made in training_step: the model learns, the step counter "
         "stays at 0 (25 epochs of 16 batches)",
         "weights that moved over 200 batches at one value of the step counter, no optimizer the run holds stepping"),
    )
    for name, extra, kinds, where, what, needs in table:
        buggy, twin = _pair(Program(silent=name, **extra), fixed=True)  # type: ignore[arg-type]
        yield Case(f"api-{name.replace('_', '-')}", "api_misuse", "PyTorch and Lightning API", buggy, twin, kinds,
                   (0, buggy.steps), where, what, needs)
    buggy, twin = _pair(Program(silent="target_broadcast", task="regress", samples=3200), fixed=True)
    yield Case("api-target-broadcast-epoch100", "api_misuse", "PyTorch and Lightning API", buggy, twin,
               ("learning_stalled",), (0, buggy.steps), r"broadcast|shape|size",
               "mse_loss on an (N, 1) output and an (N,) target, unshuffled data in an epoch of 100 batches: every "
               "hundredth step is the same batch, with the same mean target",
               "a judgement moved off the batch the one before it saw")


MEMORY_STEPS = 501
"""Memory is read every 50 steps; the first two readings are a warm-up, the trend wants 6 readings (steps 100-350)
and ``memory_growth`` a second one in a row (step 400): a leak is named at step 400 at the earliest."""


def memory() -> Iterator[Case]:
    """Memory kept across steps (PyTorch FAQ, Lightning 2.0's migration, a bank of negatives) and an out-of-memory
    error (Zhang et al., ICSE 2020), each with its fix (see benchmarks/faults/resources.py)."""
    wide = dict(width=256, batch=128, steps=MEMORY_STEPS)
    # the census names what is kept: the running sum (a scalar carrying its graph), the embeddings, the input saved
    # for the padded batch; the performance findings name the loader's setting, the period and the phase
    graph_sum = r"\[\] with grad_fn AddBackward0"
    table = (
        ("mem-loss-history", "loss_history", ("memory_growth",), (0, MEMORY_STEPS), graph_sum,
         dict(steps=MEMORY_STEPS), "PyTorch FAQ",
         "total_loss += loss (not loss.item()): every step's graph stays reachable (~10 KB a step)"),
        ("mem-loss-history-deep", "loss_history", ("memory_growth",), (0, MEMORY_STEPS), graph_sum,
         dict(depth=8, optimizer="adam", lr=1e-3, steps=MEMORY_STEPS), "PyTorch FAQ",
         "total_loss += loss on an 8-layer MLP, Adam (more graph nodes kept a step)"),
        ("mem-outputs-kept", "outputs_kept", ("memory_growth",), (0, MEMORY_STEPS),
         r"grad_fn ReluBackward0 \(shape \[128, 256\]", wide,
         "Lightning 2.0 migration",
         "embeddings appended for an epoch-end metric, never cleared (128 KB of them a step)"),
        ("mem-outputs-kept-small", "outputs_kept", ("memory_growth",), (0, MEMORY_STEPS),
         r"grad_fn ReluBackward0 \(shape \[32, 32\]",
         dict(steps=MEMORY_STEPS), "Lightning 2.0 migration",
         "embeddings appended for an epoch-end metric, never cleared (4 KB of them a step)"),
        ("mem-unbounded-bank", "unbounded_bank", ("memory_growth",), (0, MEMORY_STEPS),
         r"\(shape \[128, 256\], float32 on cpu\) without a graph", dict(wide, period=8),
         "MoCo (bounded queue)", "a memory bank of negatives that only grows (the loss uses the last 8 batches)"),
        ("mem-retain-graph", "retained_center", ("memory_growth",), (0, 451), r"\[32\] with grad_fn AddBackward0",
         dict(steps=451), "PyTorch forum (retain_graph)",
         "a running mean updated with autograd on, and retain_graph=True to silence the second-backward error"),
        ("mem-hooks-per-step", "hooks_per_step", ("memory_growth",), (0, 400), r"\[32, 32\], float32",
         dict(steps=400), "PyTorch forum (hooks registered in a loop)",
         "a forward hook keeping its layer's output, registered anew in every training step and never removed (a "
         "400-step run: first suspected at its last reading, step 350)"),
        ("mem-worker-cache", "worker_cache", ("memory_growth",), (0, MEMORY_STEPS), r"2 DataLoader worker processes",
         dict(steps=MEMORY_STEPS, batch=16, period=64), "pytorch/pytorch#62066",
         "a Dataset that keeps each record it decoded (64 KB), read by two persistent workers"),
        ("oom-long-record", "long_record", ("oom",), (5, 5), r"batch\[0\]: \[8, 200000, 16\]",
         dict(batch=8, fault_step=5, steps=20), "Zhang et al. ICSE 2020",
         "one record of 200k tokens padded into a batch: attention over every pair runs out of memory"),
    )
    for name, resource, kinds, window, where, extra, source, what in table:
        buggy, twin = _pair(Program(resource=resource, **extra), fixed=True)  # type: ignore[arg-type]
        yield Case(name, "memory", source, buggy, twin, kinds, window, where, what)


def performance() -> Iterator[Case]:
    """A data loader doing its work on the training loop's thread (PyTorch performance tuning guide) and a blocking
    call every N steps (Cao et al., FSE 2022), each with its fix (see benchmarks/faults/resources.py)."""
    loader, every = r"num_workers=0", r"every {}th step.*the forward phase"
    table = (
        ("perf-loader-decode", "slow_loader", ("dataloader_bottleneck",), (0, 100), loader,
         dict(steps=100), "PyTorch tuning guide", "each record decoded in __getitem__, num_workers=0"),
        ("perf-loader-read", "slow_loader", ("dataloader_bottleneck",), (0, 100), loader,
         dict(steps=100, batch=16, stall_ms=1.0), "PyTorch tuning guide",
         "each record decoded and read with a 1 ms blocking call in __getitem__, num_workers=0"),
        ("perf-write-every20", "periodic_write", ("slow_step",), (20, 160), every.format(20),
         dict(steps=160, period=20, stall_ms=120.0), "Cao et al. FSE 2022",
         "a blocking 120 ms write in training_step every 20 steps"),
        ("perf-write-every50", "periodic_write", ("slow_step",), (50, 260), every.format(50),
         dict(steps=260, period=50, stall_ms=150.0), "Cao et al. FSE 2022",
         "a blocking 150 ms write in training_step every 50 steps"),
        ("perf-write-every20-30ms", "periodic_write", ("slow_step",), (20, 160), every.format(20),
         dict(steps=160, period=20, stall_ms=30.0), "Cao et al. FSE 2022",
         "a blocking 30 ms write in training_step every 20 steps"),
    )
    for name, resource, kinds, window, where, extra, source, what in table:
        buggy, twin = _pair(Program(resource=resource, **extra), fixed=True)  # type: ignore[arg-type]
        yield Case(name, "performance", source, buggy, twin, kinds, window, where, what)


BUILDERS = (vanishing, exploding, dying_relu, weight_init, oscillating, slow_convergence, improper_data, improper_activation,
            loss_issue, numerical, silent, autograd_misuse, api_misuse, memory, performance)


def all_cases() -> list[Case]:
    return [case for builder in BUILDERS for case in builder()]


SUBSET = ("vanish-sigmoid12-sgd", "explode-lr5-x100-d5", "dead-relu-b-20-w16-sgd", "oscillate-regress-sgd0.9",
          "slow-sgd1e-06", "data-nan-sample-s3", "act-relu-logits-w32-sgd", "loss-softmax-twice-sgd-w32",
          "nan-log_zero-s4-adam", "tc-no-zero-grad", "tc-lr-zeroed", "tc-workers-share-seed",
          "grad-loss-from-number", "api-eval-mode-in-training", "mem-outputs-kept", "perf-loader-decode",
          "init-constant-adam")
"""One case per class (three of TrainCheck's), each with its twin: the suite's fast subset."""
