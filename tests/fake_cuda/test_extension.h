// Shared by the files of the test extension (torch_kvswap._fake_cuda).
#pragma once

#include "../../csrc/core/test_hooks.h"
#include "../../csrc/kvswap.h"

namespace kvswap_test {

// The core's engine registry and test hooks (the extension links the core).
extern const kvswap::EngineRegistry* const g_registry;
extern const kvswap::CoreTestHooks* const g_hooks;

}  // namespace kvswap_test
