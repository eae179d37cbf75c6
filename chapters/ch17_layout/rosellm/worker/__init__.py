"""The model runner: one step's inputs as tensors, the forward, the KV pool it owns."""
