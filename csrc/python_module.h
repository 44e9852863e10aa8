// Each extension of the package (the core `_C` and every engine) is a Python
// module only so that `import torch_kvswap._C...` loads the shared object and
// runs its operator registrations. It defines no Python functions.
#pragma once

#include <Python.h>

#define KVSWAP_PYTHON_MODULE(NAME)                                                              \
  extern "C" PyMODINIT_FUNC PyInit_##NAME(void) {                                               \
    static struct PyModuleDef module_def = {                                                    \
        PyModuleDef_HEAD_INIT, #NAME, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr}; \
    return PyModule_Create(&module_def);                                                        \
  }
