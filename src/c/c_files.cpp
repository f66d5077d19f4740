// The C ABI's state dicts, checkpoints, safetensors files, Checkpointer
// and flight recorder dump (include/tdist/c/tdist.h).
#include <map>

#include "c/c_model.h"
#include "tdist/checkpointer.h"
#include "tdist/safetensors.h"
#include "tdist/sharded_checkpoint.h"
#include "tdist/state_dict.h"
#include "tdist/trace.h"

using namespace tdist;
using namespace tdist::c;

struct tdist_tensor_list {
  std::vector<std::string> names;
  std::vector<at::Tensor> tensors;  // tdist_tensor_list_get hands out &tensors[i]
};

struct tdist_checkpointer {
  std::shared_ptr<Model> model;  // outlives the Checkpointer, which holds its module
  std::unique_ptr<Checkpointer> checkpointer;
};

namespace {

torch::nn::Module& module_of(tdist_module* m) { return live(m, "module")->model->module(); }

tdist_tensor_list* new_list(const StateDict& d) {
  auto l = std::make_unique<tdist_tensor_list>();
  for (const auto& item : d) {
    l->names.push_back(item.key());
    l->tensors.push_back(item.value());
  }
  return handle(l.release());
}

StateDict dict_of(const char* const* ns, const tdist_tensor* ts, size_t n, const char* what) {
  const auto keys = names(ns, n, "names");
  const auto values = tensors(ts, n, what);
  StateDict d;
  for (size_t i = 0; i < n; ++i) {
    if (d.contains(keys[i])) usage("'" + keys[i] + "' is given twice");
    d.insert(keys[i], values[i]);
  }
  return d;
}

std::map<std::string, at::Tensor> extras_of(const char* const* ns, const tdist_tensor* ts, size_t n) {
  std::map<std::string, at::Tensor> m;
  for (const auto& item : dict_of(ns, ts, n, "extra")) m.emplace(item.key(), item.value());
  return m;
}

ShardedCheckpointOptions checkpoint_options(const char* format) {
  ShardedCheckpointOptions o;
  const std::string f = format ? format : "tdist";
  if (f == "tdist") {
    o.format = ShardedFormat::tdist;
  } else if (f == "dcp") {
    o.format = ShardedFormat::dcp;
  } else {
    usage("unknown checkpoint format '" + f + "' (tdist, dcp)");
  }
  return o;
}

std::string path_of(const char* p, const char* what) {
  if (!p || !*p) usage(std::string("the ") + what + " is NULL or empty");
  return p;
}

Checkpointer& checkpointer_of(tdist_checkpointer* c) { return *live(c, "checkpointer")->checkpointer; }

}  // namespace

extern "C" {

tdist_status tdist_tensor_list_size(const tdist_tensor_list* l, size_t* n) {
  return guarded("tdist_tensor_list_size", [&] {
    if (!n) usage("the output pointer is NULL");
    *n = live(l, "tensor list")->names.size();
  });
}

tdist_status tdist_tensor_list_get(const tdist_tensor_list* l, size_t i, const char** name, tdist_tensor* t) {
  return guarded("tdist_tensor_list_get", [&] {
    if (!name || !t) usage("an output pointer is NULL");
    auto* list = const_cast<tdist_tensor_list*>(live(l, "tensor list"));
    if (i >= list->names.size()) {
      usage("index " + std::to_string(i) + " is past the list's " + std::to_string(list->names.size()) + " entries");
    }
    *name = list->names[i].c_str();
    *t = &list->tensors[i];
  });
}

tdist_status tdist_tensor_list_free(tdist_tensor_list* l) {
  return guarded("tdist_tensor_list_free", [&] { release(l, "tensor list"); });
}

tdist_status tdist_full_state_dict(tdist_module* m, int rank0_only, tdist_tensor_list** out) {
  return guarded("tdist_full_state_dict", [&] {
    out_check(out);
    *out = new_list(full_state_dict(module_of(m), rank0_only != 0));
  });
}

tdist_status tdist_load_full_state_dict(tdist_module* m, const char* const* names, const tdist_tensor* tensors,
                                        size_t n, int strict) {
  return guarded("tdist_load_full_state_dict",
                 [&] { load_full_state_dict(module_of(m), dict_of(names, tensors, n, "value"), strict != 0); });
}

tdist_status tdist_sharded_state_dict(tdist_module* m, tdist_tensor_list** out) {
  return guarded("tdist_sharded_state_dict", [&] {
    out_check(out);
    *out = new_list(sharded_state_dict(module_of(m)).tensors);
  });
}

tdist_status tdist_load_sharded_state_dict(tdist_module* m, const char* const* names, const tdist_tensor* tensors,
                                           size_t n, int strict) {
  return guarded("tdist_load_sharded_state_dict", [&] {
    torch::nn::Module& module = module_of(m);
    ShardedStateDict state{dict_of(names, tensors, n, "value"), sharded_state_dict(module).metadata};
    load_sharded_state_dict(module, state, strict != 0);
  });
}

tdist_status tdist_save_sharded_checkpoint(tdist_module* m, tdist_pg* pg, const char* prefix, const char* format) {
  return guarded("tdist_save_sharded_checkpoint", [&] {
    save_sharded_checkpoint(path_of(prefix, "prefix"), *live(pg, "process group")->pg, module_of(m), nullptr,
                            checkpoint_options(format));
  });
}

tdist_status tdist_load_sharded_checkpoint(tdist_module* m, tdist_pg* pg, const char* prefix, const char* format) {
  return guarded("tdist_load_sharded_checkpoint", [&] {
    load_sharded_checkpoint(path_of(prefix, "prefix"), *live(pg, "process group")->pg, module_of(m), nullptr,
                            checkpoint_options(format));
  });
}

tdist_status tdist_save_safetensors(const char* path, const char* const* names, const tdist_tensor* tensors,
                                    size_t n) {
  return guarded("tdist_save_safetensors",
                 [&] { save_safetensors(path_of(path, "path"), dict_of(names, tensors, n, "value")); });
}

tdist_status tdist_load_safetensors(const char* path, tdist_tensor_list** out) {
  return guarded("tdist_load_safetensors", [&] {
    out_check(out);
    *out = new_list(load_safetensors(path_of(path, "path")));
  });
}

tdist_status tdist_checkpointer_new(tdist_module* m, tdist_pg* pg, const char* dir, int64_t every_steps,
                                    int keep_last, int async, tdist_checkpointer** out) {
  return guarded("tdist_checkpointer_new", [&] {
    out_check(out);
    const auto& model = live(m, "module")->model;
    CheckpointerOptions o;
    o.dir = path_of(dir, "dir");
    o.every_steps = every_steps;
    o.keep_last = keep_last;
    o.async = async != 0;
    auto c = std::make_unique<tdist_checkpointer>();
    c->model = model;
    c->checkpointer = std::make_unique<Checkpointer>(live(pg, "process group")->pg, model->module(), nullptr, o);
    *out = handle(c.release());
  });
}

tdist_status tdist_checkpointer_restore(tdist_checkpointer* c, int64_t* step, tdist_tensor_list** extras) {
  return guarded("tdist_checkpointer_restore", [&] {
    if (!step) usage("the step pointer is NULL");
    *step = -1;
    if (extras) *extras = nullptr;
    const auto restored = checkpointer_of(c).restore();
    if (!restored) return;
    *step = restored->step;
    if (extras) {
      StateDict d;
      for (const auto& [k, v] : restored->extras) d.insert(k, v);
      *extras = new_list(d);
    }
  });
}

tdist_status tdist_checkpointer_maybe_save(tdist_checkpointer* c, int64_t step, const char* const* names,
                                           const tdist_tensor* extras, size_t n, int* saved) {
  return guarded("tdist_checkpointer_maybe_save", [&] {
    const bool s = checkpointer_of(c).maybe_save(step, extras_of(names, extras, n));
    if (saved) *saved = s ? 1 : 0;
  });
}

tdist_status tdist_checkpointer_save(tdist_checkpointer* c, int64_t step, const char* const* names,
                                     const tdist_tensor* extras, size_t n) {
  return guarded("tdist_checkpointer_save", [&] { checkpointer_of(c).save(step, extras_of(names, extras, n)); });
}

tdist_status tdist_checkpointer_wait(tdist_checkpointer* c) {
  return guarded("tdist_checkpointer_wait", [&] { checkpointer_of(c).wait(); });
}

tdist_status tdist_checkpointer_free(tdist_checkpointer* c) {
  return guarded("tdist_checkpointer_free", [&] { release(c, "checkpointer"); });
}

tdist_status tdist_dump_flight_recorder(const char** path) {
  return guarded("tdist_dump_flight_recorder", [&] {
    if (!path) usage("the output pointer is NULL");
    std::string& s = thread_string();
    s = trace::dump_flight_recorder();
    *path = s.c_str();
  });
}

}  // extern "C"
