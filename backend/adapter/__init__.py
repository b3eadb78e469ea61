"""The Triton Python-backend model: the only importer of `triton_python_backend_utils`."""
