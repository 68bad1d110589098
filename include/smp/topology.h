// smp/topology.h — where each rank sits in the (pipeline, tensor, reduced-data) mesh.
//
// A world of W ranks is a 3-D mesh with axes
//   P: pipeline stage        (size pp = pipeline_parallel_degree)
//   T: tensor-parallel slice (size tp = tensor_parallel_degree)
//   D: reduced data parallel (size rdp = W / (pp * tp))
// The placement is a permutation of the letters "D", "P", "T"; the right-most letter varies
// fastest:
//   rank = (c[0] * n[1] + c[1]) * n[2] + c[2]
// where c[i] is the rank's coordinate on the i-th letter's axis and n[i] that axis' size.
// "cluster" means "DPT" (TP peers on neighbouring ranks), "spread" means "TPD".
//
// Groups (every group is listed with its ranks ascending; groups are ordered by their first rank):
//   pp  : vary P, fix (D, T)   size pp
//   tp  : vary T, fix (D, P)   size tp
//   rdp : vary D, fix (P, T)   size rdp
//   dp  : vary (D, T), fix P   size rdp * tp     (the ranks holding the same stage; tp ⊂ dp)
//   mp  : vary (P, T), fix D   size pp * tp      (one full model replica)
// A rank's index in a group ("X_rank") is its position in that ascending list.
// Identities: pp·dp = W, pp·tp·rdp = W, mp·rdp = W.
//
// Example (W = 8, pp = tp = 2, "cluster" = DPT, so rank = 4·d + 2·p + t):
//   tp groups  {0,1} {2,3} {4,5} {6,7}
//   pp groups  {0,2} {1,3} {4,6} {5,7}
//   rdp groups {0,4} {1,5} {2,6} {3,7}
//   dp groups  {0,1,4,5} {2,3,6,7}
//   mp groups  {0,1,2,3} {4,5,6,7}
//
//   smp::Topology topo(8, /*pp=*/2, /*tp=*/2, "cluster");
//   topo.coordinates(5);            // {pp = 0, tp = 1, rdp = 1}
//   topo.group_of(smp::Axis::kTp, 5) // {4, 5}
#pragma once

#include <array>
#include <string>
#include <vector>

namespace smp {

/// The process groups of api.md §2.
enum class Axis { kPp = 0, kTp = 1, kDp = 2, kRdp = 3, kMp = 4 };

/// Name of an axis as used in the Python API ("pp", "tp", "dp", "rdp", "mp").
const char* axis_name(Axis axis);

/// All axes, in the order process groups are created.
inline constexpr std::array<Axis, 5> kAllAxes = {Axis::kPp, Axis::kTp, Axis::kDp, Axis::kRdp,
                                                 Axis::kMp};

/// A rank's position on the three mesh axes.
struct Coordinates {
  int pp = 0;
  int tp = 0;
  int rdp = 0;
  bool operator==(const Coordinates& other) const {
    return pp == other.pp && tp == other.tp && rdp == other.rdp;
  }
};

/// Turns "cluster" / "spread" / a permutation of "DPT" into the canonical 3-letter order.
/// Throws smp::Error naming the value and the allowed ones otherwise.
std::string canonical_placement(const std::string& placement_strategy);

/// The rank mesh of one job. Immutable; cheap to copy for the sizes smp runs at.
class Topology {
 public:
  /// Throws smp::Error when a degree is < 1, pp·tp does not divide world_size, or the placement
  /// is not recognised.
  Topology(int world_size, int pipeline_parallel_degree, int tensor_parallel_degree,
           const std::string& placement_strategy = "cluster");

  int world_size() const { return world_size_; }
  int pp_size() const { return pp_; }
  int tp_size() const { return tp_; }
  int rdp_size() const { return rdp_; }
  int dp_size() const { return rdp_ * tp_; }
  int mp_size() const { return pp_ * tp_; }
  /// Size of the groups along `axis`.
  int size(Axis axis) const;
  /// Canonical placement, e.g. "DPT".
  const std::string& placement() const { return placement_; }

  /// Coordinates of a world rank. Throws smp::Error if rank is outside [0, world_size).
  Coordinates coordinates(int rank) const;
  /// World rank at the given coordinates (inverse of coordinates()).
  int rank_of(const Coordinates& coords) const;

  /// The group along `axis` that contains `rank`, ranks ascending.
  std::vector<int> group_of(Axis axis, int rank) const;
  /// `rank`'s index within group_of(axis, rank).
  int rank_in(Axis axis, int rank) const;
  /// Every group along `axis`, each ascending, ordered by first rank; they partition the world.
  std::vector<std::vector<int>> groups(Axis axis) const;

 private:
  // Which coordinates an axis varies: bit 0 = P, bit 1 = T, bit 2 = D.
  static int varied_mask(Axis axis);
  int check_rank(int rank) const;

  int world_size_;
  int pp_;
  int tp_;
  int rdp_;
  std::string placement_;
};

}  // namespace smp
