"""Pure tensor kernels shared by losses and teachers: the fused LM head, the top-k rest mass, compiled kernels."""
