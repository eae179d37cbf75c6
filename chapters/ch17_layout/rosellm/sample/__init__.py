"""Turning logits into tokens: the sampler, and the rejection sampler that verifies drafts."""
