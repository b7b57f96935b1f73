"""LoRA adapters on top of the served base model: reading them (PEFT folders, llama.cpp's GGUF LoRA files), keeping
them resident within a memory budget, and the per-layer weights the linear layers add per batch segment."""
