// The etcd rendezvous backend (run/rdzv_store.h): the job's keys under the
// job's lease, this node's beat under its own lease, values signed with the
// job's token.
#include <chrono>
#include <cstdint>
#include <cstdio>

#include "run/etcd_client.h"
#include "run/rdzv_store.h"
#include "store/auth.h"
#include "tdist/errors.h"
#include "util/env.h"

namespace tdist_run {

namespace {

using Clock = std::chrono::steady_clock;
constexpr size_t kMacBytes = 32;

class EtcdStore final : public RdzvStore {
 public:
  explicit EtcdStore(const RdzvStoreOptions& o)
      : o_(o), etcd_(parse_etcd_endpoints(o.endpoint), EtcdTimeouts{}), lease_key_("tdist-run/" + o.run_id + "/lease") {
    try {
      job_lease_ = job_lease();
      node_lease_ = etcd_.grant_lease(o_.node_ttl.count());
    } catch (const tdist::Error& e) {
      throw tdist::Error("tdist-run: cannot use " + etcd_.describe() + " for the rendezvous: " + e.what());
    }
    renewed_ = Clock::now();
  }

  std::optional<std::string> get(const std::string& key) override {
    const auto v = etcd_.get(key);
    if (!v) return std::nullopt;
    return open(key, v->value);
  }

  void set(const std::string& key, const std::string& value) override { etcd_.put(key, seal(key, value), job_lease_); }

  int64_t add(const std::string& key, int64_t delta) override {
    // Read, then write if nobody wrote meanwhile; again when somebody did.
    const auto until = Clock::now() + std::chrono::seconds(30);
    for (;;) {
      const auto v = etcd_.get(key);
      const int64_t now = v ? counter(key, open(key, v->value)) : 0;
      if (delta == 0) return now;
      if ((delta > 0 && now > INT64_MAX - delta) || (delta < 0 && now < INT64_MIN - delta)) {
        throw tdist::StoreError("tdist-run: etcd: the count under '" + key + "' would overflow");
      }
      const int64_t sum = now + delta;
      if (etcd_.put_if_revision(key, seal(key, std::to_string(sum)), v ? v->mod_revision : 0, job_lease_)) return sum;
      if (Clock::now() > until) throw tdist::TimeoutError("tdist-run: etcd: could not add to '" + key + "' for 30 s");
    }
  }

  std::string compare_set(const std::string& key, const std::string& expected, const std::string& desired) override {
    const auto after = etcd_.put_if_value(key, expected.empty() ? std::nullopt : std::optional(seal(key, expected)),
                                          seal(key, desired), job_lease_);
    return after ? open(key, *after) : "";
  }

  void beat(const std::string& key) override {
    renew();
    etcd_.put(key, seal(key, std::to_string(++beats_)), node_lease_);
  }

  std::optional<int64_t> read_beat(const std::string& key) override {
    const auto v = get(key);
    if (!v) return std::nullopt;
    return counter(key, *v);
  }

  bool durable() const override { return true; }
  std::string describe() const override { return etcd_.describe(); }

 private:
  // The job's lease: the one its first launcher made (named under
  // lease_key_, which lives under it), renewed; or a new one.
  int64_t job_lease() {
    for (int tries = 0; tries < 10; ++tries) {
      if (const auto v = etcd_.get(lease_key_)) {
        const auto id = tdist::detail::parse_int(open(lease_key_, v->value));
        if (!id || *id == 0) throw tdist::StoreError("etcd holds '" + lease_key_ + "' that is no lease");
        if (etcd_.keep_alive(*id)) return *id;
        continue;  // it expired just now; its key goes with it
      }
      const int64_t mine = etcd_.grant_lease(o_.job_ttl.count());
      const std::string text = std::to_string(mine);
      if (etcd_.put_if_value(lease_key_, std::nullopt, seal(lease_key_, text), mine) == seal(lease_key_, text)) {
        return mine;
      }
      // Another launcher's lease won; this one expires unused.
    }
    throw tdist::StoreError("etcd: the job's lease under '" + lease_key_ + "' keeps changing");
  }

  // Renews the leases, often enough: the node's at a third of its TTL, the
  // job's at a tenth. A node lease gone (this node was cut off from etcd
  // for longer than its TTL: the others have counted it out) is replaced.
  void renew() {
    const auto now = Clock::now();
    if (now - renewed_ < o_.node_ttl / 3) return;
    renewed_ = now;
    if (!etcd_.keep_alive(node_lease_)) {
      std::fprintf(stderr, "tdist-run: this node's etcd lease expired (cut off for over %lld s); taking a new one\n",
                   static_cast<long long>(o_.node_ttl.count()));
      node_lease_ = etcd_.grant_lease(o_.node_ttl.count());
    }
    if (now - job_renewed_ >= o_.job_ttl / 10) {
      job_renewed_ = now;
      if (!etcd_.keep_alive(job_lease_)) {
        throw tdist::StoreError("tdist-run: the job's keys in " + etcd_.describe() + " expired (no launcher renewed " +
                                "them for " + std::to_string(o_.job_ttl.count()) + " s)");
      }
    }
  }

  std::string seal(const std::string& key, const std::string& value) const {
    if (o_.token.empty()) return value;
    const tdist::Bytes mac = tdist::detail::hmac_sha256(o_.token, message(key, value));
    return std::string(mac.begin(), mac.end()) + value;
  }

  std::string open(const std::string& key, const std::string& stored) const {
    if (o_.token.empty()) return stored;
    const std::string value = stored.size() >= kMacBytes ? stored.substr(kMacBytes) : "";
    const tdist::Bytes mac(stored.begin(), stored.begin() + static_cast<long>(std::min(stored.size(), kMacBytes)));
    if (stored.size() < kMacBytes ||
        !tdist::detail::macs_equal(mac, tdist::detail::hmac_sha256(o_.token, message(key, value)))) {
      throw tdist::StoreError("tdist-run: " + etcd_.describe() + " holds a value under '" + key +
                              "' that was not written with this job's token: another job under the same --rdzv-id "
                              "'" + o_.run_id + "' (with another token), or someone else, wrote it");
    }
    return value;
  }

  static tdist::Bytes message(const std::string& key, const std::string& value) {
    std::string m = "tdist-rdzv|" + std::to_string(key.size()) + "|" + key + "|" + value;
    return tdist::Bytes(m.begin(), m.end());
  }

  static int64_t counter(const std::string& key, const std::string& text) {
    const auto v = tdist::detail::parse_int(text);
    if (!v) throw tdist::StoreError("tdist-run: etcd holds '" + text.substr(0, 40) + "' under '" + key + "', not a count");
    return *v;
  }

  RdzvStoreOptions o_;
  EtcdClient etcd_;
  std::string lease_key_;
  int64_t job_lease_ = 0;
  int64_t node_lease_ = 0;
  int64_t beats_ = 0;
  Clock::time_point renewed_;
  Clock::time_point job_renewed_;
};

}  // namespace

std::unique_ptr<RdzvStore> make_etcd_rdzv_store(const RdzvStoreOptions& o) { return std::make_unique<EtcdStore>(o); }

}  // namespace tdist_run
