#include "smp/partition.h"

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <limits>
#include <map>
#include <numeric>
#include <string>
#include <utility>
#include <vector>

#include "smp/error.h"

// Note [Partitioner]
// ~~~~~~~~~~~~~~~~~~
// Items. A sequence holds Item{node, own}: own = false is node's whole subtree, own = true is the
// node's own cost alone (the "pseudo-item" of an expanded node). Expanding a subtree item v gives
// [own(v), child_1, ..., child_k]; items in a sequence are therefore consecutive ranges of the
// pre-order, and the fully expanded sequence is the pre-order list of own costs.
//
// Levels. place(seq, [lo, hi)) refines seq (rule 2 of the header), then
//   - m >= n (items >= devices): one_to_one() — exact segmentation into n segments, one per device;
//   - m <  n: dhondt() — one segment per item, spare devices by D'Hondt on cost / devices, capped
//     by the number of modules in the item; segments with several devices recurse. Each recursion
//     has strictly fewer devices than its parent (the item is expanded into >= 2 items first), so
//     the depth is below num_stages.
//
// Empty stages. Invariant of place(): the items hold at least as many placeable units (free
// modules) as there are devices without a pinned module. It holds at the top (checked, else
// smp::Error), one_to_one() requires a non-empty segment on every device without a pinned module
// (possible because m >= n, or after forced expansion in the pinned case), and dhondt() gives a
// segment at most as many devices as it has units. Hence no stage is ever empty.
//
// Root position. At the top level the root's own cost can sit anywhere in the sequence. Putting it
// at some position lands it in some device's segment; conversely for every device j and every
// segmentation of the rest there is a position that lands it on j. So "min over positions" equals
// "min over devices j of the segmentation with the root's cost pre-loaded on j (j may then have an
// empty segment)": n exact solves instead of m + 1, for any m.
//
// Boundary refinement. The segmentation is exact for the items it is given; coarse items (whole
// transformer blocks) can still be far from the optimum F of the fully expanded sequence (the
// pre-order of own costs, root anywhere). While the result exceeds (1 + kRefineTolerance)·F, the
// items on both sides of every boundary of an over-loaded segment are opened and the segmentation
// redone, at most kMaxBoundaryRounds times; after that (or when none of those items can be opened)
// we open exactly the items that an optimal segmentation of the fully expanded sequence cuts
// through, which makes F itself available. Opening never makes the optimum worse (the old
// segmentation is still available), and modules are split only where balance needs it.
// Consequence: at the top level (no pins) the plan is within 1 + kRefineTolerance of the best
// contiguous cut of the pre-order. (When the top level takes the dhondt() path, every segment is a
// single module or a subtree of cost <= total/n, so the plan is even at most that optimum.)
//
// Bound. Let OPT be the optimum over all assignments honouring the pins (stages not contiguous).
// OPT >= total/n, OPT >= every pre-load, OPT >= every own cost. After rule 2 every expandable item
// costs <= total/n <= OPT and every other item is one node's own cost <= OPT; call the largest item
// x <= OPT. The greedy "fill each stage up to 2·OPT" then places everything (a stage it closes
// holds > 2·OPT − x >= OPT, and n such stages would exceed the total), also with the non-empty
// rule, so the exact segmentation gives max stage cost <= OPT + x <= 2·OPT. When m < n (dhondt)
// each segment is a single item of cost <= OPT, so the result is <= OPT. Refinement only lowers
// the result. Hence partition() <= 2·OPT.

// Note [Crossings]
// ~~~~~~~~~~~~~~~~
// Cost. A call (caller u, callee v) whose ends are on different stages costs kappa = (1 − w)·
// seconds(call) / (3·Σ compute·seconds_per_compute) on both stages (partition.h). The step
// function is a caller on stage 0. A stage's load is its cost plus the kappa of every crossing it
// takes part in; a priced plan minimises the largest load.
//
// One level. The items of a sequence are consecutive ranges of the pre-order, so every call end is
// (a) inside an item of the sequence, (b) a module whose stage is already fixed (a pin, the step
// function, a module placed by an earlier level), (c) the root, when its own cost may go to any
// device (top level), or (d) a module not placed yet (another segment of a D'Hondt level: its
// crossings are not known here and are left out; the plan's report counts them all). A call with
// both ends in one item never crosses and drops out. For a segment [s, e) on device d:
//   load_d = preload_d + C(s, e) + X(s, e) + Σ_{(a) ends p in [s, e), fixed stage t ≠ d} kappa
//            + Σ_{fixed stage t = d, the item end outside [s, e)} kappa + (root terms),
// C the item costs and X the calls between items with exactly one end in [s, e). The fixed-stage
// terms are K_d + Σ_{p in [s, e)} (ext(p) − 2·ext_d(p)), K_d the calls between items and stage d,
// which makes every term a function of (d, s, e) alone, computed incrementally as e grows: adding
// item q adds kappa for each of its calls whose other end is outside [s, e) and removes it for
// each whose other end is already inside. The root's own cost is handled as in Note [Partitioner]
// (root position) by a flag in the state: "the root is on a device <= d"; the device that takes it
// pays the root's calls to items outside its segment, the others pay those to their own items.
//
// Exact dynamic programme. f[d][e][h] = the smallest max load of devices 0..d covering items
// [0, e), h = whether the root is placed. f[d][e][h'] = min over s of max(f[d−1][s][h], load_d(s,
// e)). Every load is >= preload_d + C(s, e), which only grows with e, so a sweep from s stops when
// that exceeds the best value known (the compute-only segmentation of the same items, evaluated
// with its crossings) or the balance cap below; the work is about (number of reachable starts) ×
// (items per stage) steps, each as long as the item's call list. Sequences of more than
// kMaxPricedItems items keep the compute-only segmentation (real models' levels have tens to a
// few thousand items; 100k-node trees without calls never get here).
//
// Balance cap. When crossings cost more than whole layers (tiny models, fast devices), the least
// load is reached by giving all stages but one a single tiny module: the pipeline then holds
// neither the work nor the memory it was asked to spread. A priced segmentation therefore keeps
// every stage's cost <= (1 + balance_tolerance)·V, V the compute-only optimum of the level's items
// before any boundary item is opened (whole modules), and minimises the load under that cap.
// Opening items never removes a segmentation (the pieces of an opened item may stay together, with
// the same crossings), so every refinement round's exact minimum is <= the previous one, and the
// fallback of Note [Partitioner] (open what the fully expanded optimum cuts through) reaches that
// optimum. Hence, within the size limit: the plan's largest load is within 1 + kRefineTolerance
// of the least largest load of any contiguous cut of the pre-order (root anywhere) under the cap.
// Each priced level also runs the segmentation by cost alone (the unpriced path) and keeps it when
// its load is lower: a level is never worse than ignoring crossings, also beyond the size limit
// (tests: the contiguous oracle on small trees, and 100k-node trees with a call per node).

namespace smp {
namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
// See Note [Partitioner]: how far above the fully expanded optimum a coarse segmentation may be.
constexpr double kRefineTolerance = 0.02;
constexpr int kMaxBoundaryRounds = 8;
// See Note [Crossings]: longest item sequence segmented by the exact dynamic programme.
constexpr int kMaxPricedItems = 4096;
// A crossing is a round trip in forward and another in backward.
constexpr double kPasses = 2;
// Forward + backward compute per unit of traced (forward) compute: backward ≈ 2× forward.
constexpr double kComputePasses = 3;

// Note [Exact contiguous segmentation]
// ~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~~
// Items 0..m-1 with prefix sums P go to devices 0..n-1 in order, device d taking [s_d, e_d) with
// s_0 = 0, e_{n-1} = m, e_d = s_{d+1}. load_d = preload_d + P[e_d] − P[s_d]; devices flagged
// may_be_empty may take no item, the others must take at least one. Minimise max_d load_d.
//
// probe(B): greedy — each device takes as many items as fit under B, leaving enough items for the
// devices after it that must be non-empty. It succeeds iff some assignment has max load <= B
// (exchange argument: if a feasible assignment ends device d at f_d and the greedy at g_d >= f_d,
// the greedy can reach >= f_{d+1} from g_d, since costs are >= 0).
//
// solve(): Nicol's algorithm, exact. With device j starting at s, let B(e) = max(max preload,
// load_j(s, e)) and e* the smallest e with probe(B(e)) (probing devices j.. from item s). If an
// optimum ends device j at or after e*, the optimum is B(e*). Otherwise it ends device j before
// e*, the optimum exceeds B(e* − 1), and we may end device j at e* − 1 and continue with device
// j + 1 from there. The answer is the smallest candidate seen (every candidate is the max load of
// an actual assignment, so it is feasible). Plain, that is n·log m probes of O(n log m) each; we
// first bisect the value with probes to a bracket (lo, hi] of relative width 1e-12 (lo below every
// assignment, hi feasible), and then only ends with lo < B(e) < hi can matter: a handful per
// device.
class Segmenter {
 public:
  Segmenter(const std::vector<double>& prefix, const std::vector<double>& preload,
            const std::vector<char>& may_be_empty)
      : prefix_(prefix),
        preload_(preload),
        may_be_empty_(may_be_empty),
        m_(static_cast<int>(prefix.size()) - 1),
        n_(static_cast<int>(preload.size())),
        required_from_(n_ + 1, 0) {
    for (int d = n_ - 1; d >= 0; --d) required_from_[d] = required_from_[d + 1] + !may_be_empty_[d];
    for (double b : preload_) floor_ = std::max(floor_, b);
  }

  // The optimal max load; kInf if there are fewer items than devices that must be non-empty.
  // `upper`, if finite, must be a feasible max load (it narrows the search).
  double solve(double upper = kInf) const {
    if (required_from_[0] > m_) return kInf;
    // 1. Bracket B* in (lo, hi]: lo is below every assignment's max load (the average load and
    //    the largest preload, relaxed against rounding), hi is feasible. Bisect with probes.
    const double total = prefix_[m_] + std::accumulate(preload_.begin(), preload_.end(), 0.0);
    double lo = std::max(floor_, total / n_) * (1 - 1e-9);
    double hi = upper;
    if (!(hi < kInf)) {
      double largest = 0;
      for (int i = 0; i < m_; ++i) largest = std::max(largest, prefix_[i + 1] - prefix_[i]);
      hi = std::max(floor_, total / n_) + largest;  // feasible, see Note [Partitioner] (bound)
      if (!probe(hi, 0, 0, nullptr)) hi = floor_ + prefix_[m_];  // rounding: always feasible
    }
    for (int i = 0; i < 64 && hi - lo > 1e-12 * hi; ++i) {
      const double mid = lo + (hi - lo) / 2;
      if (probe(mid, 0, 0, nullptr)) {
        hi = mid;
      } else {
        lo = mid;
      }
    }
    // 2. Nicol's search (Note [Exact contiguous segmentation]) with the best value known so far
    //    = hi: only ends e with lo < B(e) < best matter, so each binary search is short.
    double best = hi;
    double chain_max = floor_;  // max load of the devices fixed so far
    int s = 0;
    for (int j = 0; j + 1 < n_; ++j) {
      const int lo_e = s + (may_be_empty_[j] ? 0 : 1);
      const int hi_e = m_ - required_from_[j + 1];
      SMP_INTERNAL_ASSERT(lo_e <= hi_e, "segmentation lost track of the non-empty devices");
      const auto bound = [&](int e) { return std::max(floor_, load(j, s, e)); };
      // left: first e with bound(e) > lo (probes below lo fail); right: one past the last e with
      // bound(e) < best (larger e cannot improve best).
      const int left0 = first_end(lo_e, hi_e + 1, [&](int e) { return bound(e) > lo; });
      const int right0 = first_end(left0, hi_e + 1, [&](int e) { return bound(e) >= best; });
      if (right0 == lo_e) return best;  // device j alone already reaches best
      const int e_star =
          first_end(left0, right0, [&](int e) { return probe(bound(e), j, s, nullptr); });
      if (e_star < right0) {
        best = std::min(best, std::max(chain_max, bound(e_star)));
        if (e_star == lo_e) return best;  // every choice for device j ends at or after e*
      }
      // If an optimum beats best, one ends device j at e* - 1 (e* = right0 if none was found).
      const int e = e_star - 1;
      chain_max = std::max(chain_max, load(j, s, e));
      s = e;
    }
    return std::min(best, std::max(chain_max, load(n_ - 1, s, m_)));
  }

  // Whether some assignment has max load <= cap.
  bool feasible(double cap) const { return required_from_[0] <= m_ && probe(cap, 0, 0, nullptr); }

  // End (one past the last item) of every device's segment in the greedy assignment at `cap`,
  // which must be feasible (e.g. the value of solve()).
  std::vector<int> ends(double cap) const {
    std::vector<int> result(n_, 0);
    const bool ok = probe(cap, 0, 0, &result);
    SMP_INTERNAL_ASSERT(ok, "no segmentation at the optimal cap {:g}", cap);
    return result;
  }

 private:
  double load(int d, int s, int e) const { return preload_[d] + (prefix_[e] - prefix_[s]); }

  // Smallest e in [first, last) with pred(e), or last; pred must be monotone (false, then true).
  template <typename Pred>
  static int first_end(int first, int last, Pred pred) {
    while (first < last) {
      const int mid = first + (last - first) / 2;
      if (pred(mid)) {
        last = mid;
      } else {
        first = mid + 1;
      }
    }
    return first;
  }

  bool probe(double cap, int d0, int s0, std::vector<int>* ends) const {
    int s = s0;
    for (int d = d0; d < n_; ++d) {
      if (preload_[d] > cap) return false;
      const int limit = m_ - required_from_[d + 1];
      if (limit < s) return false;
      // Largest e in [s, limit] with load(d, s, e) <= cap; e = s qualifies.
      int lo = s;
      int hi = limit;
      while (lo < hi) {
        const int mid = lo + (hi - lo + 1) / 2;
        if (load(d, s, mid) <= cap) {
          lo = mid;
        } else {
          hi = mid - 1;
        }
      }
      if (!may_be_empty_[d] && lo == s) return false;
      if (ends != nullptr) (*ends)[d] = lo;
      s = lo;
    }
    return s == m_;
  }

  const std::vector<double>& prefix_;
  const std::vector<double>& preload_;
  const std::vector<char>& may_be_empty_;
  int m_;
  int n_;
  std::vector<int> required_from_;  // devices in [d, n) that must be non-empty
  double floor_ = 0;                // largest preload: no assignment does better
};

std::vector<double> prefix_sums(const std::vector<double>& costs) {
  std::vector<double> prefix(costs.size() + 1, 0.0);
  for (std::size_t i = 0; i < costs.size(); ++i) prefix[i + 1] = prefix[i] + costs[i];
  return prefix;
}

bool valid_cost(double x) { return std::isfinite(x) && x >= 0; }

// One entry of a sequence: node's whole subtree, or (own) node's own cost alone.
struct Item {
  int node;
  bool own;
};

// Segmentation of one level: device (relative to lo) of the root's own cost (-1 if not flexible),
// end of each device's segment, and the resulting max load.
struct Segmentation {
  double value = kInf;
  int root_device = -1;
  std::vector<int> ends;
  std::vector<double> loads;  // priced: every device's load (Note [Crossings])
};

// A priced call between two nodes (caller -1: the step function, on stage 0).
struct Crossing {
  int caller;
  int callee;
  double kappa;
};

// One level's crossings, by item (Note [Crossings]). Devices are relative to the level's first.
struct Level {
  int m = 0;
  int n = 0;
  std::vector<double> prefix;      // of the item costs
  std::vector<double> preload;     // pinned cost per device
  std::vector<double> base;        // preload + crossings between fixed modules + K_d
  std::vector<char> may_be_empty;  // device holds a pinned module
  std::vector<int> adj_begin;      // calls between items: CSR, both directions
  std::vector<int> adj_item;
  std::vector<double> adj_kappa;
  std::vector<int> ext_begin;   // calls with modules of fixed stages: CSR
  std::vector<int> ext_device;  // relative device, -1 outside the level's devices
  std::vector<double> ext_kappa;
  std::vector<double> ext_total;   // per item
  double root_cost = -1;           // >= 0: the root's own cost goes to any device
  std::vector<double> root_kappa;  // per item: calls with the root
  double root_total = 0;
  std::vector<double> root_host;   // per device: calls root <-> fixed stages, root there
  std::vector<double> root_guest;  // per device: the same, root elsewhere
};

class Partitioner {
 public:
  Partitioner(const std::vector<PartitionNode>& nodes, const PartitionOptions& options,
              const std::vector<PartitionCall>& calls)
      : nodes_(nodes),
        calls_(calls),
        num_stages_(options.num_stages),
        memory_weight_(options.memory_weight),
        seconds_per_compute_(options.seconds_per_compute),
        latency_(options.crossing_latency),
        bandwidth_(options.bandwidth),
        balance_tolerance_(options.balance_tolerance) {}

  PartitionPlan run() {
    validate();
    compute_costs();
    price_calls();
    build_tree();
    classify_pins();
    check_units();
    stage_.assign(num_nodes(), -1);
    for (int v = 0; v < num_nodes(); ++v) {
      if (eff_pin_[v] != -1) stage_[v] = eff_pin_[v];
    }
    if (num_stages_ == 1) {
      std::fill(stage_.begin(), stage_.end(), 0);
    } else {
      place(top_sequence(), 0, num_stages_, /*top=*/true);
    }
    return make_plan();
  }

 private:
  int num_nodes() const { return static_cast<int>(nodes_.size()); }
  const std::string& name(int v) const { return nodes_[v].name; }
  int num_children(int v) const { return child_begin_[v + 1] - child_begin_[v]; }
  double cost(const Item& item) const { return item.own ? own_[item.node] : sub_[item.node]; }
  bool expandable(const Item& item) const { return !item.own && num_children(item.node) > 0; }

  // Marks (in `marked`, one flag per item of `seq`) the expandable items on both sides of every
  // boundary of a segment whose load is above `target`; `ends[d]` is where device d's segment
  // ends. Returns whether any item was marked.
  bool mark_overloaded_ends(const std::vector<Item>& seq, const std::vector<int>& ends,
                            const std::vector<double>& loads, double target,
                            std::vector<char>& marked) const {
    const int m = static_cast<int>(seq.size());
    marked.assign(m, 0);
    bool any = false;
    for (std::size_t d = 0, start = 0; d < ends.size(); start = ends[d], ++d) {
      if (loads[d] <= target) continue;
      const int end = ends[d];
      for (int i : {static_cast<int>(start) - 1, static_cast<int>(start), end - 1, end}) {
        if (i >= 0 && i < m && expandable(seq[i])) {
          marked[i] = 1;
          any = true;
        }
      }
    }
    return any;
  }
  int units(const Item& item) const { return item.own ? 1 : size_[item.node]; }

  // ---- input --------------------------------------------------------------------------------
  void validate() const {
    SMP_CHECK(num_stages_ >= 1, "num_stages (pipeline_parallel_degree) must be >= 1, got {}",
              num_stages_);
    SMP_CHECK(
        memory_weight_ >= 0 && memory_weight_ <= 1,
        "memory_weight must be in [0, 1] (0 = balance compute only, 1 = memory only), got {:g}",
        memory_weight_);
    SMP_CHECK(!nodes_.empty(), "cannot partition an empty module tree: pass at least the root");
    SMP_CHECK(nodes_[0].parent == -1,
              "node 0 ('{}') must be the root with parent -1, got parent {}", name(0),
              nodes_[0].parent);
    for (int v = 0; v < num_nodes(); ++v) {
      const PartitionNode& node = nodes_[v];
      SMP_CHECK(v == 0 || (node.parent >= 0 && node.parent < v),
                "node {} ('{}') has parent {}; the root is node 0 and every other node's parent "
                "must be an earlier node (0 <= parent < {})",
                v, node.name, node.parent, v);
      SMP_CHECK(valid_cost(node.compute),
                "module '{}' has compute {:g}; costs must be finite and >= 0", node.name,
                node.compute);
      SMP_CHECK(valid_cost(node.param_bytes),
                "module '{}' has param_bytes {:g}; costs must be finite and >= 0", node.name,
                node.param_bytes);
      SMP_CHECK(valid_cost(node.activation_bytes),
                "module '{}' has activation_bytes {:g}; costs must be finite and >= 0", node.name,
                node.activation_bytes);
      SMP_CHECK(node.pin >= -1,
                "module '{}' has pin {}; use -1 for a free module or a stage in [0, {}]", node.name,
                node.pin, num_stages_ - 1);
      SMP_CHECK(node.pin < num_stages_,
                "module '{}' is pinned to stage {} but there are only {} pipeline stages (0..{}); "
                "pin it to a stage in that range or raise pipeline_parallel_degree",
                node.name, node.pin, num_stages_, num_stages_ - 1);
    }
    SMP_CHECK(valid_cost(seconds_per_compute_),
              "seconds_per_compute must be finite and >= 0, got {:g}", seconds_per_compute_);
    SMP_CHECK(valid_cost(latency_), "crossing_latency must be finite and >= 0 seconds, got {:g}",
              latency_);
    SMP_CHECK(bandwidth_ > 0, "bandwidth must be > 0 bytes per second, got {:g}", bandwidth_);
    SMP_CHECK(valid_cost(balance_tolerance_), "balance_tolerance must be finite and >= 0, got {:g}",
              balance_tolerance_);
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      const PartitionCall& call = calls_[i];
      SMP_CHECK(call.caller >= -1 && call.caller < num_nodes(),
                "calls[{}] has caller {}; use -1 (the step function) or a node in [0, {})", i,
                call.caller, num_nodes());
      SMP_CHECK(call.callee >= 0 && call.callee < num_nodes(),
                "calls[{}] has callee {}; use a node in [0, {})", i, call.callee, num_nodes());
      const std::string who =
          fmt::format(FMT_STRING("calls[{}] (into '{}')"), i, name(call.callee));
      SMP_CHECK(valid_cost(call.calls), "{} has calls {:g}; counts must be finite and >= 0", who,
                call.calls);
      SMP_CHECK(valid_cost(call.forward_bytes),
                "{} has forward_bytes {:g}; sizes must be finite and >= 0", who,
                call.forward_bytes);
      SMP_CHECK(valid_cost(call.backward_bytes),
                "{} has backward_bytes {:g}; sizes must be finite and >= 0", who,
                call.backward_bytes);
    }
  }

  void compute_costs() {
    const int n = num_nodes();
    double total_compute = 0;
    double total_memory = 0;
    for (const PartitionNode& node : nodes_) {
      total_compute += node.compute;
      total_memory += 3 * node.param_bytes + node.activation_bytes;
    }
    // A term with total 0 drops out; the other is rescaled so that the costs sum to 1.
    double compute_weight = total_compute > 0 ? 1 - memory_weight_ : 0.0;
    double memory_weight = total_memory > 0 ? memory_weight_ : 0.0;
    const double weights = compute_weight + memory_weight;
    if (weights == 0) {
      // Nothing to balance by: balance module counts instead.
      own_.assign(n, 1.0 / n);
      return;
    }
    compute_weight /= weights;
    memory_weight /= weights;
    compute_weight_ = compute_weight;
    total_compute_ = total_compute;
    own_.assign(n, 0.0);
    for (int v = 0; v < n; ++v) {
      const PartitionNode& node = nodes_[v];
      double c = 0;
      if (compute_weight > 0) c += compute_weight * node.compute / total_compute;
      if (memory_weight > 0) {
        c += memory_weight * (3 * node.param_bytes + node.activation_bytes) / total_memory;
      }
      own_[v] = c;
    }
  }

  // Seconds and normalised cost (kappa) of every call when it crosses; the priced ones, ends
  // apart, become crossings_ (Note [Crossings]).
  void price_calls() {
    const double scale =
        seconds_per_compute_ > 0 && compute_weight_ > 0 && total_compute_ > 0
            ? compute_weight_ / (kComputePasses * total_compute_ * seconds_per_compute_)
            : 0.0;
    call_seconds_.assign(calls_.size(), 0.0);
    call_kappa_.assign(calls_.size(), 0.0);
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      const PartitionCall& call = calls_[i];
      const double bytes = call.forward_bytes + call.backward_bytes;
      call_seconds_[i] = kPasses * latency_ * call.calls + (bytes > 0 ? bytes / bandwidth_ : 0.0);
      call_kappa_[i] = scale * call_seconds_[i];
      if (call_kappa_[i] > 0 && call.caller != call.callee) {
        crossings_.push_back({call.caller, call.callee, call_kappa_[i]});
      }
    }
    priced_ = !crossings_.empty();
  }

  void build_tree() {
    const int n = num_nodes();
    // Children in CSR form, ordered by index (counting sort by parent is stable).
    child_begin_.assign(n + 1, 0);
    for (int v = 1; v < n; ++v) ++child_begin_[nodes_[v].parent + 1];
    for (int v = 0; v < n; ++v) child_begin_[v + 1] += child_begin_[v];
    children_.assign(std::max(n - 1, 0), 0);
    std::vector<int> fill(child_begin_.begin(), child_begin_.end() - 1);
    for (int v = 1; v < n; ++v) children_[fill[nodes_[v].parent]++] = v;

    // Subtree sums and sizes: parents come before children, so one backward sweep suffices.
    sub_ = own_;
    size_.assign(n, 1);
    for (int v = n - 1; v >= 1; --v) {
      sub_[nodes_[v].parent] += sub_[v];
      size_[nodes_[v].parent] += size_[v];
    }

    // Pre-order (children in index order), iteratively: trees can be 100k deep.
    pre_.assign(n, 0);
    order_.assign(n, 0);
    std::vector<int> stack = {0};
    int next = 0;
    while (!stack.empty()) {
      const int v = stack.back();
      stack.pop_back();
      pre_[v] = next;
      order_[next++] = v;
      for (int i = child_begin_[v + 1] - 1; i >= child_begin_[v]; --i)
        stack.push_back(children_[i]);
    }
  }

  // Effective pin of every node (own pin, else the nearest pinned ancestor's) and, per subtree,
  // whether it is free (no pinned module), uniformly pinned, or mixed.
  void classify_pins() {
    const int n = num_nodes();
    eff_pin_.assign(n, -1);
    for (int v = 0; v < n; ++v) {
      eff_pin_[v] =
          nodes_[v].pin != -1 ? nodes_[v].pin : (v == 0 ? -1 : eff_pin_[nodes_[v].parent]);
    }
    std::vector<char> has_free(n);
    std::vector<int> min_pin(n);
    std::vector<int> max_pin(n);
    for (int v = 0; v < n; ++v) {
      has_free[v] = eff_pin_[v] == -1;
      min_pin[v] = eff_pin_[v] == -1 ? num_stages_ : eff_pin_[v];
      max_pin[v] = eff_pin_[v];
    }
    for (int v = n - 1; v >= 1; --v) {
      const int p = nodes_[v].parent;
      has_free[p] = has_free[p] || has_free[v];
      min_pin[p] = std::min(min_pin[p], min_pin[v]);
      max_pin[p] = std::max(max_pin[p], max_pin[v]);
    }
    kind_.assign(n, Kind::kFree);
    for (int v = 0; v < n; ++v) {
      if (max_pin[v] == -1) {
        kind_[v] = Kind::kFree;
      } else if (!has_free[v] && min_pin[v] == max_pin[v]) {
        kind_[v] = Kind::kPinned;
      } else {
        kind_[v] = Kind::kMixed;
      }
    }
    preload_.assign(num_stages_, 0.0);
    pinned_present_.assign(num_stages_, 0);
    for (int v = 0; v < n; ++v) {
      if (eff_pin_[v] != -1) {
        preload_[eff_pin_[v]] += own_[v];
        pinned_present_[eff_pin_[v]] = 1;
        has_pins_ = true;
      }
    }
  }

  // A free module can go to any stage; a stage holding a pinned module is never empty.
  void check_units() const {
    int free_modules = 0;
    for (int v = 0; v < num_nodes(); ++v) free_modules += eff_pin_[v] == -1;
    int pinned_stages = 0;
    for (char present : pinned_present_) pinned_stages += present;
    const int units = free_modules + pinned_stages;
    if (units >= num_stages_) return;
    std::vector<int> by_cost(num_nodes());
    std::iota(by_cost.begin(), by_cost.end(), 0);
    std::stable_sort(by_cost.begin(), by_cost.end(),
                     [&](int a, int b) { return own_[a] > own_[b]; });
    std::string largest;
    for (int i = 0; i < std::min(3, num_nodes()); ++i) {
      const int v = by_cost[i];
      fmt::format_to(std::back_inserter(largest), FMT_STRING("{}'{}' ({:g})"), i ? ", " : "",
                     name(v), own_[v]);
    }
    SMP_CHECK(false,
              "cannot partition the model into {} pipeline stages: its tree has only {} units that "
              "can go to distinct stages ({} free modules{}), so some stage would be empty. "
              "Largest modules by cost: {}. Use a smaller pipeline_parallel_degree (at most {}) or "
              "place modules manually with smp.partition / smp.set_partition.",
              num_stages_, units, free_modules,
              pinned_stages
                  ? fmt::format(FMT_STRING(" + {} stages holding pinned modules"), pinned_stages)
                  : "",
              largest, units);
  }

  // ---- placement ----------------------------------------------------------------------------
  // Rule 2 plus pins at the top level: pinned subtrees leave the sequence (their cost is already
  // in preload_), mixed subtrees are opened, free ones are opened if chain or above the threshold.
  std::vector<Item> top_sequence() const {
    const double threshold = sub_[0] / num_stages_;
    std::vector<Item> seq;
    std::vector<int> stack = {0};
    while (!stack.empty()) {
      const int v = stack.back();
      stack.pop_back();
      bool open = false;
      switch (kind_[v]) {
        case Kind::kPinned:
          break;
        case Kind::kMixed:
          if (eff_pin_[v] == -1) seq.push_back({v, true});
          open = true;
          break;
        case Kind::kFree:
          if (opens({v, false}, threshold)) {
            seq.push_back({v, true});
            open = true;
          } else {
            seq.push_back({v, false});
          }
          break;
      }
      if (open) {
        for (int i = child_begin_[v + 1] - 1; i >= child_begin_[v]; --i) {
          stack.push_back(children_[i]);
        }
      }
    }
    return seq;
  }

  bool opens(const Item& item, double threshold) const {
    return expandable(item) && (nodes_[item.node].chain || sub_[item.node] > threshold);
  }

  // Rule 2 on a free sequence: open items recursively until none is chain or above threshold.
  std::vector<Item> refine(const std::vector<Item>& seq, double threshold) const {
    std::vector<Item> out;
    std::vector<int> stack;
    for (const Item& item : seq) {
      if (!opens(item, threshold)) {
        out.push_back(item);
        continue;
      }
      stack.push_back(item.node);
      while (!stack.empty()) {
        const int v = stack.back();
        stack.pop_back();
        if (!opens({v, false}, threshold)) {
          out.push_back({v, false});
          continue;
        }
        out.push_back({v, true});
        for (int i = child_begin_[v + 1] - 1; i >= child_begin_[v]; --i) {
          stack.push_back(children_[i]);
        }
      }
    }
    return out;
  }

  // seq with the items at `marked` positions replaced by [own, children...].
  std::vector<Item> expand(const std::vector<Item>& seq, const std::vector<char>& marked) const {
    std::vector<Item> out;
    out.reserve(seq.size());
    for (std::size_t i = 0; i < seq.size(); ++i) {
      if (!marked[i]) {
        out.push_back(seq[i]);
        continue;
      }
      const int v = seq[i].node;
      out.push_back({v, true});
      for (int c = child_begin_[v]; c < child_begin_[v + 1]; ++c)
        out.push_back({children_[c], false});
    }
    return out;
  }

  // seq with every subtree item opened (recursively) that strictly contains one of `cuts`, given
  // as positions in the fully expanded sequence of seq (sorted).
  std::vector<Item> split_at(const std::vector<Item>& seq, const std::vector<int>& cuts) const {
    const auto cut_inside = [&](int first, int last) {  // some cut c with first < c < last
      const auto it = std::upper_bound(cuts.begin(), cuts.end(), first);
      return it != cuts.end() && *it < last;
    };
    std::vector<Item> out;
    std::vector<std::pair<int, int>> stack;  // (node, position of its subtree)
    int position = 0;
    for (const Item& item : seq) {
      const int length = item.own ? 1 : size_[item.node];
      if (item.own || !cut_inside(position, position + length)) {
        out.push_back(item);
        position += length;
        continue;
      }
      stack.push_back({item.node, position});
      while (!stack.empty()) {
        const auto [v, first] = stack.back();
        stack.pop_back();
        if (!cut_inside(first, first + size_[v])) {
          out.push_back({v, false});
          continue;
        }
        out.push_back({v, true});
        int child_first = first + size_[v];  // children fill [first + 1, first + size_[v])
        for (int i = child_begin_[v + 1] - 1; i >= child_begin_[v]; --i) {
          child_first -= size_[children_[i]];
          stack.push_back({children_[i], child_first});
        }
      }
      position += length;
    }
    return out;
  }

  void place(std::vector<Item> seq, int lo, int hi, bool top) {
    const int n = hi - lo;
    if (n == 1) {
      for (const Item& item : seq) assign(item, lo);
      return;
    }
    if (!top) {
      double total = 0;
      for (const Item& item : seq) total += cost(item);
      seq = refine(seq, total / n);
    }
    if (has_pins_) {
      // Pins only occur at the top (one_to_one does not recurse). Open the largest items until
      // there are enough for every stage without a pinned module (possible by check_units()).
      while (static_cast<int>(seq.size()) < n) {
        int pick = -1;
        for (int i = 0; i < static_cast<int>(seq.size()); ++i) {
          if (expandable(seq[i]) && (pick == -1 || cost(seq[i]) > cost(seq[pick]))) pick = i;
        }
        if (pick == -1) break;
        std::vector<char> marked(seq.size(), 0);
        marked[pick] = 1;
        seq = expand(seq, marked);
      }
      one_to_one(std::move(seq), lo, hi, top);
      return;
    }
    // A single zero-cost item is not opened by rule 2; open it so its modules can spread.
    while (seq.size() == 1 && expandable(seq[0])) seq = expand(seq, {1});
    if (static_cast<int>(seq.size()) >= n) {
      one_to_one(std::move(seq), lo, hi, top);
    } else {
      dhondt(seq, lo, hi);
    }
  }

  // Fewer items than devices: one segment per item; spare devices to the segment with the largest
  // cost per device, never more devices than modules; segments with several devices recurse.
  void dhondt(const std::vector<Item>& seq, int lo, int hi) {
    const int m = static_cast<int>(seq.size());
    std::vector<int> alloc(m, 1);
    for (int spare = hi - lo - m; spare > 0; --spare) {
      int pick = -1;
      for (int i = 0; i < m; ++i) {
        if (alloc[i] >= units(seq[i])) continue;
        // cost_i / alloc_i > cost_pick / alloc_pick, without dividing.
        if (pick == -1 || cost(seq[i]) * alloc[pick] > cost(seq[pick]) * alloc[i]) pick = i;
      }
      SMP_INTERNAL_ASSERT(pick != -1, "more devices than placeable modules in a segment");
      ++alloc[pick];
    }
    // Single-device segments first, so that the levels below see where their callers went.
    int d = lo;
    for (int i = 0; i < m; ++i) {
      if (alloc[i] == 1) assign(seq[i], d);
      d += alloc[i];
    }
    d = lo;
    for (int i = 0; i < m; ++i) {
      if (alloc[i] > 1) place({seq[i]}, d, d + alloc[i], /*top=*/false);
      d += alloc[i];
    }
  }

  // Best segmentation of `prefix` over devices [lo, lo + n); with root_cost >= 0 the root's own
  // cost is a flexible extra (see Note [Partitioner], root position).
  Segmentation segment(const std::vector<double>& prefix, int lo, int n, double root_cost) const {
    std::vector<double> preload(preload_.begin() + lo, preload_.begin() + lo + n);
    std::vector<char> may_be_empty(pinned_present_.begin() + lo, pinned_present_.begin() + lo + n);
    Segmentation best;
    if (root_cost < 0) {
      const Segmenter segmenter(prefix, preload, may_be_empty);
      best.value = segmenter.solve();
      SMP_INTERNAL_ASSERT(best.value < kInf, "no segmentation with a module on every stage");
      best.ends = segmenter.ends(best.value);
      return best;
    }
    for (int j = 0; j < n; ++j) {
      std::vector<double> preload_j = preload;
      std::vector<char> may_be_empty_j = may_be_empty;
      preload_j[j] += root_cost;
      may_be_empty_j[j] = 1;
      const Segmenter segmenter(prefix, preload_j, may_be_empty_j);
      // Ties keep the earliest device: solve only if this one can do strictly better.
      const double below = std::nextafter(best.value, 0.0);
      if (best.value < kInf && !segmenter.feasible(below)) continue;
      const double value = segmenter.solve(best.value < kInf ? below : kInf);
      if (value < best.value) {
        best.value = value;
        best.root_device = j;
        best.ends = segmenter.ends(value);
      }
    }
    SMP_INTERNAL_ASSERT(best.root_device != -1, "no segmentation with a module on every stage");
    return best;
  }

  // m >= n (or pinned): exact segmentation, one segment per device, with boundary refinement.
  void one_to_one(std::vector<Item> seq, int lo, int hi, bool top) {
    const int n = hi - lo;
    double root_cost = -1;
    if (top && !seq.empty() && seq[0].own && seq[0].node == 0) {
      root_cost = own_[0];
      seq.erase(seq.begin());
    }
    if (priced_) {
      one_to_one_priced(std::move(seq), lo, n, root_cost);
      return;
    }
    segment_by_cost(seq, lo, n, root_cost);
  }

  // The segmentation by cost alone, with boundary refinement: opens items of seq as needed and
  // places them. Returns the segmentation; seq ends up as the items it is over.
  Segmentation segment_by_cost(std::vector<Item>& seq, int lo, int n, double root_cost,
                               bool place = true) {
    // Target: the optimum of the fully expanded sequence (pre-order own costs of every item).
    std::vector<double> fine;
    for (const Item& item : seq) {
      if (item.own) {
        fine.push_back(own_[item.node]);
      } else {
        for (int p = pre_[item.node]; p < pre_[item.node] + size_[item.node]; ++p) {
          fine.push_back(own_[order_[p]]);
        }
      }
    }
    const Segmentation fine_seg = segment(prefix_sums(fine), lo, n, root_cost);
    const double target = fine_seg.value * (1 + kRefineTolerance);

    Segmentation seg;
    std::vector<double> costs;
    for (int round = 0;; ++round) {
      costs.resize(seq.size());
      for (std::size_t i = 0; i < seq.size(); ++i) costs[i] = cost(seq[i]);
      const std::vector<double> prefix = prefix_sums(costs);
      seg = segment(prefix, lo, n, root_cost);
      if (seg.value <= target) break;
      // Open the items on both sides of every boundary of an over-loaded segment.
      std::vector<double> loads(n);
      for (int d = 0, start = 0; d < n; start = seg.ends[d], ++d) {
        loads[d] = preload_[lo + d] + (prefix[seg.ends[d]] - prefix[start]) +
                   (d == seg.root_device ? root_cost : 0.0);
      }
      std::vector<char> marked;
      const bool any = mark_overloaded_ends(seq, seg.ends, loads, target, marked);
      if (any && round < kMaxBoundaryRounds) {
        seq = expand(seq, marked);
        continue;
      }
      // Fallback: open exactly the items the fully expanded optimum cuts through. Its cuts are
      // then available, so the result is at most F.
      const std::vector<int> cuts(fine_seg.ends.begin(), fine_seg.ends.end() - 1);
      seq = split_at(seq, cuts);
      costs.resize(seq.size());
      for (std::size_t i = 0; i < seq.size(); ++i) costs[i] = cost(seq[i]);
      seg = segment(prefix_sums(costs), lo, n, root_cost);
      break;
    }
    if (place) apply(seq, seg, lo);
    return seg;
  }

  void apply(const std::vector<Item>& seq, const Segmentation& seg, int lo) {
    if (seg.root_device != -1) stage_[0] = lo + seg.root_device;
    int start = 0;
    for (std::size_t d = 0; d < seg.ends.size(); ++d) {
      for (int i = start; i < seg.ends[d]; ++i) assign(seq[i], lo + static_cast<int>(d));
      start = seg.ends[d];
    }
  }

  // ---- priced crossings (Note [Crossings]) ---------------------------------------------------
  // one_to_one() when crossings are priced: the same rounds, on stage loads, under the balance
  // cap; and never a higher load than the segmentation by cost alone (which the exact programme
  // guarantees only up to kRefineTolerance, or not at all beyond kMaxPricedItems items).
  void one_to_one_priced(std::vector<Item> seq, int lo, int n, double root_cost) {
    std::vector<double> costs(seq.size());
    for (std::size_t i = 0; i < seq.size(); ++i) costs[i] = cost(seq[i]);
    const double whole = segment(prefix_sums(costs), lo, n, root_cost).value;
    const double cap = whole * (1 + balance_tolerance_) * (1 + 1e-12);

    std::vector<Item> blind_seq = seq;
    const Segmentation blind = segment_by_cost(blind_seq, lo, n, root_cost, /*place=*/false);
    const std::vector<double> blind_loads =
        level_loads(make_level(blind_seq, lo, n, root_cost), blind.ends, blind.root_device);
    const double blind_value = *std::max_element(blind_loads.begin(), blind_loads.end());

    // Target: the least load over the fully expanded sequence (every node its own item).
    std::vector<Item> fine;
    for (const Item& item : seq) {
      if (item.own) {
        fine.push_back(item);
      } else {
        for (int p = pre_[item.node]; p < pre_[item.node] + size_[item.node]; ++p) {
          fine.push_back({order_[p], true});
        }
      }
    }
    const Segmentation fine_seg = priced_segment(fine, lo, n, root_cost, cap);
    const double target = fine_seg.value * (1 + kRefineTolerance);

    Segmentation seg;
    for (int round = 0;; ++round) {
      seg = priced_segment(seq, lo, n, root_cost, cap);
      if (seg.value <= target) break;
      std::vector<char> marked;
      const bool any = mark_overloaded_ends(seq, seg.ends, seg.loads, target, marked);
      if (any && round < kMaxBoundaryRounds) {
        seq = expand(seq, marked);
        continue;
      }
      const std::vector<int> cuts(fine_seg.ends.begin(), fine_seg.ends.end() - 1);
      seq = split_at(seq, cuts);
      seg = priced_segment(seq, lo, n, root_cost, cap);
      break;
    }
    if (blind_value < seg.value) {
      apply(blind_seq, blind, lo);
    } else {
      apply(seq, seg, lo);
    }
  }

  // The least-load segmentation of seq over devices [lo, lo + n) whose stage costs stay <= cap:
  // the exact programme (up to kMaxPricedItems items), or else the compute-only segmentation.
  Segmentation priced_segment(const std::vector<Item>& seq, int lo, int n, double root_cost,
                              double cap) {
    const Level level = make_level(seq, lo, n, root_cost);
    std::vector<double> costs(seq.size());
    for (std::size_t i = 0; i < seq.size(); ++i) costs[i] = cost(seq[i]);
    Segmentation best = segment(prefix_sums(costs), lo, n, root_cost);
    best.loads = level_loads(level, best.ends, best.root_device);
    best.value = *std::max_element(best.loads.begin(), best.loads.end());
    if (level.m <= kMaxPricedItems) {
      Segmentation exact = least_load(level, cap, best.value);
      if (exact.value < best.value * (1 - 1e-12)) {
        exact.loads = level_loads(level, exact.ends, exact.root_device);
        best = std::move(exact);
      }
    }
    return best;
  }

  Level make_level(const std::vector<Item>& seq, int lo, int n, double root_cost) {
    Level level;
    const int m = static_cast<int>(seq.size());
    level.m = m;
    level.n = n;
    std::vector<double> costs(m);
    for (int i = 0; i < m; ++i) costs[i] = cost(seq[i]);
    level.prefix = prefix_sums(costs);
    level.preload.assign(preload_.begin() + lo, preload_.begin() + lo + n);
    level.base = level.preload;
    level.may_be_empty.assign(pinned_present_.begin() + lo, pinned_present_.begin() + lo + n);
    level.root_cost = root_cost;
    level.ext_total.assign(m, 0.0);
    level.root_kappa.assign(m, 0.0);
    level.root_host.assign(n, 0.0);
    level.root_guest.assign(n, 0.0);

    if (item_at_.empty()) item_at_.assign(num_nodes(), -1);
    const auto cover = [&](bool set) {  // item_at_ of every node in seq, or back to -1
      for (int i = 0; i < m; ++i) {
        const Item& item = seq[i];
        if (item.own) {
          item_at_[item.node] = set ? i : -1;
          continue;
        }
        for (int p = pre_[item.node]; p < pre_[item.node] + size_[item.node]; ++p) {
          item_at_[order_[p]] = set ? i : -1;
        }
      }
    };
    cover(true);
    // Where a call's end is: an item (>= 0), the flexible root (kRoot), a fixed stage
    // (kFixed - stage), or not placed yet (kUnknown).
    constexpr int kRoot = -1;
    constexpr int kUnknown = -2;
    constexpr int kFixed = -3;
    const auto where = [&](int x) {
      if (x == -1) return kFixed;  // the step function: stage 0
      if (item_at_[x] >= 0) return item_at_[x];
      if (x == 0 && root_cost >= 0) return kRoot;
      if (stage_[x] >= 0) return kFixed - stage_[x];
      return kUnknown;
    };
    const auto relative = [&](int stage) {
      return stage >= lo && stage < lo + n ? stage - lo : -1;
    };
    std::vector<std::pair<int, std::pair<int, double>>> adj;  // (item, (item, kappa))
    std::vector<std::pair<int, std::pair<int, double>>> ext;  // (item, (device, kappa))
    for (const Crossing& c : crossings_) {
      int a = where(c.caller);
      int b = where(c.callee);
      if (a == kUnknown || b == kUnknown) continue;
      if (a < b) std::swap(a, b);  // items first, then the root, then fixed stages
      if (a >= 0 && b >= 0) {
        if (a != b) {
          adj.push_back({a, {b, c.kappa}});
          adj.push_back({b, {a, c.kappa}});
        }
      } else if (a >= 0 && b == kRoot) {
        level.root_kappa[a] += c.kappa;
        level.root_total += c.kappa;
      } else if (a >= 0) {
        const int device = relative(kFixed - b);
        ext.push_back({a, {device, c.kappa}});
        level.ext_total[a] += c.kappa;
        if (device >= 0) level.base[device] += c.kappa;
      } else if (a == kRoot) {
        const int device = relative(kFixed - b);
        for (int d = 0; d < n; ++d)
          (d == device ? level.root_guest : level.root_host)[d] += c.kappa;
      } else if (a != b) {  // two fixed stages
        for (int stage : {kFixed - a, kFixed - b}) {
          if (relative(stage) >= 0) level.base[relative(stage)] += c.kappa;
        }
      }
    }
    cover(false);
    const auto csr = [m](std::vector<std::pair<int, std::pair<int, double>>>& entries,
                         std::vector<int>& begin, std::vector<int>& other,
                         std::vector<double>& kappa) {
      std::stable_sort(entries.begin(), entries.end(),
                       [](const auto& x, const auto& y) { return x.first < y.first; });
      begin.assign(m + 1, 0);
      for (const auto& e : entries) ++begin[e.first + 1];
      for (int i = 0; i < m; ++i) begin[i + 1] += begin[i];
      other.resize(entries.size());
      kappa.resize(entries.size());
      for (std::size_t k = 0; k < entries.size(); ++k) {
        other[k] = entries[k].second.first;
        kappa[k] = entries[k].second.second;
      }
    };
    csr(adj, level.adj_begin, level.adj_item, level.adj_kappa);
    csr(ext, level.ext_begin, level.ext_device, level.ext_kappa);
    return level;
  }

  // Every device's load for a segmentation given by its ends and the root's device (-1: none).
  static std::vector<double> level_loads(const Level& level, const std::vector<int>& ends,
                                         int root_device) {
    std::vector<int> device(level.m);
    int start = 0;
    for (int d = 0; d < level.n; ++d) {
      for (int i = start; i < ends[d]; ++i) device[i] = d;
      start = ends[d];
    }
    std::vector<double> load = level.base;
    for (int i = 0; i < level.m; ++i) {
      const int d = device[i];
      load[d] += level.prefix[i + 1] - level.prefix[i];
      for (int k = level.adj_begin[i]; k < level.adj_begin[i + 1]; ++k) {
        if (device[level.adj_item[k]] != d) load[d] += level.adj_kappa[k];  // each end its own
      }
      for (int k = level.ext_begin[i]; k < level.ext_begin[i + 1]; ++k) {
        if (level.ext_device[k] == d) {
          load[d] -= level.ext_kappa[k];  // in K_d, but does not cross
        } else {
          load[d] += level.ext_kappa[k];
        }
      }
    }
    if (level.root_cost >= 0) {
      const int j = root_device;
      for (int d = 0; d < level.n; ++d) {
        load[d] += d == j ? level.root_cost + level.root_host[d] : level.root_guest[d];
      }
      for (int i = 0; i < level.m; ++i) {
        if (device[i] != j) {
          load[device[i]] += level.root_kappa[i];
          load[j] += level.root_kappa[i];
        }
      }
    }
    return load;
  }

  // Note [Crossings]: the exact least max load with every stage cost <= cap, if below `upper`
  // (else value = kInf).
  static Segmentation least_load(const Level& level, double cap, double upper) {
    const int m = level.m;
    const int n = level.n;
    const bool flexible = level.root_cost >= 0;
    const int states = flexible ? 2 : 1;
    const auto at = [&](int d, int e, int h) {
      return (static_cast<std::size_t>(d) * (m + 1) + e) * states + h;
    };
    const std::size_t size = static_cast<std::size_t>(n) * (m + 1) * states;
    std::vector<double> f(size, kInf);
    std::vector<int> from(size, -1);          // start of device d's segment
    std::vector<signed char> came(size, -1);  // previous h, + 2 if device d took the root
    const auto relax = [&](int d, int e, int h, double value, int s, int h_prev, bool hosts) {
      const std::size_t k = at(d, e, h);
      if (value <= upper && value < f[k]) {
        f[k] = value;
        from[k] = s;
        came[k] = static_cast<signed char>(h_prev + (hosts ? 2 : 0));
      }
    };
    // Per-device part of the fixed-stage term: ext_d(q) for this device.
    const auto ext_to = [&](int q, int d) {
      double sum = 0;
      for (int k = level.ext_begin[q]; k < level.ext_begin[q + 1]; ++k) {
        if (level.ext_device[k] == d) sum += level.ext_kappa[k];
      }
      return sum;
    };
    for (int d = 0; d < n; ++d) {
      const bool last = d == n - 1;
      for (int s = 0; s <= m; ++s) {
        for (int h = 0; h < states; ++h) {
          const double before = d == 0 ? (s == 0 && h == 0 ? 0.0 : kInf) : f[at(d - 1, s, h)];
          if (!(before <= upper)) continue;
          double c = 0;     // item costs
          double x = 0;     // calls between items with one end in [s, e)
          double ext = 0;   // fixed-stage term without K_d (in base)
          double root = 0;  // calls of items in [s, e) with the root
          for (int e = s;; ++e) {
            if (e > s) {
              const int q = e - 1;
              c += level.prefix[e] - level.prefix[q];
              for (int k = level.adj_begin[q]; k < level.adj_begin[q + 1]; ++k) {
                const int other = level.adj_item[k];
                x += other >= s && other < q ? -level.adj_kappa[k] : level.adj_kappa[k];
              }
              ext += level.ext_total[q] - 2 * ext_to(q, d);
              root += level.root_kappa[q];
            }
            const double cost_load = level.preload[d] + c;
            if (cost_load > cap || cost_load > upper) break;
            if (!last || e == m) {
              const double common = level.base[d] + c + x + ext;
              if (e > s || level.may_be_empty[d]) {
                const double load = common + (flexible ? root + level.root_guest[d] : 0.0);
                relax(d, e, h, std::max(before, load), s, h, false);
              }
              if (flexible && h == 0 && cost_load + level.root_cost <= cap) {
                const double load =
                    common + level.root_cost + level.root_total - root + level.root_host[d];
                relax(d, e, 1, std::max(before, load), s, 0, true);
              }
            }
            if (e == m) break;
          }
        }
      }
    }
    Segmentation seg;
    const int final_state = flexible ? 1 : 0;
    seg.value = f[at(n - 1, m, final_state)];
    if (!(seg.value < kInf)) return seg;
    seg.ends.assign(n, 0);
    int e = m;
    int h = final_state;
    for (int d = n - 1; d >= 0; --d) {
      const std::size_t k = at(d, e, h);
      seg.ends[d] = e;
      if (came[k] >= 2) seg.root_device = d;
      h = came[k] % 2;
      e = from[k];
    }
    return seg;
  }

  void assign(const Item& item, int stage) {
    if (item.own) {
      stage_[item.node] = stage;
      return;
    }
    for (int p = pre_[item.node]; p < pre_[item.node] + size_[item.node]; ++p) {
      stage_[order_[p]] = stage;
    }
  }

  PartitionPlan make_plan() const {
    PartitionPlan plan;
    plan.stage = stage_;
    plan.node_cost = own_;
    plan.stage_cost.assign(num_stages_, 0.0);
    plan.stage_param_bytes.assign(num_stages_, 0.0);
    plan.stage_activation_bytes.assign(num_stages_, 0.0);
    plan.stage_compute.assign(num_stages_, 0.0);
    std::vector<int> count(num_stages_, 0);
    for (int v = 0; v < num_nodes(); ++v) {
      const int s = stage_[v];
      SMP_INTERNAL_ASSERT(s >= 0 && s < num_stages_, "module '{}' got stage {}", name(v), s);
      SMP_INTERNAL_ASSERT(eff_pin_[v] == -1 || s == eff_pin_[v], "module '{}' ignores its pin",
                          name(v));
      ++count[s];
      plan.stage_cost[s] += own_[v];
      plan.stage_param_bytes[s] += nodes_[v].param_bytes;
      plan.stage_activation_bytes[s] += nodes_[v].activation_bytes;
      plan.stage_compute[s] += nodes_[v].compute;
    }
    for (int s = 0; s < num_stages_; ++s) {
      SMP_INTERNAL_ASSERT(count[s] > 0, "stage {} is empty", s);
    }
    plan.max_stage_cost = *std::max_element(plan.stage_cost.begin(), plan.stage_cost.end());
    const double total = std::accumulate(plan.stage_cost.begin(), plan.stage_cost.end(), 0.0);
    plan.imbalance = total > 0 ? plan.max_stage_cost / (total / num_stages_) : 1.0;

    // Crossings of the final assignment, every call counted (Note [Crossings]).
    plan.stage_crossing_cost.assign(num_stages_, 0.0);
    std::map<std::pair<int, int>, PartitionLink> links;
    for (std::size_t i = 0; i < calls_.size(); ++i) {
      const PartitionCall& call = calls_[i];
      const int a = call.caller == -1 ? 0 : stage_[call.caller];
      const int b = stage_[call.callee];
      if (a == b) continue;
      plan.stage_crossing_cost[a] += call_kappa_[i];
      plan.stage_crossing_cost[b] += call_kappa_[i];
      PartitionLink& link = links[{std::min(a, b), std::max(a, b)}];
      link.first_stage = std::min(a, b);
      link.second_stage = std::max(a, b);
      link.calls += call.calls;
      link.forward_bytes += call.forward_bytes;
      link.backward_bytes += call.backward_bytes;
      link.seconds += call_seconds_[i];
    }
    for (const auto& entry : links) plan.links.push_back(entry.second);
    for (int s = 0; s < num_stages_; ++s) {
      plan.max_stage_load =
          std::max(plan.max_stage_load, plan.stage_cost[s] + plan.stage_crossing_cost[s]);
    }
    return plan;
  }

  enum class Kind { kFree, kPinned, kMixed };

  const std::vector<PartitionNode>& nodes_;
  const std::vector<PartitionCall>& calls_;
  int num_stages_;
  double memory_weight_;
  double seconds_per_compute_;
  double latency_;
  double bandwidth_;
  double balance_tolerance_;
  double compute_weight_ = 0;  // effective weight of compute (after terms dropped out)
  double total_compute_ = 0;
  std::vector<double> call_seconds_;  // per call: seconds when it crosses
  std::vector<double> call_kappa_;    // per call: normalised cost when it crosses (0: unpriced)
  std::vector<Crossing> crossings_;   // priced calls between distinct nodes
  bool priced_ = false;
  std::vector<int> item_at_;  // scratch of make_level(): item holding a node, -1 elsewhere

  std::vector<double> own_;       // normalised own cost
  std::vector<double> sub_;       // subtree cost
  std::vector<int> size_;         // subtree size
  std::vector<int> child_begin_;  // children of v: children_[child_begin_[v] .. child_begin_[v+1])
  std::vector<int> children_;
  std::vector<int> pre_;              // pre-order position of a node
  std::vector<int> order_;            // node at a pre-order position
  std::vector<int> eff_pin_;          // own pin or nearest pinned ancestor's; -1 = free
  std::vector<Kind> kind_;            // free / uniformly pinned / mixed subtree
  std::vector<double> preload_;       // pinned cost per stage
  std::vector<char> pinned_present_;  // stage holds a pinned module (so it may get no free item)
  bool has_pins_ = false;
  std::vector<int> stage_;
};

}  // namespace

PartitionPlan partition(const std::vector<PartitionNode>& nodes, const PartitionOptions& options,
                        const std::vector<PartitionCall>& calls) {
  return Partitioner(nodes, options, calls).run();
}

std::vector<int> optimal_contiguous_partition(const std::vector<double>& costs, int num_parts) {
  SMP_CHECK(num_parts >= 1, "num_parts must be >= 1, got {}", num_parts);
  for (std::size_t i = 0; i < costs.size(); ++i) {
    SMP_CHECK(valid_cost(costs[i]), "costs[{}] is {:g}; costs must be finite and >= 0", i,
              costs[i]);
  }
  const int m = static_cast<int>(costs.size());
  std::vector<int> part(m);
  if (m <= num_parts) {
    std::iota(part.begin(), part.end(), 0);
    return part;
  }
  const std::vector<double> prefix = prefix_sums(costs);
  const std::vector<double> preload(num_parts, 0.0);
  const std::vector<char> may_be_empty(num_parts, 0);
  const Segmenter segmenter(prefix, preload, may_be_empty);
  const std::vector<int> ends = segmenter.ends(segmenter.solve());
  int start = 0;
  for (int d = 0; d < num_parts; ++d) {
    for (int i = start; i < ends[d]; ++i) part[i] = d;
    start = ends[d];
  }
  return part;
}

}  // namespace smp
