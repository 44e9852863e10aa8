// Shared declarations of torch_kvswap's C++ core and its engines.
//
// The package is split the way a reader looks for things:
//   registration.cpp  every schema of the `kvswap` namespace, declared once;
//   core/             the device-generic core, one file per concern:
//                       validation.cpp   every check of a call's tensors and ids;
//                       descriptors.cpp  descriptor building, merging, ordering;
//                       ops.cpp          the kernels of the copy ops: which
//                                        engine and path serve a call;
//                       engines.cpp      engine lookup, descriptor tables' pool
//                                        (core.h), submission to an engine;
//                       expand_block_ids.cpp;
//                     it only ever hands a validated CopyBatch to an engine;
//   host/             the host engine (memcpy on a thread pool), always built;
//   cuda/, ascend/    the accelerator engines, each a separate extension.
//
// An engine is reached through one table of functions, EngineInterface below:
// each engine hands the core its table when its extension loads (the core's
// own host engine at start-up), and the core calls it directly. A call
// crosses the dispatcher once, into the core's op. Engines live in separate
// shared objects that link the core (for its registry, kvswap_engine_registry
// below) but not each other, and a missing engine is an error message, not a
// loader failure.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

namespace kvswap {

// Direction codes of `swap_blocks_batch`. These values are the public
// contract with the reference call (0 = host->device, 1 = device->host,
// 2 = device->device); torch_kvswap.Direction mirrors them. Two tests tie
// the two together: `kvswap::_direction_name` names a code by this enum's
// values (tests/test_swap_blocks_batch.py::test_direction_enum_matches_the_cpp_codes),
// and the codes the core hands an engine for each route are checked
// (tests/test_fake_device.py::test_each_route_hands_the_engine_its_direction_code).
enum class Direction : int64_t {
  kHostToDevice = 0,
  kDeviceToHost = 1,
  kDeviceToDevice = 2,
};

// Lower-case name of a direction code ("host_to_device", ...), decided by the
// enum's values; throws for an unknown code, naming the argument `what`.
inline const char* direction_name(int64_t code, const char* what = "direction") {
  switch (static_cast<Direction>(code)) {
    case Direction::kHostToDevice:
      return "host_to_device";
    case Direction::kDeviceToHost:
      return "device_to_host";
    case Direction::kDeviceToDevice:
      return "device_to_device";
  }
  TORCH_CHECK_VALUE(false, what, " must be 0 (host_to_device), 1 (device_to_host) or ",
                    "2 (device_to_device), got ", code);
}

inline Direction checked_direction(int64_t code, const char* what = "direction") {
  direction_name(code, what);
  return static_cast<Direction>(code);
}

// What an error says about the copies of its call. Every error raised before
// any copy was queued ends in "nothing was copied"; one raised after copies
// 0..queued-1 of a call's descriptors were queued says so and that they will
// still run (`count`: the call's descriptors, as _plan_swap_blocks lists them).
inline constexpr const char* kNothingCopied = "nothing was copied";

inline std::string copies_left_behind(int64_t queued, int64_t count) {
  if (queued <= 0) return kNothingCopied;
  return "descriptors 0.." + std::to_string(queued - 1) + " of this call's " + std::to_string(count) +
         " were queued before the failure and will still run; descriptors " + std::to_string(queued) + ".." +
         std::to_string(count - 1) + " were not";
}

// Runs `f`, which queues no copy; an error it raises says nothing was copied.
template <class F>
decltype(auto) before_any_copy(F&& f) {
  try {
    return std::forward<F>(f)();
  } catch (c10::Error& e) {
    e.add_context(kNothingCopied);
    throw;
  }
}

// A validated, merged batch of copies, as the core hands it to an engine: the
// engine re-checks nothing. The three arrays have `count` (> 0) entries; every
// size is > 0, every address non-null, and each range lies in memory the
// caller's tensors hold (or, for swap_blocks_batch, that its caller vouched
// for). `owner` holds the arrays: an engine whose copies read them after
// submit returns (an asynchronous API that reads them late) keeps a copy of it
// until then.
struct CopyBatch {
  const int64_t* src = nullptr;
  const int64_t* dst = nullptr;
  const int64_t* size = nullptr;
  int64_t count = 0;
  int64_t total_bytes = 0;
  Direction direction = Direction::kHostToDevice;
  at::Tensor owner;
};

inline void* as_ptr(int64_t address) { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); }

// --- The engine interface ------------------------------------------------------

// What an engine gives the core. The core validates every call before it
// reaches an engine and hands it only what it validated. `submit` is
// required; an entry left null is something the engine does not have, and
// the core says so (or takes the path that does without it).
struct EngineInterface {
  // As reports and errors name the engine: "CUDA engine (torch_kvswap._C_cuda)".
  const char* name;

  // Queues the core's validated, merged batch (CopyBatch) on the current
  // stream of `device`.
  void (*submit)(const CopyBatch& batch, c10::Device device);

  // Whether the current stream of `device` is being captured into a graph.
  // The core asks before it picks a path, since a capture forbids
  // synchronizing calls. Null: the engine's streams are never captured.
  bool (*stream_capturing)(c10::Device device);

  // Page-locks (pin) or releases an existing contiguous host buffer for DMA
  // by `device`, in place and at its exact size (torch.ops.kvswap._host_register).
  void (*host_register)(const at::Tensor& buffer, c10::Device device, bool pin);

  // Whether every byte of the host tensor `buffer` is page-locked for DMA by
  // `device`, as the engine sees it. An engine that answers needs pinned host
  // caches: the core refuses pageable ones before anything is copied (CANN
  // copies pageable memory synchronously, refuses it under graph capture,
  // and up to 8.0 corrupts it silently).
  bool (*host_pinned)(const at::Tensor& buffer, c10::Device device);

  // Whether `device` can address every host tensor of `tensors` in place
  // (page-locked and mapped). Engines with a copy kernel answer.
  bool (*host_mapped)(at::TensorList tensors, c10::Device device);

  // What the engine found on `device`, as "name=value" lines (python -m torch_kvswap).
  std::vector<std::string> (*report)(c10::Device device);

  // The kernel path of swap_blocks, for caches the core validated: a kernel
  // that reads the block ids from device memory when it runs, so a captured
  // graph copies the ids current at replay (copy method "kernel").
  void (*copy_blocks)(at::TensorList src_caches, at::TensorList dst_caches, const at::Tensor& src_block_ids,
                      const at::Tensor& dst_block_ids);
};

// Bumped whenever EngineInterface or EngineRegistry changes, so that an
// engine built against another layout is refused when it loads.
inline constexpr uint32_t kEngineInterfaceVersion = 2;

// The core's registry of engines, one per device type (CPU, CUDA,
// PrivateUse1), as the core's library exports it (kvswap_engine_registry).
struct EngineRegistry {
  uint32_t version;  // kEngineInterfaceVersion of the core's build
  // Makes `engine` serve `type` (null: nothing serves it) and returns the
  // engine that served it before, so that a test fake can put it back. The
  // table must outlive its use: engines keep theirs for the process's life.
  // Throws for a device type no engine can serve.
  const EngineInterface* (*install)(c10::DeviceType type, const EngineInterface* engine);
  // The engine that serves `type` now, or null (the test extension calls
  // engines through it).
  const EngineInterface* (*lookup)(c10::DeviceType type);
};

}  // namespace kvswap

// The core's registry (csrc/core/engines.cpp), exported by the core's library
// (torch_kvswap._C), which every engine's library links: an engine installs
// itself while its library loads (install_engine below, KVSWAP_ENGINE_MODULE
// in python_module.h), whether Python imports it, torch.ops.load_library
// loads it or a C++ program opens it. Never null.
extern "C" __attribute__((visibility("default"))) const kvswap::EngineRegistry* kvswap_engine_registry();

namespace kvswap {

// Why the core cannot take an engine built for engine interface `expected`
// ("" when it can).
inline std::string registry_mismatch(uint32_t expected = kEngineInterfaceVersion) {
  const uint32_t core = kvswap_engine_registry()->version;
  if (core == expected) return "";
  return "torch_kvswap: this engine was built for engine interface " + std::to_string(expected) +
         " but the core (torch_kvswap._C) has " + std::to_string(core) + "; rebuild torch_kvswap";
}

// Makes the engine `engine()` returns serve `type`. Returns why it could not
// ("" when it did): another interface, the engine's own setup or the core
// refused. Never throws, so an engine's library may call it while it loads.
inline std::string install_engine(c10::DeviceType type, const EngineInterface& (*engine)()) {
  std::string mismatch = registry_mismatch();
  if (!mismatch.empty()) return mismatch;
  try {
    kvswap_engine_registry()->install(type, &engine());
  } catch (const std::exception& e) {
    return e.what();
  } catch (...) {
    return "torch_kvswap: the engine's setup failed with an exception that is not a std::exception";
  }
  return "";
}

}  // namespace kvswap
