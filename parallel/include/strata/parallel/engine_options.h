#pragma once
// The engine's options, free of LibTorch so tools and tests can build them
// without it. Every option can also come from the environment (from_env).

#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "strata/core/dtype.h"
#include "strata/memory/types.h"

namespace strata::parallel {

class Communicator;

struct AdamWConfig {
  float lr = 1e-3f;
  float beta1 = 0.9f;
  float beta2 = 0.999f;
  float eps = 1e-8f;
  float weight_decay = 1e-2f;
};

/// Dynamic loss scaling (fp16): on overflow the step is skipped and the scale
/// multiplied by `backoff` (not below `min_scale`); after `growth_interval`
/// clean steps in a row it is multiplied by `growth_factor`.
struct LossScaleOptions {
  double initial = 65536.0;
  int growth_interval = 2000;
  double growth_factor = 2.0;
  double backoff = 0.5;
  double min_scale = 1.0;
};

struct EngineOptions {
  memory::TierBudgets budgets;
  std::string nvme_dir;        // needed when budgets.nvme > 0
  DType precision = DType::kFloat32;
  LossScaleOptions loss_scale;  // used with fp16
  int64_t chunk_elems = 0;     // 0: least padding, at most a quarter of the device budget (ChunkManager)
  double clip_norm = 0.0;      // 0: no clipping
  int grad_accumulation = 1;   // micro-steps per optimizer step; gradients are averaged
  /// Note [Updates in backward]: each chunk family is updated in the
  /// backward that ends an accumulation, as soon as its gradients are
  /// final, and its gradients are dropped then, so the optimizer's reads and
  /// writes overlap backward instead of following it. Exact (the same
  /// results as false) without clipping; with clip_norm, relaxed: a family
  /// is clipped by the norm as far as backward knows it (the families done,
  /// the rest at the previous step's norm), which needs the whole model on
  /// one rank. Needs gradients no rank reduces (dp 1, sp 1), and fp32 or bf16 (fp16's
  /// overflow check must see every gradient before any update). Families
  /// whose parameters are used differently from the step before, and those
  /// updated on the device, are updated at the step as usual
  /// (STRATA_UPDATE_IN_BACKWARD).
  bool update_in_backward = false;
  /// Fraction of chunk families whose optimizer state (master, exp_avg,
  /// exp_avg_sq) lives on NVMe between steps (static placement). -1: auto, the
  /// families whose state does not fit in half the host budget. Needs an nvme tier.
  double nvme_optim_fraction = -1.0;
  /// Fraction of chunk families, the first ones, whose optimizer state
  /// (master, exp_avg, exp_avg_sq) is updated on the device: the step moves
  /// it there and runs the device kernels (CUDA on a GPU), while the other
  /// families are updated on the CPU at the same time (Note [The optimizer
  /// where its state lives]). 0: every family on the CPU, as ZeRO-Offload.
  /// Needs device budget for a family's state beside its parameters and
  /// gradients; cannot overlap the families whose state lives on NVMe.
  double device_optim_fraction = 0.0;
  /// Record a memory trace (memory/trace.h, docs/trace.md) of the first
  /// `trace_steps` training steps and write it here; empty: no trace.
  std::string trace_path;
  /// Device eviction and prefetch: "auto" plans from the operator sequence of
  /// a warm-up step (Belady eviction, prefetch of the next operators' chunks,
  /// re-planning when the sequence changes); "lru": least recently used, no
  /// prefetch; "static": Gemini's static placement, a fixed fraction of the
  /// parameter chunks held on the device and the rest streamed (Note [Static
  /// placement] in eviction_policy.h).
  std::string policy = "auto";
  /// With policy "static": the fraction of parameter chunk bytes held on the
  /// device, first chunks first; -1: as many as the device budget holds while
  /// leaving room to stream the two largest chunks.
  double static_param_fraction = -1.0;
  /// Read ahead: the next operators' chunks to the device (policy auto) and
  /// the next family's chunks to host in the optimizer step. false: every
  /// chunk moves when it is needed (for comparison; STRATA_PREFETCH=0).
  bool prefetch = true;
  /// The device's memory for chunks and activations together; 0: off (the
  /// device budget covers chunks only). When set, before each operator the
  /// chunk budget becomes capacity x device_safety_ratio minus the larger of
  /// the non-model bytes live now and the peak the plan recorded until the
  /// next operator, never above budgets.device (Note [Device capacity]).
  /// Non-model bytes come from LibTorch's CPU allocator on the emulated
  /// device and from the CUDA caching allocator on a GPU
  /// (STRATA_DEVICE_CAPACITY).
  uint64_t device_capacity = 0;
  double device_safety_ratio = 0.9;
  int trace_steps = 2;
  /// ZeRO stage over the communicator's ranks (Note [ZeRO over chunks] in
  /// zero/sharding.h): 0 replicates everything (data parallel); 1 shards the
  /// optimizer state and master weights; 2 also the gradients
  /// (reduce-scattered); 3 also the parameters (gathered for the operators
  /// that use them, with prefetch). Ignored with one rank (STRATA_ZERO_STAGE).
  int zero_stage = 0;
  /// Weights that initialise the module's parameters at attach: a
  /// safetensors file, or a directory in Hugging Face's layout (sharded,
  /// with model.safetensors.index.json), matched by named_parameters() name
  /// (the model's own under a pipeline); a tensor-parallel rank reads only
  /// its part (STRATA_INIT_WEIGHTS).
  std::string init_weights;
  /// A JSON file mapping the module's names to the file's, for models whose
  /// names differ: {"name": "name in the file", "prefix.*": "other.*"}
  /// (STRATA_INIT_WEIGHTS_NAMES); empty: the same names.
  std::string init_weights_names;
  /// Pipeline parallel: the pipeline group, over which the gradient norm
  /// and the overflow flag are summed, so every stage clips by the model's
  /// norm and skips the same steps (pipeline::Pipeline::attach sets it from
  /// its mesh's group). Shared: the engine keeps it as long as it lives.
  std::shared_ptr<Communicator> pipeline_group;
  /// The name a checkpoint gives parameter `name` (as the attached module's
  /// named_parameters() names it); null: that name. pipeline::Pipeline::attach
  /// sets it to the model's own names (without "stage<s>."), so that a
  /// checkpoint saved under one cut into stages loads under another
  /// (Note [Checkpoints across layouts]).
  std::function<std::string(const std::string&)> checkpoint_name;

  /// `base` with every option the environment sets replaced:
  /// STRATA_DEVICE_BUDGET, STRATA_HOST_BUDGET, STRATA_NVME_BUDGET (sizes such
  /// as "512MiB"), STRATA_NVME_DIR, STRATA_PRECISION (fp32|bf16|fp16),
  /// STRATA_CHUNK_ELEMS, STRATA_CLIP_NORM, STRATA_UPDATE_IN_BACKWARD (0 or 1), STRATA_GRAD_ACCUMULATION,
  /// STRATA_NVME_OPTIM_FRACTION, STRATA_DEVICE_OPTIM_FRACTION, STRATA_LOSS_SCALE (initial scale),
  /// STRATA_TRACE (trace path), STRATA_TRACE_STEPS, STRATA_POLICY,
  /// STRATA_STATIC_PARAM_FRACTION, STRATA_PREFETCH (0 or 1),
  /// STRATA_DEVICE_CAPACITY, STRATA_INIT_WEIGHTS, STRATA_INIT_WEIGHTS_NAMES, STRATA_ZERO_STAGE. A value
  /// that does not parse is an error naming the variable.
  static EngineOptions from_env(EngineOptions base);
  /// STRATA_TRACE and STRATA_TRACE_STEPS, where set, into trace_path and
  /// trace_steps. attach() calls it when trace_path is empty, so `strata
  /// trace record -- PROGRAM` traces a program whose options are written in
  /// code (no from_env) too.
  void take_trace_from_env();
  /// Checks every option; throws strata::Error saying what to change.
  void validate() const;
};

/// Bytes of model state per parameter: the parameter and its gradient in
/// `precision`, the fp32 master in mixed precision, and `optimizer_states`
/// fp32 state arrays (2 for Adam and AdamW, OptimizerConfig::state_count()).
int64_t model_state_bytes_per_param(DType precision, int optimizer_states = 2);

}  // namespace strata::parallel
