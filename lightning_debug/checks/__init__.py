"""Pure check functions over tensors: no Lightning, no Accelerate, no I/O.

The adapters in :mod:`lightning_debug.callbacks` and :mod:`lightning_debug.accelerate` turn
framework hooks into calls of these functions, so every check has exactly one implementation.
"""
