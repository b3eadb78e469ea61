from backend.adapter.model import TritonPythonModel  # noqa: F401  (Triton loads this class)
