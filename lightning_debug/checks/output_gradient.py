"""What the model's output and the gradient the loss sends back to it say about that loss: whether the output lies on
the probability simplex, and which form its gradient has (``cross_entropy``'s, a softmax over the batch's, a sigmoid
applied twice, one target shared by every row, ...), read by the activation monitor's hook on the output on a judged
step, as device tensors the gradient area's rules read a step later. Each reading is a fixed-length row of values,
NaN where it cannot be measured, and reads a bounded part of a large output.
"""

from __future__ import annotations

import math

import torch


SIMPLEX_ROWS_ELEMENTS = 1 << 22
SIMPLEX = ("low", "high", "row_sum_error", "logit_loss")


def simplex_stats(output: torch.Tensor) -> torch.Tensor:
    """:data:`SIMPLEX` of a model's output over its rows (the last dimension), on its device: its smallest and
    largest value, the largest distance of a row's sum from 1, and ``logit_loss``, the mean of ``logsumexp(row) -
    max(row)``: what ``cross_entropy`` returns on rows that are already probabilities (a softmax applied twice) on a
    model that predicts well. Only the first :data:`SIMPLEX_ROWS_ELEMENTS` values are read: a language model's
    logits are not copied whole.

    >>> p = torch.tensor([[0.7, 0.1, 0.1, 0.1], [0.1, 0.1, 0.1, 0.7]])
    >>> [round(v, 4) for v in simplex_stats(p).tolist()]
    [0.1, 0.7, 0.0, 0.9732]
    >>> round(torch.nn.functional.cross_entropy(p, torch.tensor([0, 3])).item(), 4)
    0.9732
    """
    x = output.detach()
    width = x.shape[-1] if x.dim() else 1
    if x.numel() == 0:
        return torch.full((len(SIMPLEX),), math.nan, dtype=torch.float32, device=x.device)
    rows = leading(x, max(1, SIMPLEX_ROWS_ELEMENTS // width) * width).reshape(-1, width).float()
    low, high = torch.aminmax(rows)
    error = (rows.sum(-1) - 1).abs().max()
    logit_loss = (torch.logsumexp(rows, -1) - rows.amax(-1)).mean()
    return torch.stack([low, high, error, logit_loss])


def fit_tolerance(dtype: torch.dtype) -> float:
    """How far from exact :func:`batch_softmax_fit` may find a gradient of ``dtype`` and call it exact::

        >>> fit_tolerance(torch.float32), fit_tolerance(torch.bfloat16)
        (0.001, 0.0625)
    """
    return max(1e-3, 8 * torch.finfo(dtype).eps) if dtype.is_floating_point else 1e-3


def batch_softmax_fit(grad: torch.Tensor, output: torch.Tensor, tolerance: float = 1e-3) -> torch.Tensor:
    """The share of the rows of a 2-d output whose gradient ``grad`` has the form a loss normalised over the batch
    gives, on its device: in every column but one, the same multiple of ``softmax(output, dim=0)`` as the column's
    other rows (within ``tolerance``). ``nll_loss(log_softmax(output, dim=0), y)`` gives ``n_c / N`` times it, less
    ``1 / N`` at the label, so every row fits; a contrastive loss whose logits are computed from the output has no
    such rows. ``cross_entropy`` over the classes fits only the rows whose ``logsumexp`` is the smallest, so only the
    others are counted (NaN when there are none, as for rows all alike, or when the output is not 2-d). Only the
    first :data:`SIMPLEX_ROWS_ELEMENTS` values are read: within a column, the softmax over fewer rows is the same
    up to a factor, which leaves each column's largest multiple where it was.

    >>> from torch.nn import functional as F
    >>> z, y = torch.randn(8, 3, requires_grad=True), torch.tensor([0, 1, 2, 0, 1, 2, 0, 1])
    >>> batch_softmax_fit(torch.autograd.grad(F.nll_loss(F.log_softmax(z, 0), y), z)[0], z).item()
    1.0
    >>> batch_softmax_fit(torch.autograd.grad(F.cross_entropy(z, y), z)[0], z).item()
    0.0
    >>> other = torch.randn(8, 3)  # a contrastive loss over the batch
    >>> batch_softmax_fit(torch.autograd.grad(F.cross_entropy(other @ z.T, torch.arange(8)), z)[0], z).item() < 0.5
    True
    >>> alike = torch.zeros(8, 3, requires_grad=True)  # a zero-initialised head: either loss gives this gradient
    >>> batch_softmax_fit(torch.autograd.grad(F.cross_entropy(alike, y), alike)[0], alike).isnan().item()
    True
    """
    if grad.dim() != 2 or grad.shape != output.shape or grad.shape[1] < 2 or grad.numel() == 0:
        return torch.full((), math.nan, device=grad.device)
    kept = max(2, SIMPLEX_ROWS_ELEMENTS // grad.shape[1])
    g, z = grad.detach()[:kept].float(), output.detach()[:kept].float()
    ratio = g / torch.softmax(z, dim=0).clamp_min(torch.finfo(torch.float32).tiny)
    top = ratio.amax(0)
    fits = (ratio >= top - tolerance * top.abs()).sum(1) == g.shape[1] - 1
    row_lse = torch.logsumexp(z, dim=1)
    telling = row_lse > row_lse.min() + 2 * tolerance
    counted = telling.sum()
    return torch.where(counted > 0, (fits & telling).sum() / counted.clamp_min(1), math.nan)


SHARED = ("shared_misfit", "shared_target")


def shared_target(grad: torch.Tensor, output: torch.Tensor) -> torch.Tensor:
    """:data:`SHARED` of an output of one value per row, on its device: how far its gradient is from an affine
    function of the output across the rows (the least-squares residual as a share of the gradient's spread, in units
    of what rounding leaves of an exact line: 16 eps of the gradient's dtype, times how far the values lie from 0
    against their spread; at most 1 is exact), and the value that line crosses zero at. A loss that fits every
    output to one value ``c`` (``mean((o_i - c)^2)``: an (N,) target broadcast against an (N, 1) output gives ``c``
    the targets' mean) has a gradient ``a (o_i - c)`` exactly; a loss with a target per row has not (its residual is
    about the targets' spread over the outputs'). NaN when the outputs or the gradient are all alike, or the line
    does not rise (no loss pulls every output toward ``c``), or there is not one value per row.

    >>> from torch.nn import functional as F
    >>> o, t = torch.randn(16, 1, requires_grad=True), torch.randn(16, 1)
    >>> misfit, c = shared_target(torch.autograd.grad(F.mse_loss(o, t.squeeze(-1)), o)[0], o).tolist()
    >>> misfit <= 1, abs(c - t.mean().item()) < 1e-4
    (True, True)
    >>> shared_target(torch.autograd.grad(F.mse_loss(o, t), o)[0], o)[0].item() > 1000
    True
    """
    if output.dim() == 0 or output.numel() != output.shape[0] or grad.shape != output.shape or output.numel() < 3:
        return torch.full((len(SHARED),), math.nan, dtype=torch.float32, device=grad.device)
    g, o = grad.detach().reshape(-1).float(), output.detach().reshape(-1).float()
    oc, gc = o - o.mean(), g - g.mean()
    slope = (oc @ gc) / (oc @ oc)
    residual = torch.linalg.vector_norm(gc - slope * oc) / torch.linalg.vector_norm(gc)
    root = math.sqrt(o.numel())
    offset = root * (o.abs().amax() / torch.linalg.vector_norm(oc) + g.abs().amax() / torch.linalg.vector_norm(gc))
    exact = 16 * (torch.finfo(grad.dtype).eps if grad.dtype.is_floating_point else 1e-7) * offset
    result = torch.stack([residual / exact, o.mean() - g.mean() / slope])
    return torch.where(slope > 0, result, math.nan)


def leading(x: torch.Tensor, count: int) -> torch.Tensor:
    """The first ``count`` values of ``x``, flat, without copying the rest (a view of a contiguous tensor; the leading
    items of another)::

        >>> leading(torch.arange(12).reshape(3, 4).T, 5).tolist()
        [0, 4, 8, 1, 5]
    """
    if x.dim() > 1 and not x.is_contiguous():
        x = x[:max(1, -(-count // max(1, x[0].numel())))]
    return x.reshape(-1)[:count]


SIGMOID_TWICE = ("sigmoid_fit", "sigmoid_positives", "sigmoid_positive_weight")
SIGMOID_ELEMENTS = 1 << 16
"""The values :func:`sigmoid_twice` reads: a median over more would cost more than the judgement needs."""
SIGMOID_SPREAD = 0.01
"""How far apart the output's values must lie for the form of their gradient to say anything: on one value every
loss gives one constant."""


def group_medians(values: torch.Tensor, groups: torch.Tensor, count: int) -> torch.Tensor:
    """The median (the lower middle value) of the finite ``values`` of each group ``0 .. count - 1``, NaN for a group
    without one, on the device, without a loop, and by sorts and searches only (``bincount`` raises on CUDA under
    ``torch.use_deterministic_algorithms``)::

        >>> group_medians(torch.tensor([5.0, 1.0, 2.0, math.nan, 9.0]), torch.tensor([0, 0, 0, 1, 1]), 3).tolist()
        [2.0, 9.0, nan]
    """
    finite = torch.isfinite(values)
    order = torch.argsort(torch.where(finite, values, math.inf))
    order = order[torch.argsort(groups[order], stable=True)]
    sorted_groups, wanted = groups[order], torch.arange(count, device=values.device)
    starts = torch.searchsorted(sorted_groups, wanted)
    counted = torch.cat([finite.new_zeros(1, dtype=torch.long), finite[order].long().cumsum(0)])
    sizes = counted[torch.searchsorted(sorted_groups, wanted, right=True)] - counted[starts]
    middle = values[order][(starts + (sizes - 1).clamp_min(0) // 2).clamp_max(values.numel() - 1)]
    return torch.where(sizes > 0, middle, math.nan)


def sigmoid_twice(grad: torch.Tensor, output: torch.Tensor, tolerance: float = 1e-3) -> torch.Tensor:
    """:data:`SIGMOID_TWICE` of an output of probabilities, on its device: the share of its values whose gradient
    ``grad`` is ``w (sigmoid(p) - t) / n`` for a label ``t`` of 0 or 1, one ``n``, ``w`` 1 at the labels at 0 and one
    weight per column at the labels at 1 (within ``tolerance``), the share of those labels at 1, and their mean
    weight. ``binary_cross_entropy_with_logits(p, t, pos_weight=w)`` gives that gradient, so every value fits when
    ``p`` is already a sigmoid's; on logits it gives it too, but logits are not all in [0, 1], and an output that
    is not gives a fit of 0. The label is read from the gradient's sign (``sigmoid(p)`` lies in [0.5, 0.73]);
    ``binary_cross_entropy(p, t)`` and ``mse_loss`` on probabilities do not fit. NaN when no gradient is read (all
    0) or the output's values lie within :data:`SIGMOID_SPREAD` of each other. Only the first
    :data:`SIGMOID_ELEMENTS` values are read.

    >>> from torch.nn import functional as F
    >>> p, t = torch.rand(16, 3, requires_grad=True), torch.randint(0, 2, (16, 3)).float()
    >>> fit, positives, weight = sigmoid_twice(torch.autograd.grad(F.binary_cross_entropy_with_logits(p, t), p)[0],
    ...                                        p).tolist()
    >>> fit, abs(positives - t.mean().item()) < 1e-6, round(weight, 3)
    (1.0, True, 1.0)
    >>> def weighted(w): return sigmoid_twice(torch.autograd.grad(F.binary_cross_entropy_with_logits(p, t,
    ...                                      pos_weight=torch.tensor(w)), p)[0], p)
    >>> weighted([4.0, 2.0, 6.0])[0].item(), round(weighted(3.0)[2].item(), 4)  # one weight per column
    (1.0, 3.0)
    >>> sigmoid_twice(torch.autograd.grad(F.binary_cross_entropy(p, t), p)[0], p)[0].item() < 0.5
    True
    >>> z = torch.randn(16, 3, requires_grad=True)  # logits: the same gradient, not all in [0, 1]
    >>> sigmoid_twice(torch.autograd.grad(F.binary_cross_entropy_with_logits(z, t), z)[0], z)[0].item()
    0.0
    """
    if grad.shape != output.shape or output.numel() == 0:
        return torch.full((len(SIGMOID_TWICE),), math.nan, dtype=torch.float32, device=grad.device)
    g, o = (leading(x.detach(), SIGMOID_ELEMENTS).float() for x in (grad, output))
    columns = output.shape[-1] if output.dim() > 1 else 1
    positive = g < 0
    read = g != 0
    scale = torch.where(positive, torch.sigmoid(o) - 1, torch.sigmoid(o)) / torch.where(read, g, 1.0)
    groups = torch.where(positive, 1 + torch.arange(g.numel(), device=g.device) % columns, 0)
    middle = group_medians(torch.where(read, scale, math.nan), groups, 1 + columns)
    fits = read & ((scale - middle[groups]).abs() <= tolerance * middle[groups].abs())
    counted = read.sum()
    within = (o.amin() >= 0) & (o.amax() <= 1)
    spread = torch.where(read, o, math.inf).amin() + SIGMOID_SPREAD <= torch.where(read, o, -math.inf).amax()
    fit = torch.where(counted > 0, torch.where(within, fits.sum() / counted.clamp_min(1), 0.0), math.nan)
    fitted = positive & fits
    weight = (middle[0] / torch.where(fitted, scale, math.nan)).nansum() / fitted.sum().clamp_min(1)
    return torch.stack([torch.where(spread | ~within, fit, math.nan), fitted.sum() / fits.sum().clamp_min(1),
                        torch.where(fitted.any(), weight, math.nan)])


BATCH_LABELS = ("labelled_share", "first_label", "last_label", "in_order", "shortest_run")


def cross_entropy_rows(g: torch.Tensor, tolerance: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Which rows of a 2-d gradient have a gradient at all, and which have the form ``cross_entropy`` gives
    (``softmax(z) - target`` times a weight, for a target at one label or smoothed: one value below 0, at the
    label, and a sum of 0 within ``tolerance`` of the row's size)."""
    size = g.abs().sum(1)
    read = size > 0
    return read, read & ((g < 0).sum(1) == 1) & (g.sum(1).abs() <= tolerance * size)


def batch_labels(grad: torch.Tensor, tolerance: float = 1e-3) -> torch.Tensor:
    """:data:`BATCH_LABELS` of a 2-d output's gradient, on its device, from the rows that have the form
    ``cross_entropy`` gives (``softmax(z) - onehot(label)`` times a weight: one value below 0, at the label, and a sum
    of 0 within ``tolerance`` of the row's size): their share of the rows read (a row without a gradient counts
    against it: a loss over one row of the batch shows no batch of one label), the label of the first
    and of the last row, whether the labels run in order down the batch (1: never falling, or never rising; 0: not),
    and the length of the shortest run of one label (a row without the form takes the label before it). NaN when no
    row has a gradient or the output is not 2-d; only the first :data:`SIGMOID_ELEMENTS` values are read.

    >>> from torch.nn import functional as F
    >>> z = torch.randn(8, 3, requires_grad=True)
    >>> def labels(y): return batch_labels(torch.autograd.grad(F.cross_entropy(z, torch.tensor(y)), z)[0]).tolist()
    >>> labels([2, 2, 2, 2, 2, 2, 2, 2]), labels([0, 0, 0, 1, 1, 1, 1, 1])
    ([1.0, 2.0, 2.0, 1.0, 8.0], [1.0, 0.0, 1.0, 1.0, 3.0])
    >>> labels([0, 2, 1, 1, 0, 1, 2, 0])[3]  # shuffled
    0.0
    >>> batch_labels(torch.autograd.grad(F.mse_loss(z, torch.ones(8, 3)), z)[0])[0].item()  # not cross_entropy's
    0.0
    >>> batch_labels(torch.autograd.grad(F.cross_entropy(z[:1], torch.tensor([2])), z)[0])[0].item()  # one row of 8
    0.125
    """
    if grad.dim() != 2 or grad.shape[1] < 2 or grad.numel() == 0:
        return torch.full((len(BATCH_LABELS),), math.nan, dtype=torch.float32, device=grad.device)
    g = grad.detach()[:max(1, SIGMOID_ELEMENTS // grad.shape[1])].float()
    read, form = cross_entropy_rows(g, tolerance)
    rows = torch.arange(len(g), device=g.device)
    seen = torch.where(form, rows, -1).cummax(0).values
    first_form = torch.where(form, rows, len(g)).amin().clamp_max(len(g) - 1)
    labels = g.argmin(1)[torch.where(seen < 0, first_form, seen)]
    steps = labels[1:] - labels[:-1]
    in_order = ((steps >= 0).all() | (steps <= 0).all()).float()
    run = torch.cumsum(torch.cat([torch.ones(1, dtype=torch.long, device=g.device), (steps != 0).long()]), 0) - 1
    runs = torch.zeros(len(g), device=g.device).scatter_add_(0, run, torch.ones(len(g), device=g.device))
    shortest = torch.where(runs > 0, runs, math.inf).amin()
    share = torch.where(read.any(), form.sum() / len(g), math.nan)
    found = torch.stack([labels[0].float(), labels[-1].float(), in_order, shortest])
    return torch.cat([share.reshape(1), torch.where(form.any(), found, math.nan)])


SOFTMAX_TWICE = ("softmax_form", "label_loss", "uniform_loss")


def softmax_twice(grad: torch.Tensor, output: torch.Tensor, tolerance: float = 1e-3) -> torch.Tensor:
    """:data:`SOFTMAX_TWICE` of an output's rows (its last dimension), on its device, read with its gradient: the
    share of the rows with a gradient that have the form ``cross_entropy`` gives (:func:`cross_entropy_rows`), and
    over those rows, with the label read from the gradient (its one value below 0), the mean of
    ``logsumexp(row) - row[label]`` and of ``logsumexp(row) - mean(row)``: what ``cross_entropy`` of the rows taken as
    logits costs with a one-hot target and with a uniform one. ``cross_entropy(z, y, label_smoothing=e)`` is
    ``(1 - e)`` times the first plus ``e`` times the second, whatever ``z`` is, so the loss read beside them gives
    ``e`` when the loss is that. NaN when no row has the form; only the first :data:`SIGMOID_ELEMENTS` values are
    read.

    >>> from torch.nn import functional as F
    >>> p, y = torch.softmax(torch.randn(16, 4), -1).requires_grad_(), torch.randint(0, 4, (16,))
    >>> loss = F.cross_entropy(p, y, label_smoothing=0.1)
    >>> share, one_hot, uniform = softmax_twice(torch.autograd.grad(loss, p)[0], p).tolist()
    >>> share, round((loss.item() - one_hot) / (uniform - one_hot), 4)
    (1.0, 0.1)
    >>> softmax_twice(torch.autograd.grad(F.nll_loss(p.log(), y), p)[0], p)[0].item()  # not cross_entropy's form
    0.0
    >>> padded = torch.where(torch.arange(16) < 12, y, -100)  # ignore_index rows have no gradient: not counted
    >>> softmax_twice(torch.autograd.grad(F.cross_entropy(p, padded), p)[0], p)[0].item()
    1.0
    """
    width = output.shape[-1] if output.dim() else 0
    if grad.shape != output.shape or width < 2 or output.numel() == 0:
        return torch.full((len(SOFTMAX_TWICE),), math.nan, dtype=torch.float32, device=grad.device)
    count = max(1, SIGMOID_ELEMENTS // width) * width
    g, z = (leading(x.detach(), count).float().reshape(-1, width) for x in (grad, output))
    read, form = cross_entropy_rows(g, tolerance)
    lse = torch.logsumexp(z, -1)
    one_hot = lse - z.gather(1, g.argmin(1, keepdim=True)).squeeze(1)
    uniform = lse - z.mean(-1)
    rows = form.sum().clamp_min(1)
    means = torch.stack([torch.where(form, one_hot, 0.0).sum(), torch.where(form, uniform, 0.0).sum()]) / rows
    share = torch.where(read.any(), form.sum() / read.sum().clamp_min(1), math.nan)
    return torch.cat([share.reshape(1), torch.where(form.any(), means, math.nan)])


AVERAGE_GUESS = ("guess_rows", "guess_rows_loss", "average_guess_loss")
GUESS_ROWS = 64
"""The rows :func:`average_guess` reads at least (more where :data:`SIGMOID_ELEMENTS` values hold more), spread over
the output: a language model's vocabulary fills the values of one row, and one row is its own average."""


def spread_rows(grad: torch.Tensor, output: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``rows`` rows (the last dimension) of ``grad`` and of ``output``, the same ones, as float32 copies: spread
    evenly over all the rows where both are contiguous (a language model's positions, not its first sequence's
    first tokens alone), the first ones otherwise; no other copy is made::

        >>> x = torch.arange(24.0).reshape(2, 6, 2)
        >>> spread_rows(x, x, 3)[1][:, 0].tolist(), spread_rows(x, x.transpose(0, 1), 3)[1][:, 0].tolist()
        ([0.0, 8.0, 16.0], [0.0, 12.0, 2.0])
    """
    width = output.shape[-1]
    if grad.is_contiguous() and output.is_contiguous():
        every = max(1, output.numel() // width // rows)
        return tuple(x.detach().reshape(-1, width)[::every][:rows].float() for x in (grad, output))
    return tuple(leading(x.detach(), rows * width).float().reshape(-1, width) for x in (grad, output))


def average_guess(grad: torch.Tensor, output: torch.Tensor, tolerance: float = 1e-3) -> torch.Tensor:
    """:data:`AVERAGE_GUESS` of an output's rows (its last dimension), on its device, read with its gradient: how many
    rows have the form ``cross_entropy`` gives (the label at the gradient's one value below 0), the mean of their own
    ``cross_entropy`` (``logsumexp(z) - z[label]``), and the mean of ``-log(mean_rows(softmax(z))[label])``, what their
    average prediction costs. A model that gives every sample the same answer (the labels' frequencies, nothing from
    the inputs) pays as much per row as its average does; one that learns from its inputs pays less, whatever the
    balance of the classes. NaN means when no row has the form; :data:`GUESS_ROWS` rows or :data:`SIGMOID_ELEMENTS`
    values are read (:func:`spread_rows`).

    >>> from torch.nn import functional as F
    >>> y = torch.tensor([0, 0, 0, 1])
    >>> same = torch.tensor([[1.0, 0.0]]).repeat(4, 1).requires_grad_()  # one answer for all: its own loss, twice
    >>> loss = F.cross_entropy(same, y)
    >>> [round(v, 4) for v in average_guess(torch.autograd.grad(loss, same)[0], same).tolist()], round(loss.item(), 4)
    ([4.0, 0.5633, 0.5633], 0.5633)
    >>> fitted = (10 * F.one_hot(y, 2).float()).requires_grad_()  # each row right: far less than its average's cost
    >>> read = average_guess(torch.autograd.grad(F.cross_entropy(fitted, y), fitted)[0], fitted)
    >>> [round(v, 3) for v in read.tolist()]
    [4.0, 0.0, 0.562]
    """
    width = output.shape[-1] if output.dim() else 0
    if grad.shape != output.shape or width < 2 or output.numel() == 0:
        return torch.full((len(AVERAGE_GUESS),), math.nan, dtype=torch.float32, device=grad.device)
    g, z = spread_rows(grad, output, max(GUESS_ROWS, SIGMOID_ELEMENTS // width))
    _, form = cross_entropy_rows(g, tolerance)
    weights = form.float()
    rows = weights.sum()
    labels = g.argmin(1, keepdim=True)
    own = torch.logsumexp(z, -1) - z.gather(1, labels).squeeze(1)
    average = (torch.softmax(z, -1) * weights[:, None]).sum(0) / rows.clamp_min(1)
    cost = -average[labels.squeeze(1)].clamp_min(torch.finfo(torch.float32).tiny).log()
    means = torch.stack([torch.where(form, own, 0.0).sum(), torch.where(form, cost, 0.0).sum()]) / rows.clamp_min(1)
    return torch.cat([rows.reshape(1), torch.where(form.any(), means, math.nan)])


SCALED_CROSS_ENTROPY = ("softmax_fit", "softmax_misfit", "label_smoothing", "row_loss")
SMOOTHING_MAX = 0.5
"""The largest label smoothing :func:`scaled_cross_entropy` reads (0.1 or 0.2 is what models train with)."""
SMOOTHING_GRID = 51
SOFTMAX_ELEMENTS = 1 << 18
"""The largest output :func:`scaled_cross_entropy` reads: all of it, since the loss is compared with every row's (256
rows of 1,000 classes: 25 ms on a busy 2-core CPU, once per judged step)."""


def scaled_cross_entropy(grad: torch.Tensor, output: torch.Tensor, loss: torch.Tensor | None,
                         tolerance: float = 1e-3) -> torch.Tensor:
    """:data:`SCALED_CROSS_ENTROPY` of an output's rows (its last dimension), on its device, read with its gradient
    and the loss it came from: whether the loss is ``cross_entropy`` of the rows taken as logits, times any factor.

    ``c * cross_entropy(z, y, label_smoothing=e)`` gives each row the gradient ``k (softmax(z) - t)``, ``t`` the
    smoothed one-hot target at the label (the gradient's one value below 0), ``k`` the row's weight (``c / N`` for the
    mean, ``c`` for a sum, times a class weight), and the loss is the sum over the rows of ``k`` times the row's
    cross-entropy, ``(1 - e)`` times its one-hot cost plus ``e`` times its uniform one. For each ``e`` from 0 to
    :data:`SMOOTHING_MAX` the rows' ``k`` is fitted to their gradient, and ``e`` is where the loss so predicted
    crosses the loss given (interpolated on a grid). Returned: the share of the rows with a gradient that it fits
    within ``tolerance`` (with ``k > 0``), the predicted loss's distance from the given one as a share of it, ``e``,
    and the rows' mean cross-entropy at ``e`` (the loss over it is the factor). Neither the loss's scale (``loss /
    k``, ``reduction="sum"``) nor ignored rows change the reading; ``mse_loss`` against one-hot targets, which also
    gives one value below 0 per row, misses the loss by a factor of 2 or more. Class weights with label smoothing
    give each class its own smoothed target, which this does not fit (:func:`softmax_twice` reads those, at a factor
    of 1). NaN when no row has a gradient, the loss is unknown or the output has more than
    :data:`SOFTMAX_ELEMENTS` values.

    >>> from torch.nn import functional as F
    >>> p, y = torch.softmax(torch.randn(16, 4), -1).requires_grad_(), torch.randint(0, 4, (16,))
    >>> def read(loss): return scaled_cross_entropy(torch.autograd.grad(loss, p)[0], p, loss).tolist()
    >>> fit, misfit, smoothing, row_loss = read(0.5 * F.cross_entropy(p, y, label_smoothing=0.1))
    >>> fit, misfit < 1e-4, round(smoothing, 4), round(0.5 * F.cross_entropy(p, y, label_smoothing=0.1).item()
    ...                                                   / row_loss, 4)
    (1.0, True, 0.1, 0.5)
    >>> fit, misfit, _, _ = read(F.mse_loss(p, F.one_hot(y, 4).float()))  # the same form, not the same loss
    >>> fit < 0.5 or misfit > 1
    True
    >>> read(F.nll_loss(p.log(), y))[0]  # not cross_entropy's gradient
    0.0
    """
    width = output.shape[-1] if output.dim() else 0
    if (loss is None or grad.shape != output.shape or width < 2 or output.numel() == 0
            or output.numel() > SOFTMAX_ELEMENTS):
        return torch.full((len(SCALED_CROSS_ENTROPY),), math.nan, dtype=torch.float32, device=grad.device)
    g, z = (x.detach().reshape(-1, width).float() for x in (grad, output))
    given = loss.detach().float().mean().to(g.device)
    read = g.abs().sum(1) > 0
    labels = g.argmin(1, keepdim=True)
    soft = torch.softmax(z, -1)
    one_hot = torch.zeros_like(soft).scatter_(1, labels, 1.0)
    a, b = soft - one_hot, one_hot - 1.0 / width  # t = one_hot - e * b: the gradient is k (a + e b)
    ga, gb, aa, ab, bb = ((x * y).sum(1) for x, y in ((g, a), (g, b), (a, a), (a, b), (b, b)))
    lse = torch.logsumexp(z, -1)
    hot, flat = lse - z.gather(1, labels).squeeze(1), lse - z.mean(-1)

    def at(e: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        e = e[..., None]
        k = (ga + e * gb) / (aa + 2 * e * ab + e * e * bb).clamp_min(torch.finfo(torch.float32).tiny)
        row = hot + e * (flat - hot)
        return k, row, torch.where(read, k * row, 0.0).sum(-1)

    grid = torch.linspace(0.0, SMOOTHING_MAX, SMOOTHING_GRID, device=g.device)
    off = (at(grid)[2] - given) / given.abs().clamp_min(torch.finfo(torch.float32).tiny)
    crosses = (off[:-1] <= 0) != (off[1:] <= 0)
    j = crosses.int().argmax()
    step = (off[j] - off[j + 1]).where(off[j] != off[j + 1], torch.ones_like(off[j]))
    e = torch.where(crosses.any(), grid[j] + (grid[j + 1] - grid[j]) * off[j] / step, grid[off.abs().argmin()])
    k, row, predicted = (value[0] for value in at(e.reshape(1)))
    residual = torch.linalg.vector_norm(g - k[:, None] * (a + e * b), dim=1)
    fits = read & (residual <= tolerance * torch.linalg.vector_norm(g, dim=1)) & (k > 0)
    rows = read.sum().clamp_min(1)
    found = torch.stack([fits.sum() / rows, (predicted - given).abs() / given.abs(), e,
                         torch.where(read, row, 0.0).sum() / rows])
    return torch.where(read.any() & torch.isfinite(given), found, math.nan)
