"""Speculative decoding: proposers, acceptance accounting and metrics."""
