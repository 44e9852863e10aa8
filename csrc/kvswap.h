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
// An engine is reached through the dispatcher, not through a C++ symbol: it
// registers a kernel for `kvswap::_submit` under its own dispatch key (CPU,
// CUDA, PrivateUse1), and the core redispatches validated descriptors to that
// key. Engines therefore live in separate shared objects without linking to
// each other, and a missing engine is an error message, not a loader failure.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Device.h>
#include <c10/util/Exception.h>

#include <cstdint>
#include <string>
#include <utility>

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

// A validated, merged batch of copies, as handed to an engine. The three
// arrays have `count` entries; every size is > 0 and every address non-null.
// The arrays are borrowed from tensors owned by the caller of the engine; an
// engine that needs them after it returns (an asynchronous API that reads them
// late) must keep those tensors alive itself.
struct CopyBatch {
  const int64_t* src = nullptr;
  const int64_t* dst = nullptr;
  const int64_t* size = nullptr;
  int64_t count = 0;
  int64_t total_bytes = 0;
  Direction direction = Direction::kHostToDevice;
};

// Views the tensors of a `_submit` call as a CopyBatch. The tensors were built
// by the core (contiguous, int64, CPU, equal length, sizes > 0), so this only
// re-checks what is cheap and would otherwise corrupt memory.
inline CopyBatch batch_from_tensors(const at::Tensor& src_ptrs, const at::Tensor& dst_ptrs,
                                    const at::Tensor& sizes, int64_t direction, int64_t total_bytes) {
  const auto n = src_ptrs.numel();
  TORCH_CHECK(dst_ptrs.numel() == n && sizes.numel() == n && src_ptrs.scalar_type() == at::kLong &&
                  dst_ptrs.scalar_type() == at::kLong && sizes.scalar_type() == at::kLong &&
                  src_ptrs.is_contiguous() && dst_ptrs.is_contiguous() && sizes.is_contiguous(),
              "kvswap::_submit expects the core's descriptor tensors; call swap_blocks or "
              "swap_blocks_batch instead");
  CopyBatch batch;
  batch.src = src_ptrs.const_data_ptr<int64_t>();
  batch.dst = dst_ptrs.const_data_ptr<int64_t>();
  batch.size = sizes.const_data_ptr<int64_t>();
  batch.count = n;
  batch.total_bytes = total_bytes;
  batch.direction = checked_direction(direction);
  return batch;
}

inline void* as_ptr(int64_t address) { return reinterpret_cast<void*>(static_cast<uintptr_t>(address)); }

}  // namespace kvswap
