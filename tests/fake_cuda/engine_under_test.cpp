// The CUDA engine's host logic, compiled into `torch_kvswap._fake_cuda`: the
// same source file as in `_C_cuda`, included rather than copied (a separate
// translation unit keeps its object file apart from `_C_cuda`'s).
#include "../../csrc/cuda/cuda_engine.cpp"
