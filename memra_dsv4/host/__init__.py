"""Host-side (NumPy) rules shared by the oracle and mirrored by the GPU kernels."""
