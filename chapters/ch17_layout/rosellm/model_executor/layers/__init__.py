"""Layers the models share: packed (fused) and quantized linear layers."""
