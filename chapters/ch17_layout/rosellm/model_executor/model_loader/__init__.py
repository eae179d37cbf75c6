"""Weights into a model: Hugging Face folders, GGUF files, quantization at load."""
