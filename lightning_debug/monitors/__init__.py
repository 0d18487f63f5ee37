"""Framework-free checks of each area, driven by the Lightning callbacks and the Accelerate debugger."""
