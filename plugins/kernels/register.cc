// RegisterCustomOps: the entry point SessionOptions.register_custom_ops_library calls; adds every op of
// plugins/kernels/ to the domain "engine".
#include <string>

#include "ort_abi.h"

#ifdef ENGINE_KERNELS_TRACE
// The trace's events so far (step_trace.h), emptying it: bench/step_trace.py's reader.
extern "C" __attribute__((visibility("default"))) size_t EngineKernelsTrace(engine_kernels::TraceEvent* out,
                                                                           size_t capacity) {
  return engine_kernels::Trace::get().take(out, capacity);
}
#endif

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  namespace k = engine_kernels;
  const OrtApi* api = base->GetApi(k::kMinApi);
  if (api == nullptr) {  // an ORT older than pyproject allows: say so through the table every ORT has
    const std::string message = std::string("the engine's kernels need ONNX Runtime 1.22 or newer, not ") +
                                base->GetVersionString() + ": upgrade onnxruntime";
    return base->GetApi(1)->CreateStatus(ORT_FAIL, message.c_str());
  }
  k::g_api = api;
  k::g_api24 = base->GetApi(ORT_API_VERSION);
  // Each session's domain must outlive it: domains are created per registration and never released.
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* st = api->CreateCustomOpDomain("engine", &domain)) return st;
  std::vector<OrtCustomOp*> ops = k::paged_attention_ops();
  for (OrtCustomOp* op : k::block_offsets_ops()) ops.push_back(op);
  for (OrtCustomOp* op : k::e4m3_encode_ops()) ops.push_back(op);
  for (OrtCustomOp* op : k::swiglu_ops()) ops.push_back(op);
  for (OrtCustomOp* op : k::quant_matmul_ops()) ops.push_back(op);
  for (OrtCustomOp* op : k::bf16_matmul_ops()) ops.push_back(op);
  for (OrtCustomOp* op : k::add_rms_norm_ops()) ops.push_back(op);
  for (OrtCustomOp* op : k::moe_ops()) ops.push_back(op);
  for (OrtCustomOp* op : k::lora_ops()) ops.push_back(op);
  for (OrtCustomOp* op : ops)
    if (OrtStatus* st = api->CustomOpDomain_Add(domain, op)) return st;
  return api->AddCustomOpDomain(options, domain);
}
