"""The CPU's native kernels: C++ through the XLA FFI."""
