"""Speculative Verification (Kim et al., arXiv 2509.24328): verify only the drafted tokens that pay for themselves.

A companion model scores each drafted block; per-position features of the draft and companion distributions
predict how much each drafted token adds to the expected accepted length (``features``, ``predictor``); a
latency table measured on this machine (``latency``) prices each verification width; the stopping rule in
``blockspec.policy`` turns both into lossless per-row verification lengths.
"""
