from backend.triton_model import TritonPythonModel  # noqa: F401  (Triton loads this class)
