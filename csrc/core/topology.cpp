#include "smp/topology.h"

#include <algorithm>

#include "smp/error.h"

namespace smp {

namespace {

constexpr int kVaryP = 1;
constexpr int kVaryT = 2;
constexpr int kVaryD = 4;

// Size of the mesh axis named by a placement letter.
int axis_extent(char letter, int pp, int tp, int rdp) {
  switch (letter) {
    case 'P':
      return pp;
    case 'T':
      return tp;
    default:
      return rdp;
  }
}

int coordinate_for(char letter, const Coordinates& c) {
  switch (letter) {
    case 'P':
      return c.pp;
    case 'T':
      return c.tp;
    default:
      return c.rdp;
  }
}

}  // namespace

const char* axis_name(Axis axis) {
  switch (axis) {
    case Axis::kPp:
      return "pp";
    case Axis::kTp:
      return "tp";
    case Axis::kDp:
      return "dp";
    case Axis::kRdp:
      return "rdp";
    case Axis::kMp:
      return "mp";
  }
  SMP_INTERNAL_ASSERT(false, "unknown axis");
}

std::string canonical_placement(const std::string& placement_strategy) {
  if (placement_strategy == "cluster") return "DPT";
  if (placement_strategy == "spread") return "TPD";
  std::string sorted = placement_strategy;
  std::sort(sorted.begin(), sorted.end());
  SMP_CHECK(placement_strategy.size() == 3 && sorted == "DPT",
            "placement_strategy must be \"cluster\", \"spread\" or a permutation of the letters "
            "D, P, T (e.g. \"DPT\", \"TPD\"), got \"{}\"",
            placement_strategy);
  return placement_strategy;
}

Topology::Topology(int world_size, int pipeline_parallel_degree, int tensor_parallel_degree,
                   const std::string& placement_strategy)
    : world_size_(world_size),
      pp_(pipeline_parallel_degree),
      tp_(tensor_parallel_degree),
      rdp_(1),
      placement_(canonical_placement(placement_strategy)) {
  SMP_CHECK(world_size_ >= 1, "world size must be >= 1, got {}", world_size_);
  SMP_CHECK(pp_ >= 1, "pipeline_parallel_degree must be >= 1, got {}", pp_);
  SMP_CHECK(tp_ >= 1, "tensor_parallel_degree must be >= 1, got {}", tp_);
  SMP_CHECK(world_size_ % (pp_ * tp_) == 0,
            "world size {} is not divisible by pipeline_parallel_degree * tensor_parallel_degree = "
            "{} * {} = {}; launch a multiple of {} processes or change the degrees",
            world_size_, pp_, tp_, pp_ * tp_, pp_ * tp_);
  rdp_ = world_size_ / (pp_ * tp_);
}

int Topology::size(Axis axis) const {
  switch (axis) {
    case Axis::kPp:
      return pp_;
    case Axis::kTp:
      return tp_;
    case Axis::kDp:
      return dp_size();
    case Axis::kRdp:
      return rdp_;
    case Axis::kMp:
      return mp_size();
  }
  SMP_INTERNAL_ASSERT(false, "unknown axis");
}

int Topology::check_rank(int rank) const {
  SMP_CHECK(rank >= 0 && rank < world_size_, "rank {} is outside [0, {})", rank, world_size_);
  return rank;
}

Coordinates Topology::coordinates(int rank) const {
  int rest = check_rank(rank);
  Coordinates c;
  // Peel letters right to left: the right-most varies fastest.
  for (int i = 2; i >= 0; --i) {
    const char letter = placement_[i];
    const int extent = axis_extent(letter, pp_, tp_, rdp_);
    const int value = rest % extent;
    rest /= extent;
    if (letter == 'P') {
      c.pp = value;
    } else if (letter == 'T') {
      c.tp = value;
    } else {
      c.rdp = value;
    }
  }
  return c;
}

int Topology::rank_of(const Coordinates& coords) const {
  SMP_CHECK(coords.pp >= 0 && coords.pp < pp_ && coords.tp >= 0 && coords.tp < tp_ &&
                coords.rdp >= 0 && coords.rdp < rdp_,
            "coordinates (pp={}, tp={}, rdp={}) are outside the mesh ({}, {}, {})", coords.pp,
            coords.tp, coords.rdp, pp_, tp_, rdp_);
  int rank = 0;
  for (char letter : placement_) {
    rank = rank * axis_extent(letter, pp_, tp_, rdp_) + coordinate_for(letter, coords);
  }
  return rank;
}

int Topology::varied_mask(Axis axis) {
  switch (axis) {
    case Axis::kPp:
      return kVaryP;
    case Axis::kTp:
      return kVaryT;
    case Axis::kDp:
      return kVaryD | kVaryT;
    case Axis::kRdp:
      return kVaryD;
    case Axis::kMp:
      return kVaryP | kVaryT;
  }
  SMP_INTERNAL_ASSERT(false, "unknown axis");
}

std::vector<int> Topology::group_of(Axis axis, int rank) const {
  const Coordinates base = coordinates(rank);
  const int mask = varied_mask(axis);
  const int np = (mask & kVaryP) ? pp_ : 1;
  const int nt = (mask & kVaryT) ? tp_ : 1;
  const int nd = (mask & kVaryD) ? rdp_ : 1;
  std::vector<int> members;
  members.reserve(static_cast<size_t>(np) * nt * nd);
  for (int p = 0; p < np; ++p) {
    for (int t = 0; t < nt; ++t) {
      for (int d = 0; d < nd; ++d) {
        Coordinates c = base;
        if (mask & kVaryP) c.pp = p;
        if (mask & kVaryT) c.tp = t;
        if (mask & kVaryD) c.rdp = d;
        members.push_back(rank_of(c));
      }
    }
  }
  std::sort(members.begin(), members.end());
  return members;
}

int Topology::rank_in(Axis axis, int rank) const {
  const std::vector<int> members = group_of(axis, rank);
  const auto it = std::lower_bound(members.begin(), members.end(), rank);
  SMP_INTERNAL_ASSERT(it != members.end() && *it == rank, "rank missing from its own group");
  return static_cast<int>(it - members.begin());
}

std::vector<std::vector<int>> Topology::groups(Axis axis) const {
  std::vector<std::vector<int>> result;
  std::vector<bool> seen(static_cast<size_t>(world_size_), false);
  for (int rank = 0; rank < world_size_; ++rank) {
    if (seen[rank]) continue;
    std::vector<int> members = group_of(axis, rank);
    for (int member : members) seen[member] = true;
    result.push_back(std::move(members));
  }
  return result;
}

}  // namespace smp
