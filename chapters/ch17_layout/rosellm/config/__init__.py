"""The engine's options, the model's shape and speculative decoding's settings, checked once."""
