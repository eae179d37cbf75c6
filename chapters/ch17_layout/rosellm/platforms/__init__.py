"""What the machine can do: the CPU's vector extensions and the level kernels are built for."""
