// smp_partition_bench — times smp::partition on random module trees.
//
// Trees are seeded and grown breadth-first: every node gets a random number of children in [1, 8]
// until the tree has the requested size; costs are random, 5% of nodes have no cost and 2% are
// chain nodes. For 1k, 10k and 100k nodes and 2, 4, 8 stages it prints the best of 3 wall times,
// the plan's imbalance (max / mean stage cost) and its max stage cost relative to the exact optimum
// over contiguous cuts of the pre-order (optimal_contiguous_partition of the fully expanded tree).
//
// A second table times the same trees with priced crossings: every node is called once by its
// parent (the step function calls the root) with 64 KiB crossing each way, the whole forward
// takes one second, a round trip 1 ms and bandwidth is 2 GB/s; it prints the plan's largest stage
// load relative to that of the plan which ignores the crossings.
//
// Usage: smp_partition_bench   (no arguments; exits 0)
#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <deque>
#include <limits>
#include <random>
#include <string>
#include <vector>

#include "smp/partition.h"

namespace {

std::vector<smp::PartitionNode> random_tree(int num_nodes, unsigned seed) {
  std::mt19937 rng(seed);
  std::uniform_real_distribution<double> unit(0.0, 1.0);
  std::uniform_int_distribution<int> branching(1, 8);
  std::vector<smp::PartitionNode> nodes;
  nodes.reserve(num_nodes);
  const auto add = [&](int parent) {
    smp::PartitionNode node;
    node.name = fmt::format("m{}", nodes.size());
    node.parent = parent;
    if (unit(rng) >= 0.05) {
      node.compute = unit(rng);
      node.param_bytes = unit(rng) * 1e6;
      node.activation_bytes = unit(rng) * 1e5;
    }
    node.chain = unit(rng) < 0.02;
    nodes.push_back(node);
  };
  add(-1);
  std::deque<int> frontier = {0};
  while (static_cast<int>(nodes.size()) < num_nodes && !frontier.empty()) {
    const int parent = frontier.front();
    frontier.pop_front();
    const int k = branching(rng);
    for (int i = 0; i < k && static_cast<int>(nodes.size()) < num_nodes; ++i) {
      add(parent);
      frontier.push_back(static_cast<int>(nodes.size()) - 1);
    }
  }
  return nodes;
}

// Own costs in pre-order, children by index.
std::vector<double> preorder_costs(const std::vector<smp::PartitionNode>& nodes,
                                   const std::vector<double>& cost) {
  std::vector<std::vector<int>> children(nodes.size());
  for (std::size_t v = 1; v < nodes.size(); ++v) children[nodes[v].parent].push_back(v);
  std::vector<double> out;
  std::vector<int> stack = {0};
  while (!stack.empty()) {
    const int v = stack.back();
    stack.pop_back();
    out.push_back(cost[v]);
    for (auto it = children[v].rbegin(); it != children[v].rend(); ++it) stack.push_back(*it);
  }
  return out;
}

// Largest stage load of `stage` under the crossing cost model (smp/partition.h).
double stage_load(const std::vector<smp::PartitionNode>& nodes,
                  const std::vector<smp::PartitionCall>& calls,
                  const smp::PartitionOptions& options, const std::vector<double>& cost,
                  const std::vector<int>& stage) {
  double total_compute = 0;
  for (const smp::PartitionNode& x : nodes) total_compute += x.compute;
  std::vector<double> load(options.num_stages, 0.0);
  for (std::size_t v = 0; v < nodes.size(); ++v) load[stage[v]] += cost[v];
  for (const smp::PartitionCall& c : calls) {
    const int a = c.caller == -1 ? 0 : stage[c.caller];
    const int b = stage[c.callee];
    if (a == b) continue;
    const double seconds = 2 * options.crossing_latency * c.calls +
                           (c.forward_bytes + c.backward_bytes) / options.bandwidth;
    const double kappa =
        (1 - options.memory_weight) * seconds / (3 * total_compute * options.seconds_per_compute);
    load[a] += kappa;
    load[b] += kappa;
  }
  return *std::max_element(load.begin(), load.end());
}

}  // namespace

int main() {
  std::printf("%8s  %6s  %9s  %9s  %12s\n", "nodes", "stages", "ms", "imbalance", "vs_leaf_opt");
  for (int num_nodes : {1000, 10000, 100000}) {
    const std::vector<smp::PartitionNode> nodes = random_tree(num_nodes, 1234 + num_nodes);
    for (int num_stages : {2, 4, 8}) {
      smp::PartitionOptions options;
      options.num_stages = num_stages;
      double best_ms = std::numeric_limits<double>::infinity();
      smp::PartitionPlan plan;
      for (int rep = 0; rep < 3; ++rep) {
        const auto start = std::chrono::steady_clock::now();
        plan = smp::partition(nodes, options);
        const auto stop = std::chrono::steady_clock::now();
        best_ms =
            std::min(best_ms, std::chrono::duration<double, std::milli>(stop - start).count());
      }
      const std::vector<double> leaves = preorder_costs(nodes, plan.node_cost);
      const std::vector<int> part = smp::optimal_contiguous_partition(leaves, num_stages);
      std::vector<double> sums(num_stages, 0.0);
      for (std::size_t i = 0; i < leaves.size(); ++i) sums[part[i]] += leaves[i];
      const double optimum = *std::max_element(sums.begin(), sums.end());
      std::printf("%8d  %6d  %9.2f  %9.4f  %12.4f\n", num_nodes, num_stages, best_ms,
                  plan.imbalance, plan.max_stage_cost / optimum);
    }
  }
  std::printf("\nwith priced crossings (every node called by its parent):\n");
  std::printf("%8s  %6s  %9s  %9s  %14s\n", "nodes", "stages", "ms", "imbalance", "vs_blind_load");
  for (int num_nodes : {1000, 10000, 100000}) {
    const std::vector<smp::PartitionNode> nodes = random_tree(num_nodes, 1234 + num_nodes);
    std::vector<smp::PartitionCall> calls;
    for (int v = 0; v < num_nodes; ++v) {
      smp::PartitionCall call;
      call.caller = v == 0 ? -1 : nodes[v].parent;
      call.callee = v;
      call.calls = 1;
      call.forward_bytes = call.backward_bytes = 2 * 65536;
      calls.push_back(call);
    }
    for (int num_stages : {2, 4, 8}) {
      smp::PartitionOptions options;
      options.num_stages = num_stages;
      double total_compute = 0;
      for (const smp::PartitionNode& x : nodes) total_compute += x.compute;
      options.seconds_per_compute = 1 / total_compute;  // the forward takes one second
      double best_ms = std::numeric_limits<double>::infinity();
      smp::PartitionPlan plan;
      for (int rep = 0; rep < 3; ++rep) {
        const auto start = std::chrono::steady_clock::now();
        plan = smp::partition(nodes, options, calls);
        const auto stop = std::chrono::steady_clock::now();
        best_ms =
            std::min(best_ms, std::chrono::duration<double, std::milli>(stop - start).count());
      }
      smp::PartitionOptions blind_options;
      blind_options.num_stages = num_stages;
      const smp::PartitionPlan blind = smp::partition(nodes, blind_options);
      const double blind_load = stage_load(nodes, calls, options, plan.node_cost, blind.stage);
      std::printf("%8d  %6d  %9.2f  %9.4f  %14.4f\n", num_nodes, num_stages, best_ms,
                  plan.imbalance, plan.max_stage_load / blind_load);
    }
  }
  return 0;
}
