"""The model families: the Llama-family decoder."""
