"""Constraints compiled into token automata, and the bitmask that applies them to logits."""
