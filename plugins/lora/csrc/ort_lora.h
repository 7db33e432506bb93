// llmc::LoraApply for ONNX Runtime: a LoRA slot update chosen per token (llmc.passes.lora), in one node.
// Included by plugins/paged_attention/csrc/ort_paged_attention.cpp inside its anonymous namespace, after its
// helpers (input, output, int_attr, with_threads, make_op), so that one library holds every llmc op.
//
// LoraApply(Y float [..., W], X float [..., K], A float [K, S*R], B float [S*R, N], slots int64 [T])
//   -> float [..., W], attributes rank = R, offset (default 0, offset + N <= W):
// out = Y, then for every token t (T = the rows of X and Y) whose slot s = slots[t] is in 1..S:
//   out[t, offset : offset + N] += (X[t] @ A[:, (s-1)R : sR]) @ B[(s-1)R : sR]
// in float32. Only the token's own slot is computed (the graph's standard-op form computes all S and masks
// the others away), and a packed projection (Q|K|V) takes its parts' updates as a chain of nodes with offsets.

struct LoraKernel {
    int64_t rank = 0, offset = 0;
};

void* create_lora_kernel(const OrtCustomOpV13*, const OrtApi*, const OrtKernelInfo* info) {
    auto* k = new LoraKernel();
    try {
        k->rank = int_attr(info, "rank", true, 0);
        k->offset = int_attr(info, "offset", false, 0);
        if (k->rank <= 0 || k->offset < 0) {
            throw Error("rank must be positive and offset >= 0, got rank=" + std::to_string(k->rank) +
                        ", offset=" + std::to_string(k->offset));
        }
    } catch (...) {
        delete k;
        throw;
    }
    return k;
}

void destroy_lora_kernel(void* kernel) { delete static_cast<LoraKernel*>(kernel); }

struct LoraProblem {
    const float *y, *x, *a, *b;
    const int64_t* slots;
    float* out;
    int64_t K, W, N, R, S, offset, width;
};

void lora_copy_row(const LoraProblem& p, int64_t t) {
    float* __restrict o = p.out + t * p.width;
    const float* __restrict yr = p.y + t * p.width;
    if (o != yr) {
        for (int64_t i = 0; i < p.width; ++i) o[i] = yr[i];
    }
}

// The tokens `rows[0..m)` of slot s together: each row of the slot's A and B is read once for all of them
// (a decode step's update is bound by reading A and B, not by the multiply-adds). u: m * R floats.
void lora_group(const LoraProblem& p, int64_t s, const int64_t* rows, int64_t m, float* __restrict u) {
    const int64_t R = p.R, c0 = (s - 1) * R;
    for (int64_t i = 0; i < m * R; ++i) u[i] = 0.0f;
    for (int64_t k = 0; k < p.K; ++k) {
        const float* __restrict ar = p.a + k * p.W + c0;
        for (int64_t i = 0; i < m; ++i) {
            const float xv = p.x[rows[i] * p.K + k];
            float* __restrict ui = u + i * R;
            for (int64_t r = 0; r < R; ++r) ui[r] += xv * ar[r];
        }
    }
    // Expand in column blocks: a block of B's slot rows (R x 64 floats) stays in L1 across the tokens, and each
    // token's block of sums in registers across the R rows.
    constexpr int64_t kBlock = 64;
    for (int64_t n0 = 0; n0 < p.N; n0 += kBlock) {
        const int64_t nb = std::min(kBlock, p.N - n0);
        for (int64_t i = 0; i < m; ++i) {
            float acc[kBlock];
            for (int64_t n = 0; n < nb; ++n) acc[n] = 0.0f;
            const float* ui = u + i * R;
            for (int64_t r = 0; r < R; ++r) {
                const float uv = ui[r];
                const float* __restrict br = p.b + (c0 + r) * p.N + n0;
                for (int64_t n = 0; n < nb; ++n) acc[n] += uv * br[n];
            }
            float* __restrict od = p.out + rows[i] * p.width + p.offset + n0;
            for (int64_t n = 0; n < nb; ++n) od[n] += acc[n];
        }
    }
}

void lora_row(const LoraProblem& p, int64_t t) {
    lora_copy_row(p, t);
    const int64_t s = p.slots[t];
    if (s < 1 || s > p.S) return;
    float u[256];  // R <= 256 (llmc.passes.lora.MAX_RANK)
    lora_group(p, s, &t, 1, u);
}

void compute_lora(void* kernel, OrtKernelContext* ctx) {
    const LoraKernel& k = *static_cast<const LoraKernel*>(kernel);
    const Tensor y = input(ctx, 0, "Y"), x = input(ctx, 1, "X"), a = input(ctx, 2, "A"), b = input(ctx, 3, "B"),
                 s = input(ctx, 4, "slots");
    require_rank(a, 2, "A");
    require_rank(b, 2, "B");
    require_rank(s, 1, "slots");
    const int64_t K = a.dims[0], W = a.dims[1], N = b.dims[1];
    if (k.rank > 256 || W % k.rank || b.dims[0] != W) {
        throw Error("A " + dims_str(a.dims) + " and B " + dims_str(b.dims) + " must stack whole slots of rank " +
                    std::to_string(k.rank) + " (at most 256)");
    }
    if (x.dims.empty() || x.dims.back() != K || y.dims.empty() || y.dims.back() < k.offset + N) {
        throw Error("X " + dims_str(x.dims) + " must end in K = " + std::to_string(K) + " and Y " + dims_str(y.dims) +
                    " in at least offset + N = " + std::to_string(k.offset + N));
    }
    int64_t T = 1, TY = 1;
    for (size_t i = 0; i + 1 < x.dims.size(); ++i) T *= x.dims[i];
    for (size_t i = 0; i + 1 < y.dims.size(); ++i) TY *= y.dims[i];
    if (TY != T || s.dims[0] != T) {
        throw Error("X, Y and slots must have the same number of tokens, got X " + dims_str(x.dims) + ", Y " +
                    dims_str(y.dims) + ", slots " + dims_str(s.dims));
    }
    LoraProblem p{static_cast<const float*>(y.data), static_cast<const float*>(x.data),
                  static_cast<const float*>(a.data), static_cast<const float*>(b.data),
                  static_cast<const int64_t*>(s.data), output(ctx, y.dims.data(), y.dims.size()),
                  K, W, N, k.rank, W / k.rank, k.offset, y.dims.back()};
    // A decode step's few rows are cheaper on one thread than the pool's hand-off; long prefills spread.
    if (T * k.rank * (K + N) < (int64_t{1} << 20)) {
        // Few rows (decode): tokens grouped by slot, on this thread.
        std::vector<int64_t> rows;
        std::vector<float> u;
        for (int64_t t = 0; t < T; ++t) lora_copy_row(p, t);
        for (int64_t s = 1; s <= p.S; ++s) {
            rows.clear();
            for (int64_t t = 0; t < T; ++t) {
                if (p.slots[t] == s) rows.push_back(t);
            }
            if (rows.empty()) continue;
            u.resize(rows.size() * static_cast<size_t>(k.rank));
            lora_group(p, s, rows.data(), static_cast<int64_t>(rows.size()), u.data());
        }
        return;
    }
    with_threads(ctx, [&](int threads, const llmc::ParallelFor* pf) {
        if (pf != nullptr && threads > 1) {
            pf->fn(pf->self, T, [](void* arg, int64_t t) { lora_row(*static_cast<const LoraProblem*>(arg), t); },
                   &p);
        } else {
            for (int64_t t = 0; t < T; ++t) lora_row(p, t);
        }
    });
}

const char* lora_name(const OrtCustomOpV13*) { return "LoraApply"; }
int32_t lora_input_type(const OrtCustomOpV13*, size_t i) { return i == 4 ? kOrtInt64 : kOrtFloat; }
size_t lora_input_count(const OrtCustomOpV13*) { return 5; }

const OrtCustomOpV13 g_lora_op = make_op(lora_name, lora_input_type, lora_input_count, create_lora_kernel,
                                         compute_lora, destroy_lora_kernel);
