"""Runs the model over several processes (tensor parallelism): rank 0 drives, the others follow."""
