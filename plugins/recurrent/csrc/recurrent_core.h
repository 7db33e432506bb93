// llmc's recurrent-state kernels on the CPU, on packed tokens with per-sequence state slots
// (semantics: llmc/plugins/recurrent/reference.py, which is normative).
//
// A step packs S sequences' new tokens into T rows; sequence s owns rows
// query_start_loc[s]..query_start_loc[s+1] and its state lives in slot state_slots[s] of a pool
// the runtime owns ([num_slots, ...state shape], bound by pointer). A sequence whose whole context
// is this step's rows (context_lens[s] == its row count) starts from a zero state: the runtime
// never has to clear a slot, and a sequence recomputed after preemption starts over by itself.

#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <stdexcept>
#include <string>

namespace llmc_rec {

struct Error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

// Which rows are sequence s's and whether it starts fresh; throws on metadata that does not add up.
struct SeqRows {
    int64_t begin, end;
    bool fresh;
};

inline SeqRows seq_rows(const int64_t* qsl, const int64_t* ctx_lens, int64_t s, int64_t T) {
    const int64_t b = qsl[s], e = qsl[s + 1];
    if (b < 0 || e < b || e > T) {
        throw Error("query_start_loc[" + std::to_string(s) + ":" + std::to_string(s + 2) + "] = " + std::to_string(b) +
                    ", " + std::to_string(e) + " is not a range of the " + std::to_string(T) + " rows");
    }
    if (ctx_lens[s] < e - b) {
        throw Error("context_lens[" + std::to_string(s) + "] = " + std::to_string(ctx_lens[s]) +
                    " is less than the sequence's " + std::to_string(e - b) + " new rows");
    }
    return {b, e, ctx_lens[s] == e - b};
}

inline float silu(float v) { return v / (1.0f + std::exp(-v)); }

// Causal depthwise convolution over each sequence's inputs, its last K-1 inputs carried in a state
// slot [C, K-1] (channel-major, oldest first, as transformers' conv_state): x [T, C] (rows with a
// row stride `x_row`), weight [C, K], bias [C] or null, out [T, C]. activation 1: SiLU.
struct ConvArgs {
    const float* x = nullptr;
    int64_t x_row = 0;
    const float* weight = nullptr;
    const float* bias = nullptr;
    float* out = nullptr;
    float* state = nullptr;  // the pool array of this layer: [num_slots, C, K-1]
    int64_t num_slots = 0;
    const int64_t* state_slots = nullptr;
    const int64_t* context_lens = nullptr;
    const int64_t* query_start_loc = nullptr;
    int64_t T = 0, S = 0, C = 0, K = 0;
    int activation = 0;
};

inline void check_slot(int64_t slot, int64_t num_slots, int64_t s) {
    if (slot < 0 || slot >= num_slots) {
        throw Error("state_slots[" + std::to_string(s) + "] = " + std::to_string(slot) +
                    " is outside the bound state pool of " + std::to_string(num_slots) + " slots");
    }
}

// Channels c0..c1 of every sequence (channels are independent: the unit of parallel work).
inline void causal_conv1d_channels(const ConvArgs& a, int64_t c0, int64_t c1) {
    const int64_t K = a.K, W = K - 1;
    float window[64];  // the last K-1 inputs of one channel, oldest first (K <= 65 checked by the caller)
    for (int64_t s = 0; s < a.S; ++s) {
        const SeqRows r = seq_rows(a.query_start_loc, a.context_lens, s, a.T);
        float* state = a.state + a.state_slots[s] * a.C * W;
        for (int64_t c = c0; c < c1; ++c) {
            float* st = state + c * W;
            for (int64_t j = 0; j < W; ++j) window[j] = r.fresh ? 0.0f : st[j];
            const float* w = a.weight + c * K;
            const float b = a.bias ? a.bias[c] : 0.0f;
            for (int64_t t = r.begin; t < r.end; ++t) {
                const float xt = a.x[t * a.x_row + c];
                float acc = b;
                for (int64_t j = 0; j < W; ++j) acc += w[j] * window[j];
                acc += w[W] * xt;
                for (int64_t j = 0; j + 1 < W; ++j) window[j] = window[j + 1];
                if (W > 0) window[W - 1] = xt;
                a.out[t * a.C + c] = a.activation == 1 ? silu(acc) : acc;
            }
            for (int64_t j = 0; j < W; ++j) st[j] = window[j];
        }
    }
}

inline void check_conv(const ConvArgs& a) {
    if (a.K < 1 || a.K > 65) throw Error("kernel size must be 1..65, got " + std::to_string(a.K));
    for (int64_t s = 0; s < a.S; ++s) {
        check_slot(a.state_slots[s], a.num_slots, s);
        seq_rows(a.query_start_loc, a.context_lens, s, a.T);
        for (int64_t u = 0; u < s; ++u) {
            if (a.state_slots[u] == a.state_slots[s]) {
                throw Error("state_slots[" + std::to_string(u) + "] and state_slots[" + std::to_string(s) +
                            "] are both slot " + std::to_string(a.state_slots[s]) + ": two sequences of one step "
                            "cannot share a state slot");
            }
        }
    }
}

// The gated delta rule (Gated DeltaNet), token by token: per sequence and value head h, a state S [Dk, Dv]
// (slot layout [Hv, Dk, Dv]) and for each token S = exp(g) S + k (beta (v - exp(g) S^T k))^T, out = S^T q, with q and
// k L2-normalised (use_l2norm) and q scaled by Dk^-0.5; value head h reads query/key head h / (Hv / Hk).
struct DeltaArgs {
    const float *q = nullptr, *k = nullptr, *v = nullptr, *g = nullptr, *beta = nullptr;
    int64_t q_row = 0, k_row = 0, v_row = 0, g_row = 0, beta_row = 0;
    float* out = nullptr;    // [T, Hv * Dv]
    float* state = nullptr;  // [num_slots, Hv, Dk, Dv]
    int64_t num_slots = 0;
    const int64_t* state_slots = nullptr;
    const int64_t* context_lens = nullptr;
    const int64_t* query_start_loc = nullptr;
    int64_t T = 0, S = 0, Hk = 0, Hv = 0, Dk = 0, Dv = 0;
    bool use_l2norm = true;
};

// One (sequence, value head) pair: the unit of parallel work (pairs share no state).
inline void gated_delta_rule_item(const DeltaArgs& a, int64_t s, int64_t h, float* scratch) {
    const SeqRows r = seq_rows(a.query_start_loc, a.context_lens, s, a.T);
    const int64_t Dk = a.Dk, Dv = a.Dv, kh = h / (a.Hv / a.Hk);
    float* st = a.state + (a.state_slots[s] * a.Hv + h) * Dk * Dv;
    if (r.fresh) {
        for (int64_t i = 0; i < Dk * Dv; ++i) st[i] = 0.0f;
    }
    float* q = scratch;        // [Dk]
    float* k = scratch + Dk;   // [Dk]
    float* u = scratch + 2 * Dk;  // [Dv]: S^T k, then beta (v - S^T k)
    float* o = u + Dv;            // [Dv]
    const float q_scale = 1.0f / std::sqrt(static_cast<float>(Dk));
    for (int64_t t = r.begin; t < r.end; ++t) {
        const float* qt = a.q + t * a.q_row + kh * Dk;
        const float* kt = a.k + t * a.k_row + kh * Dk;
        const float* vt = a.v + t * a.v_row + h * Dv;
        float qn = 1.0f, kn = 1.0f;
        if (a.use_l2norm) {
            float sq = 0.0f, sk = 0.0f;
            for (int64_t i = 0; i < Dk; ++i) {
                sq += qt[i] * qt[i];
                sk += kt[i] * kt[i];
            }
            qn = 1.0f / std::sqrt(sq + 1e-6f);
            kn = 1.0f / std::sqrt(sk + 1e-6f);
        }
        for (int64_t i = 0; i < Dk; ++i) {
            q[i] = qt[i] * qn * q_scale;
            k[i] = kt[i] * kn;
        }
        const float decay = std::exp(a.g[t * a.g_row + h]), b = a.beta[t * a.beta_row + h];
        for (int64_t j = 0; j < Dv; ++j) u[j] = 0.0f;
        for (int64_t i = 0; i < Dk; ++i) {
            float* row = st + i * Dv;
            const float ki = k[i];
            for (int64_t j = 0; j < Dv; ++j) u[j] += row[j] * ki;
        }
        for (int64_t j = 0; j < Dv; ++j) {
            u[j] = (vt[j] - decay * u[j]) * b;
            o[j] = 0.0f;
        }
        for (int64_t i = 0; i < Dk; ++i) {
            float* row = st + i * Dv;
            const float ki = k[i], qi = q[i];
            for (int64_t j = 0; j < Dv; ++j) {
                const float nv = decay * row[j] + ki * u[j];
                row[j] = nv;
                o[j] += nv * qi;
            }
        }
        float* ot = a.out + t * a.Hv * Dv + h * Dv;
        for (int64_t j = 0; j < Dv; ++j) ot[j] = o[j];
    }
}

inline void check_delta(const DeltaArgs& a) {
    if (a.Hk <= 0 || a.Hv <= 0 || a.Hv % a.Hk) {
        throw Error("num_v_heads (" + std::to_string(a.Hv) + ") must be a positive multiple of num_k_heads (" +
                    std::to_string(a.Hk) + ")");
    }
    ConvArgs c;
    c.state_slots = a.state_slots;
    c.context_lens = a.context_lens;
    c.query_start_loc = a.query_start_loc;
    c.num_slots = a.num_slots;
    c.S = a.S;
    c.T = a.T;
    c.K = 1;
    check_conv(c);  // the slots and sequence rows: the same checks as the convolution's
}

// Mamba2's selective scan (SSD), token by token: per sequence and head h, a state S [P, N] (slot layout [H, P, N]);
// for each token dt' = clamp(softplus(dt + dt_bias), dt_min, dt_max), S = exp(dt' A) S + dt' x B^T, y = S C + D x,
// A = -exp(A_log); head h reads B and C of group h / (H / G).
struct SsdArgs {
    const float *x = nullptr, *b = nullptr, *c = nullptr, *dt = nullptr;
    const float *a_log = nullptr, *d = nullptr, *dt_bias = nullptr;
    int64_t x_row = 0, bc_row = 0, dt_row = 0;
    float* out = nullptr;    // [T, H * P]
    float* state = nullptr;  // [num_slots, H, P, N]
    int64_t num_slots = 0;
    const int64_t* state_slots = nullptr;
    const int64_t* context_lens = nullptr;
    const int64_t* query_start_loc = nullptr;
    int64_t T = 0, S = 0, H = 0, G = 0, P = 0, N = 0;
    float dt_min = 0.0f, dt_max = INFINITY;
};

inline float softplus(float v) { return v > 20.0f ? v : std::log1p(std::exp(v)); }

inline void ssd_scan_item(const SsdArgs& a, int64_t s, int64_t h) {
    const SeqRows r = seq_rows(a.query_start_loc, a.context_lens, s, a.T);
    const int64_t P = a.P, N = a.N, g = h / (a.H / a.G);
    float* st = a.state + (a.state_slots[s] * a.H + h) * P * N;
    if (r.fresh) {
        for (int64_t i = 0; i < P * N; ++i) st[i] = 0.0f;
    }
    const float A = -std::exp(a.a_log[h]), D = a.d ? a.d[h] : 0.0f, bias = a.dt_bias ? a.dt_bias[h] : 0.0f;
    for (int64_t t = r.begin; t < r.end; ++t) {
        const float step = std::min(std::max(softplus(a.dt[t * a.dt_row + h] + bias), a.dt_min), a.dt_max);
        const float decay = std::exp(step * A);
        const float* xt = a.x + t * a.x_row + h * P;
        const float* bt = a.b + t * a.bc_row + g * N;
        const float* ct = a.c + t * a.bc_row + g * N;
        float* ot = a.out + t * a.H * P + h * P;
        for (int64_t i = 0; i < P; ++i) {
            float* row = st + i * N;
            const float dx = step * xt[i];
            float y = 0.0f;
            for (int64_t j = 0; j < N; ++j) {
                const float nv = row[j] * decay + dx * bt[j];
                row[j] = nv;
                y += nv * ct[j];
            }
            ot[i] = y + D * xt[i];
        }
    }
}

}  // namespace llmc_rec
