"""The NumPy oracle of DeepSeek-V4-Flash: the arithmetic contract of the GPU runtime."""
