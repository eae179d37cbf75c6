"""Paged attention: the metadata of a forward, the layer the model calls, backends and their ops."""
