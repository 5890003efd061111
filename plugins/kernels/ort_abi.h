// The slice of ONNX Runtime's C ABI the engine's kernels use (plugins/kernels/*.cc).
//
// ORT is reached through the function table OrtGetApiBase()->GetApi(1) returns: version 1 of the table and of
// OrtCustomOp, whose layouts every later ORT keeps (the table only grows), so no ORT header is needed. The slot
// numbers below are positions in that table.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "spin_pool.h"
#include "step_trace.h"

namespace engine_kernels {

struct OrtStatus;
struct OrtValue;
struct OrtKernelContext;
struct OrtKernelInfo;
struct OrtTypeShape;
struct OrtSessionOptions;
struct OrtCustomOpDomain;
struct OrtKeyValuePairs;

// Slots of the OrtApi function table used here (version 1 unless noted).
enum Slot : int {
  kGetErrorMessage = 2,
  kCreateCustomOpDomain = 26,
  kCustomOpDomainAdd = 27,
  kAddCustomOpDomain = 28,
  kGetTensorMutableData = 51,
  kGetDimensionsCount = 61,
  kGetDimensions = 62,
  kGetTensorTypeAndShape = 65,
  kKernelInfoGetAttributeFloat = 85,
  kKernelInfoGetAttributeInt64 = 86,
  kKernelContextGetInput = 90,
  kKernelContextGetOutput = 91,
  kReleaseStatus = 93,
  kReleaseTypeShape = 99,
  kKernelContextParallelFor = 274,    // since version 17 (ORT 1.17)
  kGetKeyValue = 297,                 // since version 22 (ORT 1.22)
  kReleaseKeyValuePairs = 300,        // since version 22
  kKernelInfoGetConfigEntries = 391,  // since version 24 (ORT 1.24)
  kGetTensorElementTypeAndShapeDataReference = 414,  // since version 24: the last slot of that table
};

// ONNXTensorElementDataType values.
enum ElementType : int { kFloat = 1, kUint8 = 2, kInt8 = 3, kUint16 = 4, kInt64 = 7, kBool = 9, kFloat16 = 10 };

struct OrtApiBase {
  const void* (*GetApi)(uint32_t version);
  const char* (*GetVersionString)();
};

// The OrtApi table again where it has KernelInfo_GetConfigEntries and GetTensorElementTypeAndShapeDataReference
// (version 24, ORT 1.24), set by RegisterCustomOps.
inline void* const* g_api24 = nullptr;

// The session config entry runtime/session.py sets on engines whose EngineConfig.thread_pool is "engine": how many
// threads the kernels' own pool has (spin_pool.h; ORT's intra-op pool then has one). Absent, or before ORT 1.24,
// the kernels share ORT's intra-op pool.
constexpr const char* kThreadsEntry = "engine.kernel_threads";

class Api {
 public:
  // `info`: the kernel's, whose session config says which pool its parallel_for calls use
  Api(const void* table, const OrtKernelInfo* info) : table_(static_cast<void* const*>(table)), pool_(pool_of(info)) {}

  template <typename Fn, typename... Args>
  void call(Slot slot, Args... args) const {
    check(reinterpret_cast<Fn>(table_[slot])(args...));
  }

  void check(OrtStatus* status) const {
    if (status == nullptr) return;
    std::string message = reinterpret_cast<const char* (*)(const OrtStatus*)>(table_[kGetErrorMessage])(status);
    reinterpret_cast<void (*)(OrtStatus*)>(table_[kReleaseStatus])(status);
    throw std::runtime_error(message);
  }

  // An attribute the node may lack (engines built before it existed): `fallback` then.
  int64_t optional_int(const OrtKernelInfo* info, const char* name, int64_t fallback) const {
    using GetInt = OrtStatus* (*)(const OrtKernelInfo*, const char*, int64_t*);
    int64_t value = fallback;
    OrtStatus* status = reinterpret_cast<GetInt>(table_[kKernelInfoGetAttributeInt64])(info, name, &value);
    if (status == nullptr) return value;
    reinterpret_cast<void (*)(OrtStatus*)>(table_[kReleaseStatus])(status);
    return fallback;
  }

  void* const* table() const { return table_; }
  SpinPool* pool() const { return pool_; }

 private:
  SpinPool* pool_of(const OrtKernelInfo* info) const {
    if (g_api24 == nullptr) return nullptr;
    using GetEntries = OrtStatus* (*)(const OrtKernelInfo*, OrtKeyValuePairs**);
    using GetValue = const char* (*)(const OrtKeyValuePairs*, const char*);
    OrtKeyValuePairs* entries = nullptr;
    check(reinterpret_cast<GetEntries>(g_api24[kKernelInfoGetConfigEntries])(info, &entries));
    const char* value = reinterpret_cast<GetValue>(g_api24[kGetKeyValue])(entries, kThreadsEntry);
    const int threads = value ? std::atoi(value) : 0;
    reinterpret_cast<void (*)(OrtKeyValuePairs*)>(g_api24[kReleaseKeyValuePairs])(entries);
    return threads > 1 ? SpinPool::shared(threads) : nullptr;
  }

  void* const* table_;
  SpinPool* pool_;
};

struct Tensor {
  void* data = nullptr;
  std::vector<int64_t> shape;
};

// A tensor's data and shape. From ORT 1.24 the shape is read in place (GetTensorElementTypeAndShapeDataReference)
// rather than through a type-and-shape object ORT allocates and frees: one call instead of four, where a SmolLM2
// decode step reads ~630 inputs with the caches cold from its weight streams (bench/NOTES.md entry 52).
inline Tensor describe(const Api& api, OrtValue* value) {
  using GetData = OrtStatus* (*)(OrtValue*, void**);
  using GetTypeShape = OrtStatus* (*)(const OrtValue*, OrtTypeShape**);
  using GetCount = OrtStatus* (*)(const OrtTypeShape*, size_t*);
  using GetDims = OrtStatus* (*)(const OrtTypeShape*, int64_t*, size_t);
  using GetShapeReference = OrtStatus* (*)(const OrtValue*, int*, const int64_t**, size_t*);
  Tensor t;
  api.call<GetData>(kGetTensorMutableData, value, &t.data);
  if (g_api24 != nullptr) {
    int type = 0;
    const int64_t* dims = nullptr;
    size_t rank = 0;
    api.check(reinterpret_cast<GetShapeReference>(g_api24[kGetTensorElementTypeAndShapeDataReference])(
        value, &type, &dims, &rank));
    t.shape.assign(dims, dims + rank);
    return t;
  }
  OrtTypeShape* info = nullptr;
  api.call<GetTypeShape>(kGetTensorTypeAndShape, static_cast<const OrtValue*>(value), &info);
  size_t rank = 0;
  api.call<GetCount>(kGetDimensionsCount, static_cast<const OrtTypeShape*>(info), &rank);
  t.shape.resize(rank);
  api.call<GetDims>(kGetDimensions, static_cast<const OrtTypeShape*>(info), t.shape.data(), rank);
  reinterpret_cast<void (*)(OrtTypeShape*)>(api.table()[kReleaseTypeShape])(info);
  return t;
}

// OrtCustomOp: the version-1 fields, plus the two characteristic queries of version 8, which ORT's schema check
// calls whatever the version (all inputs and outputs here are required: 0).
struct CustomOp {
  uint32_t version;
  void* (*CreateKernel)(CustomOp* op, const void* api, const OrtKernelInfo* info);
  const char* (*GetName)(CustomOp* op);
  const char* (*GetExecutionProviderType)(CustomOp* op);
  int (*GetInputType)(CustomOp* op, size_t index);
  size_t (*GetInputTypeCount)(CustomOp* op);
  int (*GetOutputType)(CustomOp* op, size_t index);
  size_t (*GetOutputTypeCount)(CustomOp* op);
  void (*KernelCompute)(void* kernel, OrtKernelContext* context);
  void (*KernelDestroy)(void* kernel);
  int (*GetInputCharacteristic)(CustomOp* op, size_t index);
  int (*GetOutputCharacteristic)(CustomOp* op, size_t index);
};

// The fields every op here shares: version 1, the CPU provider, required inputs and outputs.
inline CustomOp custom_op_base() {
  CustomOp op{};
  op.version = 1;
  op.GetExecutionProviderType = [](CustomOp*) -> const char* { return nullptr; };
  op.GetInputCharacteristic = [](CustomOp*, size_t) { return 0; };
  op.GetOutputCharacteristic = [](CustomOp*, size_t) { return 0; };
  return op;
}

// An op of `input_types.size()` inputs and `outputs` outputs of `output_type`, its kernel object made by `create`,
// run by `compute` and deleted by `destroy` (destroy_kernel<K>).
struct KernelOp : CustomOp {
  const char* name;
  std::vector<int> input_types;
  int output_type;
  size_t outputs;
};

template <typename K>
void destroy_kernel(void* kernel) {
  delete static_cast<K*>(kernel);
}

inline KernelOp kernel_op(const char* name, std::vector<int> input_types, int output_type, size_t outputs,
                          void* (*create)(CustomOp*, const void*, const OrtKernelInfo*),
                          void (*compute)(void*, OrtKernelContext*), void (*destroy)(void*)) {
  KernelOp op{custom_op_base(), name, std::move(input_types), output_type, outputs};
  op.CreateKernel = create;
  op.GetName = [](CustomOp* o) { return static_cast<KernelOp*>(o)->name; };
  op.GetInputType = [](CustomOp* o, size_t i) { return static_cast<KernelOp*>(o)->input_types[i]; };
  op.GetInputTypeCount = [](CustomOp* o) { return static_cast<KernelOp*>(o)->input_types.size(); };
  op.GetOutputType = [](CustomOp* o, size_t) { return static_cast<KernelOp*>(o)->output_type; };
  op.GetOutputTypeCount = [](CustomOp* o) { return static_cast<KernelOp*>(o)->outputs; };
  op.KernelCompute = compute;
  op.KernelDestroy = destroy;
  return op;
}

// An op whose kernel keeps only the API table (no attributes): `inputs` inputs of `input_type`, one output of
// `output_type`, computed by `compute(Api*, context)`.
inline KernelOp simple_op(const char* name, int input_type, size_t inputs, int output_type,
                          void (*compute)(void* api, OrtKernelContext* context)) {
  return kernel_op(
      name, std::vector<int>(inputs, input_type), output_type, 1,
      [](CustomOp*, const void* table, const OrtKernelInfo* info) -> void* { return new Api(table, info); }, compute,
      destroy_kernel<Api>);
}

// KernelContext_ParallelFor of the table GetApi(17) returns, set by RegisterCustomOps (null before ORT 1.17).
inline void* g_parallel_for = nullptr;

// fn(data, i) for i < items on the kernel's own pool, or ORT's intra-op threads, or one after the other without
// ParallelFor.
inline void parallel_for(const Api& api, OrtKernelContext* context, size_t items, void (*fn)(void*, size_t),
                         void* data) {
  trace(kCallEnter, items);
  using ParallelFor = OrtStatus* (*)(const OrtKernelContext*, void (*)(void*, size_t), size_t, size_t, void*);
  if (api.pool())
    api.pool()->run(items, fn, data);
  else if (g_parallel_for)
    api.check(reinterpret_cast<ParallelFor>(g_parallel_for)(context, fn, items, 0, data));
  else
    for (size_t i = 0; i < items; ++i) fn(data, i);
  trace(kCallExit, items);
}

inline std::vector<Tensor> inputs(const Api& api, OrtKernelContext* context, size_t count) {
  using GetInput = OrtStatus* (*)(const OrtKernelContext*, size_t, const OrtValue**);
  std::vector<Tensor> in(count);
  for (size_t i = 0; i < count; ++i) {
    const OrtValue* value = nullptr;
    api.call<GetInput>(kKernelContextGetInput, static_cast<const OrtKernelContext*>(context), i, &value);
    in[i] = describe(api, const_cast<OrtValue*>(value));
  }
  return in;
}

// The data of output `index`, allocated by ORT with `shape` (elements of T, the type the op declares for it).
template <typename T>
inline T* output(const Api& api, OrtKernelContext* context, size_t index, const std::vector<int64_t>& shape) {
  using GetOutput = OrtStatus* (*)(OrtKernelContext*, size_t, const int64_t*, size_t, OrtValue**);
  OrtValue* value = nullptr;
  api.call<GetOutput>(kKernelContextGetOutput, context, index, shape.data(), shape.size(), &value);
  void* data = nullptr;  // its data only: its shape is the one just asked for
  api.call<OrtStatus* (*)(OrtValue*, void**)>(kGetTensorMutableData, value, &data);
  return static_cast<T*>(data);
}

// An input or attribute the op cannot take: std::invalid_argument naming the op, which ORT reports as the run's
// error.
inline void require(bool ok, const char* op, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("engine ") + op + ": " + what);
}

// The ops of each kernel file, registered by register.cc.
std::vector<CustomOp*> paged_attention_ops();
std::vector<CustomOp*> block_offsets_ops();
std::vector<CustomOp*> e4m3_encode_ops();
std::vector<CustomOp*> swiglu_ops();
std::vector<CustomOp*> quant_matmul_ops();
std::vector<CustomOp*> bf16_matmul_ops();
std::vector<CustomOp*> add_rms_norm_ops();

}  // namespace engine_kernels
