"""The group loop every rank runs: rank 0's scheduler, one plan per block boundary, the response writer.

No Triton import: a responder is anything with the `Responder` protocol.
"""
