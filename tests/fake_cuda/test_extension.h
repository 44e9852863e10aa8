// Shared by the files of the test extension (torch_kvswap._fake_cuda).
#pragma once

#include "../../csrc/core/test_hooks.h"
#include "../../csrc/kvswap.h"

namespace kvswap_test {

// The core's engine registry and test hooks, taken when the module is
// imported (test_extension.cpp, PyInit__fake_cuda).
extern const kvswap::EngineRegistry* g_registry;
extern const kvswap::CoreTestHooks* g_hooks;

}  // namespace kvswap_test
