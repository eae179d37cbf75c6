"""What the server exports about the engine's load, from the engine's stats snapshots."""
