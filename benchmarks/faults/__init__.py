"""The fault benchmark (issue 45): published training-bug classes re-created as tiny CPU Lightning programs,
each with its fixed twin, and a runner that measures what lightning-debug names. See docs/faults.md."""
