"""``llmc bench``: the standard workloads on one engine, with a roofline report (``driver.run``).

Definitions match benchmarks/peers (so figures compare with llama.cpp and ONNX Runtime GenAI):

- prefill tok/s = P / TTFT for one P-token prompt (P = 512 by default);
- decode bB tok/s = B * (N - 1) / (t_N - t_1) for B different prompts of ``input_len`` tokens decoded
  together, N = ``output_len`` new tokens each, t_i = when token i of the batch became available (the
  prompt pass is excluded);
- a request stream: requests with Poisson arrivals; TTFT and inter-token latency p50/p99.

Each figure is the median of ``repeats`` timed runs after ``warmup`` untimed ones. Greedy decoding;
EOS never stops generation, so every request makes exactly the tokens it asked for (checked).

Roofline. A decode step reads every weight that a matrix op consumes once, the embedding rows of its
tokens, and the KV cache of every sequence. Those bytes come from the engine's own graph (each
initializer and the ops that consume it, read from ``model.onnx`` without the onnx package, which the
runtime does not depend on) and its manifest (KV layout). Bytes per token / time per token is the
achieved read bandwidth, reported against this machine's read bandwidth measured right before and
after each decode workload (it drifts minute to minute on shared machines).

Modules: ``config`` (what to run, what comes back), ``machine`` (read bandwidth, load), ``weights`` (the
engine's bytes), ``workloads`` (one timed run of each kind), ``driver`` (the whole benchmark).
"""
