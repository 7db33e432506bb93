"""The engine core, executor-independent: requests (``request``), the scheduler (``scheduler``), the KV pool
(``kv_cache``), the block manager (``block_manager``, the C++ core; ``block_manager_ref``, its Python
definition), hybrid models' state slots (``state_cache``) and one engine step (``step``)."""
