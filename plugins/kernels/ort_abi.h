// The slice of ONNX Runtime's C API the engine's kernels use (plugins/kernels/*.cc), over ORT's own header, vendored
// at 1.24.1 in third_party/onnxruntime/ (its README says why that version).
//
// RegisterCustomOps (register.cc) asks OrtGetApiBase()->GetApi for two versions of the OrtApi table:
//   kMinApi          22 (ORT 1.22; pyproject asks 1.23 for opset 23 graphs)  required; every call goes through it
//   ORT_API_VERSION  24 (ORT 1.24, the header's)             null before 1.24 (g_api24): the own pool's config entry
//                                                            and the tensor shape read in place
// The table only grows, so the header's names hold for every runtime >= 1.22; a member the header says came after
// version 22 is read only from g_api24.
#pragma once

#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <stdexcept>
#include <string>
#include <vector>

#include "spin_pool.h"
#include "step_trace.h"
#include "third_party/onnxruntime/onnxruntime_c_api.h"

static_assert(ORT_API_VERSION == 24, "g_api24 is the table of the vendored header's version");

namespace engine_kernels {

constexpr uint32_t kMinApi = 22;

// The element types the ops declare.
constexpr ONNXTensorElementDataType kFloat = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT;
constexpr ONNXTensorElementDataType kUint8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT8;
constexpr ONNXTensorElementDataType kInt8 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT8;
constexpr ONNXTensorElementDataType kUint16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_UINT16;
constexpr ONNXTensorElementDataType kInt64 = ONNX_TENSOR_ELEMENT_DATA_TYPE_INT64;
constexpr ONNXTensorElementDataType kBool = ONNX_TENSOR_ELEMENT_DATA_TYPE_BOOL;
constexpr ONNXTensorElementDataType kFloat16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_FLOAT16;
constexpr ONNXTensorElementDataType kBFloat16 = ONNX_TENSOR_ELEMENT_DATA_TYPE_BFLOAT16;

// The tables RegisterCustomOps got. The kernels use these, not the one ORT hands CreateKernel: that is the table of
// the op's version (1, custom_op_base), which need not have KernelContext_ParallelFor (version 17).
inline const OrtApi* g_api = nullptr;
inline const OrtApi* g_api24 = nullptr;

// The session config entry runtime/session.py sets on engines whose EngineConfig.thread_pool is "engine": how many
// threads the kernels' own pool has (spin_pool.h; ORT's intra-op pool then has one). Absent, or before ORT 1.24,
// the kernels share ORT's intra-op pool.
constexpr const char* kThreadsEntry = "engine.kernel_threads";

class Api {
 public:
  // `info`: the kernel's, whose session config says which pool its parallel_for calls use
  explicit Api(const OrtKernelInfo* info) : ort_(g_api), pool_(pool_of(info)) {}

  // The members of the version-22 table: api->KernelContext_GetInput(...)
  const OrtApi* operator->() const { return ort_; }

  void check(OrtStatus* status) const {
    if (status == nullptr) return;
    std::string message = ort_->GetErrorMessage(status);
    ort_->ReleaseStatus(status);
    throw std::runtime_error(message);
  }

  // An attribute the node may lack (engines built before it existed): `fallback` then.
  int64_t optional_int(const OrtKernelInfo* info, const char* name, int64_t fallback) const {
    int64_t value = fallback;
    OrtStatus* status = ort_->KernelInfoGetAttribute_int64(info, name, &value);
    if (status == nullptr) return value;
    ort_->ReleaseStatus(status);
    return fallback;
  }

  SpinPool* pool() const { return pool_; }

 private:
  SpinPool* pool_of(const OrtKernelInfo* info) const {
    if (g_api24 == nullptr) return nullptr;
    OrtKeyValuePairs* entries = nullptr;
    check(g_api24->KernelInfo_GetConfigEntries(info, &entries));
    const char* value = g_api24->GetKeyValue(entries, kThreadsEntry);
    const int threads = value ? std::atoi(value) : 0;
    g_api24->ReleaseKeyValuePairs(entries);
    return threads > 1 ? SpinPool::shared(threads) : nullptr;
  }

  const OrtApi* ort_;
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
  Tensor t;
  api.check(api->GetTensorMutableData(value, &t.data));
  if (g_api24 != nullptr) {
    ONNXTensorElementDataType type = ONNX_TENSOR_ELEMENT_DATA_TYPE_UNDEFINED;
    const int64_t* dims = nullptr;
    size_t rank = 0;
    api.check(g_api24->GetTensorElementTypeAndShapeDataReference(value, &type, &dims, &rank));
    t.shape.assign(dims, dims + rank);
    return t;
  }
  OrtTensorTypeAndShapeInfo* info = nullptr;
  api.check(api->GetTensorTypeAndShape(value, &info));
  size_t rank = 0;
  api.check(api->GetDimensionsCount(info, &rank));
  t.shape.resize(rank);
  api.check(api->GetDimensions(info, t.shape.data(), rank));
  api->ReleaseTensorTypeAndShapeInfo(info);
  return t;
}

// The OrtCustomOp members every op here shares: the CPU provider, required inputs and outputs. Version 1: ORT then
// reads the version-1 members and the two characteristic queries (its schema check calls them whatever the
// version), and leaves alone the later members a higher version would oblige the op to fill in (GetInputMemoryType
// from 13, ...).
inline OrtCustomOp custom_op_base() {
  OrtCustomOp op{};
  op.version = 1;
  op.GetExecutionProviderType = [](const OrtCustomOp*) -> const char* { return nullptr; };
  op.GetInputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  op.GetOutputCharacteristic = [](const OrtCustomOp*, size_t) { return INPUT_OUTPUT_REQUIRED; };
  return op;
}

// An op of `input_types.size()` inputs and `outputs` outputs of `output_type`, its kernel object made by `create`,
// run by `compute` and deleted by `destroy` (destroy_kernel<K>).
struct KernelOp : OrtCustomOp {
  const char* name;
  std::vector<ONNXTensorElementDataType> input_types;
  ONNXTensorElementDataType output_type;
  size_t outputs;
};

template <typename K>
void destroy_kernel(void* kernel) {
  delete static_cast<K*>(kernel);
}

// OrtCustomOp::CreateKernel (its OrtApi argument unused: g_api)
using MakeKernel = void* (*)(const OrtCustomOp*, const OrtApi*, const OrtKernelInfo*);

inline KernelOp kernel_op(const char* name, std::vector<ONNXTensorElementDataType> input_types,
                          ONNXTensorElementDataType output_type, size_t outputs, MakeKernel create,
                          void (*compute)(void*, OrtKernelContext*), void (*destroy)(void*)) {
  KernelOp op{custom_op_base(), name, std::move(input_types), output_type, outputs};
  op.CreateKernel = create;
  op.GetName = [](const OrtCustomOp* o) { return static_cast<const KernelOp*>(o)->name; };
  op.GetInputType = [](const OrtCustomOp* o, size_t i) { return static_cast<const KernelOp*>(o)->input_types[i]; };
  op.GetInputTypeCount = [](const OrtCustomOp* o) { return static_cast<const KernelOp*>(o)->input_types.size(); };
  op.GetOutputType = [](const OrtCustomOp* o, size_t) { return static_cast<const KernelOp*>(o)->output_type; };
  op.GetOutputTypeCount = [](const OrtCustomOp* o) { return static_cast<const KernelOp*>(o)->outputs; };
  op.KernelCompute = compute;
  op.KernelDestroy = destroy;
  return op;
}

// An op whose kernel keeps only the Api (no attributes): `inputs` inputs of `input_type`, one output of
// `output_type`, computed by `compute(Api*, context)`.
inline KernelOp simple_op(const char* name, ONNXTensorElementDataType input_type, size_t inputs,
                          ONNXTensorElementDataType output_type,
                          void (*compute)(void* api, OrtKernelContext* context)) {
  return kernel_op(
      name, std::vector<ONNXTensorElementDataType>(inputs, input_type), output_type, 1,
      [](const OrtCustomOp*, const OrtApi*, const OrtKernelInfo* info) -> void* { return new Api(info); }, compute,
      destroy_kernel<Api>);
}

// fn(data, i) for i < items on the kernel's own pool, or else ORT's intra-op threads.
inline void parallel_for(const Api& api, OrtKernelContext* context, size_t items, void (*fn)(void*, size_t),
                         void* data) {
  trace(kCallEnter, items);
  if (api.pool())
    api.pool()->run(items, fn, data);
  else
    api.check(api->KernelContext_ParallelFor(context, fn, items, 0, data));
  trace(kCallExit, items);
}

inline std::vector<Tensor> inputs(const Api& api, OrtKernelContext* context, size_t count) {
  std::vector<Tensor> in(count);
  for (size_t i = 0; i < count; ++i) {
    const OrtValue* value = nullptr;
    api.check(api->KernelContext_GetInput(context, i, &value));
    in[i] = describe(api, const_cast<OrtValue*>(value));
  }
  return in;
}

// The data of output `index`, allocated by ORT with `shape` (elements of T, the type the op declares for it).
template <typename T>
inline T* output(const Api& api, OrtKernelContext* context, size_t index, const std::vector<int64_t>& shape) {
  OrtValue* value = nullptr;
  api.check(api->KernelContext_GetOutput(context, index, shape.data(), shape.size(), &value));
  void* data = nullptr;  // its data only: its shape is the one just asked for
  api.check(api->GetTensorMutableData(value, &data));
  return static_cast<T*>(data);
}

// An input or attribute the op cannot take: std::invalid_argument naming the op, which ORT reports as the run's
// error.
inline void require(bool ok, const char* op, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("engine ") + op + ": " + what);
}

// The ops of each kernel file, registered by register.cc.
std::vector<OrtCustomOp*> paged_attention_ops();
std::vector<OrtCustomOp*> block_offsets_ops();
std::vector<OrtCustomOp*> e4m3_encode_ops();
std::vector<OrtCustomOp*> swiglu_ops();
std::vector<OrtCustomOp*> quant_matmul_ops();
std::vector<OrtCustomOp*> bf16_matmul_ops();
std::vector<OrtCustomOp*> add_rms_norm_ops();
std::vector<OrtCustomOp*> moe_ops();
std::vector<OrtCustomOp*> lora_ops();

}  // namespace engine_kernels
