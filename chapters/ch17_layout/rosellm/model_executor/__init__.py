"""The model and what builds it: the Llama network, its layers, the loaders of its weights."""
