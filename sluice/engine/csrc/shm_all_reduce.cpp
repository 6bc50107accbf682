// torch.ops.sluice.shm_all_reduce: the all-reduce of tensor-parallel ranks on one host,
// through a shared-memory segment (vLLM's CPU backend does the same): each call is one round
// that every rank enters with the same `seq` (1, 2, ... counted by the caller).
//
// Segment (uint8, sluice/engine/distributed/shm_all_reduce.py lays it out): `world` flags of
// one cache line each, then two buffers of `world` slots. Round seq uses buffer seq % 2:
//   1. copy x into this rank's slot; publish seq in this rank's flag (release);
//   2. wait until every rank's flag reaches seq (acquire);
//   3. x = slot 0 + slot 1 + ... in rank order, so every rank computes the same bits.
// A rank writes a buffer again two rounds later, which it reaches only after every rank has
// published the round between, so after every rank finished reading this one.
// The wait spins, then yields, with the GIL released: a peer that never comes is the
// engine's to end (the worker monitor and the parent-death signal), not this op's.
#include <Python.h>

#include <ATen/core/Tensor.h>
#include <ATen/ops/from_blob.h>
#include <torch/library.h>

#include <sched.h>

#include <cstdint>
#include <cstring>

namespace {

constexpr int64_t kFlagBytes = 64;

class ReleasedGil {
  public:
    ReleasedGil() : state_(Py_IsInitialized() && PyGILState_Check() ? PyEval_SaveThread() : nullptr) {}
    ~ReleasedGil() {
        if (state_ != nullptr) PyEval_RestoreThread(state_);
    }

  private:
    PyThreadState *state_;
};

void wait_for(const int64_t *flag, int64_t seq) {
    for (int spins = 0; __atomic_load_n(flag, __ATOMIC_ACQUIRE) < seq; spins++) {
        if (spins > 2000) sched_yield();  // (more ranks than free cores: let the peer run)
    }
}

void shm_all_reduce(at::Tensor x, at::Tensor shm, int64_t rank, int64_t world, int64_t seq) {
    TORCH_CHECK(x.device().is_cpu() && x.is_contiguous(), "x: a contiguous CPU tensor");
    TORCH_CHECK(shm.scalar_type() == at::kByte && shm.is_contiguous(), "shm: uint8, contiguous");
    TORCH_CHECK(world > 0 && 0 <= rank && rank < world && seq > 0, "rank < world, seq > 0");
    const int64_t slot_bytes = (shm.numel() - world * kFlagBytes) / (2 * world);
    const int64_t nbytes = x.numel() * x.element_size();
    TORCH_CHECK(nbytes <= slot_bytes, "x (", nbytes, " bytes) exceeds a slot (", slot_bytes, ")");
    uint8_t *base = shm.data_ptr<uint8_t>();
    auto flag = [&](int64_t r) { return reinterpret_cast<int64_t *>(base + r * kFlagBytes); };
    uint8_t *buffer = base + world * kFlagBytes + (seq & 1) * world * slot_bytes;
    auto slot = [&](int64_t r) {
        return at::from_blob(buffer + r * slot_bytes, x.sizes(), x.options());
    };
    std::memcpy(buffer + rank * slot_bytes, x.data_ptr(), nbytes);
    __atomic_store_n(flag(rank), seq, __ATOMIC_RELEASE);
    {
        ReleasedGil released;
        for (int64_t r = 0; r < world; r++) wait_for(flag(r), seq);
    }
    x.copy_(slot(0));
    for (int64_t r = 1; r < world; r++) x.add_(slot(r));
}

}  // namespace

TORCH_LIBRARY_FRAGMENT(sluice, m) {
    m.def("shm_all_reduce(Tensor(a!) x, Tensor shm, int rank, int world, int seq) -> ()");
}

TORCH_LIBRARY_IMPL(sluice, CPU, m) { m.impl("shm_all_reduce", &shm_all_reduce); }
