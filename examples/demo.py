"""Run the planted-NaN demo: ``python examples/demo.py`` (same as ``lightning-debug demo``)."""

from lightning_debug.demo import run_demo

if __name__ == "__main__":
    run_demo()
