"""What a user calls: the `LLM` class, the command line, the OpenAI-compatible server."""
