#include "strata/memory/chunk.h"

#include "strata/core/bytes.h"
#include "strata/core/error.h"

namespace strata::memory {

const char* chunk_role_name(ChunkRole role) {
  switch (role) {
    case ChunkRole::kParam: return "param";
    case ChunkRole::kMaster: return "master";
    case ChunkRole::kGrad: return "grad";
    case ChunkRole::kOptimState: return "optim";
  }
  return "unknown";
}

size_t Chunk::payload_bytes() const noexcept {
  return static_cast<size_t>(layout_->capacity_elems) * dtype_size(dtype_);
}

size_t Chunk::alloc_bytes() const noexcept {
  return static_cast<size_t>(round_up(std::max<size_t>(payload_bytes(), 1), kChunkAlignment));
}

TensorState Chunk::state(size_t slot) const {
  STRATA_CHECK(slot < states_.size(), "tensor slot ", slot, " out of range for ", describe(), " with ",
               states_.size(), " tensors");
  return states_[slot];
}

std::string Chunk::describe() const {
  std::string role = chunk_role_name(role_);
  if (role_ == ChunkRole::kOptimState) role += std::to_string(role_index_);
  if (shard_) role += " shard";
  if (gathered_) role += " (gathered)";
  return "chunk " + std::to_string(id_) + " (" + role + " " + dtype_name(dtype_) + " of family " +
         std::to_string(family_) + ", " + format_bytes(alloc_bytes()) + ", " +
         (location_ ? std::string("on ") + tier_name(*location_) : std::string("no payload")) + ")";
}

std::vector<ChunkId> ChunkFamily::members() const {
  std::vector<ChunkId> ids{param};
  if (master) ids.push_back(*master);
  if (grad != param) ids.push_back(grad);
  ids.insert(ids.end(), optim_states.begin(), optim_states.end());
  if (grad_shard) ids.push_back(*grad_shard);
  if (param_shard) ids.push_back(*param_shard);
  return ids;
}

}  // namespace strata::memory
