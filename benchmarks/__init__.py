"""Load tests and speed comparisons."""
