// The shipped binding of the Ascend engine (torch_kvswap._C_npu): fills the
// ACL table of acl_api.h from the ACL library torch_npu has already loaded,
// by name at run time. Nothing is linked, so one binary serves every CANN
// release: a function this CANN lacks is a null entry, and the engine takes
// the path that does without it.
//
// acl/acl_rt.h is included only to check, at compile time, that every mirror
// of acl_api.h has ACL's layout and values, and that every looked-up
// function has the declared type. torch_npu's NPUStream.h is included only
// for torch_npu releases before 2.13 (acl_stream_of).
#include <dlfcn.h>

#include <acl/acl_rt.h>
#include <c10/core/Stream.h>
#include <torch/version.h>

// The generic route to a stream's handle, c10::Stream::native_handle(), needs
// torch 2.11 or later (torch 2.10's c10/core/Stream.h lacks it) and a
// torch_npu whose NPUGuardImpl overrides getStreamNativeHandle, which first
// appears in torch-npu 2.13.0 (2.10.0.post4, 2.10.0.post7, 2.11.0.post3 and
// 2.12.0.post3 lack it; torch's default raises). Each torch_npu release pins
// its torch release, so torch's version tells them apart, as it does in
// torch_npu's own torch_npu/csrc/_compat/version.h.
#if TORCH_VERSION_MAJOR == 2 && TORCH_VERSION_MINOR < 13
#define KVSWAP_STREAM_NATIVE_HANDLE 0
#include <torch_npu/csrc/core/npu/NPUStream.h>
#else
#define KVSWAP_STREAM_NATIVE_HANDLE 1
#endif

#include <cstddef>
#include <type_traits>

#include "../python_module.h"
#include "acl_api.h"
#include "ascend_engine.h"

KVSWAP_ENGINE_MODULE(_C_npu, c10::DeviceType::PrivateUse1, kvswap::ascend::engine_interface())

namespace kvswap {
namespace ascend {
namespace {

static_assert(std::is_same_v<AclError, aclError> && std::is_same_v<AclStream, aclrtStream>);
static_assert(kAclFeatureNotSupported == ACL_ERROR_RT_FEATURE_NOT_SUPPORT);
static_assert(kAclSuccess == ACL_SUCCESS);
static_assert(kHostRegPinned == ACL_HOST_REG_PINNED);
static_assert(sizeof(MemcpyKind) == sizeof(aclrtMemcpyKind) &&
              static_cast<int>(MemcpyKind::kHostToHost) == ACL_MEMCPY_HOST_TO_HOST &&
              static_cast<int>(MemcpyKind::kHostToDevice) == ACL_MEMCPY_HOST_TO_DEVICE &&
              static_cast<int>(MemcpyKind::kDeviceToHost) == ACL_MEMCPY_DEVICE_TO_HOST &&
              static_cast<int>(MemcpyKind::kDeviceToDevice) == ACL_MEMCPY_DEVICE_TO_DEVICE);
static_assert(sizeof(MemLocationType) == sizeof(aclrtMemLocationType) &&
              static_cast<int>(MemLocationType::kHost) == ACL_MEM_LOCATION_TYPE_HOST &&
              static_cast<int>(MemLocationType::kDevice) == ACL_MEM_LOCATION_TYPE_DEVICE &&
              static_cast<int>(MemLocationType::kUnregistered) == ACL_MEM_LOCATION_TYPE_UNREGISTERED &&
              static_cast<int>(MemLocationType::kHostNuma) == ACL_MEM_LOCATION_TYPE_HOST_NUMA);
static_assert(sizeof(MemLocation) == sizeof(aclrtMemLocation) &&
              offsetof(MemLocation, id) == offsetof(aclrtMemLocation, id) &&
              offsetof(MemLocation, type) == offsetof(aclrtMemLocation, type));
static_assert(sizeof(MemcpyBatchAttr) == sizeof(aclrtMemcpyBatchAttr) &&
              offsetof(MemcpyBatchAttr, dstLoc) == offsetof(aclrtMemcpyBatchAttr, dstLoc) &&
              offsetof(MemcpyBatchAttr, srcLoc) == offsetof(aclrtMemcpyBatchAttr, srcLoc) &&
              offsetof(MemcpyBatchAttr, rsv) == offsetof(aclrtMemcpyBatchAttr, rsv) &&
              sizeof(MemcpyBatchAttr::rsv) == sizeof(aclrtMemcpyBatchAttr::rsv));
static_assert(sizeof(PtrAttributes) == sizeof(aclrtPtrAttributes) &&
              offsetof(PtrAttributes, location) == offsetof(aclrtPtrAttributes, location) &&
              offsetof(PtrAttributes, pageSize) == offsetof(aclrtPtrAttributes, pageSize) &&
              offsetof(PtrAttributes, rsv) == offsetof(aclrtPtrAttributes, rsv) &&
              sizeof(PtrAttributes::rsv) == sizeof(aclrtPtrAttributes::rsv));
static_assert(sizeof(CaptureStatus) == sizeof(aclmdlRICaptureStatus) &&
              static_cast<int>(CaptureStatus::kNone) == ACL_MODEL_RI_CAPTURE_STATUS_NONE &&
              static_cast<int>(CaptureStatus::kActive) == ACL_MODEL_RI_CAPTURE_STATUS_ACTIVE &&
              static_cast<int>(CaptureStatus::kInvalidated) == ACL_MODEL_RI_CAPTURE_STATUS_INVALIDATED);

// A function of the loaded ACL library, or null. torch_npu loads
// libascendcl.so as a dependency of its own extension, which Python opens
// with RTLD_LOCAL, so the global scope may not see it: then ask the already
// loaded library itself (RTLD_NOLOAD never loads a second copy).
void* find(const char* name) {
  if (void* symbol = dlsym(RTLD_DEFAULT, name)) return symbol;
  static void* const library = dlopen("libascendcl.so", RTLD_NOW | RTLD_NOLOAD);
  return library != nullptr ? dlsym(library, name) : nullptr;
}

template <class Fn>
Fn lookup(const char* name) {
  return reinterpret_cast<Fn>(find(name));
}

// The looked-up functions, with ACL's own declared types.
struct Real {
  decltype(&::aclrtMemcpyAsync) memcpy_async = lookup<decltype(&::aclrtMemcpyAsync)>("aclrtMemcpyAsync");
  decltype(&::aclrtHostUnregister) host_unregister =
      lookup<decltype(&::aclrtHostUnregister)>("aclrtHostUnregister");
  decltype(&::aclGetRecentErrMsg) get_recent_err_msg =
      lookup<decltype(&::aclGetRecentErrMsg)>("aclGetRecentErrMsg");
  decltype(&::aclrtMemcpyBatchAsync) memcpy_batch_async =
      lookup<decltype(&::aclrtMemcpyBatchAsync)>("aclrtMemcpyBatchAsync");
  decltype(&::aclmdlRICaptureGetInfo) capture_get_info =
      lookup<decltype(&::aclmdlRICaptureGetInfo)>("aclmdlRICaptureGetInfo");
  bool capture_begin_present = find("aclmdlRICaptureBegin") != nullptr;
  decltype(&::aclrtHostRegisterV2) host_register_v2 =
      lookup<decltype(&::aclrtHostRegisterV2)>("aclrtHostRegisterV2");
  decltype(&::aclrtPointerGetAttributes) pointer_get_attributes =
      lookup<decltype(&::aclrtPointerGetAttributes)>("aclrtPointerGetAttributes");
};

const Real& real() {
  static const Real functions;
  return functions;
}

// Trampolines from the mirrored types to ACL's (layouts checked above).
AclError memcpy_async(void* dst, size_t dest_max, const void* src, size_t count, MemcpyKind kind,
                      AclStream stream) {
  return real().memcpy_async(dst, dest_max, src, count, static_cast<aclrtMemcpyKind>(kind), stream);
}
AclError host_unregister(void* ptr) { return real().host_unregister(ptr); }
const char* get_recent_err_msg() { return real().get_recent_err_msg(); }
AclError memcpy_batch_async(void** dsts, size_t* dest_maxs, void** srcs, size_t* sizes, size_t num_batches,
                            MemcpyBatchAttr* attrs, size_t* attrs_indexes, size_t num_attrs,
                            size_t* fail_index, AclStream stream) {
  return real().memcpy_batch_async(dsts, dest_maxs, srcs, sizes, num_batches,
                                   reinterpret_cast<aclrtMemcpyBatchAttr*>(attrs), attrs_indexes, num_attrs,
                                   fail_index, stream);
}
AclError capture_get_info(AclStream stream, CaptureStatus* status, void** model_ri) {
  return real().capture_get_info(stream, reinterpret_cast<aclmdlRICaptureStatus*>(status),
                                 reinterpret_cast<aclmdlRI*>(model_ri));
}
AclError host_register_v2(void* ptr, uint64_t size, uint32_t flag) {
  return real().host_register_v2(ptr, size, flag);
}
AclError pointer_get_attributes(const void* ptr, PtrAttributes* attributes) {
  return real().pointer_get_attributes(ptr, reinterpret_cast<aclrtPtrAttributes*>(attributes));
}

AclApi bind() {
  const Real& r = real();
  TORCH_CHECK(r.memcpy_async != nullptr && r.host_unregister != nullptr,
              "kvswap Ascend engine: aclrtMemcpyAsync / aclrtHostUnregister not found in the loaded "
              "ACL library (import torch_npu first; is CANN's libascendcl.so loaded?)");
  AclApi api;
  api.memcpy_async = &memcpy_async;
  api.host_unregister = &host_unregister;
  api.get_recent_err_msg = r.get_recent_err_msg != nullptr ? &get_recent_err_msg : nullptr;
  api.memcpy_batch_async = r.memcpy_batch_async != nullptr ? &memcpy_batch_async : nullptr;
  api.capture_get_info = r.capture_get_info != nullptr ? &capture_get_info : nullptr;
  api.capture_begin_present = r.capture_begin_present;
  api.host_register_v2 = r.host_register_v2 != nullptr ? &host_register_v2 : nullptr;
  api.pointer_get_attributes = r.pointer_get_attributes != nullptr ? &pointer_get_attributes : nullptr;
  return api;
}

}  // namespace

// NPUStream::stream(), which drains torch_npu's task queue first and answers
// null when that fails. From torch_npu 2.13 on it is reached through the
// PrivateUse1 guard impl: c10::Stream::native_handle() asks it, and
// NPUGuardImpl::getStreamNativeHandle returns NPUStream(stream).stream()
// (torch_npu 2.13's libtorch_npu.so), so _C_npu links nothing of torch_npu.
// Before 2.13 the same call is made here, which links libtorch_npu
// (setup.py, npu_extension).
AclStream acl_stream_of(const c10::Stream& stream) {
#if KVSWAP_STREAM_NATIVE_HANDLE
  return stream.native_handle();
#else
  return c10_npu::NPUStream(stream).stream();
#endif
}

Engine& engine() {
  static const AclApi api = bind();
  static Engine* const instance = new Engine(api);  // process lifetime
  return *instance;
}

}  // namespace ascend
}  // namespace kvswap
