"""Render the model repository and run a real tritonserver (and perf_analyzer) from the pytriton wheel."""
