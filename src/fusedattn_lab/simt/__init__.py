"""Thread-level kernels written with the numba.cuda API (the chapter's HIP route).

Device buffers are torch tensors; numba sees them through `__cuda_array_interface__` and
launches on torch's current stream, so torch's memory statistics and CUDA events see
everything. In emulation (numba's CUDA simulator) the same kernels run on CPU tensors'
numpy views.
"""
