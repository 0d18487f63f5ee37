"""What kind of runtime error stopped the user's step (``details.category`` of an ``exception`` finding), and the
advice for each, so the console, events.jsonl and the report agree.

    >>> ErrorCategory("shape_mismatch") is ErrorCategory.SHAPE_MISMATCH, all(c in ERROR_ADVICE for c in ErrorCategory)
    (True, True)
"""

from __future__ import annotations

from lightning_debug.core.strenum import StrEnum


class ErrorCategory(StrEnum):
    """What kind of runtime error the user's step raised (``details.category`` of an ``exception`` event)."""

    SHAPE_MISMATCH = "shape_mismatch"
    DEVICE_MISMATCH = "device_mismatch"
    DTYPE_MISMATCH = "dtype_mismatch"
    INPLACE_OPERATION = "inplace_operation"
    BACKWARD_TWICE = "backward_twice"
    NO_GRAD = "no_grad"
    DDP_UNUSED_PARAMETERS = "ddp_unused_parameters"
    INDEX_OUT_OF_RANGE = "index_out_of_range"
    DEVICE_ASSERT = "device_assert"
    OOM = "oom"
    OTHER = "other"


ERROR_ADVICE: dict[ErrorCategory, str] = {
    ErrorCategory.SHAPE_MISMATCH: "Make the shapes agree where it failed: flatten (`x.view(x.size(0), -1)`), "
                                  "transpose, unsqueeze, or fix the layer's size (`in_features`, `in_channels`) to "
                                  "the input it really gets; `lightning_debug.inspect_tensor(x)` prints a tensor's "
                                  "shape, dtype and device.",
    ErrorCategory.DEVICE_MISMATCH: "Keep the model and the batch on one device: let Lightning/Accelerate move the "
                                   "batch (no `.cuda()`/`.cpu()` of your own), register tensors the model keeps as "
                                   "buffers (`self.register_buffer`) so `.to(device)` moves them, and create new "
                                   "tensors with `device=x.device`.",
    ErrorCategory.DTYPE_MISMATCH: "Use float32 (or the autocast dtype) for inputs and long (int64) for class "
                                  "labels; convert with `.float()` / `.long()` in the dataset, not in the model.",
    ErrorCategory.INPLACE_OPERATION: "An in-place operation (`x += y`, `x[i] = v`, `.add_()`, `relu(inplace=True)`) "
                                     "changed a tensor the backward needs: use the out-of-place form `x = x + y`, or "
                                     "`x = x.clone()` before modifying it; modify leaf parameters only under "
                                     "`torch.no_grad()`.",
    ErrorCategory.BACKWARD_TWICE: "Recompute the forward before the second backward, or pass `retain_graph=True` to "
                                  "the first one if you really need both. Most often a tensor of the previous step "
                                  "(an RNN hidden state, a running loss) enters this step's graph: `.detach()` it.",
    ErrorCategory.NO_GRAD: "The loss is cut off from the parameters: remove the `.detach()`, `.item()`, `.data`, "
                           "`torch.no_grad()` or numpy round-trip on the path to the loss, and check that parameters "
                           "have `requires_grad=True`.",
    ErrorCategory.DDP_UNUSED_PARAMETERS: "Parameters that get no gradient under DDP: use them in forward, "
                                         "remove them, freeze them (`requires_grad_(False)`), or let DDP look for "
                                         "them (slower, it walks the graph every step): `Trainer(strategy="
                                         "'ddp_find_unused_parameters_true')`, `DistributedDataParallel("
                                         "find_unused_parameters=True)`, or Accelerate's "
                                         "`DistributedDataParallelKwargs(find_unused_parameters=True)`.",
    ErrorCategory.INDEX_OUT_OF_RANGE: "A class label or an index is out of range: labels for `cross_entropy`/"
                                      "`nll_loss` must be in [0, num_classes) (check `target.min()`, `target.max()` "
                                      "and that the head has num_classes outputs), token ids below the embedding "
                                      "size; `lightning_debug.check_labels(target, num_classes)` names the samples.",
    ErrorCategory.DEVICE_ASSERT: "A CUDA kernel failed an assertion, most often a class label outside [0, num_classes) "
                                 "in `cross_entropy`/`nll_loss` or a token id beyond the embedding size. Check the "
                                 "labels' range; rerun with `CUDA_LAUNCH_BLOCKING=1` or on CPU to see the exact "
                                 "operation. The CUDA context is unusable after this error: restart the process.",
    ErrorCategory.OOM: "See the out-of-memory post-mortem (`oom` finding, `oom_step<N>.md`, with "
                       "MemoryProfilerCallback): a smaller batch, gradient accumulation, mixed precision or activation "
                       "checkpointing.",
    ErrorCategory.OTHER: "The traceback and the module named here show where it happened.",
}
