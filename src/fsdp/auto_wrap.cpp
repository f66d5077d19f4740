// Auto wrapping: the policies of tdist/fsdp_wrap.h and the walk of
// auto_wrap.h.
#include "fsdp/auto_wrap.h"

#include <torch/nn/modules/activation.h>
#include <torch/nn/modules/container/moduledict.h>
#include <torch/nn/modules/container/modulelist.h>
#include <torch/nn/modules/container/sequential.h>

#include "tdist/errors.h"
#include "tdist/fsdp_wrap.h"

namespace tdist {

namespace {

bool is_container(torch::nn::Module& m) {
  return dynamic_cast<torch::nn::SequentialImpl*>(&m) || dynamic_cast<torch::nn::ModuleListImpl*>(&m) ||
         dynamic_cast<torch::nn::ModuleDictImpl*>(&m);
}

}  // namespace

AutoWrapPolicy size_based_auto_wrap_policy(int64_t min_num_params) {
  if (min_num_params < 0) throw UsageError("size_based_auto_wrap_policy: min_num_params must be >= 0");
  return [min_num_params](torch::nn::Module& m, bool recurse, int64_t nonwrapped_numel) {
    const bool large = nonwrapped_numel >= min_num_params;
    if (recurse) return large && !dynamic_cast<torch::nn::MultiheadAttentionImpl*>(&m);
    return large && !is_container(m);
  };
}

AutoWrapPolicy transformer_auto_wrap_policy(std::set<std::string> layer_names) {
  return [names = std::move(layer_names)](torch::nn::Module& m, bool recurse, int64_t) {
    return recurse || names.count(m.name()) > 0;
  };
}

AutoWrapPolicy lambda_auto_wrap_policy(std::function<bool(torch::nn::Module&)> fn) {
  if (!fn) throw UsageError("lambda_auto_wrap_policy: the function is empty");
  return [fn = std::move(fn)](torch::nn::Module& m, bool recurse, int64_t) { return recurse || fn(m); };
}

namespace detail {

FullyShardedDataParallelOptions child_options(const FullyShardedDataParallelOptions& options) {
  FullyShardedDataParallelOptions o = options;
  o.auto_wrap_policy = nullptr;
  o.auto_wrapper_callable = nullptr;
  return o;
}

namespace {

std::string join(const std::string& a, const std::string& b) { return a.empty() ? b : a + "." + b; }

bool is_wrapper(torch::nn::Module& m) { return dynamic_cast<FullyShardedModule*>(&m) != nullptr; }

// Parameters of m's tree that no wrapper owns.
int64_t nonwrapped_numel(torch::nn::Module& m) {
  if (is_wrapper(m)) return 0;
  int64_t n = 0;
  for (const auto& p : m.parameters(/*recurse=*/false)) n += p.numel();
  for (const auto& c : m.children()) n += nonwrapped_numel(*c);
  return n;
}

thread_local const std::unordered_set<const c10::TensorImpl*>* t_left_to_outer = nullptr;

// Every parameter registered in m's tree (into wrappers too), except in
// the subtree `skip`.
void params_of(torch::nn::Module& m, const torch::nn::Module* skip, std::unordered_set<const c10::TensorImpl*>& out) {
  if (&m == skip) return;
  for (const auto& p : m.parameters(/*recurse=*/false)) out.insert(p.unsafeGetTensorImpl());
  for (const auto& c : m.children()) params_of(*c, skip, out);
}

// Sets t_left_to_outer for one wrapper's construction.
class LeaveToOuterScope {
 public:
  explicit LeaveToOuterScope(const std::unordered_set<const c10::TensorImpl*>* d) : before_(t_left_to_outer) { t_left_to_outer = d; }
  LeaveToOuterScope(const LeaveToOuterScope&) = delete;
  LeaveToOuterScope& operator=(const LeaveToOuterScope&) = delete;
  ~LeaveToOuterScope() { t_left_to_outer = before_; }

 private:
  const std::unordered_set<const c10::TensorImpl*>* before_;
};

class Walk {
 public:
  Walk(torch::nn::Module& root, const FullyShardedDataParallelOptions& options, std::string label)
      : root_(root),
        policy_(options.auto_wrap_policy),
        callable_(options.auto_wrapper_callable),
        child_(child_options(options)),
        label_(std::move(label)) {}

  // Returns the parameters of m's tree that wrappers made here now own.
  int64_t visit(torch::nn::Module& m, const std::string& path, torch::nn::Module* parent, const std::string& name,
                bool only_children) {
    const int64_t numel = nonwrapped_numel(m);
    if (!policy_(m, /*recurse=*/true, numel)) return 0;
    int64_t wrapped = 0;
    for (const auto& c : m.named_children()) {
      if (is_wrapper(*c.value())) continue;
      wrapped += visit(*c.value(), join(path, c.key()), &m, c.key(), false);
    }
    if (only_children || !policy_(m, /*recurse=*/false, numel - wrapped)) return wrapped;
    replace(m, path, *parent, name);
    return numel;
  }

 private:
  void replace(torch::nn::Module& m, const std::string& path, torch::nn::Module& parent, const std::string& name) {
    auto* seq = dynamic_cast<torch::nn::SequentialImpl*>(&parent);
    if (!seq) {
      const char* what = dynamic_cast<torch::nn::ModuleListImpl*>(&parent) ? "an entry of a ModuleList"
                         : dynamic_cast<torch::nn::ModuleDictImpl*>(&parent) ? "an entry of a ModuleDict"
                                                                              : "a member";
      throw UsageError(label_ + ": auto_wrap_policy picked '" + path + "' (" + m.name() + "), " + what + " of '" +
                       path.substr(0, path.rfind('.') == std::string::npos ? 0 : path.rfind('.')) + "' (" +
                       parent.name() + ")" +
                       ", whose forward is called directly, where no wrapper can take it over: FSDP wraps "
                       "automatically only the entries of a torch::nn::Sequential. Put it in a "
                       "torch::nn::Sequential, wrap it by hand where it is built (tdist::FSDP<...> or "
                       "tdist::wrap), or give a policy that does not pick it");
    }
    // The parameters m shares with the rest of root's tree stay out of its unit.
    std::unordered_set<const c10::TensorImpl*> inside, outside, left;
    params_of(m, nullptr, inside);
    params_of(root_, &m, outside);
    for (const auto* impl : inside) {
      if (outside.count(impl)) left.insert(impl);
    }
    const LeaveToOuterScope scope(left.empty() ? nullptr : &left);
    for (auto it = seq->begin(); it != seq->end(); ++it) {
      if (it->ptr().get() != &m) continue;
      torch::nn::AnyModule wrapped =
          callable_ ? callable_(*it, child_)
                    : torch::nn::AnyModule(FullyShardedDataParallel<torch::nn::AnyModule>(*it, child_));
      if (wrapped.is_empty()) throw UsageError(label_ + ": auto_wrapper_callable returned nothing for '" + path + "'");
      *it = std::move(wrapped);
      seq->replace_module(name, it->ptr());
      return;
    }
    throw UsageError(label_ + ": '" + path + "' is a child of a torch::nn::Sequential but not one of its entries");
  }

  torch::nn::Module& root_;
  AutoWrapPolicy policy_;
  AutoWrapperCallable callable_;
  FullyShardedDataParallelOptions child_;
  std::string label_;
};

}  // namespace

void auto_wrap_children(torch::nn::Module& root, const FullyShardedDataParallelOptions& options,
                        const std::string& label) {
  if (!options.auto_wrap_policy) return;
  Walk(root, options, label).visit(root, "", nullptr, "", /*only_children=*/true);
}

const std::unordered_set<const c10::TensorImpl*>* left_to_outer() { return t_left_to_outer; }

}  // namespace detail
}  // namespace tdist
