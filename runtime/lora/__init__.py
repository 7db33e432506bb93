"""Multi-LoRA at run time: PEFT adapters read and checked (``adapter``), the engine's slots and their buffers
(``slots``), and the engine's handling of adapters named by requests (``requests``)."""
