"""Tensor parallelism's pieces: how weights are sharded per rank and how ranks sum their parts."""
