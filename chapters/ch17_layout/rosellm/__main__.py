"""`python -m rosellm`: the command line of entrypoints/cli.py."""

from .entrypoints.cli import main

if __name__ == "__main__":  # a process spawned by this one imports this module again, under another name
    main()
