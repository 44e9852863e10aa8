// Each extension of the package (the core `_C` and every engine) is a Python
// module so that `import torch_kvswap._C...` loads the shared object and runs
// its operator registrations. None defines Python functions.
//
// The core module also exports the engine registry (kvswap.h, EngineRegistry)
// as the capsule `torch_kvswap._C._engine_registry`, and each engine's module
// installs its engine there when it is imported: CPython's way for one
// extension to call another (PyCapsule_Import), so the engines link nothing
// of the core. Its other capsule, `_test_hooks`, serves the test extension
// (core/test_hooks.h).
#pragma once

#include <Python.h>

#include "kvswap.h"

namespace kvswap {
namespace python {

inline constexpr const char* kRegistryCapsule = "torch_kvswap._C._engine_registry";
inline constexpr const char* kTestHooksCapsule = "torch_kvswap._C._test_hooks";

// The core's registry, imported (and checked) from an extension's module
// init, which holds the GIL. Null with a Python ImportError set when the core
// is missing or was built against another engine interface than `expected`
// (this extension's own; tests pass another).
inline const EngineRegistry* core_registry(uint32_t expected = kEngineInterfaceVersion) {
  const auto* registry = static_cast<const EngineRegistry*>(PyCapsule_Import(kRegistryCapsule, 0));
  if (registry == nullptr) return nullptr;
  if (registry->version != expected) {
    PyErr_Format(PyExc_ImportError,
                 "torch_kvswap: this engine was built for engine interface %u but the core "
                 "(torch_kvswap._C) has %u; rebuild torch_kvswap",
                 expected, registry->version);
    return nullptr;
  }
  return registry;
}

// Makes the engine `engine()` returns serve `type`; false with a Python
// ImportError set when it cannot: the engine's own setup or the core refused.
inline bool install_engine(c10::DeviceType type, const EngineInterface& (*engine)()) {
  const EngineRegistry* registry = core_registry();
  if (registry == nullptr) return false;
  try {
    registry->install(type, &engine());
  } catch (const std::exception& e) {
    PyErr_SetString(PyExc_ImportError, e.what());
    return false;
  }
  return true;
}

// A module with no functions; `attribute`, when given, is added under `name`
// (its reference is taken, also on failure).
inline PyObject* create_module(PyModuleDef* def, const char* name = nullptr, PyObject* attribute = nullptr) {
  PyObject* module = PyModule_Create(def);
  if (name == nullptr) return module;
  if (module == nullptr || attribute == nullptr || PyModule_AddObject(module, name, attribute) < 0) {
    Py_XDECREF(attribute);
    Py_XDECREF(module);
    return nullptr;
  }
  return module;
}

}  // namespace python
}  // namespace kvswap

#define KVSWAP_MODULE_DEF(NAME)     \
  static PyModuleDef module_def = { \
      PyModuleDef_HEAD_INIT, #NAME, nullptr, 0, nullptr, nullptr, nullptr, nullptr, nullptr}

// An engine's module: on import, installs `ENGINE` (a const EngineInterface&)
// for device type TYPE; the import fails with the reason when it cannot.
#define KVSWAP_ENGINE_MODULE(NAME, TYPE, ENGINE)                                                          \
  extern "C" PyMODINIT_FUNC PyInit_##NAME(void) {                                                         \
    KVSWAP_MODULE_DEF(NAME);                                                                              \
    if (!kvswap::python::install_engine(TYPE, []() -> const kvswap::EngineInterface& { return ENGINE; })) \
      return nullptr;                                                                                     \
    return kvswap::python::create_module(&module_def);                                                    \
  }
