"""memra-dsv4: a CuPy + raw-CUDA runtime for DeepSeek-V4-Flash on H200s, with an exact NumPy oracle."""
