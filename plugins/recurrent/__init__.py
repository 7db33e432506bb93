"""Ops of layers that keep recurrent state between tokens (hybrid models: short convolutions, ...).

They work on the packed tokens of a step like PagedAttention (see llmc.plugins.paged_attention):
sequence ``s`` owns rows ``query_start_loc[s]:query_start_loc[s+1]`` and has ``context_lens[s]``
tokens once this step's are in. Instead of KV blocks, each sequence has one *state slot* in a pool
the runtime owns (per recurrent layer, an array ``[num_slots, ...]``), named per sequence by the graph
input ``state_slots`` ``[S]``. A sequence whose whole context is this step's rows starts from a zero
state, so the runtime never clears a slot, and a sequence recomputed after preemption starts over by
itself; every other sequence continues from its slot (chunked prefill, decode), and the op leaves the
state after its last row in the slot.

``CausalConv1d(x [T, C], weight [C, K], bias [C] (optional), state_slots, context_lens, query_start_loc)
-> [T, C]``, attributes ``state_idx`` (which array of the bound state pool), ``activation`` (0 none,
1 SiLU): a causal depthwise convolution whose slot ``[C, K-1]`` holds each channel's last ``K-1``
inputs, oldest first (transformers' ``conv_state``).

``GatedDeltaRule(query [T, Hk*Dk], key [T, Hk*Dk], value [T, Hv*Dv], g [T, Hv], beta [T, Hv], state_slots,
context_lens, query_start_loc) -> [T, Hv*Dv]``, attributes ``state_idx``, ``num_k_heads``, ``num_v_heads``,
``use_qk_l2norm``: Gated DeltaNet's recurrence (Qwen3-Next, Qwen3.5) in its recurrent form, token by token,
with a slot ``[Hv, Dk, Dv]``.

``SsdScan(x [T, H*P], B [T, G*N], C [T, G*N], dt [T, H], A_log [H], D [H], dt_bias [H], state_slots, context_lens,
query_start_loc) -> [T, H*P]``, attributes ``state_idx``, ``num_heads``, ``n_groups``, ``dt_min``, ``dt_max``: Mamba2's
selective scan (Nemotron-H, Falcon-H1, Granite-4 hybrid, Bamba, ...) in its recurrent form, slot ``[H, P, N]``.
:mod:`.reference` is normative for all three.
"""

DOMAIN = "llmc"
OPSET_VERSION = 1
CONV_OP_TYPE = "CausalConv1d"
# The graph input naming each sequence's state slot, after the attention metadata.
STATE_SLOTS = "state_slots"
CONV_INPUT_NAMES = ("x", "weight", "bias", STATE_SLOTS, "context_lens", "query_start_loc")
ACTIVATIONS = {None: 0, "silu": 1, "swish": 1}
DELTA_OP_TYPE = "GatedDeltaRule"
DELTA_INPUT_NAMES = ("query", "key", "value", "g", "beta", STATE_SLOTS, "context_lens", "query_start_loc")
SSD_OP_TYPE = "SsdScan"
SSD_INPUT_NAMES = ("x", "B", "C", "dt", "A_log", "D", "dt_bias", STATE_SLOTS, "context_lens", "query_start_loc")
