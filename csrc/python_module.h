// Each extension of the package (the core `_C` and every engine) is also a
// Python module, so that `import torch_kvswap._C...` loads its shared object.
// None defines Python functions, and nothing happens at import that does not
// happen when the library loads: the core's library registers the ops and the
// host engine, and an engine's library installs its engine in the core's
// registry (kvswap.h, install_engine), which it links. So
// torch.ops.load_library, or a C++ program that opens the library, gets the
// same as the import. The import only reports an engine whose install failed.
//
// Only CPython functions are used, never its data (no PyExc_* objects), so a
// program without libpython loads these libraries (lazy binding resolves a
// function when it is first called, and nothing calls these outside Python).
#pragma once

#include <Python.h>

#include <string>

#include "kvswap.h"

namespace kvswap {
namespace python {

// Raises ImportError(message) in the calling module init, which holds the GIL.
inline void set_import_error(const std::string& message) {
  PyObject* text = PyUnicode_FromStringAndSize(message.data(), static_cast<Py_ssize_t>(message.size()));
  if (text == nullptr) return;  // MemoryError is set
  PyErr_SetImportError(text, nullptr, nullptr);
  Py_DECREF(text);
}

// A module with no functions.
inline PyObject* create_module(PyModuleDef* def) { return PyModule_Create(def); }

}  // namespace python
}  // namespace kvswap

#define KVSWAP_MODULE_DEF(NAME)     \
  static PyModuleDef module_def = { \
      PyModuleDef_HEAD_INIT, #NAME, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr}

// An engine's library: installs `ENGINE` (a const EngineInterface&) for
// device type TYPE while the library loads; its module's import fails with
// the reason when that did not work.
#define KVSWAP_ENGINE_MODULE(NAME, TYPE, ENGINE)                                               \
  namespace {                                                                                  \
  const std::string kvswap_install_error =                                                     \
      kvswap::install_engine(TYPE, []() -> const kvswap::EngineInterface& { return ENGINE; }); \
  }                                                                                            \
  extern "C" PyMODINIT_FUNC PyInit_##NAME(void) {                                              \
    KVSWAP_MODULE_DEF(NAME);                                                                   \
    if (!kvswap_install_error.empty()) {                                                       \
      kvswap::python::set_import_error(kvswap_install_error);                                  \
      return nullptr;                                                                          \
    }                                                                                          \
    return kvswap::python::create_module(&module_def);                                         \
  }
