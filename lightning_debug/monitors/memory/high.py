"""The ``memory_high`` rule: a device or the machine nearly full at a check step. The caching allocator keeps
a healthy run's reserved memory near its peak, which ``memory_high_fraction`` leaves room for; one episode
per device; on the CPU ``available`` memory (not ``free``: the page cache) is compared::

    >>> from lightning_debug.checks.memory import MemoryReading
    >>> reading = MemoryReading(cpu_rss=2**30, cpu_available=2**30, cpu_total=2**34, cpu_heap=None)
    >>> [(key, finding.details["device"], round(finding.details["fraction"], 2))
    ...  for key, finding in high_memory(reading, 7, limit=0.9)]
    [('cpu', 'cpu', 0.94)]
"""

from __future__ import annotations

from lightning_debug.checks.memory import MB, MemoryReading, format_bytes
from lightning_debug.core.findings import Finding
from lightning_debug.core.kinds import Kind, Severity
from lightning_debug.core.rules import CheckRead, Moment, Recorded, rule


def high_memory(reading: MemoryReading, step: int, limit: float) -> list[tuple[str, Finding]]:
    """``(episode key, finding)`` for the CUDA device and for the machine, each when above ``limit``."""
    found: list[tuple[str, Finding]] = []
    if reading.cuda_reserved is not None and reading.cuda_total:
        share = reading.cuda_reserved / reading.cuda_total
        if share > limit:
            found.append(("cuda", Finding(
                Kind.MEMORY_HIGH, Severity.WARNING,
                f"CUDA memory reserved is {share:.0%} of the device ({format_bytes(reading.cuda_reserved)} of "
                f"{format_bytes(reading.cuda_total)}; {format_bytes(reading.cuda_allocated or 0)} allocated) at "
                f"step {step}, above memory_high_fraction={limit:g}: a larger batch or a longer sequence will "
                "run out. Mixed precision, activation checkpointing or a smaller batch make room.",
                {"device": "cuda", "fraction": share, "reserved_mb": reading.cuda_reserved / MB,
                 "allocated_mb": (reading.cuda_allocated or 0) / MB, "total_mb": reading.cuda_total / MB,
                 "limit": limit})))
    used = 1.0 - reading.cpu_available / reading.cpu_total if reading.cpu_total else 0.0
    if used > limit:
        found.append(("cpu", Finding(
            Kind.MEMORY_HIGH, Severity.WARNING,
            f"System memory is {used:.0%} used ({format_bytes(reading.cpu_available)} available of "
            f"{format_bytes(reading.cpu_total)}; this process holds {format_bytes(reading.cpu_rss)}) at step "
            f"{step}, above memory_high_fraction={limit:g}: the machine may start swapping or the OOM killer "
            "may end the run. Fewer DataLoader workers, a smaller prefetch_factor or a dataset read from "
            "disk instead of memory make room.",
            {"device": "cpu", "fraction": used, "available_mb": reading.cpu_available / MB,
             "total_mb": reading.cpu_total / MB, "rss_mb": reading.cpu_rss / MB, "limit": limit})))
    return found


@rule(Kind.MEMORY_HIGH, at=Moment.CHECK_READ)
def high_at_check(facts: CheckRead) -> list[Recorded]:
    """The registered rule: one episode per device."""
    return [Recorded(finding, key=key) for key, finding in high_memory(facts.numbers, facts.step,
                                                                        facts.settings.high_fraction)]
