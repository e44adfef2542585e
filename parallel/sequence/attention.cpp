// parallel::sequence::Attention: the three sequence-parallel attentions
// behind one module, the mode chosen by option, with the sharding helpers
// that match its layout.
#include "strata/core/enum_names.h"
#include "strata/core/error.h"
#include "strata/parallel/sequence_parallel.h"

namespace strata::parallel::sequence {

namespace {
constexpr EnumName<Mode> kModeNames[] = {
    {Mode::kRingAttention, "ring-attention"}, {Mode::kUlysses, "ulysses"}, {Mode::kRingSelfAttention, "ring-self-attention"}};
}  // namespace

Mode parse_mode(const std::string& name) { return parse_enum(kModeNames, name, "sequence-parallel mode", "choose"); }

const char* mode_name(Mode mode) { return enum_name(kModeNames, mode); }

AttentionImpl::AttentionImpl(Communicator& g, AttentionOptions o) : group(&g), options(o) {}

AttentionImpl::AttentionImpl(std::shared_ptr<Communicator> g, AttentionOptions o)
    : group(g.get()), options(o), owner(std::move(g)) {
  STRATA_CHECK(group != nullptr, "sequence::Attention needs a communicator (the mesh's sequence group)");
}

SequenceLayout AttentionImpl::layout() const {
  return options.mode == Mode::kRingAttention ? options.layout : SequenceLayout::kContiguous;
}

torch::Tensor AttentionImpl::forward(const torch::Tensor& q, const torch::Tensor& k, const torch::Tensor& v) {
  switch (options.mode) {
    case Mode::kUlysses: return ulysses_attention(q, k, v, *group, options.causal);
    case Mode::kRingSelfAttention: return ring_self_attention(q, k, v, *group, options.causal);
    case Mode::kRingAttention: return ring_attention(q, k, v, *group, options.causal, options.layout);
  }
  STRATA_FAIL("unknown sequence-parallel mode");
}

torch::Tensor AttentionImpl::shard(const torch::Tensor& x, int64_t dim) const {
  return layout() == SequenceLayout::kZigzag ? split_sequence_zigzag(x, dim, *group) : split_sequence(x, dim, *group);
}

torch::Tensor AttentionImpl::positions(int64_t local) const {
  const int64_t n = group->world_size(), r = group->rank();
  if (layout() == SequenceLayout::kContiguous) return torch::arange(local) + r * local;
  STRATA_CHECK(local % 2 == 0, "the zigzag layout holds two equal chunks per rank; ", local, " positions are not");
  const int64_t c = local / 2;  // chunks r and 2N-1-r of 2N
  return torch::cat({torch::arange(c) + r * c, torch::arange(c) + (2 * n - 1 - r) * c});
}

}  // namespace strata::parallel::sequence
