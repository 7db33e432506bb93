"""Speculative decoding: propose a few tokens cheaply, verify them in one packed step of the target.

A decoding request that speculates feeds its last token plus ``k`` proposed (draft) tokens to the
target in one chunk; the chunk's ``k + 1`` logits rows decide how many drafts are kept, and one more
token is always sampled, so a step emits 1 to ``k + 1`` tokens. The scheduler schedules such chunks
beside ordinary decodes and prefills and rewinds the KV of rejected drafts (``BlockManager.rewind``);
this package holds what is specific to speculation, one concern a module:

- ``config``: :class:`SpeculativeConfig`, the method and its limits, given to ``Engine.load``.
- ``ngram``: the prompt-lookup proposer (:class:`NgramIndex`; :func:`ngram_propose` is its reference scan).
- ``draft_model``: the draft-model proposer (:class:`DraftProposer`), driving the parts (``draft_source``:
  :class:`DraftModel`) of a second, smaller llmc engine, which the engine hands over (:class:`DraftSource`).
- ``verification``: greedy verification and rejection sampling (Leviathan et al. 2023, Chen et al. 2023).
- ``cost`` (:class:`StepCost`: what a step costs per extra token), ``state`` (:class:`SpecState`: a request's
  acceptance and its choice of drafts) and ``speculator`` (:class:`Speculator`: the engine's speculation,
  proposing before a step and verifying after it).
"""
