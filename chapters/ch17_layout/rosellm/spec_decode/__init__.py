"""Speculative decoding: proposers of draft tokens (n-gram, a draft model) and how one is chosen."""
