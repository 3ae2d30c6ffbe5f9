"""Model adapters: a Hugging Face model plus the KV cache it owns, with rollback, as the decode loops call
them (`base.ModelAdapter`). Eager: `causal_lm.CachedCausalLM` (DynamicCache), `seq2seq_lm.CachedSeq2SeqLM`,
`batch_lm.BatchedCausalLM` (rows of different lengths). The fast path: `static_lm.StaticCausalLM` and
`batch_static.StaticBatchedCausalLM` on the preallocated `slot_cache.SlotCache`, with the compile registry in
`compiled` and the draft graphs in `draft_graphs`. `threads`: torch's thread count.

Nothing is imported here, so `specdec.runtime.threads` (the CLI's --threads) does not load torch."""
