"""Everything a person reads: report.json and report.md, the console summary, the plots, the TensorBoard layout
and text, the out-of-memory post-mortem, and the offline rebuild of all of them. Nothing here measures or decides.
"""
