// Causal prefill attention read straight from the paged KV cache, for the CPU fp32 path (fp32 or fp8 e4m3 caches;
// e4m3 rows are widened a key block at a time into the task's staging rows, e4m3.h): fresh prompts and
// prompts that continue a cached prefix (chunked prefill, prefix-cache hits), grouped-query attention included.
//
// The torch path gathers every sequence's blocks into a padded copy and runs SDPA over it per query head, so
// each K/V head is read again for every one of its `num_heads / num_kv_heads` query heads. Here one task owns (sequence, kv head, block of queries)
// and all query heads of that kv head at once: its tile has rows = queries x group heads, and every K/V row it
// reads serves all of them. Keys go by in blocks with an online (flash-style) softmax, so nothing of size
// queries x keys is ever stored.
//
// Layout of a task: the query tile is stored transposed, QT[d][row], so one vector holds 16 rows (lanes). The
// scores of a key block are then ST[key][row], and every softmax step (running max, exp, sum, rescale) works
// lane-wise on whole vectors: no horizontal reductions, no transposed copy of K (K and V are broadcast
// scalar by scalar straight from the cache). The output accumulates transposed too, OT[d][row], and is written
// out once at the end.
//
// Vectors are GCC vector extensions of 16 floats: AVX-512 registers where the machine has them (built with
// -march=native), split into narrower ones elsewhere. Built with the flags of the bit-exact kernels: no
// -ffast-math (exp2 is the polynomial below; every other operation keeps IEEE semantics) and no FMA contraction
// (allowing it measured only 2-4 % faster on the dev box's Zen 4, which has separate add and multiply pipes).
// The result is not bit-identical to SDPA's (another summation order) but as close to a float64 reference.
#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <limits>
#include <vector>

#include "e4m3.h"

namespace {

constexpr int64_t kLanes = 16;
constexpr int64_t kMaxGroupVectors = 4;  // rows per pass: 4 vectors = 64 rows (16 accumulators with 4 keys / dims)
constexpr int64_t kRowsPerTask = kLanes * kMaxGroupVectors;
// Keys per online-softmax step: 128 measured ahead of 32 and 64 (fewer rescales of the output per key) and level
// with 256 on the SmolLM2 shapes; its scores (128 keys x 64 rows, 32 KiB) and K/V rows stay within L2.
constexpr int64_t kKeyBlock = 128;
constexpr int64_t kUnroll = 4;     // keys (scores) or head dims (output) per micro-tile

typedef float vfloat __attribute__((vector_size(kLanes * sizeof(float))));
typedef int32_t vint __attribute__((vector_size(kLanes * sizeof(int32_t))));

inline vfloat load(const float* p) {
  vfloat v;
  std::memcpy(&v, p, sizeof v);
  return v;
}

inline void store(float* p, vfloat v) { std::memcpy(p, &v, sizeof v); }

inline vfloat splat(float x) { return vfloat{} + x; }

inline vfloat vmax(vfloat a, vfloat b) { return a > b ? a : b; }

// 2^x for x <= 0 (scores minus their running max), lane-wise: x = n + f with n integer and |f| <= 1/2,
// 2^f from Cephes' exp2f minimax polynomial (relative error ~2e-7), 2^n put straight into the exponent bits.
// Inputs below -126.5 (and -inf) give exactly 0, which is what masked keys must contribute.
inline vfloat exp2_nonpositive(vfloat x) {
  const vfloat lowest = splat(-127.f);
  x = x < lowest ? lowest : x;
  const vfloat magic = splat(12582912.f);  // 1.5 * 2^23: adding and subtracting it rounds to an integer
  const vfloat n = (x + magic) - magic;
  const vfloat f = x - n;
  vfloat p = splat(1.535336188319500e-4f);
  p = p * f + 1.339887440266574e-3f;
  p = p * f + 9.618437357674640e-3f;
  p = p * f + 5.550332471162809e-2f;
  p = p * f + 2.402264791363012e-1f;
  p = p * f + 6.931472028550421e-1f;
  p = p * f + 1.f;
  const vint bits = (__builtin_convertvector(n, vint) + 127) << 23;  // n = -127 -> bits 0 -> 0.0f
  return p * (vfloat)bits;  // same-size vector cast: the bits, reinterpreted
}

// ST[a][row] = sum_d QT[d][row] * K_a[d] for kUnroll keys a and NV vectors of rows.
template <int NV>
void score_tile(const float* qt, int64_t ldq, const float* const* keys, int64_t head_dim, float* st) {
  vfloat acc[kUnroll][NV] = {};
  const float* k0 = keys[0];
  const float* k1 = keys[1];
  const float* k2 = keys[2];
  const float* k3 = keys[3];
  for (int64_t d = 0; d < head_dim; ++d) {
    vfloat q[NV];
    for (int v = 0; v < NV; ++v) q[v] = load(qt + d * ldq + v * kLanes);
    const float ks[kUnroll] = {k0[d], k1[d], k2[d], k3[d]};
    for (int a = 0; a < kUnroll; ++a)
      for (int v = 0; v < NV; ++v) acc[a][v] += ks[a] * q[v];
  }
  for (int a = 0; a < kUnroll; ++a)
    for (int v = 0; v < NV; ++v) store(st + a * kRowsPerTask + v * kLanes, acc[a][v]);
}

// OT[d0 + a][row] += sum_j V_j[d0 + a] * PT[j][row] for kUnroll dims a and NV vectors of rows.
template <int NV>
void value_tile(float* ot, int64_t ldo, const float* pt, const float* const* values, int64_t count, int64_t d0) {
  vfloat acc[kUnroll][NV];
  for (int a = 0; a < kUnroll; ++a)
    for (int v = 0; v < NV; ++v) acc[a][v] = load(ot + (d0 + a) * ldo + v * kLanes);
  for (int64_t j = 0; j < count; ++j) {
    vfloat p[NV];
    for (int v = 0; v < NV; ++v) p[v] = load(pt + j * kRowsPerTask + v * kLanes);
    const float* vj = values[j] + d0;
    for (int a = 0; a < kUnroll; ++a) {
      const float s = vj[a];
      for (int v = 0; v < NV; ++v) acc[a][v] += s * p[v];
    }
  }
  for (int a = 0; a < kUnroll; ++a)
    for (int v = 0; v < NV; ++v) store(ot + (d0 + a) * ldo + v * kLanes, acc[a][v]);
}

template <int NV>
void score_block(const float* qt, int64_t ldq, const float* const* keys, int64_t count, int64_t head_dim,
                 float* st) {
  for (int64_t j = 0; j < count; j += kUnroll) score_tile<NV>(qt, ldq, keys + j, head_dim, st + j * kRowsPerTask);
}

template <int NV>
void value_block(float* ot, int64_t ldo, const float* pt, const float* const* values, int64_t count,
                 int64_t head_dim) {
  for (int64_t d0 = 0; d0 < head_dim; d0 += kUnroll) value_tile<NV>(ot, ldo, pt, values, count, d0);
}

struct Task {
  int64_t seq, kv_head, first_query, num_queries, cost, family, family_cost;
};

struct Geometry {
  int64_t num_heads, num_kv_heads, group, head_dim, block_size, max_blocks;
  int64_t q_token_stride, out_token_stride;
};

// The KV cache: float32 rows read in place, or e4m3 codes (k8/v8 set) that a task widens a key block at a time
// into its own staging rows (their values x 2^-8: the 2^8 and the scales are folded into q_scale and out_scale).
struct Cache {
  const float* k = nullptr;
  const float* v = nullptr;
  const uint8_t* k8 = nullptr;
  const uint8_t* v8 = nullptr;
};

// One task: `num_queries` queries of one sequence x the `group` query heads of one kv head.
void run_task(const Task& task, const Geometry& g, const float* q, const Cache& cache, const int64_t* tables,
              const int64_t* q_starts, const int64_t* q_lens, const int64_t* seq_lens, float q_scale,
              float out_scale, float* out, std::vector<float>& qt, std::vector<float>& ot, std::vector<float>& st,
              std::vector<const float*>& key_rows, std::vector<const float*>& value_rows, std::vector<float>& staging) {
  const int64_t rows = task.num_queries * g.group;
  const int64_t padded = (rows + kLanes - 1) / kLanes * kLanes;
  const int64_t head_dim = g.head_dim;
  const int64_t context = seq_lens[task.seq] - q_lens[task.seq];  // cached tokens before this step's queries
  const int64_t first_pos = context + task.first_query;          // absolute position of the tile's first query
  const int64_t token0 = q_starts[task.seq] + task.first_query;   // its flat row in q / out
  const int64_t* table = tables + task.seq * g.max_blocks;
  const int64_t kv_row = g.num_kv_heads * head_dim;
  qt.assign(head_dim * padded, 0.f);
  ot.assign(head_dim * padded, 0.f);
  // Row r = query i * group + head h (query-major): rows that share a query share its causal limit. Padding
  // rows repeat the last query (finite, discarded).
  std::vector<float> limit(padded);
  for (int64_t r = 0; r < padded; ++r) {
    const int64_t i = std::min(r, rows - 1) / g.group;
    limit[r] = static_cast<float>(first_pos + i);  // exact: positions are far below 2^24
    if (r >= rows) continue;
    const float* src = q + (token0 + i) * g.q_token_stride + (task.kv_head * g.group + r % g.group) * head_dim;
    for (int64_t d = 0; d < head_dim; ++d) qt[d * padded + r] = src[d] * q_scale;
  }
  const int64_t num_vectors = padded / kLanes;
  const int64_t num_keys = first_pos + task.num_queries;  // the last query sees keys 0 .. its position
  std::vector<float> running_max(padded, -std::numeric_limits<float>::infinity());
  std::vector<float> running_sum(padded, 0.f);
  const vfloat minus_inf = splat(-std::numeric_limits<float>::infinity());
  for (int64_t kb = 0; kb < num_keys; kb += kKeyBlock) {
    const int64_t block_keys = std::min(kKeyBlock, num_keys - kb);
    for (int64_t j = 0; j < block_keys; ++j) {
      const int64_t t = kb + j;
      const int64_t offset = (table[t / g.block_size] * g.block_size + t % g.block_size) * kv_row +
                             task.kv_head * head_dim;
      if (cache.k8 != nullptr) {
        float* k_stage = staging.data() + j * head_dim;
        float* v_stage = k_stage + kKeyBlock * head_dim;
        kvflow_e4m3::widen(cache.k8 + offset, k_stage, head_dim);
        kvflow_e4m3::widen(cache.v8 + offset, v_stage, head_dim);
        key_rows[j] = k_stage;
        value_rows[j] = v_stage;
      } else {
        key_rows[j] = cache.k + offset;
        value_rows[j] = cache.v + offset;
      }
    }
    for (int64_t j = block_keys; j < (block_keys + kUnroll - 1) / kUnroll * kUnroll; ++j) {
      key_rows[j] = key_rows[block_keys - 1];  // a partial last micro-tile computes duplicates, never read
    }
    for (int64_t v0 = 0; v0 < num_vectors; v0 += kMaxGroupVectors) {
      const int64_t nv = std::min(kMaxGroupVectors, num_vectors - v0);
      const int64_t r0 = v0 * kLanes;
      const float lowest = limit[r0], highest = limit[std::min(r0 + nv * kLanes, rows) - 1];
      // Keys past the group's last query are masked for every row: skip them instead of computing them.
      const int64_t count = std::min<int64_t>(block_keys, static_cast<int64_t>(highest) - kb + 1);
      if (count <= 0) continue;
      const bool masked = static_cast<float>(kb + count - 1) > lowest;
      const float* qt_group = qt.data() + r0;
      float* ot_group = ot.data() + r0;
      switch (nv) {
        case 1: score_block<1>(qt_group, padded, key_rows.data(), count, head_dim, st.data()); break;
        case 2: score_block<2>(qt_group, padded, key_rows.data(), count, head_dim, st.data()); break;
        case 3: score_block<3>(qt_group, padded, key_rows.data(), count, head_dim, st.data()); break;
        default: score_block<4>(qt_group, padded, key_rows.data(), count, head_dim, st.data()); break;
      }
      for (int64_t v = 0; v < nv; ++v) {
        const int64_t r = r0 + v * kLanes;
        const vfloat lim = load(limit.data() + r);
        vfloat block_max = minus_inf;
        for (int64_t j = 0; j < count; ++j) {
          float* s_row = st.data() + j * kRowsPerTask + v * kLanes;
          vfloat s = load(s_row);
          if (masked) {
            s = splat(static_cast<float>(kb + j)) > lim ? minus_inf : s;
            store(s_row, s);
          }
          block_max = vmax(block_max, s);
        }
        const vfloat old_max = load(running_max.data() + r);
        const vfloat new_max = vmax(old_max, block_max);
        // Rows that have seen no key yet keep max -inf: subtract 0 there (-inf - -inf would be NaN).
        const vfloat shift = new_max == minus_inf ? splat(0.f) : new_max;
        const vfloat alpha = exp2_nonpositive(old_max - shift);  // 0 for a row's first keys (old max -inf)
        vfloat total = splat(0.f);
        for (int64_t j = 0; j < count; ++j) {
          float* s_row = st.data() + j * kRowsPerTask + v * kLanes;
          const vfloat p = exp2_nonpositive(load(s_row) - shift);
          store(s_row, p);
          total += p;
        }
        store(running_sum.data() + r, load(running_sum.data() + r) * alpha + total);
        store(running_max.data() + r, new_max);
        for (int64_t d = 0; d < head_dim; ++d) {
          float* o = ot_group + d * padded + v * kLanes;
          store(o, load(o) * alpha);
        }
      }
      switch (nv) {
        case 1: value_block<1>(ot_group, padded, st.data(), value_rows.data(), count, head_dim); break;
        case 2: value_block<2>(ot_group, padded, st.data(), value_rows.data(), count, head_dim); break;
        case 3: value_block<3>(ot_group, padded, st.data(), value_rows.data(), count, head_dim); break;
        default: value_block<4>(ot_group, padded, st.data(), value_rows.data(), count, head_dim); break;
      }
    }
  }
  for (int64_t r = 0; r < rows; ++r) {
    const int64_t i = r / g.group;
    float* dst = out + (token0 + i) * g.out_token_stride + (task.kv_head * g.group + r % g.group) * head_dim;
    const float inv = out_scale / running_sum[r];  // > 0: every query sees at least key 0
    for (int64_t d = 0; d < head_dim; ++d) dst[d] = ot[d * padded + r] * inv;
  }
}

// query [T, H, D] (rows may be strided, e.g. a view into the fused qkv projection), caches
// [blocks, block_size, kv_heads, D], per sequence: its block table row, the flat row of its first query, its
// number of queries and its context length after this step. Writes the rows of those queries into out [T, H, D].
// The checks and the task schedule of both entry points; `cache` holds the caches' data (fp32 or e4m3 codes),
// `score_scale` multiplies q . k and `out_scale` the output.
void prefill_attention_impl(const torch::Tensor& query, const torch::Tensor& key_cache,
                            const torch::Tensor& value_cache, const torch::Tensor& block_tables,
                            const torch::Tensor& query_starts, const torch::Tensor& query_lens,
                            const torch::Tensor& seq_lens, double score_scale, float out_scale, const Cache& cache,
                            torch::Tensor& out) {
  TORCH_CHECK(query.dim() == 3 && out.dim() == 3 && key_cache.dim() == 4 && value_cache.sizes() == key_cache.sizes(),
              "query and out [T,H,D], caches [blocks,block_size,kv_heads,D]");
  TORCH_CHECK(query.scalar_type() == torch::kFloat32 && out.scalar_type() == torch::kFloat32,
              "float32 queries and output only");
  TORCH_CHECK(query.device().is_cpu() && out.device().is_cpu() && key_cache.device().is_cpu() &&
                  value_cache.device().is_cpu(), "CPU tensors only");
  TORCH_CHECK(key_cache.is_contiguous() && value_cache.is_contiguous(), "caches must be contiguous");
  const int64_t num_tokens = query.size(0), num_heads = query.size(1), head_dim = query.size(2);
  TORCH_CHECK(query.stride(2) == 1 && query.stride(1) == head_dim, "query rows must hold contiguous heads");
  TORCH_CHECK(out.sizes() == query.sizes() && out.is_contiguous(), "out must be a contiguous tensor like query");
  const int64_t num_blocks = key_cache.size(0), block_size = key_cache.size(1), num_kv_heads = key_cache.size(2);
  TORCH_CHECK(key_cache.size(3) == head_dim && num_kv_heads > 0 && num_heads % num_kv_heads == 0,
              "head shapes disagree");
  TORCH_CHECK(head_dim % kUnroll == 0, "head_dim must be a multiple of ", kUnroll);
  const auto tables = block_tables.to(torch::kInt64).contiguous();
  const auto starts = query_starts.to(torch::kInt64).contiguous();
  const auto q_lens_t = query_lens.to(torch::kInt64).contiguous();
  const auto lens_t = seq_lens.to(torch::kInt64).contiguous();
  TORCH_CHECK(tables.dim() == 2, "block_tables must be [sequences, max_blocks]");
  const int64_t num_seqs = tables.size(0), max_blocks = tables.size(1);
  TORCH_CHECK(starts.numel() == num_seqs && q_lens_t.numel() == num_seqs && lens_t.numel() == num_seqs,
              "one query start, query length and sequence length per block-table row");
  const int64_t* table = tables.data_ptr<int64_t>();
  const int64_t* start = starts.data_ptr<int64_t>();
  const int64_t* q_len = q_lens_t.data_ptr<int64_t>();
  const int64_t* len = lens_t.data_ptr<int64_t>();
  const int64_t group = num_heads / num_kv_heads;
  // Queries per task: as many as fill kRowsPerTask rows with all `group` heads (at least one).
  const int64_t queries_per_task = std::max<int64_t>(1, kRowsPerTask / group);
  std::vector<Task> tasks;
  for (int64_t s = 0; s < num_seqs; ++s) {  // checked up front: a bad index must not read out of bounds
    TORCH_CHECK(q_len[s] >= 1 && q_len[s] <= len[s] && len[s] <= max_blocks * block_size,
                "need 1 <= query_len <= seq_len <= the block table's capacity");
    TORCH_CHECK(start[s] >= 0 && start[s] + q_len[s] <= num_tokens, "query rows outside query");
    const int64_t used_blocks = (len[s] + block_size - 1) / block_size;
    for (int64_t b = 0; b < used_blocks; ++b) {
      const int64_t id = table[s * max_blocks + b];
      TORCH_CHECK(id >= 0 && id < num_blocks, "block id outside the KV cache");
    }
    for (int64_t kv = 0; kv < num_kv_heads; ++kv) {
      const size_t family_start = tasks.size();
      int64_t family_cost = 0;
      for (int64_t first = 0; first < q_len[s]; first += queries_per_task) {
        const int64_t n = std::min(queries_per_task, q_len[s] - first);
        const int64_t keys = len[s] - q_len[s] + first + n;
        tasks.push_back({s, kv, first, n, n * keys, s * num_kv_heads + kv, 0});
        family_cost += n * keys;
      }
      for (size_t t = family_start; t < tasks.size(); ++t) tasks[t].family_cost = family_cost;
    }
  }
  // Tasks are taken by whichever thread is free: causal tasks differ in cost by up to the prompt length, and a
  // static split would leave one core idle at the end. Order: the tasks of one (sequence, kv head) together,
  // longest first, so the two threads work on the same K/V rows while they are in cache (measured 2-7 % ahead
  // of a plain longest-first order at 16 x 512 and 64 x 128 tokens, level elsewhere); heaviest of those
  // families first, so the small tasks come last and even out the finish.
  std::sort(tasks.begin(), tasks.end(), [](const Task& a, const Task& b) {
    if (a.family_cost != b.family_cost) return a.family_cost > b.family_cost;
    if (a.family != b.family) return a.family < b.family;
    return a.cost > b.cost;
  });
  const Geometry geometry{num_heads, num_kv_heads, group, head_dim, block_size, max_blocks,
                          query.stride(0), out.stride(0)};
  const float* q = query.data_ptr<float>();
  float* o = out.data_ptr<float>();
  // Scores in base 2 (exp2 is cheaper than exp): fold log2(e) into the query scale.
  const float q_scale = static_cast<float>(score_scale * 1.4426950408889634);
  const int64_t num_tasks = static_cast<int64_t>(tasks.size());
  std::atomic<int64_t> next{0};
  const int64_t workers = std::min<int64_t>(at::get_num_threads(), num_tasks);
  at::parallel_for(0, workers, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> qt, ot;
    std::vector<float> st(kKeyBlock * kRowsPerTask);
    std::vector<const float*> key_rows(kKeyBlock), value_rows(kKeyBlock);
    std::vector<float> staging(cache.k8 != nullptr ? 2 * kKeyBlock * head_dim : 0);
    for (int64_t w = begin; w < end; ++w) {
      for (int64_t i = next.fetch_add(1); i < num_tasks; i = next.fetch_add(1)) {
        run_task(tasks[i], geometry, q, cache, table, start, q_len, len, q_scale, out_scale, o, qt, ot, st,
                 key_rows, value_rows, staging);
      }
    }
  });
}

void prefill_attention(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                       torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor query_lens,
                       torch::Tensor seq_lens, double scale, torch::Tensor out) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kFloat32 && value_cache.scalar_type() == torch::kFloat32,
              "float32 caches (fp8 ones: prefill_attention_fp8)");
  Cache cache;
  cache.k = key_cache.data_ptr<float>();
  cache.v = value_cache.data_ptr<float>();
  prefill_attention_impl(query, key_cache, value_cache, block_tables, query_starts, query_lens, seq_lens, scale,
                         1.f, cache, out);
}

// The caches as uint8 views of e4m3 bytes (value / scale).
void prefill_attention_fp8(torch::Tensor query, torch::Tensor key_cache, torch::Tensor value_cache,
                           torch::Tensor block_tables, torch::Tensor query_starts, torch::Tensor query_lens,
                           torch::Tensor seq_lens, double scale, double k_scale, double v_scale, torch::Tensor out) {
  TORCH_CHECK(key_cache.scalar_type() == torch::kUInt8 && value_cache.scalar_type() == torch::kUInt8,
              "fp8 caches as uint8 views");
  Cache cache;
  cache.k8 = key_cache.data_ptr<uint8_t>();
  cache.v8 = value_cache.data_ptr<uint8_t>();
  prefill_attention_impl(query, key_cache, value_cache, block_tables, query_starts, query_lens, seq_lens,
                         scale * k_scale * kvflow_e4m3::kUnscale, static_cast<float>(v_scale * kvflow_e4m3::kUnscale),
                         cache, out);
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("prefill_attention", &prefill_attention,
        "causal GQA prefill attention over a paged fp32 KV cache, written into out's query rows (CPU)");
  m.def("prefill_attention_fp8", &prefill_attention_fp8,
        "prefill_attention over a paged fp8 (e4m3, per-tensor scales) KV cache given as uint8 views");
}
