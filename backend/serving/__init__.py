"""The group loop every rank runs: one session table, the scheduler copy every rank plans with, one plan per
block boundary, the decode sender. No Triton import: a responder is anything with the `Responder` protocol.
"""
