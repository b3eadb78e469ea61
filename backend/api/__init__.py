"""Torch-free: the wire contract, request checks and errors, shared by the server and the client."""
