"""One setting for the benchmark scripts that train many models in one process (the sweep, the plant matrix)."""

from __future__ import annotations

import logging
import warnings


def quiet_process() -> None:
    """No Python warnings or log lines below errors, one torch thread (2-core machine: spin-waiting OpenMP
    threads make step times meaningless), transformers' own messages at error level."""
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(1)
    try:
        import transformers
    except ImportError:
        return
    transformers.logging.set_verbosity_error()
