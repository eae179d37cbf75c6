"""The OpenAI-compatible HTTP server and the shapes of its requests and answers."""
