// smp/partition.h — the automatic partitioner: which pipeline stage each module runs on.
//
// Input is the module tree recorded by tracing (design.md §3): one PartitionNode per module,
// modules that share parameters already merged into one node. Output is a stage in [0, num_stages)
// for every node, chosen to minimise the largest stage cost.
//
// Invariants of the input (checked; violations throw smp::Error naming the module):
//   - node 0 is the only root (parent -1); every other node's parent is an earlier node;
//   - the children of a node are ordered by node index (first-call order, never-called ones last);
//   - costs are finite and >= 0; pins are -1 (free) or a stage in [0, num_stages).
//
// Cost model. With w = memory_weight and mem(n) = 3·param_bytes(n) + activation_bytes(n) (the 3
// stands for the parameters, their gradients and the optimizer state), a node's own cost is
//   cost(n) = (1 − w)·compute(n)/Σ compute + w·mem(n)/Σ mem,
// a term whose total is 0 drops out and the other is rescaled to weight 1 (memory not measured:
// compute alone), and when both drop out (nothing measured, or w selects the unmeasured term) every
// node costs 1/N. Costs therefore sum to 1. A subtree's cost is the sum of its own costs.
//
// Crossings. `calls` (optional) lists which node's forward calls which, how often and with how many
// bytes per microbatch (tracing records them). A call whose caller and callee are on different
// stages is a crossing: in forward its arguments go to the callee's stage and its outputs come
// back, in backward the outputs' gradients go and the arguments' gradients come back, so each
// crossing is a round trip in each pass, taking
//   seconds(call) = 2·crossing_latency·calls + (forward_bytes + backward_bytes) / bandwidth.
// Both stages take part in it. With seconds_per_compute > 0 crossings are priced: a stage's load is
// its cost plus, for every crossing it takes part in,
//   (1 − w)·seconds(call) / (3·Σ compute·seconds_per_compute)
// (the share of the model's forward + backward compute time, backward ≈ 2× forward, weighted like
// compute), and the partitioner minimises the largest stage load instead of the largest stage
// cost, so a module is split only where the balance it buys outweighs its crossings. To keep the
// stages' work and memory spread when crossings cost more than whole layers (tiny models, very
// fast devices), a priced plan's largest stage cost stays within (1 + balance_tolerance) of the
// best that whole modules give (the segmentation of step 3 before any boundary item is opened).
// With seconds_per_compute = 0 (the default) crossings are reported but do not steer the plan.
//
// Algorithm (top-down; Note [Partitioner] in csrc/core/partition.cpp has the details and proofs):
//   place(items, devices [lo, hi)), items an ordered list of subtrees and "own cost" pseudo-items:
//   1. One device: everything goes to it.
//   2. Refine: an item with children is replaced by its own-cost pseudo-item followed by its
//      children when it is a `chain` node or its cost exceeds (items + pinned cost) / devices;
//      repeated until nothing changes. A chain of similar blocks is so partitioned as one flat
//      sequence, and a wrapper around a chain is opened because it is too big for one stage. An
//      expanded node is placed on the stage of its own-cost pseudo-item.
//   3. Items >= devices: the exact min-max contiguous segmentation, one segment per device. At the
//      top level the root's own cost may sit at any position of the sequence (solved exactly as
//      "the root's own cost is extra load on device j", for every j). If the result is more than 2%
//      above the optimum F of the fully expanded sequence (the pre-order of own costs), the items
//      on the boundaries of the over-loaded segments are expanded and the segmentation redone (up
//      to 8 rounds), and failing that exactly the items that F's cuts go through. Whole modules so
//      stay together unless splitting them buys real balance, and without pins the plan is within
//      2% of the best contiguous cut of the pre-order (and never above 2x the best assignment).
//      With priced crossings each segmentation is the exact minimum of the largest stage load
//      (dynamic programming over the items, up to 4096 of them, under the balance cap), the target
//      is that minimum over the fully expanded sequence, and opening an item so never raises the
//      load: a cut inside a module is taken only when it lowers the largest stage load. The
//      segmentation by cost alone is computed too and kept if its load is lower, so a priced
//      level is never worse than the crossing-blind one.
//   4. Items < devices: every item is a segment; the remaining devices go one at a time to the
//      segment with the largest cost / devices (D'Hondt), never more devices than the segment has
//      modules; segments get consecutive device ranges and recurse.
//   Pins are hard constraints: a subtree whose modules all have the same pin (unpinned modules
//   follow their nearest pinned ancestor) is taken out of the sequence and its cost pre-loaded on
//   its stage; a module whose subtree holds other pins is expanded; the free rest is segmented
//   exactly, one segment per stage, minimising max(pre-load + segment cost). No stage is ever
//   empty: the segmentation requires a non-empty segment on every stage without a pinned module,
//   and step 4 never gives a segment more stages than it has modules. If the tree has fewer
//   placeable units than stages (free modules plus distinct pinned stages), partition() throws.
//
// Example:
//   std::vector<smp::PartitionNode> nodes = {
//       {"", -1},                                          // the model (root)
//       {"embed", 0, /*compute=*/2, /*param_bytes=*/400},
//       {"layers", 0, 0, 0, 0, -1, /*chain=*/true},
//       {"layers.0", 2, 4, 100}, {"layers.1", 2, 4, 100}, {"layers.2", 2, 4, 100},
//   };
//   smp::PartitionOptions options;
//   options.num_stages = 2;
//   smp::PartitionPlan plan = smp::partition(nodes, options);
//   plan.stage;        // {0, 0, 0, 0, 1, 1}: embed + layers.0 | layers.1 + layers.2
//   plan.imbalance;    // max stage cost / mean stage cost, >= 1
#pragma once

#include <string>
#include <vector>

namespace smp {

/// One module (or group of modules sharing parameters) of the traced model.
struct PartitionNode {
  /// Module path(s), used in reports and error messages.
  std::string name;
  /// Index of the parent node; -1 for the root, which is node 0. Parents come before children.
  int parent = -1;
  /// Own forward cost, exclusive of children, >= 0 (any unit: seconds, FLOPs).
  double compute = 0;
  /// Own parameter bytes, >= 0.
  double param_bytes = 0;
  /// Own output bytes, >= 0.
  double activation_bytes = 0;
  /// Stage this node and its subtree (except descendants with their own pin) must be on; -1 = free.
  int pin = -1;
  /// This node's children are a chain of similar blocks (nn.ModuleList / nn.Sequential of layers):
  /// the partitioner always opens it and cuts the blocks as one flat sequence.
  bool chain = false;
};

/// Knobs of partition().
struct PartitionOptions {
  /// Number of pipeline stages (pipeline_parallel_degree), >= 1.
  int num_stages = 1;
  /// Weight of memory against compute in the cost model, in [0, 1].
  double memory_weight = 0.2;
  /// Seconds one unit of PartitionNode::compute takes in forward: 1 when compute is measured in
  /// seconds, 1 / (FLOP rate) when it is FLOPs. 0 leaves crossings unpriced (reported only).
  double seconds_per_compute = 0;
  /// Seconds of one cross-stage round trip (per crossing and pass), >= 0.
  double crossing_latency = 1e-3;
  /// Bytes per second between two stages, > 0 (infinity: bytes are free).
  double bandwidth = 2e9;
  /// With priced crossings: how far above the best whole-module balance a plan's largest stage
  /// cost may go to save crossings, >= 0.
  double balance_tolerance = 0.1;
};

/// Calls one node's forward makes to another during one forward (one microbatch), from tracing.
struct PartitionCall {
  /// Node whose forward makes the calls; -1 = code outside the model (the step function), which
  /// runs on stage 0.
  int caller = -1;
  /// Node called.
  int callee = 0;
  /// Number of calls, >= 0.
  double calls = 0;
  /// Bytes of the arguments and the outputs, summed over the calls (what crosses in forward).
  double forward_bytes = 0;
  /// Bytes of the gradients of the outputs and of the arguments, summed over the calls (what
  /// crosses in backward).
  double backward_bytes = 0;
};

/// Traffic between two stages per microbatch: the crossings of the plan between them.
struct PartitionLink {
  /// The two stages, first_stage < second_stage.
  int first_stage = 0;
  int second_stage = 0;
  /// Crossing calls (each a round trip in forward and another in backward).
  double calls = 0;
  /// Bytes crossing in forward (arguments out, outputs back) and in backward (gradients).
  double forward_bytes = 0;
  double backward_bytes = 0;
  /// Estimated time of these crossings, forward + backward (see the cost model above).
  double seconds = 0;
};

/// The result of partition(). Vectors indexed by node have one entry per node; vectors indexed by
/// stage have num_stages entries.
struct PartitionPlan {
  /// Stage of every node.
  std::vector<int> stage;
  /// Normalised own cost of every node (see the cost model above); sums to 1.
  std::vector<double> node_cost;
  /// Sum of node_cost per stage.
  std::vector<double> stage_cost;
  /// Sum of the raw param_bytes per stage.
  std::vector<double> stage_param_bytes;
  /// Sum of the raw activation_bytes per stage.
  std::vector<double> stage_activation_bytes;
  /// Sum of the raw compute per stage.
  std::vector<double> stage_compute;
  /// Largest entry of stage_cost.
  double max_stage_cost = 0;
  /// max_stage_cost / mean of stage_cost (1 = perfect balance).
  double imbalance = 1;
  /// Normalised cost of the crossings each stage takes part in (same scale as stage_cost); 0 when
  /// crossings are unpriced.
  std::vector<double> stage_crossing_cost;
  /// Largest stage_cost + stage_crossing_cost: what the partitioner minimises.
  double max_stage_load = 0;
  /// Every pair of stages with crossings between them, ordered by (first_stage, second_stage).
  std::vector<PartitionLink> links;
};

/// Assigns every node of the module tree to a pipeline stage (algorithm in the file comment).
/// Deterministic: the same input gives the same plan. Throws smp::Error when num_stages < 1,
/// memory_weight is outside [0, 1], a cost is negative or not finite, a parent index is invalid,
/// a pin is outside [-1, num_stages), the tree has fewer placeable units than stages, a call names
/// a node that does not exist or has a negative or non-finite count or size, or a crossing option
/// is out of range.
PartitionPlan partition(const std::vector<PartitionNode>& nodes, const PartitionOptions& options,
                        const std::vector<PartitionCall>& calls = {});

/// Exact min-max partition of `costs` (in order) into `num_parts` contiguous parts: returns the
/// part of each item (non-decreasing), minimising the largest part sum. Parts are non-empty
/// whenever costs.size() >= num_parts (which never costs optimality); otherwise item i goes to part
/// i. Used by the partitioner, by tests and by the benchmark as the optimum. Throws smp::Error when
/// num_parts < 1 or a cost is negative or not finite.
std::vector<int> optimal_contiguous_partition(const std::vector<double>& costs, int num_parts);

}  // namespace smp
