// RegisterCustomOps: the entry point SessionOptions.register_custom_ops_library calls; adds every op of
// plugins/kernels/ to the domain "engine".
#include "ort_abi.h"

using engine_kernels::CustomOp;
using engine_kernels::OrtApiBase;
using engine_kernels::OrtCustomOpDomain;
using engine_kernels::OrtSessionOptions;
using engine_kernels::OrtStatus;

#ifdef ENGINE_KERNELS_TRACE
// The trace's events so far (step_trace.h), emptying it: bench/step_trace.py's reader.
extern "C" __attribute__((visibility("default"))) size_t EngineKernelsTrace(engine_kernels::TraceEvent* out,
                                                                           size_t capacity) {
  return engine_kernels::Trace::get().take(out, capacity);
}
#endif

extern "C" __attribute__((visibility("default"))) OrtStatus* RegisterCustomOps(OrtSessionOptions* options,
                                                                              const OrtApiBase* base) {
  using CreateDomain = OrtStatus* (*)(const char*, OrtCustomOpDomain**);
  using AddOp = OrtStatus* (*)(OrtCustomOpDomain*, CustomOp*);
  using AddDomain = OrtStatus* (*)(OrtSessionOptions*, OrtCustomOpDomain*);
  namespace k = engine_kernels;
  auto* t = static_cast<void* const*>(base->GetApi(1));
  if (auto* v17 = static_cast<void* const*>(base->GetApi(17))) k::g_parallel_for = v17[k::kKernelContextParallelFor];
  k::g_api24 = static_cast<void* const*>(base->GetApi(24));
  // Each session's domain must outlive it: domains are created per registration and never released.
  OrtCustomOpDomain* domain = nullptr;
  if (OrtStatus* st = reinterpret_cast<CreateDomain>(t[k::kCreateCustomOpDomain])("engine", &domain)) return st;
  std::vector<CustomOp*> ops = k::paged_attention_ops();
  for (CustomOp* op : k::block_offsets_ops()) ops.push_back(op);
  for (CustomOp* op : k::e4m3_encode_ops()) ops.push_back(op);
  for (CustomOp* op : k::swiglu_ops()) ops.push_back(op);
  for (CustomOp* op : k::quant_matmul_ops()) ops.push_back(op);
  for (CustomOp* op : k::bf16_matmul_ops()) ops.push_back(op);
  for (CustomOp* op : k::add_rms_norm_ops()) ops.push_back(op);
  for (CustomOp* op : ops)
    if (OrtStatus* st = reinterpret_cast<AddOp>(t[k::kCustomOpDomainAdd])(domain, op)) return st;
  return reinterpret_cast<AddDomain>(t[k::kAddCustomOpDomain])(options, domain);
}
