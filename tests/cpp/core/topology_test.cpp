#include "smp/topology.h"

#include <fmt/format.h>
#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>
#include <vector>

#include "smp/error.h"

namespace smp {
namespace {

using Groups = std::vector<std::vector<int>>;

const std::vector<std::string> kPermutations = {"DPT", "DTP", "PDT", "PTD", "TDP", "TPD"};

// Every (world, pp, tp) with pp * tp dividing world, for world sizes 1..16.
struct Shape {
  int world;
  int pp;
  int tp;
};
std::vector<Shape> all_shapes() {
  std::vector<Shape> shapes;
  for (int world = 1; world <= 16; ++world) {
    for (int pp = 1; pp <= world; ++pp) {
      for (int tp = 1; pp * tp <= world; ++tp) {
        if (world % (pp * tp) == 0) shapes.push_back({world, pp, tp});
      }
    }
  }
  return shapes;
}

TEST(TopologyTest, WorkedExampleFromTheApi) {
  Topology topo(8, 2, 2, "cluster");
  EXPECT_EQ(topo.placement(), "DPT");
  EXPECT_EQ(topo.groups(Axis::kTp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(topo.groups(Axis::kPp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
  EXPECT_EQ(topo.groups(Axis::kRdp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(topo.groups(Axis::kDp), (Groups{{0, 1, 4, 5}, {2, 3, 6, 7}}));
  EXPECT_EQ(topo.groups(Axis::kMp), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}}));
  EXPECT_EQ(topo.coordinates(5), (Coordinates{0, 1, 1}));
  EXPECT_EQ(topo.rank_in(Axis::kDp, 5), 3);
  EXPECT_EQ(topo.rank_in(Axis::kPp, 6), 1);
}

TEST(TopologyTest, SpreadPutsDataParallelPeersNextToEachOther) {
  Topology topo(8, 2, 2, "spread");
  EXPECT_EQ(topo.placement(), "TPD");
  // rank = (t * 2 + p) * 2 + d
  EXPECT_EQ(topo.groups(Axis::kRdp), (Groups{{0, 1}, {2, 3}, {4, 5}, {6, 7}}));
  EXPECT_EQ(topo.groups(Axis::kTp), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}}));
  EXPECT_EQ(topo.groups(Axis::kPp), (Groups{{0, 2}, {1, 3}, {4, 6}, {5, 7}}));
}

TEST(TopologyTest, RightMostLetterVariesFastest) {
  for (const std::string& placement : kPermutations) {
    Topology topo(24, 2, 3, placement);  // rdp = 4
    const char fastest = placement[2];
    const Coordinates c0 = topo.coordinates(0);
    const Coordinates c1 = topo.coordinates(1);
    EXPECT_EQ(c0, (Coordinates{0, 0, 0})) << placement;
    EXPECT_EQ(c1.pp, fastest == 'P' ? 1 : 0) << placement;
    EXPECT_EQ(c1.tp, fastest == 'T' ? 1 : 0) << placement;
    EXPECT_EQ(c1.rdp, fastest == 'D' ? 1 : 0) << placement;
  }
}

// For every world size 1..16, every divisible (pp, tp) and every permutation: coordinates are a
// bijection, groups partition the world with the documented sizes, members share exactly the fixed
// coordinates, and the api.md identities hold.
TEST(TopologyTest, GroupsPartitionTheWorldForAllShapesAndPermutations) {
  int checked = 0;
  for (const Shape& s : all_shapes()) {
    for (const std::string& placement : kPermutations) {
      const Topology topo(s.world, s.pp, s.tp, placement);
      const std::string where =
          fmt::format("world={} pp={} tp={} {}", s.world, s.pp, s.tp, placement);
      ASSERT_EQ(topo.pp_size() * topo.dp_size(), s.world) << where;
      ASSERT_EQ(topo.pp_size() * topo.tp_size() * topo.rdp_size(), s.world) << where;
      ASSERT_EQ(topo.mp_size() * topo.rdp_size(), s.world) << where;

      std::set<int> seen;
      for (int rank = 0; rank < s.world; ++rank) {
        const Coordinates c = topo.coordinates(rank);
        ASSERT_EQ(topo.rank_of(c), rank) << where;
        seen.insert(rank);
      }
      ASSERT_EQ(static_cast<int>(seen.size()), s.world) << where;

      for (Axis axis : kAllAxes) {
        const Groups groups = topo.groups(axis);
        ASSERT_EQ(static_cast<int>(groups.size()) * topo.size(axis), s.world) << where;
        std::vector<int> covered;
        for (const auto& group : groups) {
          ASSERT_EQ(static_cast<int>(group.size()), topo.size(axis)) << where;
          ASSERT_TRUE(std::is_sorted(group.begin(), group.end())) << where;
          const Coordinates first = topo.coordinates(group.front());
          for (size_t i = 0; i < group.size(); ++i) {
            const int rank = group[i];
            const Coordinates c = topo.coordinates(rank);
            // Fixed coordinates agree with the group's first member.
            if (axis == Axis::kPp) {
              EXPECT_TRUE(c.tp == first.tp && c.rdp == first.rdp) << where;
            } else if (axis == Axis::kTp) {
              EXPECT_TRUE(c.pp == first.pp && c.rdp == first.rdp) << where;
            } else if (axis == Axis::kRdp) {
              EXPECT_TRUE(c.pp == first.pp && c.tp == first.tp) << where;
            } else if (axis == Axis::kDp) {
              EXPECT_EQ(c.pp, first.pp) << where;
            } else {
              EXPECT_EQ(c.rdp, first.rdp) << where;
            }
            EXPECT_EQ(topo.group_of(axis, rank), group) << where;
            EXPECT_EQ(topo.rank_in(axis, rank), static_cast<int>(i)) << where;
            covered.push_back(rank);
          }
        }
        std::sort(covered.begin(), covered.end());
        for (int rank = 0; rank < s.world; ++rank) ASSERT_EQ(covered[rank], rank) << where;
      }
      // tp ⊂ dp, and pp ∩ dp = {rank}.
      for (int rank = 0; rank < s.world; ++rank) {
        const auto dp = topo.group_of(Axis::kDp, rank);
        for (int member : topo.group_of(Axis::kTp, rank)) {
          EXPECT_TRUE(std::binary_search(dp.begin(), dp.end(), member)) << where;
        }
        int shared = 0;
        for (int member : topo.group_of(Axis::kPp, rank)) {
          shared += std::binary_search(dp.begin(), dp.end(), member) ? 1 : 0;
        }
        EXPECT_EQ(shared, 1) << where;
      }
      ++checked;
    }
  }
  EXPECT_GT(checked, 200);
}

TEST(TopologyTest, CanonicalPlacement) {
  EXPECT_EQ(canonical_placement("cluster"), "DPT");
  EXPECT_EQ(canonical_placement("spread"), "TPD");
  for (const std::string& p : kPermutations) EXPECT_EQ(canonical_placement(p), p);
  for (const std::string bad : {"", "DP", "DDT", "dpt", "DPTT", "XYZ", "clusters"}) {
    EXPECT_THROW(canonical_placement(bad), Error) << bad;
  }
}

TEST(TopologyTest, BadInputNamesTheValue) {
  try {
    Topology(6, 4, 1);
    FAIL() << "expected smp::Error";
  } catch (const Error& e) {
    const std::string message = e.what();
    EXPECT_NE(message.find("world size 6"), std::string::npos) << message;
    EXPECT_NE(message.find("4"), std::string::npos) << message;
  }
  EXPECT_THROW(Topology(4, 0, 1), Error);
  EXPECT_THROW(Topology(4, 1, -2), Error);
  EXPECT_THROW(Topology(0, 1, 1), Error);
  EXPECT_THROW(Topology(4, 2, 1, "PPT"), Error);
  const Topology topo(4, 2, 2);
  EXPECT_THROW(topo.coordinates(4), Error);
  EXPECT_THROW(topo.coordinates(-1), Error);
  EXPECT_THROW(topo.rank_of(Coordinates{2, 0, 0}), Error);
}

TEST(TopologyTest, AxisNames) {
  EXPECT_STREQ(axis_name(Axis::kPp), "pp");
  EXPECT_STREQ(axis_name(Axis::kTp), "tp");
  EXPECT_STREQ(axis_name(Axis::kDp), "dp");
  EXPECT_STREQ(axis_name(Axis::kRdp), "rdp");
  EXPECT_STREQ(axis_name(Axis::kMp), "mp");
}

}  // namespace
}  // namespace smp
