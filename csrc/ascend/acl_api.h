// The seam between the Ascend engine's logic (ascend_engine.cpp) and CANN's
// ACL runtime: the few ACL functions the engine calls, as a table of function
// pointers over ABI mirrors of ACL's types. The logic includes no ACL header.
//
// Two bindings fill the table:
//   acl_real.cpp             the shipped one: looks every function up at run
//                            time in the ACL library torch_npu has loaded, and
//                            checks each mirror below against acl/acl_rt.h;
//   tests/fake_npu/fake_acl  a fake runtime on host memory, compiled only into
//                            the test extension.
// Optional functions are null where a CANN release lacks them; the engine
// picks its path from what is there (docs/ascend.md, "CANN versions").
#pragma once

#include <cstddef>
#include <cstdint>

namespace kvswap {
namespace ascend {

using AclError = int;     // aclError (acl/acl_base_rt.h: typedef int aclError)
using AclStream = void*;  // aclrtStream

constexpr AclError kAclSuccess = 0;
// ACL_ERROR_RT_FEATURE_NOT_SUPPORT (acl/error_codes/rt_error_codes.h:69).
constexpr AclError kAclFeatureNotSupported = 207000;
// RT_ERROR_HOST_MEMORY_NOT_REGISTERED as ACL answers it (src/runtime/api/impl/
// errcode_manage.cc:555-556): aclrtHostUnregister of memory not registered.
constexpr AclError kAclHostMemoryNotRegistered = 507911;

// aclrtMemcpyKind (acl/acl_rt.h:144), the members the engine uses.
enum class MemcpyKind : int32_t {
  kHostToHost = 0,
  kHostToDevice = 1,
  kDeviceToHost = 2,
  kDeviceToDevice = 3,
};

// aclrtMemLocationType (acl/acl_rt.h:312).
enum class MemLocationType : int32_t {
  kHost = 0,
  kDevice = 1,
  kUnregistered = 2,
  kHostNuma = 4,
};

// aclrtMemLocation (acl/acl_rt.h:320).
struct MemLocation {
  uint32_t id;
  MemLocationType type;
};

// aclrtMemcpyBatchAttr (acl/acl_rt.h:726); rsv must be zero.
struct MemcpyBatchAttr {
  MemLocation dstLoc;
  MemLocation srcLoc;
  uint8_t rsv[16];
};

// aclrtPtrAttributes (acl/acl_rt.h:324): what aclrtPointerGetAttributes
// reports of an address.
struct PtrAttributes {
  MemLocation location;
  uint32_t pageSize;
  uint32_t rsv[4];
};

// aclmdlRICaptureStatus (acl/acl_rt.h:410).
enum class CaptureStatus : int32_t {
  kNone = 0,
  kActive = 1,
  kInvalidated = 2,
};

// ACL_HOST_REG_PINNED (acl/acl_rt.h:78): aclrtHostRegisterV2 page-locks
// existing pageable host memory.
constexpr uint32_t kHostRegPinned = 0x10000000u;

struct AclApi {
  // Present in every CANN the engine supports.
  AclError (*memcpy_async)(void* dst, size_t dest_max, const void* src, size_t count, MemcpyKind kind,
                           AclStream stream) = nullptr;
  AclError (*host_unregister)(void* ptr) = nullptr;

  // Optional: null where this CANN lacks them.
  const char* (*get_recent_err_msg)() = nullptr;
  AclError (*memcpy_batch_async)(void** dsts, size_t* dest_maxs, void** srcs, size_t* sizes,
                                 size_t num_batches, MemcpyBatchAttr* attrs, size_t* attrs_indexes,
                                 size_t num_attrs, size_t* fail_index, AclStream stream) = nullptr;
  AclError (*capture_get_info)(AclStream stream, CaptureStatus* status, void** model_ri) = nullptr;
  // aclmdlRICaptureBegin is never called; whether it exists tells whether
  // this CANN can capture at all (see Engine::capture_state).
  bool capture_begin_present = false;
  AclError (*host_register_v2)(void* ptr, uint64_t size, uint32_t flag) = nullptr;
  // aclrtPointerGetAttributes (acl/acl_rt.h:1937): checks that a range
  // pinned in place is registered host memory (Engine::host_register).
  AclError (*pointer_get_attributes)(const void* ptr, PtrAttributes* attributes) = nullptr;
};

}  // namespace ascend
}  // namespace kvswap
