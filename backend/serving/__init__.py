"""One rank of the serving group: its intake (requests in, responses out, on the owner), its group loop (the
scheduler copy every rank plans with, one plan per block boundary, the engine sessions), its decode sender, and
the letters between them. No Triton import: a responder is anything with the `Responder` protocol.
"""
