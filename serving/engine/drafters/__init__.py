"""Drafters: what proposes tokens for the target to verify, including model-free host-side proposers."""
